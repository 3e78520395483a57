"""A discrete-event executor for the dispatchers' decisions.

Time belongs to the engine: one heap of ``(time, priority, seq, event)`` entries, where the priority
orders simultaneous events (arrivals first, then ends of work, then planned starts, then dispatcher
wake-ups) and the sequence number keeps the run deterministic. Dispatchers are stepped with ``now``.

What the engine models:

* every slot (a 1/v vGPU) runs its computes one at a time, in order of planned start; a compute
  starts at max(planned start, slot free, input arrival). Slices of one GPU run independently:
  their profiled latencies already include the interference;
* every server has an uplink and a downlink NIC, each a FIFO in planned-start order; a transfer
  holds the sender's uplink and the receiver's downlink together. Hops between slots of one server
  need no transfer. Ordering every queue by planned start means the globally earliest pending
  operation can always run, so nothing deadlocks;
* durations come from a :class:`Durations` model, optionally with multiplicative noise: a
  mean-one log-normal factor on every duration, and/or for computes a ratio drawn from an
  empirical list of measured/profiled ratios (what the runtime's feedback records);
* every ended compute or transfer is reported back as :class:`~daskpipe.sched.api.Feedback`.

No request is lost: every submitted request ends dispatched-and-completed (on time or late) or
dropped with a reason; leftovers in a dispatcher when no event remains are drained, and the
engine checks the books before it returns.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from daskpipe.sched.api import Action, Dispatch, Dispatcher, Drop, Feedback, Request, Slot, Time

ARRIVAL, OP_END, OP_START, WAKE = range(4)
_EPS = 1e-9  # seconds: tolerance for "on time" against float sums


class Durations(Protocol):
    """How long work really takes (the engine's ground truth, not the dispatcher's belief)."""

    def compute(self, dispatch: Dispatch, partition: int, slot: Slot) -> float: ...

    def transfer(self, dispatch: Dispatch, partition: int) -> float:
        """Feature map into ``partition`` (>= 1) crossing one link."""

    def partitions(self, model: str, pipeline: int) -> int: ...


class ReservedDurations:
    """Durations exactly as the dispatcher reserved them; single-partition pipelines. For unit
    tests and stand-alone Symphony runs where the dispatcher's latency function is the truth."""

    def compute(self, dispatch: Dispatch, partition: int, slot: Slot) -> float:
        hop = next(h for h in dispatch.hops if h.partition == partition)
        return hop.compute.end - hop.compute.start

    def transfer(self, dispatch: Dispatch, partition: int) -> float:
        hop = next(h for h in dispatch.hops if h.partition == partition)
        return 0.0 if hop.transfer_in is None else hop.transfer_in[0].end - hop.transfer_in[0].start

    def partitions(self, model: str, pipeline: int) -> int:
        return 1


@dataclass(eq=False)
class _Op:
    planned: Time
    seq: int
    kind: str  # "compute" | "transfer"
    resources: tuple[str, ...]
    duration: float
    source: int  # index of the dispatcher that made it
    dispatch: Dispatch
    partition: int
    waiting: int = 0
    dependents: list[_Op] = field(default_factory=list)
    start: Time | None = None
    end: Time | None = None
    timer_at: Time | None = None


class _Resource:
    """A slot or a NIC direction: one operation at a time, in planned-start order."""

    __slots__ = ("queue", "busy", "busy_time")

    def __init__(self) -> None:
        self.queue: list[tuple[Time, int, _Op]] = []
        self.busy = False
        self.busy_time = 0.0


@dataclass
class RequestRecord:
    """What became of one request."""

    model: str
    arrival: Time
    deadline: Time
    finish: Time | None = None
    dropped: str | None = None  # the drop reason


@dataclass
class Trace:
    """Everything the engine saw, for metrics and exact-schedule tests."""

    requests: dict[Hashable, RequestRecord] = field(default_factory=dict)
    dispatches: list[tuple[Time, Dispatch]] = field(default_factory=list)  # (decided at, dispatch)
    computes: list[tuple[str, str, int, int, Time, Time]] = field(default_factory=list)  # (model, slot, batch, partition, start, end)
    slot_busy: dict[str, float] = field(default_factory=dict)  # seconds of compute within the horizon
    end_time: Time = 0.0
    events: int = 0


