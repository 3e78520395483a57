"""The control path's measured delays, and the margin every deadline is planned with.

A dispatcher plans a batch's reservations from the profile; what it cannot see is the runtime's
own path: the batch message reaching the first worker (and the timer that sent it firing late),
each feature map's hop beyond its planned transfer, the completion reaching the scheduler, and the
resolution reaching the client. The plugin measures those from the feedback of every batch:

* ``dispatch``: the first stage's actual start minus the later of its planned start and the end
  of the batch its slot computed before (a wait behind a batch that ran over its reservation is
  compute variance, which slack-aware dispatch plans for, not the control path);
* ``hop``: a later stage's actual start minus the latest of the previous stage's actual end plus
  its planned transfer, its own planned start (so a planned wait is not counted) and the end of
  its slot's batch before;
* ``done``: the completion read on the scheduler minus the last stage's actual end, in two parts
  (not planned apart, shown apart): ``done_worker``, until the last stage's worker writes the
  completion (its compute thread's hand-back, and its clients' resolutions, written first), on
  that worker's own clock; and ``done_wire``, the rest (the message's way and the scheduler's
  reading). A ``done`` that grows shows which end to look at.

One more delay comes before all of these, and is not planned with a margin: ``send``, from the
caller's ``submit`` to the scheduler reading the request, beyond the fastest such trip from that
client (:class:`daskpipe.runtime.scheduler.intake.SendClocks`). Each request's deadline is counted from
the caller's ``submit``, so a request that waited on its way in has that much less time left.

The resolution's way to the client is one more message of the same kind as ``done``: from the
last stage's worker on the client's reply stream, in parallel with ``done`` (the ``done`` itself
counts it), or, for a client that worker could not tell, from the scheduler after ``done`` (one
more ``done``). A batch's control delay is the sum.

The margin, by which each request's planned deadline is moved earlier, is a high percentile
(:data:`MARGIN_QUANTILE`) of the delays of the batches of the last :data:`HORIZON_S` seconds
(:data:`WINDOW` at most), and never less than the seed: round trips measured when the model is
deployed, and never less than :data:`MIN_MARGIN_S`. Until :data:`MIN_BATCHES` batches are measured the seed alone is used: one slow
batch among a few says little. A model served at fewer than :data:`MIN_BATCHES` batches per horizon
keeps its latest :data:`MIN_BATCHES` however old: else its margin would stay the seed for good,
and the seed, from pings, falls short of a batch's path (measured on CPU workers: 1.3-2.9 ms
against 3.0-3.4 ms p50, and batches dispatched at their last moment ended late). A stall is
forgotten once it leaves the horizon (or, at such rates, once :data:`MIN_BATCHES` later batches
are in): otherwise a margin swollen by it would drop every request, no batch would run, and nothing
would bring it down. For the same reason the margin never takes more than :data:`MAX_SHARE` of the headroom, what the
model's tightest budget leaves beyond a lone request's latency (nor of the budget itself): a
request can always still be dispatched, with room to queue, so batches keep running and being
measured through a stall, and what the pipeline can still serve in time is served.

A data plane that sends its batches at the last moment of their window (deferred: Symphony's
``d - l(b+1)``, ``alpha`` before the last) leaves them no slack but the margin, so a p99 margin
makes about 1% of them late: all of a 99% target. Its margin (:func:`control_path`) is
:data:`LAST_MOMENT_QUANTILE` of the latest :data:`WINDOW` batches, however old: a tail that rare
needs that many, and the horizon's recent few say only what the last seconds' load did. Eager
batching and the other planes keep the slack of their SLOs beyond it, as PPipe's plans do.

Dropping a request is a sure miss, so a request is dropped only when its batch cannot finish by
the SLO less the *typical* delay (the median of the same batches, :attr:`ControlPath.typical_s`):
the dispatcher is given the difference as the request's tolerance
(:attr:`daskpipe.sched.api.Request.tolerance`). A batch planned into that band is late only when
its delays run above their median; dropping it would make every one of its requests late.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from daskpipe.sched.registry import DataPlane

WINDOW = 1000
"""Batches the margin is computed over at most: enough for a p99, recent enough to follow the load."""
HORIZON_S = 10.0
MARGIN_QUANTILE = 0.99
LAST_MOMENT_QUANTILE = 0.999
"""The margin's percentile where batches leave at their last moment (:func:`control_path`)."""
LAST_MOMENT_PLANES = frozenset({DataPlane.DEFERRED.value})
MIN_BATCHES = 20
RECOMPUTE_EVERY = 20
"""Batches between two recomputations of the margin (a percentile of the window costs ~30 us)."""
MAX_SHARE = 0.5
MIN_MARGIN_S = 0.002
"""The least margin, under what a few quiet batches measure. The last-moment dispatch of a batch
waits on the dispatcher's wake-up, which is on time on Linux (:mod:`daskpipe.runtime.scheduler.timer`) and
up to a millisecond late elsewhere (the event loop's selector waits whole milliseconds)."""
KINDS = ("send", "dispatch", "hop", "done", "done_worker", "done_wire")


