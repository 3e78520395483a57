"""The scheduler plugin's watch over its own batches: gray failures, as :mod:`daskpipe.runtime.scheduler.gray`
describes them (stalled and slow slots, late limits, poison and hang isolation).

:class:`GrayWatch` keeps one watchlist and one timer for every model: when each hop must have
reported (two strikes) and when each batch's requests reach their late limit. The per-model state
(suspects, slow streaks, abandoned batches) lives on each model's :class:`~daskpipe.runtime.scheduler.ledger.Ledger`,
which ends the requests the watch gives up on; the dispatchers hear of suspect slots through
:class:`~daskpipe.runtime.scheduler.models.Models`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from typing import Any, Callable

from daskpipe.runtime.errors import RequestFailed, guarded
from daskpipe.runtime.scheduler.gray import Suspect, Watchlist, isolation_split
from daskpipe.runtime.scheduler.ledger import Dropped, Failed, Flight, Ledger
from daskpipe.runtime.scheduler.links import Links
from daskpipe.runtime.scheduler.models import Models
from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.messages import Hop
from daskpipe.sched.api import Request, Slot

logger = logging.getLogger(__name__)

ABANDONED_KEPT = 10_000
"""Batches taken from a suspect slot that are remembered, so that what it reports for them later
is discarded (:mod:`daskpipe.runtime.scheduler.gray`)."""
EXPIRY = -1
"""The watchlist's partition for a batch's late limit (its hops are 0, 1, ...)."""
WATCH_TICK_S = 0.005
"""The watch timer (overdue hops, late limits) fires at most this often: bursts of batches share a check."""


class GrayWatch:
    """Watches the plugin's batches and slots (see the module docstring); runs on the scheduler's loop."""

    def __init__(self, models: Models, links: Links, send: Callable[[Ledger, str, int, Flight], None]) -> None:
        self.models = models
        self.links = links
        self.send = send  # where the batches it makes itself go: the batches' send
        # (model, dispatch, hop index or EXPIRY, strike) by when it must have reported
        self._watch: Watchlist[tuple[str, int, int, int]] = Watchlist()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._fired = 0.0
        self._probe_tokens = itertools.count()
        self._isolation_ids = itertools.count(-1, -1)  # batches the plugin sends itself: ids no dispatcher uses
        self._heard: dict[str, float] = {}  # address -> when its slot last reported a computation (scheduler clock)

    def own_id(self) -> int:
        """A dispatch id for a batch the plugin sends itself (an isolation, a deploy's trial): one no dispatcher uses."""
        return next(self._isolation_ids)

    # -- batches -------------------------------------------------------------------------------
    def watch_batch(self, ledger: Ledger, model: str, dispatch: int, flight: Flight) -> float:
        """``flight`` is being sent: its first hop must report within its bound, its requests
        within the late limit. The latest of their late limits (scheduler clock)."""
        if flight.planned:
            self.watch_hop(ledger, model, dispatch, flight, 0, flight.planned[0][1])
        limits = [r.arrival + ledger.gray.late_limit_slos * ledger.budgets[r.start_block] for r, _, _ in flight.retries]
        self._watch.push(min(limits), (model, dispatch, EXPIRY, 0))
        self._arm()
        return max(limits)

    def watch_hop(self, ledger: Ledger, model: str, dispatch: int, flight: Flight, index: int, start: float) -> None:
        """Hop ``index`` of ``flight`` must report within its bound past ``start``."""
        self._watch.push(
            start + ledger.gray.hop_bound(flight.spans[index], ledger.control.margin_s, ledger.model.slo_us * 1e-6),
            (model, dispatch, index, 1),
        )
        self._arm()

    def close(self) -> None:
        """Stop the timer: the plugin is closing and drops what is still watched."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, float("inf")

    def settle(self) -> None:
        """A batch ended: if the timer waits for what has happened (the batch's hop or late limit
        at the head of the watchlist), move it to the next entry that may still need a check, so
        that a batch done in time costs the loop no wake-up (at low rates, most of them)."""
        if self._timer is None:
            return
        self._watch.skim(self._pending)
        due = self._watch.next_due
        if due is None or due > self._timer_at:
            self._timer.cancel()
            self._timer, self._timer_at = None, float("inf")
            self._arm()

    def _pending(self, item: tuple[str, int, int, int]) -> bool:
        """Whether a watched moment may still need a check: its batch is in flight and, for a hop, the hop has not reported."""
        model, dispatch, index, _ = item
        ledger = self.models.ledgers.get(model)
        flight = ledger.flights.get(dispatch) if ledger is not None else None
        return flight is not None and (index == EXPIRY or flight.planned[index][0] not in flight.ran)

    def _arm(self) -> None:
        """Keep one timer at the earliest watched moment that may still need a check, firing at
        most every :data:`WATCH_TICK_S`."""
        self._watch.skim(self._pending)
        due = self._watch.next_due
        if due is None or (self._timer is not None and due >= self._timer_at):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        now = time.monotonic()
        self._timer = asyncio.get_running_loop().call_later(max(0.0, due - now, self._fired + WATCH_TICK_S - now), self._on_timer)

    @guarded
    def _on_timer(self) -> None:
        """Suspect the slots of overdue hops; drop requests in flight past the late limit."""
        self._timer, self._timer_at = None, float("inf")
        now = self._fired = time.monotonic()
        for model, dispatch, index, strike in self._watch.due(now):
            ledger = self.models.ledgers.get(model)
            flight = ledger.flights.get(dispatch) if ledger is not None else None
            if ledger is None or flight is None:
                continue
            if index == EXPIRY:
                self._expire(ledger, model, dispatch, flight, now)
            elif flight.planned[index][0] not in flight.ran:
                bound = ledger.gray.hop_bound(flight.spans[index], ledger.control.margin_s, ledger.model.slo_us * 1e-6)
                address = flight.route[index]["address"]
                # once more: a report that waits behind this loop's own lag gets read meanwhile; a
                # request re-dispatched alone may wait behind what its slot was given before it
                if strike == 1 or (flight.stalled_on and now - self._heard.get(address, -math.inf) < bound):
                    self._watch.push(now + bound, (model, dispatch, index, 2))
                    continue
                self._stalled(ledger, model, dispatch, flight, index, now - self._heard.get(address, -math.inf), now)
        self._arm()
        self.models.arm()

    def _stalled(self, ledger: Ledger, model: str, dispatch: int, flight: Flight, index: int, silent_s: float, now: float) -> None:
        """Hop ``index`` of ``flight`` did not report within its bound, twice: its slot stalled, or
        its stage hangs on an input of the batch. The slot is suspected, and the batch's requests
        are re-dispatched apart on other slots (:meth:`suspect`). A request re-dispatched alone
        that way whose slot then computes nothing for a bound is that input: it fails alone."""
        partition, address = flight.planned[index][0], flight.route[index]["address"]
        planned_ms = flight.spans[index] * 1e3
        detail = (
            f"missed its reservation for stage {partition} of batch {dispatch} twice over "
            f"({ledger.gray.suspect_factor:g}x its planned {planned_ms:.1f} ms each)"
        )
        hung = [r.id for r, _, _ in flight.retries if r.id in ledger.deadlines] if flight.stalled_on else []
        if hung:
            ledger.flights.pop(dispatch, None)
            _abandon(ledger, dispatch, address)
            self.models.metrics.forget(model, dispatch)
            failure = RequestFailed(
                f"stage {partition} of {model!r} hung on this input: its batch stalled on worker {flight.stalled_on}, and "
                f"re-dispatched alone it computed nothing on worker {address} for {silent_s * 1e3:.0f} ms (planned "
                f"{planned_ms:.1f} ms); its batch-mates were re-dispatched apart"
            )
            ledger.end(hung, Failed(failure))
            logger.warning(
                "daskpipe: %s: stage %d hung on request %r twice (on %s, then alone on %s); it fails alone",
                model,
                partition,
                hung[0],
                flight.stalled_on,
                address,
            )
            detail = f"hung on request {hung[0]!r} in stage {partition}"
        self.suspect(ledger, model, address, detail, now, stalled=dispatch)

    def _expire(self, ledger: Ledger, model: str, dispatch: int, flight: Flight, now: float) -> None:
        """Drop the requests of ``flight`` that are ``late_limit_slos`` SLOs old; watch the rest."""
        limit = ledger.gray.late_limit_slos
        remaining = []
        for request, _, _ in flight.retries:
            if request.id not in ledger.deadlines:
                continue
            until = request.arrival + limit * ledger.budgets[request.start_block]
            if now >= until:
                ledger.end([request.id], Dropped("deadline", f"still in flight {limit:g}x its SLO after it arrived"))
            else:
                remaining.append(until)
        if remaining:
            self._watch.push(min(remaining), (model, dispatch, EXPIRY, 0))
        else:  # whatever it reports later is discarded
            ledger.flights.pop(dispatch, None)
            _abandon(ledger, dispatch, "")

    @guarded
    def on_expired(self, worker: str, model: str, dispatch: int, keys: list) -> None:
        """A stage skipped a batch that reached it past its requests' late limit."""
        ledger = self.models.ledgers.get(model)
        if ledger is None or dispatch in ledger.abandoned:
            return
        ledger.flights.pop(dispatch, None)
        limit = ledger.gray.late_limit_slos
        ledger.end(keys, Dropped("deadline", f"its batch reached worker {worker} {limit:g}x its SLO after it arrived"))
        self.models.arm()

    # -- suspects ------------------------------------------------------------------------------
    def suspect(self, ledger: Ledger, model: str, address: str, detail: str, now: float, stalled: int | None = None) -> None:
        """``address`` stopped keeping its reservations: it gets no new batches, its batches are
        re-dispatched (or dropped as "slow-worker"), what it reports for them later is discarded,
        and it is probed until it computes in line again: a probe waits behind what its compute
        thread still runs, so a thread hung on an input re-admits its slot once it returns. The
        batch ``stalled`` (the one that did not report), and the requests already re-dispatched
        alone after a stall, go apart, each alone on another slot (:meth:`_send_apart`), where the
        dispatcher would batch them again with the input that hangs. Where its batches have nowhere else to
        go, it is not suspected: under a dispatcher whose pools are fixed (``supports_pools``
        false), and when it is the last slot in line of one of its pools (a lone CPU worker that
        fell behind under a burst would otherwise drop every queued request at once). The late
        limit still ends what a stalled slot holds."""
        models = self.models
        if address not in models.slots or not ledger.dispatcher.supports_pools:  # gone: remove_worker retries its batches
            return
        mine = {(p, q) for p, q, a in ledger.stages if a == address}
        in_line = {(p, q) for p, q, a in ledger.stages if a != address and a in models.slots and a not in ledger.suspects}
        if address not in ledger.suspects and not mine <= in_line:
            return
        taken = ledger.take_flights(address)
        for dispatch, _ in taken:
            _abandon(ledger, dispatch, address)
        if address not in ledger.suspects:
            ledger.suspects[address] = Suspect(now, detail, sorted({(p, q) for p, q, a in ledger.stages if a == address}))
            ledger.counts["suspected"] += 1
            logger.warning(
                "daskpipe: %s: worker %s is suspect: it %s; it gets no batches until a probe computes in line", model, address, detail
            )
            models.remove_slot(ledger, model, address, now, "slow-worker")
            self._probe(ledger, model, address)
        again = [
            flight
            for dispatch, flight in taken
            if not (
                (dispatch == stalled or flight.stalled_on) and not flight.staged and self._send_apart(ledger, model, flight, address, now)
            )
        ]
        models.retry(ledger, model, again, now, "slow-worker", f"worker {address} {detail}")

    def pace(self, ledger: Ledger, model: str, address: str, seconds: float, planned_s: float, now: float) -> None:
        """``address`` computed a batch in ``seconds``, planned ``planned_s``: suspect it once the
        slow rule says so (:class:`~daskpipe.runtime.scheduler.gray.SlowSlots`; :meth:`suspect`
        keeps a pool's last slot in line)."""
        self._heard[address] = now
        why = ledger.slow.observe(address, seconds, planned_s, ledger.suspects)
        if why is not None:
            self.suspect(ledger, model, address, why, now)

    def _probe(self, ledger: Ledger, model: str, address: str) -> None:
        """Time one batch-1 computation of a suspect's stage, behind whatever it still runs."""
        suspect = ledger.suspects.get(address)
        if suspect is None or suspect.probe is not None or address not in self.models.slots or self.models.ledgers.get(model) is not ledger:
            return
        p, q = suspect.pools[0]
        profiled = ledger.durations.compute_s(p, q, 1)
        token = next(self._probe_tokens)
        suspect.probe = (token, profiled)
        suspect.probes += 1
        hold = profiled if address in ledger.emulated else 0.0
        self.links.to_worker(
            address, {"op": messages.PROBE, "model": model, "token": token, "stage": ledger.stages[(p, q, address)], "hold_s": hold}
        )

    @guarded
    def on_probed(self, worker: str, model: str, token: int, start: float, end: float) -> None:
        """A suspect's probe computed over [start, end): re-admit it when that is in line."""
        ledger = self.models.ledgers.get(model)
        suspect = ledger.suspects.get(worker) if ledger is not None else None
        if ledger is None or suspect is None or suspect.probe is None or suspect.probe[0] != token:
            return
        profiled = suspect.probe[1]
        suspect.probe = None
        suspect.last_ratio = round((end - start) / profiled, 3) if profiled > 0 else 1.0
        if suspect.last_ratio <= ledger.gray.readmit_ratio:
            self._readmit(ledger, model, worker)
        else:
            asyncio.get_running_loop().call_later(ledger.gray.probe_interval_s, self._probe, ledger, model, worker)

    def _readmit(self, ledger: Ledger, model: str, address: str) -> None:
        """The suspect ``address`` rejoins its pools."""
        slot = self.models.slots.get(address)
        if slot is None:
            return
        suspect = ledger.suspects.pop(address)
        ledger.counts["readmitted"] += 1
        now = time.monotonic()
        for p, q in suspect.pools:
            try:
                actions = ledger.dispatcher.add_slot(Slot(id=address, gpu=slot.gpu, slices=slot.slices, server=slot.server), p, q, now)
            except ValueError:  # a re-plan has put it back already
                continue
            self.models.act(ledger, model, actions)
        logger.warning(
            "daskpipe: %s: worker %s is back in line (probe at %.2fx its profile) after %.1f s; it takes batches again",
            model,
            address,
            suspect.last_ratio,
            now - suspect.since,
        )
        self.models.arm()

    # -- poison and hang isolation ------------------------------------------------------------
    def isolate(
        self, ledger: Ledger, model: str, flight: Flight, live: list[tuple[Request, Any, int]], now: float
    ) -> tuple[list[tuple[int, Flight]], list]:
        """The parts of a failed batch's ``live`` requests to retry apart, as
        :func:`~daskpipe.runtime.scheduler.gray.isolation_split` splits them by the time their deadlines leave
        and the budget allows, each on a route through other slots of the batch's pools where they
        have several, as (dispatch id, flight) to send; and the keys that cannot go."""
        margin, durations, pipeline = ledger.control.margin_s, ledger.durations, flight.pipeline
        limit = ledger.model.pipelines[pipeline].batch_size
        lanes_by_hop = [sorted({hop["address"]} | set(lanes)) for hop, lanes in zip(flight.route, self._lanes(ledger, flight))]

        def hop_s(samples: int) -> list[float]:
            return [durations.compute_s(pipeline, hop["partition"], min(samples, limit)) for hop in flight.route]

        # a round's parts leave together, and the measured margin covers a batch's whole control path
        left = min(ledger.deadlines[r.id] for r, _, _ in live) - now
        split = isolation_split([n for _, _, n in live], left, hop_s, min(len(lane) for lane in lanes_by_hop), margin)
        if (
            split is None
            or not flight.addresses <= set(self.models.scheduler.workers)
            or not ledger.gray.may_isolate(ledger.counts["isolated"] + len(split) - 1, ledger.counts["batches"])
        ):
            return [], [r.id for r, _, _ in live]
        ledger.counts["isolated"] += len(split)
        sent = []
        for lane, part in enumerate(split):
            requests = [live[i] for i in part]
            route, _ = self._route(ledger, flight, lanes_by_hop, lane, sum(n for _, _, n in requests))
            isolation = Flight(
                [r.id for r, _, _ in requests],
                frozenset(hop["address"] for hop in route),
                requests,
                route=route,
                spans=flight.spans,
                isolating=True,
                pipeline=pipeline,
            )
            sent.append((self.own_id(), isolation))
        return sent, []

    def _send_apart(self, ledger: Ledger, model: str, flight: Flight, address: str, now: float) -> bool:
        """Re-dispatch the requests of ``flight``, which stalled on ``address`` (or was taken from
        it), each alone on slots in line of its pools, dealt round them and planned one after
        another on each; each is watched as a batch is, so one that stalls again fails alone
        (:meth:`_stalled`). Alone at once, not by halves: a round of a hang costs its detection
        (two hop bounds), not its compute. ``False`` when a pool has no slot in line or the
        isolation budget is spent: the dispatcher then takes them again."""
        live = [entry for entry in flight.retries if entry[0].id in ledger.deadlines]
        lanes_by_hop = self._lanes(ledger, flight)
        if not live:
            return True
        if not all(lanes_by_hop) or not ledger.gray.may_isolate(ledger.counts["isolated"] + len(live) - 1, ledger.counts["batches"]):
            return False
        ledger.counts["isolated"] += len(live)
        queued: dict[str, float] = {}  # first slot -> the planned compute of the parts dealt to it so far
        for lane, entry in enumerate(live):
            route, spans = self._route(ledger, flight, lanes_by_hop, lane, entry[2])
            first = route[0]["address"]
            start = now + queued.get(first, 0.0)
            queued[first] = queued.get(first, 0.0) + spans[0]
            part = Flight(
                [entry[0].id],
                frozenset(hop["address"] for hop in route),
                [entry],
                [(hop["partition"], start if i == 0 else -math.inf, 0.0) for i, hop in enumerate(route)],
                route=route,
                spans=spans,
                isolating=True,
                pipeline=flight.pipeline,
                stalled_on=flight.stalled_on or address,
            )
            self.send(ledger, model, self.own_id(), part)
        return True

    def _lanes(self, ledger: Ledger, flight: Flight) -> list[list[str]]:
        """Per hop of ``flight``: the slots in line of its pool (live, not suspect)."""
        workers = self.models.scheduler.workers
        return [
            sorted(
                a
                for (p, q, a) in ledger.stages
                if (p, q) == (flight.pipeline, hop["partition"]) and a in workers and a not in ledger.suspects
            )
            for hop in flight.route
        ]

    @staticmethod
    def _route(ledger: Ledger, flight: Flight, lanes_by_hop: list[list[str]], lane: int, samples: int) -> tuple[list[Hop], list[float]]:
        """``flight``'s route for a part of ``samples`` on lane ``lane`` (of each hop's slots), and
        its hops' compute seconds (what an emulated slot holds)."""
        pipeline = flight.pipeline
        samples = min(samples, ledger.model.pipelines[pipeline].batch_size)
        route: list[Hop] = []
        spans: list[float] = []
        for hop, slots in zip(flight.route, lanes_by_hop):
            address = slots[lane % len(slots)]
            span = ledger.durations.compute_s(pipeline, hop["partition"], samples)
            held = span if address in ledger.emulated else 0.0
            route.append({**hop, "address": address, "stage": ledger.stages[(pipeline, hop["partition"], address)], "hold_s": held})
            spans.append(span)
        return route, spans


def _abandon(ledger: Ledger, dispatch: int, address: str) -> None:
    """Whatever batch ``dispatch`` reports from now on is discarded (it ended here)."""
    ledger.abandoned[dispatch] = address
    while len(ledger.abandoned) > ABANDONED_KEPT:
        ledger.abandoned.popitem(last=False)