class Engine:
    """Executes ``dispatchers`` (model -> dispatcher; one dispatcher may serve several models).

    Parameters
    ----------
    dispatchers
        Who decides for each model.
    slots
        Every slot a dispatch may name (its server decides NIC sharing).
    durations
        Ground-truth durations.
    noise
        Sigma of a mean-one log-normal factor applied to every duration (0: deterministic).
    latency_ratios
        Measured/profiled compute ratios: each compute's duration is multiplied by one drawn
        uniformly from them (with replacement), before ``noise``. ``None``: computes as profiled.
    seed
        Seeds the noise and the ratio draws.
    horizon
        End of the measurement window for busy time (default: run to the end).
    """

    def __init__(
        self,
        dispatchers: Mapping[str, Dispatcher],
        slots: Mapping[str, Slot],
        durations: Durations,
        *,
        noise: float = 0.0,
        latency_ratios: Sequence[float] | None = None,
        seed: int = 1,
        horizon: Time | None = None,
    ) -> None:
        if not (noise >= 0 and math.isfinite(noise)):
            raise ValueError(f"noise must be a non-negative sigma, got {noise!r}")
        if latency_ratios is not None:
            check_ratios(latency_ratios)
        self.models = dict(dispatchers)
        self.sources: list[Dispatcher] = []
        self._source_of: dict[int, int] = {}
        for dispatcher in self.models.values():
            if id(dispatcher) not in self._source_of:
                self._source_of[id(dispatcher)] = len(self.sources)
                self.sources.append(dispatcher)
        self.slots = dict(slots)
        self.durations = durations
        self.noise = noise
        self.latency_ratios = None if latency_ratios is None else tuple(float(r) for r in latency_ratios)
        self._rng = np.random.default_rng([seed, 7])
        self.horizon = horizon
        self.trace = Trace()
        self._heap: list[tuple[Time, int, int, Callable[[Time], None]]] = []
        self._seq = itertools.count()
        self._resources: dict[str, _Resource] = {s.id: _Resource() for s in self.slots.values()}
        self._wake_at: list[Time | None] = [None] * len(self.sources)
        self._idle_wakes = [0] * len(self.sources)
        self._last_compute: dict[Hashable, _Op] = {}  # request id -> the compute that holds its data
        self.now: Time = 0.0

    # -- event loop ----------------------------------------------------------------------------
    def at(self, time: Time, priority: int, event: Callable[[Time], None]) -> None:
        heapq.heappush(self._heap, (time, priority, next(self._seq), event))

    def add_arrivals(self, requests: Iterable[Request]) -> None:
        """Schedule arrivals lazily, one at a time, so millions of requests cost no memory up front."""
        stream = iter(requests)

        def arrive(now: Time) -> None:
            request = current[0]
            nxt = next(stream, None)
            if nxt is not None:
                if nxt.arrival < request.arrival:
                    raise ValueError(
                        f"arrivals must be sorted by time: {nxt.id!r} at {nxt.arrival} after {request.id!r} at {request.arrival}"
                    )
                current[0] = nxt
                self.at(nxt.arrival, ARRIVAL, arrive)
            self._submit(request, now)

        first = next(stream, None)
        current = [first]
        if first is not None:
            self.at(first.arrival, ARRIVAL, arrive)

    def run(self) -> Trace:
        while True:
            while self._heap:
                time, _, _, event = heapq.heappop(self._heap)
                self.now = time
                self.trace.events += 1
                event(time)
            leftovers = [s for s in self.sources if s.queued]
            if not leftovers:
                break
            for source in leftovers:  # nothing can wake them any more
                self._apply(source, source.drain(self.now, "shutdown"), self.now)
        self.trace.end_time = self.now
        self._check_books()
        return self.trace

    # -- dispatcher side -------------------------------------------------------------------------
    def _submit(self, request: Request, now: Time) -> None:
        dispatcher = self.models.get(request.model)
        if dispatcher is None:
            raise ValueError(
                f"request {request.id!r} is for model {request.model!r}, which no dispatcher serves (have {sorted(self.models)})"
            )
        if request.id in self.trace.requests:
            raise ValueError(f"request id {request.id!r} was submitted twice")
        self.trace.requests[request.id] = RequestRecord(request.model, request.arrival, request.deadline)
        self._apply(dispatcher, dispatcher.submit(request, now), now)

    def _apply(self, dispatcher: Dispatcher, actions: list[Action], now: Time) -> None:
        source = self._source_of[id(dispatcher)]
        for action in actions:
            if isinstance(action, Drop):
                record = self._record(action.request)
                if record.dropped is not None or record.finish is not None:  # completed or dropped already
                    raise RuntimeError(
                        f"dispatcher dropped request {action.request.id!r}, which was already {record.dropped or 'completed'}"
                    )
                record.dropped = action.reason
                self._last_compute.pop(action.request.id, None)  # a request may be dropped between partitions
            elif isinstance(action, Dispatch):
                self._execute(source, action, now)
            else:
                raise TypeError(f"dispatcher returned {action!r}, neither a Dispatch nor a Drop")
        self._arm_wake(source, now)

    def _arm_wake(self, source: int, now: Time) -> None:
        wake = self.sources[source].next_wake()
        if wake is None or wake == self._wake_at[source]:
            return
        if not math.isfinite(wake):
            raise ValueError(f"dispatcher {type(self.sources[source]).__name__} asked for a wake at {wake}")
        self._wake_at[source] = wake
        when = max(wake, now)

        def fire(time: Time) -> None:
            if self._wake_at[source] != wake:
                return  # superseded
            self._wake_at[source] = None
            dispatcher = self.sources[source]
            actions = dispatcher.wake(time)
            again = dispatcher.next_wake()
            self._idle_wakes[source] = self._idle_wakes[source] + 1 if not actions and again is not None and again <= time else 0
            if self._idle_wakes[source] > 1000:
                raise RuntimeError(
                    f"dispatcher {type(dispatcher).__name__} keeps asking to be woken at {again} (now {time}) without acting"
                )
            self._apply(dispatcher, actions, time)

        self.at(when, WAKE, fire)

    def _record(self, request: Request) -> RequestRecord:
        record = self.trace.requests.get(request.id)
        if record is None:
            raise RuntimeError(f"dispatcher acted on request {request.id!r}, which was never submitted")
        return record

    # -- execution -------------------------------------------------------------------------------
    def _scaled(self, seconds: float, kind: str) -> float:
        if seconds == 0.0:
            return seconds
        if kind == "compute" and self.latency_ratios is not None:
            seconds *= self.latency_ratios[int(self._rng.integers(len(self.latency_ratios)))]
        if self.noise == 0.0:
            return seconds
        return seconds * float(np.exp(self._rng.normal(-(self.noise**2) / 2, self.noise)))

    def _execute(self, source: int, dispatch: Dispatch, now: Time) -> None:
        if not dispatch.hops or not dispatch.requests:
            raise ValueError(f"dispatch {dispatch.id} of {dispatch.model!r} has no hops or no requests")
        self.trace.dispatches.append((now, dispatch))
        first = dispatch.hops[0].partition
        for request in dispatch.requests:
            record = self._record(request)
            if record.dropped is not None:
                raise RuntimeError(f"dispatch {dispatch.id} carries request {request.id!r}, which was dropped ({record.dropped})")
            held = self._last_compute.get(request.id)
            expected = 0 if held is None else held.partition + 1
            if first != expected:
                raise RuntimeError(
                    f"dispatch {dispatch.id} runs partition {first} of request {request.id!r}, which needs partition {expected} next"
                )
        last_partition = self.durations.partitions(dispatch.model, dispatch.pipeline) - 1
        ops: list[_Op] = []
        previous = self._last_compute.get(dispatch.requests[0].id)
        for hop in dispatch.hops:
            slot = self.slots.get(hop.slot)
            if slot is None:
                raise ValueError(f"dispatch {dispatch.id} names unknown slot {hop.slot!r}")
            if previous is not None and hop.partition != previous.partition + 1:
                raise ValueError(
                    f"dispatch {dispatch.id}: hops must follow partitions in order, got {hop.partition} after {previous.partition}"
                )
            feeder = previous
            if previous is not None and self.slots[previous.resources[0]].server != slot.server:
                planned = hop.transfer_in[0].start if hop.transfer_in else hop.compute.start  # the api.Dispatch contract
                sender, receiver = self.slots[previous.resources[0]].server, slot.server
                feeder = self._op(
                    source,
                    dispatch,
                    hop.partition,
                    "transfer",
                    (f"{sender}/ul", f"{receiver}/dl"),
                    planned,
                    self._scaled(self.durations.transfer(dispatch, hop.partition), "transfer"),
                    previous,
                )
                ops.append(feeder)
            compute = self._op(
                source,
                dispatch,
                hop.partition,
                "compute",
                (hop.slot,),
                hop.compute.start,
                self._scaled(self.durations.compute(dispatch, hop.partition, slot), "compute"),
                feeder,
            )
            ops.append(compute)
            previous = compute
            if hop.partition > last_partition:
                raise ValueError(
                    f"dispatch {dispatch.id} runs partition {hop.partition}; pipeline {dispatch.pipeline} of {dispatch.model!r} has "
                    f"{last_partition + 1}"
                )
        for request in dispatch.requests:
            self._last_compute[request.id] = previous
        for op in ops:
            self._enqueue(op)

    def _op(
        self,
        source: int,
        dispatch: Dispatch,
        partition: int,
        kind: str,
        resources: tuple[str, ...],
        planned: Time,
        duration: float,
        after: _Op | None,
    ) -> _Op:
        op = _Op(planned, next(self._seq), kind, resources, duration, source, dispatch, partition)
        if after is not None and after.end is None:
            op.waiting = 1
            after.dependents.append(op)
        return op

    def _enqueue(self, op: _Op) -> None:
        for name in op.resources:
            resource = self._resources.setdefault(name, _Resource())
            heapq.heappush(resource.queue, (op.planned, op.seq, op))
        self._try(op, self.now)

    def _try(self, op: _Op, now: Time) -> None:
        if op.waiting or op.start is not None:
            return
        for name in op.resources:
            resource = self._resources[name]
            if resource.busy or resource.queue[0][2] is not op:
                return
        if op.planned > now:
            if op.timer_at != op.planned:
                op.timer_at = op.planned
                self.at(op.planned, OP_START, lambda t, op=op: self._try(op, t))
            return
        op.start = now
        for name in op.resources:
            resource = self._resources[name]
            heapq.heappop(resource.queue)
            resource.busy = True
        self.at(now + op.duration, OP_END, lambda t, op=op: self._finish(op, t))

    def _finish(self, op: _Op, now: Time) -> None:
        op.end = now
        for name in op.resources:
            resource = self._resources[name]
            resource.busy = False
            if op.kind == "compute":
                lo, hi = op.start, now if self.horizon is None else min(now, self.horizon)
                resource.busy_time += max(0.0, hi - lo)
        dispatch = op.dispatch
        if op.kind == "compute":
            self.trace.computes.append((dispatch.model, op.resources[0], dispatch.batch_size, op.partition, op.start, now))
            if op.partition == self.durations.partitions(dispatch.model, dispatch.pipeline) - 1:
                for request in dispatch.requests:
                    record = self.trace.requests[request.id]
                    if record.dropped is None:
                        record.finish = now
                        del self._last_compute[request.id]
        source = self.sources[op.source]
        self._apply(source, source.feedback(Feedback(dispatch.id, op.partition, op.kind, op.start, now), now), now)  # type: ignore[arg-type]
        for dependent in op.dependents:
            dependent.waiting -= 1
            self._try(dependent, now)
        for name in op.resources:
            queue = self._resources[name].queue
            if queue:
                self._try(queue[0][2], now)

    def _check_books(self) -> None:
        unfinished = [rid for rid, r in self.trace.requests.items() if r.dropped is None and r.finish is None]
        if unfinished:
            raise RuntimeError(f"{len(unfinished)} request(s) were neither completed nor dropped, e.g. {unfinished[:5]}")
        for name, resource in self._resources.items():
            if name in self.slots:
                self.trace.slot_busy[name] = resource.busy_time


def check_ratios(ratios: Sequence[float]) -> None:
    """Refuse an empty list of latency ratios, or one with a ratio that is not a positive number."""
    if len(ratios) == 0:
        raise ValueError("latency_ratios is empty; give at least one measured/profiled ratio")
    bad = [r for r in ratios if not (r > 0 and math.isfinite(r))]
    if bad:
        raise ValueError(f"latency ratios must be positive numbers, got {bad[:5]}")


def on_time(record: RequestRecord) -> bool:
    return record.dropped is None and record.finish is not None and record.finish <= record.deadline + _EPS