@dataclass
class ControlPath:
    """One model's control-path delays (seconds) and the margin planned from them.

    ``cap_s``: the most the margin may be (the headroom, at most :data:`MAX_SHARE` of the tightest budget).
    ``quantile``: the batch delays' percentile the margin is; ``horizon_s``: how old a batch it
    forgets (it keeps the latest :data:`MIN_BATCHES` however old)."""

    seed_s: float
    cap_s: float = float("inf")
    quantile: float = MARGIN_QUANTILE
    horizon_s: float = HORIZON_S
    batches: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))  # (when, total)
    parts: dict[str, deque[float]] = field(default_factory=lambda: {kind: deque(maxlen=WINDOW) for kind in KINDS})
    margin_s: float = 0.0
    typical_s: float = 0.0
    recorded: int = 0

    def __post_init__(self) -> None:
        self.margin_s = self.typical_s = min(max(self.seed_s, MIN_MARGIN_S), self.cap_s)

    @property
    def tolerance_s(self) -> float:
        """How far past its planned deadline a request's batch may finish rather than drop it: the
        margin less the typical delay (0 until :data:`MIN_BATCHES` batches are measured)."""
        return self.margin_s - self.typical_s

    def record(
        self, now: float, dispatch_s: float, hops_s: list[float], done_s: float, relayed: bool = True, done_worker_s: float | None = None
    ) -> None:
        """One batch's delays, measured at ``now``; each is clipped at 0 (a stage may start before
        its planned time). ``relayed``: the scheduler resolved a client's futures after ``done``,
        rather than the last stage's worker all of them beside it. ``done_worker_s``: the part of
        ``done`` before the completion was written (``None``: not reported)."""
        dispatch_s, done_s = max(0.0, dispatch_s), max(0.0, done_s)
        hops_s = [max(0.0, h) for h in hops_s]
        parts = self.parts
        parts["dispatch"].append(dispatch_s)
        parts["hop"].extend(hops_s)
        parts["done"].append(done_s)
        if done_worker_s is not None:
            worker_s = min(max(0.0, done_worker_s), done_s)  # two clocks: the part is never more than the whole
            parts["done_worker"].append(worker_s)
            parts["done_wire"].append(done_s - worker_s)
        self.batches.append((now, dispatch_s + sum(hops_s) + (2 if relayed else 1) * done_s))
        self.recorded += 1
        if self.recorded % RECOMPUTE_EVERY == 0:
            self.refresh(now)

    def record_send(self, delay_s: float, count: int = 1) -> None:
        """``count`` requests of one submit message, read ``delay_s`` after their fastest way in."""
        self.parts["send"].extend(repeat(delay_s, min(count, WINDOW)))

    def refresh(self, now: float) -> None:
        """Recompute the margin from the batches within the horizon, or the latest :data:`MIN_BATCHES`."""
        batches = self.batches
        while len(batches) > MIN_BATCHES and batches[0][0] < now - self.horizon_s:
            batches.popleft()
        margin = typical = max(self.seed_s, MIN_MARGIN_S)
        if len(batches) >= MIN_BATCHES:
            median, high = np.quantile([total for _, total in batches], (0.5, self.quantile))
            margin, typical = max(margin, float(high)), float(median)
        self.margin_s = min(margin, self.cap_s)
        self.typical_s = min(typical, self.margin_s)

    def summary(self) -> dict[str, float]:
        """Milliseconds: the margin, and p50 / p99 of each delay and of the batches' totals."""
        out = {
            "margin_ms": self.margin_s * 1e3,
            "tolerance_ms": self.tolerance_s * 1e3,
            "seed_ms": self.seed_s * 1e3,
            "cap_ms": self.cap_s * 1e3,
            "batches": float(self.recorded),
        }
        for name, values in (*self.parts.items(), ("total", [total for _, total in self.batches])):
            if values:
                p50, p99 = np.quantile(np.fromiter(values, float, len(values)), (0.5, 0.99))
                out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = float(p50) * 1e3, float(p99) * 1e3
        return out


def control_path(seed_s: float, dataplane: str) -> ControlPath:
    """A control path seeded at ``seed_s`` for a model (or a shared pool) served by ``dataplane``:
    a plane of :data:`LAST_MOMENT_PLANES` plans with :data:`LAST_MOMENT_QUANTILE` of the latest
    :data:`WINDOW` batches, any other with :data:`MARGIN_QUANTILE` of the horizon's."""
    if dataplane in LAST_MOMENT_PLANES:
        return ControlPath(seed_s, quantile=LAST_MOMENT_QUANTILE, horizon_s=float("inf"))
    return ControlPath(seed_s)


def seed_from_round_trips(round_trips_s: list[float], messages: int) -> float:
    """A margin before any batch has run: ``messages`` one-way messages (a pipeline of P stages
    takes P + 2), each as long as a high percentile (p90) of the measured scheduler-worker round
    trips. A ping's round trip is two messages, but a batch's message also meets a compute thread's
    hand-off and a tensor's serialization on its way (measured: a batch's path took about twice the
    pings'). Not the slowest ping: one garbage collection among them would swell it."""
    return float(np.quantile(round_trips_s, 0.9)) * messages if round_trips_s else 0.0
