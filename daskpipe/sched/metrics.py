"""What the dashboard and ``/metrics`` show, recorded as it happens: :class:`ServiceMetrics`.

The scheduler plugin (or a simulator replay) calls one method per event; each call does work in
proportion to its batch on bounded structures (per-second counters, ring buffers, fixed histogram
buckets) and keeps no per-request objects: a request's arrival time is all it needs, so a full
ring buffer holds no ``Request`` for the collector to walk. A batch's completion is counted in
plain Python, a bisection per value: numpy's per-call overhead made recording one small batch
cost about 0.1 ms of the scheduler's loop, where a lone request's next message waited. Aggregation
(rates, percentiles, utilisation) is left to the readers: the dashboard's periodic ``update`` and
the Prometheus collector, which run far less often than requests arrive.

It lives below the simulator and the runtime, which both record into it, and below the dashboard,
which only reads it.

Times are the caller's clock (the plugin's ``time.monotonic()``, or the simulator's virtual
clock); readers pass their own ``now`` in the same clock.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from daskpipe.plan.schema import ModelPlan
    from daskpipe.sched.api import Dispatch, Feedback, Hop, Placement

BUCKET_S = 1.0
"""Width of one bucket of the rate series."""
HISTORY_BUCKETS = 600
"""Buckets kept per series: ten minutes of per-second counts."""
LATENCY_BOUNDS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
"""Upper bounds of the latency histogram's buckets (Prometheus ``le``); one more bucket is +Inf."""
LATENCY_BINS_S = tuple(1e-4 * 10 ** (i / 20) for i in range(121))
"""Edges of the fine latency bins kept per bucket, for percentiles over time: 0.1 ms to 100 s,
12% apart (a percentile is read as its bin's upper edge)."""
DISPATCH_HISTORY = 4_000
"""Recent dispatches kept per model, for the reservation timeline."""
BUSY_HISTORY = 20_000
"""Recent actual busy intervals kept (all resources together)."""
PENDING_LIMIT = 10_000
"""Dispatches awaiting their completion, per model; past it the oldest is forgotten (a batch whose
worker died reports nothing)."""
DROP_HISTORY = 100
"""Recent drop events kept (all models together), for the table of recent drops; the drops of one
model for one reason within one bucket are one event (a burst is one row, not a hundred)."""
PHASES = ("queue", "compute", "transfer", "other")
"""The parts a completed request's latency is split into: waiting for its batch to be dispatched,
its batch computing on the stages, its batch's feature maps crossing NICs, and the rest (messages
between scheduler and workers, waiting between stages, storing the outputs)."""


