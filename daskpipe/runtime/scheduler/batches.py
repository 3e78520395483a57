"""Dispatched batches, from the scheduler out to their stages and back.

:class:`Batches` turns a dispatcher's :class:`~daskpipe.sched.api.Dispatch` into a batch message
along its hops (a staged dispatch parks or takes its requests' intermediate data), and takes the
stages' reports: feedback per hop, a batch done (the clients' futures resolve), a batch failed
(retried in halves, poison isolation). Every batch sent is watched by the
:class:`~daskpipe.runtime.scheduler.watch.GrayWatch`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
from distributed.protocol import Serialized

from daskpipe.runtime.errors import RequestFailed, guarded
from daskpipe.runtime.scheduler.keys import InMemoryReports, clients_of, err_keys, free_keys, resolve, store
from daskpipe.runtime.scheduler.ledger import Dropped, Failed, Flight, Ledger, Output, client_gone, worker_lost
from daskpipe.runtime.scheduler.links import Links
from daskpipe.runtime.scheduler.models import Models
from daskpipe.runtime.scheduler.watch import GrayWatch
from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.inputs import HeldInput
from daskpipe.runtime.wire.messages import BatchHeader, Hop
from daskpipe.sched.api import Dispatch, Feedback


class Batches:
    """The plugin's batches in flight (see the module docstring); runs on the scheduler's loop."""

    def __init__(self, models: Models, links: Links, watch: GrayWatch) -> None:
        self.models = models
        self.links = links
        self.watch = watch
        self.slot_ends: dict[str, float] = {}  # address -> end of the last batch it reported computing (scheduler clock)
        self.next_ids: dict[str, int] = {}  # model -> past the highest dispatch id ever sent for it: reports carry no other tag
        self.reports = InMemoryReports(links.client_streams)

    @guarded
    def on_feedback(self, worker: str, model: str, dispatch: int, timings: list, overrun: bool = False) -> None:
        ledger = self.models.ledgers.get(model)
        if ledger is not None and dispatch not in ledger.abandoned:
            self._feedback(ledger, model, dispatch, timings, overrun)
            self.models.arm()

    @guarded
    def on_done(
        self,
        worker: str,
        model: str,
        dispatch: int,
        keys: list,
        nbytes: list,
        timings: list,
        overrun: bool = False,
        outputs: list | None = None,
        told: list | None = None,
        written_s: float | None = None,
    ) -> None:
        """The last stage stored the batch's outputs on ``worker``: resolve the futures of the
        clients it has not ``told`` itself, with the small ``outputs`` (packed tensors, never
        unpacked here) that came along. ``written_s``: how long after its compute ended ``worker`` wrote this.

        Only the resolutions are sent from here; the bookkeeping (the keys into memory on
        ``worker``, feedback, counters) runs on the next loop turn, after their write has left.
        No client can act on a resolution before that turn: it takes a round trip."""
        if worker not in self.models.scheduler.workers:  # it left after sending: its outputs are gone, the retries of its batches run
            return
        ledger = self.models.ledgers.get(model)
        if ledger is not None and dispatch in ledger.abandoned:  # retried or dropped meanwhile: discard what it computed
            free_keys(self.models.scheduler, worker, list(keys), "abandoned")
            return
        tasks = self.models.scheduler.tasks
        pending = [k for k in keys if (ts := tasks.get(k)) is not None and ts.state == "released"]
        relayed = False
        if pending:
            relayed = resolve(
                self.models.scheduler,
                self.links.client_streams,
                pending,
                dict(zip(keys, outputs)) if outputs is not None else None,
                worker=worker,
                told=frozenset(told or ()),
            )
        asyncio.get_running_loop().call_soon(
            self._done, worker, model, dispatch, keys, nbytes, timings, overrun, time.monotonic(), relayed, written_s
        )

    @guarded
    def _done(
        self,
        worker: str,
        model: str,
        dispatch: int,
        keys: list,
        nbytes: list,
        timings: list,
        overrun: bool,
        done: float,
        relayed: bool,
        written_s: float | None,
    ) -> None:
        """The keys in memory on ``worker`` (as ``scatter`` does), and the batch's feedback and
        counts; ``relayed``: a client's futures were resolved from here, after the completion;
        ``written_s``: how long after its compute ended the worker wrote the completion."""
        store(self.models.scheduler, worker, keys, nbytes, self.reports)
        ledger = self.models.ledgers.get(model)
        if ledger is None:
            return
        self._feedback(ledger, model, dispatch, timings, overrun)
        flight = ledger.flights.pop(dispatch, None)
        delays = flight.control_delays() if flight is not None else None
        if flight is not None and delays is not None and not flight.isolating:  # an isolation's plan is the watch's, not a dispatcher's
            ledger.control.record(done, *delays, done - flight.ran[flight.planned[-1][0]][1], relayed, written_s)
        late = sum(done > deadline for key in keys if (deadline := ledger.deadlines.get(key)) is not None)
        ended = set(ledger.end(keys, Output(done)))  # not those ended already: both a batch and its retry after a worker loss ran
        legs = flight.legs(done) if late and flight is not None else None
        if legs is not None:
            ledger.late.add(legs, late)
        metrics = self.models.metrics
        arrivals = [r.arrival for r, _, _ in flight.retries if r.id in ended] if flight is not None else None
        if not ended:
            metrics.forget(model, dispatch)
        elif flight is not None and flight.isolating:  # sent by the plugin, not the dispatcher: the metrics have no batch for it
            metrics.complete(model, [done - arrival for arrival in arrivals or ()], done)
        else:
            metrics.done(model, dispatch, done, arrivals)
        self.watch.settle()
        self.models.arm()

    @guarded
    def on_failed(self, worker: str, model: str, dispatch: int, keys: list, exception: Serialized) -> None:
        """A stage raised. A batch of several requests is retried in halves (poison isolation,
        :mod:`daskpipe.runtime.scheduler.gray`); a request that fails alone, or that its deadline or the
        isolation budget leave no retry, errs with the stage's RequestFailed."""
        ledger = self.models.ledgers.get(model)
        if ledger is None:
            err_keys(self.models.scheduler, keys, exception)
            return
        if dispatch in ledger.abandoned:  # its requests were retried or dropped when it was taken away
            return
        flight = ledger.flights.pop(dispatch, None)
        now = time.monotonic()
        live = [entry for entry in flight.retries if entry[0].id in ledger.deadlines] if flight is not None else []
        if flight is not None and len(live) > 1 and not flight.staged:
            halves, failing = self.watch.isolate(ledger, model, flight, live, now)
            for isolation, half in halves:
                self.send(ledger, model, isolation, half)
        else:
            failing = [key for key in keys if key in ledger.deadlines]
        ledger.end(failing, Failed(exception))
        self.models.metrics.forget(model, dispatch)
        self.models.arm()

    @guarded
    def on_unfetched(self, worker: str, model: str, dispatch: int, keys: list, reason: str, detail: str) -> None:
        """The first stage on ``worker`` could not fetch the inputs of ``keys`` from their client: they
        end here, dropped as ``client-gone`` or ``deadline`` (``reason``), or failed with ``detail``;
        the rest of the batch runs."""
        ledger = self.models.ledgers.get(model)
        if ledger is None or dispatch in ledger.abandoned:
            return
        flight = ledger.flights.get(dispatch)
        ending, ended = set(keys), True
        if flight is not None:
            kept = [i for i, key in enumerate(flight.keys) if key not in ending]
            flight.keys = [flight.keys[i] for i in kept]
            flight.retries = [flight.retries[i] for i in kept]
            ended = not kept
            if ended:  # nothing of it runs
                ledger.flights.pop(dispatch, None)
        if ended:
            self.models.metrics.forget(model, dispatch)
        ledger.end(keys, Dropped(reason, detail) if reason in ("client-gone", "deadline") else Failed(RequestFailed(detail)))
        self.models.arm()

    def _feedback(self, ledger: Ledger, model: str, dispatch: int, timings: list, overrun: bool) -> None:
        ledger.counts["overruns"] += bool(overrun)
        now = time.monotonic()
        offset = now - time.time()  # wall clock on the wire -> this scheduler's monotonic clock
        flight = ledger.flights.get(dispatch)
        for partition, kind, start, end in timings:
            fb = Feedback(dispatch, int(partition), kind, start + offset, end + offset)
            if flight is not None and kind == "compute":
                flight.ran[fb.partition] = (fb.start, fb.end)
                index = next((i for i, (partition, _, _) in enumerate(flight.planned) if partition == fb.partition), None)
                if index is None:
                    continue
                # a slot computes one batch at a time and reports in order: until the end of the
                # one before, this batch waited on compute, not on the control path
                address = flight.route[index]["address"]
                flight.slot_free[fb.partition] = before = self.slot_ends.get(address, -np.inf)
                self.slot_ends[address] = max(fb.end, before)
                if flight.trial:  # measured, not watched
                    continue
                if index + 1 < len(flight.planned):
                    _, planned_start, transfer = flight.planned[index + 1]
                    self.watch.watch_hop(ledger, model, dispatch, flight, index + 1, max(planned_start, fb.end + transfer))
                elif flight.staged and flight.route[-1].get(
                    "park"
                ):  # before the dispatcher hears of it: it may send the next stage at once
                    self._park(ledger, model, dispatch, flight, now)
                self.watch.pace(ledger, model, address, fb.end - fb.start, flight.spans[index], now)
            if flight is not None and flight.trial:  # the plugin's, not the dispatcher's
                continue
            self.models.metrics.feedback(model, fb)
            self.models.act(ledger, model, ledger.step(lambda: ledger.dispatcher.feedback(fb, now)))

    def dispatch(self, ledger: Ledger, model: str, action: Dispatch) -> None:
        """Send ``action``'s batch along its hops. A staged dispatch (hops covering part of the
        pipeline, :class:`~daskpipe.sched.api.Dispatch`) that ends before the last partition
        leaves its requests' intermediate data parked on its last slot; one that starts past
        partition 0 takes each request's data from the slot where it is parked."""
        keys, payloads, sizes = [], [], []
        tasks = self.models.scheduler.tasks
        for request in action.requests:
            queued = ledger.queued.pop(request.id, None)
            if queued is None:  # it already ended (a dispatcher failure failed it)
                continue
            if request.id not in tasks:  # its client released it (cancelled, or left): compute nothing for nobody
                ledger.end([request.id], Dropped("released"))
            elif isinstance(queued[0], HeldInput) and queued[0].client not in self.links.client_streams:
                ledger.end([request.id], client_gone(f"client {queued[0].client} left holding its input"))
            else:
                keys.append(request.id)
                payloads.append(queued[0])
                sizes.append(queued[1])
        if not keys:
            return
        pipeline = ledger.model.pipelines[action.pipeline]
        first, last = action.hops[0].partition, action.hops[-1].partition
        parked_on = [ledger.parked.pop(key, None) for key in keys] if first > 0 else []
        samples = sum(sizes)
        try:
            holds = [
                ledger.durations.compute_s(action.pipeline, hop.partition, samples) if hop.slot in ledger.emulated else 0.0
                for hop in action.hops
            ]
            if None in parked_on:
                raise ValueError(f"partition {first} for requests that ran no partition {first - 1}")
        except ValueError as exc:  # a dispatcher bug: the batch fails, with the cause
            failure = RequestFailed(f"the dispatcher of {model!r} dispatched {exc}", cause=exc)
            ledger.end(keys, Failed(failure))
            return
        route: list[Hop] = [
            {
                "address": hop.slot,
                "stage": ledger.stages[(action.pipeline, hop.partition, hop.slot)],
                "partition": hop.partition,
                "hold_s": hold,
            }
            for hop, hold in zip(action.hops, holds)
        ]
        if last < len(pipeline.partitions) - 1:
            route[-1]["park"] = True
        sources = [address for address in parked_on if address is not None]  # all of them (checked above)
        addresses = frozenset(r["address"] for r in route).union(sources)
        missing = [a for a in addresses if a not in self.models.scheduler.workers]
        if missing:
            ledger.end(keys, worker_lost(f"worker {missing[0]} of its pipeline is gone"))
            return
        requests = {request.id: request for request in action.requests}
        planned = [
            (h.partition, h.compute.start, 0.0 if h.transfer_in is None else h.transfer_in[1].end - h.transfer_in[1].start)
            for h in action.hops
        ]
        spans = [h.compute.end - h.compute.start for h in action.hops]
        ledger.counts["batches"] += 1
        self.models.metrics.dispatch(model, action, time.monotonic(), len(ledger.queued))
        flight = Flight(
            keys,
            addresses,
            [(requests[k], p, n) for k, p, n in zip(keys, payloads, sizes)],
            planned,
            route=route,
            spans=spans,
            sources=sources,
            pipeline=action.pipeline,
        )
        self.send(ledger, model, action.id, flight)

    def _park(self, ledger: Ledger, model: str, dispatch: int, flight: Flight, now: float) -> None:
        """A staged batch ended before the pipeline's last partition: its requests queue again (in
        the dispatcher, for their next stage), their data parked on its last slot."""
        ledger.flights.pop(dispatch, None)
        address = flight.route[-1]["address"]
        for request, payload, size in flight.retries:
            ledger.requeue(request.id, payload, size, parked_on=address)
        delays = flight.control_delays()
        if delays is not None:
            ledger.control.record(now, *delays, now - flight.ran[flight.planned[-1][0]][1])
        self.models.metrics.forget(model, dispatch)

    def send(self, ledger: Ledger, model: str, dispatch: int, flight: Flight) -> None:
        """Send ``flight`` to its first stage, and watch it: its first hop must report within
        its bound, its requests within the late limit (:mod:`daskpipe.runtime.scheduler.gray`)."""
        ledger.flights[dispatch] = flight
        if dispatch >= self.next_ids.get(model, 0):
            self.next_ids[model] = dispatch + 1
        retries = flight.retries
        batch: BatchHeader = {
            "op": messages.BATCH,
            "model": model,
            "dispatch": dispatch,
            "keys": flight.keys,
            "sizes": [n for _, _, n in retries],
            "route": flight.route,
            "clients": (clients := clients_of(self.models.scheduler, self.links.client_streams, flight.keys)),
        }
        if not flight.trial:  # a trial's slow batches are what it measures: the watch would take them away
            batch["expires"] = self.watch.watch_batch(ledger, model, dispatch, flight) + time.time() - time.monotonic()
        last = flight.route[-1]["address"]
        for client in clients:  # a stage worker new since its first requests (a re-plan): before it has outputs for it
            self.links.reach(client, [last])
        if not flight.sources:
            first = flight.route[0]["address"]
            inputs: list[Any] = []
            fetch: dict[str, list[int]] = {}  # client -> the indices of the inputs the first stage fetches from it
            for index, (_, payload, _) in enumerate(retries):
                if isinstance(payload, HeldInput):
                    fetch.setdefault(payload.client, []).append(index)
                    payload = None
                inputs.append(payload)
            for client in fetch:
                self.links.reach(client, [first])
            batch["inputs"] = inputs
            if fetch:
                batch["fetch"] = fetch
            self.links.to_worker(first, batch)
            return
        parts: dict[str, list] = {}
        for key, source in zip(flight.keys, flight.sources):
            parts.setdefault(source, []).append(key)
        for source, take in parts.items():  # each sends its part to the first stage, which gathers them
            self.links.to_worker(source, {**batch, "op": messages.FORWARD, "take": take})
