"""How fast requests come while a model has work outstanding: the rate a waiting batch can grow at.

A batch that is not full waits for more requests (PPipe's last moment, docs/dataplane.md), and
only a request that arrives while it waits can join it. A client that sends its next request once
it holds the answer to the last one never sends one then, however often it sends; counting every
arrival would make such a client look like load, and its lone requests wait for nothing. So the
rate is the arrivals that find the model with work outstanding (a request queued, or a batch not
finished) per second it had some: under open-loop arrivals (Poisson, which come whatever the model
is doing) that is the arrival rate, for a closed-loop client it is 0. Both are taken over the
arrivals of the last ``window_s`` seconds, so that a burst long past is forgotten, whatever the
model did since, and as if the window began with ``prior_s`` seconds of outstanding work that no
request joined: two requests that happen to come together (a client's pair, a chance meeting at
low load) are not taken for a rate, and the first requests of a busy stream soon outweigh it.

Pure and clock-injected: every call carries the dispatcher's ``now``.
"""

from __future__ import annotations

from collections import deque

from daskpipe.sched.api import Time

INF = float("inf")


class OutstandingArrivals:
    """Arrivals that found work outstanding, per second of outstanding work, over a sliding window.

    The dispatcher says when a request arrives (``arrive``, with whether one is queued), until when
    what it dispatched is planned to run (``outstanding_until``), and when the last of it reported
    done (``settled``, which ends the outstanding time early when execution beat the plan).
    """

    __slots__ = ("window_s", "prior_s", "busy_until", "last_arrival", "recent", "joined", "busy_s")

    def __init__(self, window_s: float, prior_s: float) -> None:
        if not 0 < window_s < INF:
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
        if not 0 < prior_s < INF:
            raise ValueError(f"prior_s must be a positive number of seconds, got {prior_s!r}")
        self.window_s = window_s
        self.prior_s = prior_s
        self.busy_until: Time = -INF  # work is outstanding until then, queued requests aside
        self.last_arrival: Time = -INF
        self.recent: deque[tuple[Time, float, bool]] = deque()  # (arrival, outstanding seconds since the one before, found work)
        self.joined = 0  # arrivals in ``recent`` that found work outstanding
        self.busy_s = 0.0  # outstanding seconds in ``recent``

    def arrive(self, now: Time, queued: bool) -> None:
        """A request arrived at ``now``; ``queued``: another one was queued then."""
        found_work = queued or now < self.busy_until
        # a request queued now has been queued since the last arrival at least
        end = now if found_work else self.busy_until
        busy_s = end - self.last_arrival if end > self.last_arrival else 0.0
        self.last_arrival = now
        recent = self.recent
        if busy_s > 0 or found_work:
            recent.append((now, busy_s, found_work))
            self.joined += found_work
            self.busy_s += busy_s
        horizon = now - self.window_s
        while recent and recent[0][0] < horizon:
            _, old_busy_s, old_found_work = recent.popleft()
            self.joined -= old_found_work
            self.busy_s -= old_busy_s
        if not recent:
            self.busy_s = 0.0  # no float residue from the running sum

    def outstanding_until(self, end: Time) -> None:
        """Work (a dispatched batch, a request still queued) is outstanding until ``end`` at least."""
        if end > self.busy_until:
            self.busy_until = end

    def settled(self, now: Time) -> None:
        """Everything dispatched reported done by ``now``, and nothing is queued."""
        if now < self.busy_until:
            self.busy_until = now

    @property
    def rate(self) -> float:
        """Arrivals per second that a waiting batch could have taken."""
        return self.joined / (self.busy_s + self.prior_s)