class _Series:
    """Per-:data:`BUCKET_S` buckets, the last :data:`HISTORY_BUCKETS` of them: ``[index, value]``."""

    __slots__ = ("buckets",)

    def __init__(self) -> None:
        self.buckets: deque[list] = deque(maxlen=HISTORY_BUCKETS)

    def _current(self, now: float, empty: Any) -> list:
        """The bucket of ``now`` (or the latest, for a slightly earlier time), appended if new with
        ``empty`` (called first if callable)."""
        index = int(now // BUCKET_S)
        buckets = self.buckets
        if not buckets or buckets[-1][0] < index:
            buckets.append([index, empty() if callable(empty) else empty])
        return buckets[-1]

    def values(self, first: int, last: int, missing: Any) -> list:
        """Values of buckets ``first`` to ``last`` inclusive (``missing`` where nothing happened);
        walks back from the newest bucket, so reading the last few costs only those."""
        out = [missing] * (last - first + 1)
        for index, value in reversed(self.buckets):
            if index < first:
                break
            if index <= last:
                out[index - first] = value
        return out


class PeakSeries(_Series):
    """The highest value seen in each bucket (the queue-depth series)."""

    __slots__ = ()

    def add(self, now: float, value: int) -> None:
        bucket = self._current(now, value)
        if value > bucket[1]:
            bucket[1] = value


class LatencySeries(_Series):
    """A histogram of latencies per bucket over :data:`LATENCY_BINS_S`: percentiles over time at
    O(log bins) per sample."""

    __slots__ = ()

    def add(self, now: float, latencies: Sequence[float]) -> None:
        _histogram_add(self._current(now, lambda: np.zeros(len(LATENCY_BINS_S) + 1, dtype=np.int64))[1], LATENCY_BINS_S, latencies)

    def percentiles(self, first: int, last: int, qs: tuple[float, ...]) -> dict[float, list[float]]:
        """Each ``q``-th percentile (0-100) of each bucket ``first`` to ``last``, in seconds; NaN
        where nothing completed."""
        out = {q: [float("nan")] * (last - first + 1) for q in qs}
        rows = [(position, counts) for position, counts in enumerate(self.values(first, last, None)) if counts is not None]
        if rows:
            cumulative = np.cumsum([counts for _, counts in rows], axis=1)
            edges = np.append(LATENCY_BINS_S, np.inf)
            for q in qs:
                ranks = np.maximum(q / 100 * cumulative[:, -1], 1)
                bins = (cumulative < ranks[:, None]).sum(axis=1)
                for (position, _), edge in zip(rows, edges[bins]):
                    out[q][position] = float(edge)
        return out


class PhaseSeries(_Series):
    """Per bucket, the completed requests and their summed seconds in each of :data:`PHASES`."""

    __slots__ = ()

    def add(self, now: float, phases: Sequence[Sequence[float]]) -> None:
        """``phases``: one column of seconds per phase of :data:`PHASES`, a value per completed request."""
        sums = self._current(now, lambda: [0] * (len(PHASES) + 1))[1]
        sums[0] += len(phases[0])
        for i, seconds in enumerate(phases, 1):
            sums[i] += sum(seconds)

    def means(self, first: int, last: int) -> dict[str, float]:
        """Mean seconds per request in each phase over buckets ``first`` to ``last`` (empty when
        nothing completed with a known breakdown)."""
        total = [0.0] * (len(PHASES) + 1)
        for sums in self.values(first, last, None):
            if sums is not None:
                total = [a + b for a, b in zip(total, sums)]
        return {phase: seconds / total[0] for phase, seconds in zip(PHASES, total[1:])} if total[0] else {}


class RateSeries(_Series):
    """Event counts per bucket, and in all."""

    __slots__ = ("total",)

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def add(self, now: float, count: int = 1) -> None:
        self._current(now, 0)[1] += count
        self.total += count

    def counts(self, first: int, last: int) -> list[int]:
        return self.values(first, last, 0)


@dataclass(slots=True)
class Pending:
    """A dispatched batch until its last stage is done: its planned hops, its requests' arrivals,
    when it left the queue, and the seconds its reservations really took so far (from the
    workers' feedback)."""

    hops: tuple[Hop, ...]
    arrivals: list[float]
    dispatched: float
    compute_s: float = 0.0
    transfer_s: float = 0.0


@dataclass(slots=True, eq=False)
class DropEvent:
    """Drops of ``model`` for ``reason`` from ``time`` on, within its bucket: ``count`` requests,
    ``detail`` the last one's."""

    time: float
    model: str
    reason: str
    count: int
    detail: str


def _latency_buckets() -> np.ndarray:
    return np.zeros(len(LATENCY_BOUNDS_S) + 1, dtype=np.int64)


def _histogram_add(counts: np.ndarray, bounds: Sequence[float], seconds: Sequence[float]) -> None:
    """Count ``seconds`` into the buckets over ``bounds`` (``le``: a bound belongs to its bucket)."""
    for value in seconds:
        counts[bisect_left(bounds, value)] += 1


@dataclass
class ModelMetrics:
    """Everything recorded about one model."""

    slo_s: float = 0.0
    plan: ModelPlan | None = None
    plan_quality: str = ""  # the whole plan's objective, bound and gap (Plan.quality), where the server knows it
    placement: Placement | None = None
    offered: RateSeries = field(default_factory=RateSeries)
    completed: RateSeries = field(default_factory=RateSeries)
    on_time: RateSeries = field(default_factory=RateSeries)
    failed: RateSeries = field(default_factory=RateSeries)
    invalid: RateSeries = field(default_factory=RateSeries)  # refused on arrival by the scheduler's check of the bytes
    dropped: dict[str, RateSeries] = field(default_factory=dict)  # reason -> series
    latency_buckets: np.ndarray = field(default_factory=_latency_buckets)
    latency_sum: float = 0.0
    latencies: LatencySeries = field(default_factory=LatencySeries)
    phases: PhaseSeries = field(default_factory=PhaseSeries)  # latency breakdown of completions, per bucket
    phase_buckets: dict[str, np.ndarray] = field(default_factory=lambda: {phase: _latency_buckets() for phase in PHASES})
    phase_sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    batch_sizes: dict[tuple[int, int], int] = field(default_factory=dict)  # (pipeline, requests in batch) -> batches
    dispatches: deque[tuple[float, tuple[Hop, ...]]] = field(default_factory=lambda: deque(maxlen=DISPATCH_HISTORY))  # (when, planned hops)
    pending: dict[int, Pending] = field(default_factory=dict)  # dispatch id -> its batch, until done
    queue: PeakSeries = field(default_factory=PeakSeries)  # the longest queue of each bucket
    control: Callable[[], dict[str, float]] | None = None  # the live runtime's control-path summary (ms), if any
    suspects: Callable[[], dict[str, dict[str, Any]]] | None = (
        None  # the live runtime's suspect slots, if any (daskpipe/runtime/scheduler/gray.py)
    )


class ServiceMetrics:
    """The recorder: one instance per scheduler plugin (or per simulated run)."""

    def __init__(self, unix_offset: float = 0.0) -> None:
        """``unix_offset`` turns the caller's clock into Unix time (the live plugin passes
        ``time.time() - time.monotonic()``); with 0, a virtual clock's times read as time since its
        start."""
        self.unix_offset = unix_offset
        self.models: dict[str, ModelMetrics] = {}
        self.busy: deque[tuple[str, float, float]] = deque(maxlen=BUSY_HISTORY)  # (resource, start, end)
        self.drops: deque[DropEvent] = deque(maxlen=DROP_HISTORY)
        self.gpu_of: dict[str, str] = {}  # slot id -> GPU type
        self.last_time = 0.0

    def model(self, model: str) -> ModelMetrics:
        found = self.models.get(model)
        if found is None:
            found = self.models[model] = ModelMetrics()
        return found

    # -- events ---------------------------------------------------------------------------------
    def serve(
        self,
        model: str,
        plan: ModelPlan,
        placement: Placement,
        control: Callable[[], dict[str, float]] | None = None,
        suspects: Callable[[], dict[str, dict[str, Any]]] | None = None,
        plan_quality: str = "",
    ) -> None:
        """``model`` is served by ``plan`` on ``placement`` from now on; ``control`` reads its
        measured control path (``daskpipe.runtime.scheduler.control.ControlPath.summary``), ``suspects``
        its suspect slots (``daskpipe.runtime.scheduler.gray.Suspect.summary`` by address), ``plan_quality``
        says how good the whole plan is (``Plan.quality``)."""
        metrics = self.model(model)
        metrics.plan_quality = plan_quality
        metrics.plan, metrics.slo_s, metrics.control, metrics.suspects = plan, plan.slo_us * 1e-6, control, suspects
        self.place(model, placement)

    def place(self, model: str, placement: Placement) -> None:
        """``model`` runs on ``placement`` from now on (slots joined its pools while it serves)."""
        self.model(model).placement = placement
        for slot in placement.slots.values():
            self.gpu_of[slot.id] = slot.gpu

    def submit(self, model: str, count: int, now: float, queued: int) -> None:
        """``count`` requests arrived; ``queued`` wait now (the live queue-depth gauge)."""
        metrics = self.model(model)
        metrics.offered.add(now, count)
        metrics.queue.add(now, queued)
        self.last_time = now

    def dispatch(self, model: str, dispatch: Dispatch, now: float, queued: int) -> None:
        """A batch left the queue along ``dispatch.hops`` (with their planned reservations)."""
        metrics = self.model(model)
        key = (dispatch.pipeline, len(dispatch.requests))
        metrics.batch_sizes[key] = metrics.batch_sizes.get(key, 0) + 1
        metrics.dispatches.append((now, dispatch.hops))
        pending = metrics.pending
        pending[dispatch.id] = Pending(dispatch.hops, [r.arrival for r in dispatch.requests], now)
        if len(pending) > PENDING_LIMIT:
            del pending[next(iter(pending))]
        metrics.queue.add(now, queued)
        self.last_time = now

    def feedback(self, model: str, fb: Feedback) -> None:
        """A reservation of a pending dispatch really ran over [fb.start, fb.end)."""
        pending = self.models[model].pending.get(fb.dispatch) if model in self.models else None
        if pending is None:
            return
        for hop in pending.hops:
            if hop.partition != fb.partition:
                continue
            if fb.kind == "compute":
                pending.compute_s += fb.end - fb.start
                self.busy_interval(hop.slot, fb.start, fb.end)
            else:
                pending.transfer_s += fb.end - fb.start
                for reservation in hop.transfer_in or ():
                    self.busy_interval(reservation.resource, fb.start, fb.end)
            return

    def busy_interval(self, resource: str, start: float, end: float) -> None:
        """``resource`` (a slot, or a ``<server>/ul|dl`` NIC direction) was busy over [start, end)."""
        self.busy.append((resource, start, end))

    def forget(self, model: str, dispatch_id: int) -> None:
        """Dispatch ``dispatch_id`` will not complete: it failed, was taken from its slot, or was a
        staged batch that ended before the pipeline's last partition (its requests go on in later
        batches; the one that runs their last partition completes them)."""
        metrics = self.models.get(model)
        if metrics is not None:
            metrics.pending.pop(dispatch_id, None)

    def done(self, model: str, dispatch_id: int, now: float, arrivals: Sequence[float] | None = None) -> None:
        """The last stage of dispatch ``dispatch_id`` finished: its requests completed, each with
        its latency split into :data:`PHASES`; ``arrivals``: those of the requests that completed
        with it, where not all it was dispatched with (some ended before, by another batch)."""
        metrics = self.models.get(model)
        pending = metrics.pending.pop(dispatch_id, None) if metrics is not None else None
        if pending is None:
            return
        compute_s, transfer_s = pending.compute_s, pending.transfer_s
        arrivals = pending.arrivals if arrivals is None else arrivals
        latencies = [now - arrival for arrival in arrivals]
        queue = [pending.dispatched - arrival for arrival in arrivals]
        other = [max(0.0, latency - waited - compute_s - transfer_s) for latency, waited in zip(latencies, queue)]
        self.complete(model, latencies, now, (queue, [compute_s] * len(queue), [transfer_s] * len(queue), other))

    def complete(self, model: str, latencies: Sequence[float], now: float, phases: Sequence[Sequence[float]] | None = None) -> None:
        """Requests completed ``latencies`` seconds after they arrived (one batch, or one request);
        ``phases`` holds their latencies split into :data:`PHASES` (a column each, a value per
        request), where known."""
        metrics = self.model(model)
        metrics.completed.add(now, len(latencies))
        metrics.on_time.add(now, sum(latency <= metrics.slo_s for latency in latencies))
        _histogram_add(metrics.latency_buckets, LATENCY_BOUNDS_S, latencies)
        metrics.latency_sum += sum(latencies)
        metrics.latencies.add(now, latencies)
        if phases is not None:
            metrics.phases.add(now, phases)
            for phase, seconds in zip(PHASES, phases):
                _histogram_add(metrics.phase_buckets[phase], LATENCY_BOUNDS_S, seconds)
                metrics.phase_sums[phase] += sum(seconds)
        self.last_time = now

    def drop(self, model: str, reason: str, count: int, now: float, detail: str = "") -> None:
        """``count`` requests were dropped for ``reason`` (a ``DropReason``; ``detail`` says more)."""
        metrics = self.model(model)
        series = metrics.dropped.get(reason)
        if series is None:
            series = metrics.dropped[reason] = RateSeries()
        series.add(now, count)
        last = self.drops[-1] if self.drops else None
        if last is not None and (last.model, last.reason) == (model, reason) and last.time // BUCKET_S == now // BUCKET_S:
            last.count += count
            last.detail = detail or last.detail
        elif count:
            self.drops.append(DropEvent(now, model, reason, count, detail))
        self.last_time = now

    def refuse(self, model: str, count: int, now: float) -> None:
        """``count`` submitted requests were refused on arrival as invalid (they never queued)."""
        self.model(model).invalid.add(now, count)
        self.last_time = now

    def fail(self, model: str, count: int, now: float) -> None:
        """``count`` requests failed (a stage or the dispatcher raised, or their inputs could not
        be had); a batch that ends with them is :meth:`forget`-ed."""
        metrics = self.model(model)
        metrics.failed.add(now, count)
        self.last_time = now

    # -- readers --------------------------------------------------------------------------------
    def recent_busy(self, start: float) -> Iterator[tuple[str, float, float]]:
        """Busy intervals that may end after ``start``, newest first: they are recorded in about
        the order they end, so the walk stops a second (of reordering) past ``start``."""
        for interval in reversed(self.busy):
            if interval[2] < start - 1.0:
                return
            yield interval

    def busy_seconds(self, start: float, end: float) -> dict[str, float]:
        """Seconds each resource was busy within [start, end), from the recent busy intervals."""
        busy: dict[str, float] = {}
        for resource, begin, finish in self.recent_busy(start):
            if finish > start and begin < end:
                busy[resource] = busy.get(resource, 0.0) + min(finish, end) - max(begin, start)
        return busy

    def utilisation_by_gpu(self, busy: dict[str, float], window: float) -> dict[str, float]:
        """Busy share of each GPU type's slots over ``window`` seconds, given :meth:`busy_seconds`."""
        slots: dict[str, int] = {}
        seconds: dict[str, float] = {}
        for slot, gpu in self.gpu_of.items():
            slots[gpu] = slots.get(gpu, 0) + 1
            seconds[gpu] = seconds.get(gpu, 0.0) + busy.get(slot, 0.0)
        return {gpu: min(1.0, seconds[gpu] / (window * slots[gpu])) for gpu in sorted(slots)}
