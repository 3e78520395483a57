"""Symphony's deferred batch scheduling (Chen et al., arXiv:2308.07470, Alg. 1 and App. D).

A batch of ``b`` samples whose earliest deadline is ``d`` may only be dispatched inside its
schedulable window ``[d - l(b+1), d - l(b)]``: before ``d - l(b+1)`` ("frontrun") it could still
grow, after ``d - l(b)`` ("latest") it is late. Dispatching at frontrun loses no batching and leaves
GPUs idle as late as possible, so successive batches of a model stagger over the GPUs.

Each model keeps one queue (sorted by deadline) and one candidate batch. Matchmaking happens on two
events only, as in the paper's RankThread: a *model timer* at the candidate's ``exec`` takes a GPU
that is free by then, and a *GPU timer* at a GPU's predicted free time gives it the most urgent
candidate (smallest ``latest``) that is schedulable. Comparisons are non-strict (``<=``): the
paper's own worked example has exact ties. GPU free times are *predicted* (``exec + l(b)``), never
observed, as in the paper; feedback is ignored.

Data structures make every request or batch event O(log M + log G): a heap of model timers, a heap
of pending candidates by ``latest``, a heap of busy GPUs by free time and a heap of idle GPUs by
the configured choice (lowest id, or earliest free). Stale heap entries are skipped lazily.

The batch policy is one method, ``_exec_bound``, and the choice among waiting candidates another,
``_rank``; ``daskpipe.sched.batching`` swaps them for the timeout, eager and Shepherd baselines
(Symphony §3.4).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Collection, Literal, Mapping, Protocol, Sequence

from daskpipe.sched.api import (
    Action,
    Dispatch,
    Dispatcher,
    Drop,
    DropReason,
    Feedback,
    Hop,
    Placement,
    PoolsFixed,
    Request,
    Reservation,
    Slot,
    Stats,
    Time,
)

GpuChoice = Literal["lowest-id", "earliest-free"]
DropPolicy = Literal["head", "window"]


class Route(Protocol):
    """How a batch started on a first slot travels on (a plan's later partitions)."""

    def probe(self, model: str, slot: str, start: Time, batch: int) -> tuple[int, tuple[Hop, ...], Time]:
        """``(pipeline, hops, first slot free)`` for ``batch`` started on ``slot`` at ``start``;
        changes nothing."""

    def commit(self, hops: tuple[Hop, ...]) -> None:
        """Book what ``probe`` planned (later slots, NICs)."""


class WholeModelRoute:
    """The whole model on the first slot: Symphony's setting."""

    def __init__(self, latency: Callable[[str, int], float]) -> None:
        self.latency = latency

    def probe(self, model: str, slot: str, start: Time, batch: int) -> tuple[int, tuple[Hop, ...], Time]:
        end = start + self.latency(model, batch)
        return 0, (Hop(0, slot, Reservation(slot, start, end)),), end

    def commit(self, hops: tuple[Hop, ...]) -> None:
        return None


SlotKind = tuple[str, int]
"""A slot's (GPU, slices): what a shared pool's latencies and pipelines are by."""


class SharedPoolRoute:
    """Every model whole on every slot of a sub-cluster (Symphony's setting), on slots of several
    kinds (``kinds``: slot -> its (GPU, slices)): a batch runs for its slot's kind's latency,
    ``latency(model, slot, batch)``, and on the model's pipeline of that kind in the plan (what the
    executor holds the batch for). The window takes :meth:`slowest`, as Symphony takes the slowest
    GPU's profile, so a batch sent to a faster slot only ends earlier. Models join and leave while
    the pool serves (:meth:`add`, :meth:`remove`), and so do slots of a kind it has (:meth:`add_slot`)."""

    def __init__(self, kinds: Mapping[str, SlotKind]) -> None:
        self.kinds = dict(kinds)
        self.latencies: dict[str, Callable[[SlotKind, int], float]] = {}  # model -> latency(kind, batch), seconds
        self.pipelines: dict[str, Mapping[SlotKind, int]] = {}  # model -> its pipeline of each kind

    def add(self, model: str, latency: Callable[[SlotKind, int], float], pipelines: Mapping[SlotKind, int], on: Collection[str]) -> None:
        """``model`` runs on the slots ``on`` of the pool (those taken out for good need not be), with
        ``pipelines`` of their kinds."""
        missing = {self.kinds[slot] for slot in on if self.kinds[slot] not in pipelines}
        if missing:
            raise ValueError(f"model {model!r} has no pipeline on kind(s) {sorted(map(str, missing))} of its shared pool's slots")
        self.latencies[model], self.pipelines[model] = latency, pipelines

    def remove(self, model: str) -> None:
        del self.latencies[model], self.pipelines[model]

    def add_slot(self, slot: str, kind: SlotKind) -> None:
        """``slot``, of ``kind`` (one every model has a pipeline on), joins the pool."""
        if slot in self.kinds:
            raise ValueError(f"slot {slot!r} is in this shared pool already")
        lacking = sorted(model for model, pipelines in self.pipelines.items() if kind not in pipelines)
        if lacking:
            raise ValueError(f"models {lacking} have no pipeline on {kind}, the kind of slot {slot!r}")
        self.kinds[slot] = kind

    def latency(self, model: str, slot: str, batch: int) -> float:
        return self.latencies[model](self.kinds[slot], batch)

    def slowest(self, model: str, batch: int) -> float:
        pipelines = self.pipelines[model]
        return max(self.latencies[model](kind, batch) for kind in set(self.kinds.values()) if kind in pipelines)

    def probe(self, model: str, slot: str, start: Time, batch: int) -> tuple[int, tuple[Hop, ...], Time]:
        end = start + self.latency(model, slot, batch)
        return self.pipelines[model][self.kinds[slot]], (Hop(0, slot, Reservation(slot, start, end)),), end

    def commit(self, hops: tuple[Hop, ...]) -> None:
        return None


@dataclass(frozen=True)
class DeferredSettings:
    """Knobs of the deferred dispatcher and its baselines.

    gpu_choice: ``"lowest-id"`` (Alg. 1: high-id GPUs stay idle and can be released) or
        ``"earliest-free"`` (App. D and the authors' code: spreads idle time over all GPUs).
    drop_policy: ``"head"`` drops a head request only when it cannot finish even alone (GetBatch
        style 1, Clipper); ``"window"`` is Nexus' head drop (the code's default ``kWindowDrop``): it
        drops heads early to keep a target batch size.
    target_batch: the window policy's target in samples; ``None`` estimates it from the measured
        arrival rate with Symphony's staggering rule (1+1/n)·l(b) <= SLO.
    rate_window_s: the arrival meter's window: the window policy's rate, and which models
        ``cover_windows`` expects a request from.
    cover_windows: where waiting for the windows would leave a candidate without a GPU, send the
        most urgent early on an idle one (daskpipe's rule, docs/batching.md; ``False``: Alg. 1 as printed).
    """

    gpu_choice: GpuChoice = "lowest-id"
    drop_policy: DropPolicy = "head"
    target_batch: int | None = None
    rate_window_s: float = 1.0
    cover_windows: bool = True

    def __post_init__(self) -> None:
        if self.gpu_choice not in ("lowest-id", "earliest-free"):
            raise ValueError(f"gpu_choice must be 'lowest-id' or 'earliest-free', got {self.gpu_choice!r}")
        if self.drop_policy not in ("head", "window"):
            raise ValueError(f"drop_policy must be 'head' or 'window', got {self.drop_policy!r}")
        if self.target_batch is not None and (
            isinstance(self.target_batch, bool) or not isinstance(self.target_batch, int) or self.target_batch < 1
        ):
            raise ValueError(f"target_batch must be an integer >= 1 or None, got {self.target_batch!r}")
        if not (self.rate_window_s > 0 and math.isfinite(self.rate_window_s)):
            raise ValueError(f"rate_window_s must be a positive number of seconds, got {self.rate_window_s!r}")


RUNNING_KEPT = 64
"""Dispatches a unit's feedback is awaited for, at most, per unit (:meth:`DeferredDispatcher.feedback`)."""


class _Queue:
    """Requests sorted by deadline, with running sample counts so that "how many requests from the
    head fit in b samples" is a binary search. Appends are O(1) when deadlines arrive in order (one
    SLO per model); an out-of-order deadline costs a re-sort of the tail."""

    def __init__(self) -> None:
        self.items: list[Request] = []
        self.cum: list[int] = []  # cum[i]: samples in items[0..i]
        self.head = 0

    def __len__(self) -> int:
        return len(self.items) - self.head

    def push(self, request: Request) -> None:
        if len(self) and request.deadline < self.items[-1].deadline:
            at = bisect.bisect_right(self.items, request.deadline, lo=self.head, key=lambda r: r.deadline)
            self.items.insert(at, request)
            self.cum.append(0)
            total = self._before(at)
            for i in range(at, len(self.items)):
                total += self.items[i].size
                self.cum[i] = total
        else:
            self.items.append(request)
            self.cum.append((self.cum[-1] if self.cum else 0) + request.size)

    def _before(self, i: int) -> int:
        return self.cum[i - 1] if i else 0

    def at(self, offset: int) -> Request:
        return self.items[self.head + offset]

    def samples_from(self, offset: int) -> int:
        return self.cum[-1] - self._before(self.head + offset)

    def count_fitting(self, samples: int, offset: int = 0) -> int:
        """Requests from ``offset`` whose sizes add up to at most ``samples``."""
        start = self.head + offset
        return bisect.bisect_right(self.cum, self._before(start) + samples, lo=start) - start

    def first_meeting(self, deadline: Time) -> int:
        """Offset of the first request whose deadline is >= ``deadline``."""
        return bisect.bisect_left(self.items, deadline, lo=self.head, key=lambda r: r.deadline) - self.head

    def head_samples(self, count: int) -> int:
        """Samples in the first ``count`` requests."""
        return self.samples_from(0) - self.samples_from(count)

    def pop(self, count: int) -> list[Request]:
        out = self.items[self.head : self.head + count]
        self.head += count
        if self.head > 1024 and self.head * 2 > len(self.items):  # compact, amortised O(1)
            base = self.cum[self.head - 1]
            self.cum = [c - base for c in self.cum[self.head :]]
            del self.items[: self.head]
            self.head = 0
        return out


@dataclass(slots=True)
class _Candidate:
    requests: int  # how many requests from the queue head
    samples: int
    exec: Time
    latest: Time
    deadline: Time
    version: int
    pending: bool = False  # its model timer fired and no GPU was free: waits for a GPU timer


class ModelQueue:
    """One model's deadline-ordered queue and its current batch candidate (the deferred
    dispatchers of :mod:`daskpipe.sched.batching` subclass this one and reuse it)."""

    def __init__(self, name: str, slo: float, latency: Sequence[float]) -> None:
        self.name = name
        self.slo = slo
        self.latency = latency  # seconds at batch 1..max_batch, non-decreasing
        self.queue = _Queue()
        self.candidate: _Candidate | None = None
        self.version = 0
        self.arrivals: deque[Time] = deque()

    @property
    def max_batch(self) -> int:
        return len(self.latency)

    def l(self, batch: int) -> float:  # noqa: E743 - the paper's l(b)
        """Latency of a batch; +inf beyond the largest profiled batch (such a batch cannot exist)."""
        return self.latency[batch - 1] if batch <= len(self.latency) else math.inf

    def largest_batch(self, start: Time, deadline: Time) -> int:
        """Largest batch that started at ``start`` ends by ``deadline`` (0 if not even one), by the
        same float test ``start + l(b) <= deadline`` used everywhere, so rounding cannot disagree."""
        batch = bisect.bisect_right(self.latency, deadline - start)
        while batch and start + self.latency[batch - 1] > deadline:
            batch -= 1
        return batch


@dataclass(slots=True)
class _Unit:
    """A GPU in Symphony's sense: a slot where a model's batch starts."""

    index: int  # its rank in the lowest-id order
    slot: str
    free: Time = 0.0
    shifted: Time = 0.0  # how much later feedback has moved its plan, in all (DeferredDispatcher.feedback)


class DeferredDispatcher(Dispatcher):
    """Symphony's deferred batch scheduler over a set of slots that can each run any of ``models``.

    Parameters
    ----------
    models
        Model name -> latency SLO in seconds (used by the window drop policy's target batch).
    slots
        The GPUs, in id order (the order decides "lowest id"). Every slot runs every model, as in a
        Symphony sub-cluster; models that share no GPUs belong in separate dispatchers.
    latency
        ``latency(model, batch)`` in seconds: the end-to-end time a batch needs, used for the
        schedulable window. Must be profiled for every batch up to ``max_batch``; it is made
        non-decreasing (a running max), as the authors' code does with measured profiles.
    max_batch
        Largest batch in samples, for all models or per model.
    route
        How a batch travels once started on a slot (default: the whole model on that slot for
        ``latency(model, batch)``); ``for_plan`` installs multi-partition routes.
    settings
        :class:`DeferredSettings`.
    """

    def __init__(
        self,
        models: Mapping[str, float],
        slots: Sequence[Slot],
        latency: Callable[[str, int], float],
        *,
        max_batch: int | Mapping[str, int] = 32,
        route: Route | None = None,
        settings: DeferredSettings | None = None,
    ) -> None:
        if not models:
            raise ValueError("DeferredDispatcher needs at least one model")
        if not slots:
            raise ValueError("DeferredDispatcher needs at least one slot")
        ids = [s.id for s in slots]
        if len(set(ids)) != len(ids):
            raise ValueError(f"slot ids must be unique, got {ids}")
        self.settings = settings or DeferredSettings()
        self.stats = Stats()
        self._latency = latency
        self._models: dict[str, ModelQueue] = {}
        for name, slo in models.items():
            self._models[name] = self._model_queue(name, slo, max_batch[name] if isinstance(max_batch, Mapping) else max_batch)
        self._units = [_Unit(i, s.id) for i, s in enumerate(slots)]
        self.route = route or WholeModelRoute(lambda name, batch: self._models[name].l(batch))
        # a slot that runs whole models is one unit: it can leave and come back (a plan's route books later pools of its own)
        self.supports_pools = isinstance(self.route, (WholeModelRoute, SharedPoolRoute))
        self._gone: set[int] = set()  # units taken out (remove_slot)
        self._busy: list[tuple[Time, int]] = []  # (free, index) of units free after the last call's now
        self._idle: list[tuple] = [self._idle_key(u) for u in self._units]
        heapq.heapify(self._idle)
        # dispatch id -> (its unit, the planned end of its first hop there, the unit's shift then), until that hop reports
        self._running: OrderedDict[int, tuple[int, Time, Time]] = OrderedDict()
        self._model_timers: list[tuple[Time, int, str, int]] = []  # (exec, seq, model, version)
        self._pending: list[tuple[Time, int, str, int]] = []  # (latest, seq, model, version)
        self._seq = itertools.count()
        self._dispatch_ids = itertools.count()

    def _model_queue(self, name: str, slo: float, cap: int) -> ModelQueue:
        """``name``'s queue, its latency table profiled up to ``cap`` samples, checked."""
        if not (isinstance(slo, (int, float)) and slo > 0 and math.isfinite(slo)):
            raise ValueError(f"model {name!r}: SLO must be a positive number of seconds, got {slo!r}")
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"model {name!r}: max_batch must be an integer >= 1, got {cap!r}")
        table: list[float] = []
        for b in range(1, cap + 1):
            value = float(self._latency(name, b))
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"model {name!r}: latency at batch {b} must be a positive number of seconds, got {value!r}")
            table.append(max(value, table[-1]) if table else value)
        return ModelQueue(name, float(slo), table)

    # -- models joining and leaving a shared pool ----------------------------------------------
    def add_model(self, name: str, slo: float, max_batch: int) -> None:
        """Serve ``name`` too, on every slot, from now on (its latency is the constructor's
        ``latency``: a shared pool's route must know it first)."""
        if name in self._models:
            raise ValueError(f"model {name!r} is served by this dispatcher already")
        self._models[name] = self._model_queue(name, slo, max_batch)

    def remove_model(self, name: str, now: Time, reason: DropReason = "shutdown") -> list[Action]:
        """Stop serving ``name``: what it has queued is dropped for ``reason``; the other models
        keep their queues and the slots (its batches in flight are the executor's)."""
        if name not in self._models:
            raise ValueError(f"model {name!r} is not served by this dispatcher (serves {sorted(self._models)})")
        if len(self._models) == 1:
            raise ValueError(f"model {name!r} is this dispatcher's last model")
        actions = self.drain(now, reason, models=[name])
        del self._models[name]
        return actions

    # -- construction on a plan --------------------------------------------------------------
    @classmethod
    def for_plan(
        cls, model_plan, placement: Placement, profile, *, bw_gbps: float, settings: DeferredSettings | None = None, **policy
    ) -> DeferredDispatcher:
        """One dispatcher for one model of a plan, over its pipelines' first slots: see :class:`PlanRoute`."""
        route = PlanRoute(model_plan, placement, profile, bw_gbps=bw_gbps)
        cap = policy.pop("max_batch", None)
        max_batch = route.max_batch if cap is None else min(route.max_batch, cap)
        return cls(
            {model_plan.name: route.slo},
            route.first,
            lambda _model, batch: route.latency(batch),
            max_batch=max_batch,
            route=route,
            settings=settings,
            **policy,
        )

    # -- policy (overridden by the baselines) ------------------------------------------------
    def _exec_bound(self, model: ModelQueue, samples: int, deadline: Time) -> Time:
        """Earliest moment the policy lets this candidate go: Symphony's frontrun d - l(b+1)."""
        return deadline - model.l(samples + 1)

    # -- Dispatcher API ----------------------------------------------------------------------
    def submit(self, request: Request, now: Time) -> list[Action]:
        model = self._models.get(request.model)
        if model is None:
            raise ValueError(
                f"request {request.id!r} is for model {request.model!r}, which this dispatcher does not serve (serves "
                f"{sorted(self._models)})"
            )
        if not (isinstance(request.size, int) and request.size >= 1):
            raise ValueError(f"request {request.id!r}: size must be an integer >= 1, got {request.size!r}")
        self.stats.submitted += 1
        actions: list[Action] = []
        if request.size > model.max_batch:
            return self._drop([request], "no-capacity", f"{request.size} samples exceed the largest batch {model.max_batch}", actions)
        if len(self._gone) == len(self._units):
            return self._drop([request], "no-capacity", "every slot of its pool is gone", actions)
        model.queue.push(request)
        self._meter(model, request.arrival, now)
        self._update_candidate(model, now, actions)
        self._advance(now, actions)
        return actions

    def wake(self, now: Time) -> list[Action]:
        actions: list[Action] = []
        self._advance(now, actions)
        return actions

    def next_wake(self) -> Time | None:
        times = []
        self._clean(self._model_timers, pending=False)
        if self._model_timers:
            times.append(self._model_timers[0][0])
        self._clean(self._pending, pending=True)
        while self._busy and self._busy[0][0] != self._units[self._busy[0][1]].free:  # moved by feedback
            heapq.heappop(self._busy)
        if self._busy and (self._pending or self._covers_windows and self._candidates() > 1):
            times.append(self._busy[0][0])  # one GPU timer, on the earliest-free GPU (a unit freed may cover a window)
        return min(times) if times else None

    def drain(self, now: Time, reason: DropReason = "shutdown", models: Collection[str] | None = None) -> list[Action]:
        """Drop what is queued; ``models``: only their requests (models leaving a shared pool
        whose other models stay: those keep their queues and the slots)."""
        actions: list[Action] = []
        for model in self._models.values():
            if models is None or model.name in models:
                self._drop(model.queue.pop(len(model.queue)), reason, "dispatcher drained", actions)
                self._set_candidate(model, None)
        return actions

    @property
    def queued(self) -> int:
        return sum(len(m.queue) for m in self._models.values())

    @property
    def slots_in(self) -> list[str]:
        """The slots batches may go to now (not taken out)."""
        return [u.slot for u in self._units if u.index not in self._gone]

    def continue_ids(self, first: int) -> None:
        self._dispatch_ids = itertools.count(first)

    def _rank(self, model: ModelQueue) -> float:
        """Which waiting candidate a freed GPU takes, lowest first: the most urgent (smallest latest)."""
        assert model.candidate is not None, "only a candidate is ranked"
        return model.candidate.latest

    def feedback(self, fb: Feedback, now: Time) -> list[Action]:
        """A batch's first hop ended ``late`` past its plan (its start waited on the way there, or
        its compute ran over): the batches its unit was given after it start that much later, so
        the unit is free that much later. Without this a unit kept busy back to back drifts from
        its plan by every batch's delay, and the dispatcher sends batches that queue on a busy
        slot past their deadlines. An early end frees nothing early: the plan keeps to the profile."""
        if fb.kind != "compute" or fb.partition != 0:
            return []
        record = self._running.pop(fb.dispatch, None)
        if record is None:
            return []
        index, planned_end, shifted_then = record
        unit = self._units[index]
        late = fb.end - planned_end - (unit.shifted - shifted_then)  # past its plan as moved since it was sent
        if late <= 0 or unit.free <= now or index in self._gone:  # nothing given after it is still to run
            return []
        unit.free += late
        unit.shifted += late
        heapq.heappush(self._busy, (unit.free, index))
        return []

    def remove_slot(self, slot_id: str, now: Time, reason: DropReason = "worker-lost") -> list[Action]:
        """``slot_id`` gets no more batches; with no slot left, everything queued is dropped for
        ``reason``. Taking out a slot already out does nothing: every model of a shared pool takes
        it out of the one dispatcher."""
        unit = self._unit(slot_id, f"take slot {slot_id!r} out of its pools")
        if unit.index in self._gone:
            return []
        self._gone.add(unit.index)
        if len(self._gone) < len(self._units):
            return []
        actions: list[Action] = []
        for model in self._models.values():
            self._drop(model.queue.pop(len(model.queue)), reason, "no slot is left to run it", actions)
            self._set_candidate(model, None)
        return actions

    def add_slot(self, slot: Slot, pipeline: int, partition: int, now: Time) -> list[Action]:
        """A slot taken out comes back, or a new one joins (a shared pool's route must know its kind
        first: :meth:`SharedPoolRoute.add_slot`), free from ``now`` (``pipeline`` and ``partition``:
        the route knows them); a ``ValueError`` for one that is in."""
        if self.supports_pools and not any(u.slot == slot.id for u in self._units):
            if isinstance(self.route, SharedPoolRoute) and slot.id not in self.route.kinds:
                raise ValueError(f"slot {slot.id!r} is not in this shared pool's route: its kind must be added there first")
            self._units.append(_Unit(len(self._units), slot.id))
            self._gone.add(len(self._units) - 1)  # as if it had left: it joins below
        unit = self._unit(slot.id, f"add slot {slot.id!r} to its pools")
        if unit.index not in self._gone:
            raise ValueError(f"slot {slot.id!r} is in this dispatcher's pool already")
        self._gone.discard(unit.index)
        for heap in (self._busy, self._idle):  # what it was doing when it left is over (rare: O(slots))
            heap[:] = [entry for entry in heap if entry[-1] != unit.index]
            heapq.heapify(heap)
        unit.free = now
        heapq.heappush(self._idle, self._idle_key(unit))
        actions: list[Action] = []
        self._advance(now, actions)
        return actions

    def _unit(self, slot_id: str, change: str) -> _Unit:
        if not self.supports_pools:
            raise PoolsFixed(f"{type(self).__name__} on a plan's route cannot {change}")
        unit = next((u for u in self._units if u.slot == slot_id), None)
        if unit is None:
            raise ValueError(f"slot {slot_id!r} is not one of this dispatcher's ({[u.slot for u in self._units]})")
        return unit

    # -- candidates (the paper's ModelThread) ------------------------------------------------
    def _meter(self, model: ModelQueue, arrival: Time, now: Time) -> None:
        """The arrivals of the last ``rate_window_s``: the window policy's rate, and which models
        covering windows expects a request from."""
        if self._covers_windows or self.settings.drop_policy == "window" and self.settings.target_batch is None:
            model.arrivals.append(arrival)
            while model.arrivals and model.arrivals[0] < now - self.settings.rate_window_s:
                model.arrivals.popleft()

    def _target_batch(self, model: ModelQueue) -> int:
        """Window policy target: the authors' estimator, eqs. (1)-(2) with the measured rate (a
        scan over batch sizes: O(max_batch), a constant of the profile)."""
        if self.settings.target_batch is not None:
            return min(self.settings.target_batch, model.max_batch)
        rate = len(model.arrivals) / self.settings.rate_window_s
        best = 1
        for b in range(1, model.max_batch + 1):
            lat = model.l(b)
            gpus = rate * lat / b  # GPUs this rate keeps busy at batch b
            if gpus > 1:
                fits = lat * (1 + 1 / gpus) <= model.slo  # staggered over n GPUs
            elif rate > 0:
                fits = lat + b / rate <= model.slo  # Nexus: one GPU, the batch fills while it waits
            else:
                fits = 2 * lat <= model.slo  # no rate measured yet
            if not fits:
                break
            best = b
        return best

    def _update_candidate(self, model: ModelQueue, start: Time, actions: list[Action]) -> None:
        """GetBatch from ``start`` (dropping what the policy drops), then the window.

        A head that cannot finish by its deadline even alone but can within its tolerance
        (:attr:`~daskpipe.sched.api.Request.drop_after`: the runtime's control path is usually
        faster than the margin it plans with) goes at once, in the largest batch that finishes
        within that: a drop is a sure miss. The simulator's requests have none."""
        queue = model.queue
        if self.settings.drop_policy == "window" and len(queue):
            self._window_drop(model, start, actions)
        while len(queue) and start + model.l(queue.at(0).size) > queue.at(0).drop_after:
            self._drop(queue.pop(1), "deadline", "cannot finish before its deadline even alone", actions)
        if not len(queue):
            self._set_candidate(model, None)
            return
        head = queue.at(0)
        deadline = head.deadline
        count = queue.count_fitting(model.largest_batch(start, deadline))
        if count == 0:
            deadline = head.drop_after
            count = queue.count_fitting(model.largest_batch(start, deadline))
        samples = queue.head_samples(count)
        latest = deadline - model.l(samples)
        exec_at = start if deadline > head.deadline else max(start, min(self._exec_bound(model, samples, deadline), latest))
        self._set_candidate(model, _Candidate(count, samples, exec_at, latest, deadline, 0))

    def _window_drop(self, model: ModelQueue, start: Time, actions: list[Action]) -> None:
        """Nexus-style head drop: find the longest deadline-sorted suffix whose head meets its own
        batch, aim for min(target, that suffix), and drop earlier heads that would miss it."""
        queue = model.queue
        n = len(queue)

        def suffix_ok(i: int) -> bool:
            return start + model.l(min(queue.samples_from(i), model.max_batch)) <= queue.at(i).deadline

        lo, hi = 0, n  # the condition is monotone in i: fewer samples and a later deadline
        while lo < hi:
            mid = (lo + hi) // 2
            if suffix_ok(mid):
                hi = mid
            else:
                lo = mid + 1
        if lo == n:
            return  # nothing meets any batch: the head rule below drops what it must
        target = min(self._target_batch(model), queue.samples_from(lo))
        doomed = min(queue.first_meeting(start + model.l(target)), lo)
        if doomed:
            self._drop(queue.pop(doomed), "deadline", f"dropped early to keep a batch of {target}", actions)

    def _set_candidate(self, model: ModelQueue, candidate: _Candidate | None) -> None:
        model.version += 1
        model.candidate = candidate
        if candidate is not None:
            candidate.version = model.version
            heapq.heappush(self._model_timers, (candidate.exec, next(self._seq), model.name, model.version))

    def _valid(self, entry: tuple[Time, int, str, int], pending: bool) -> bool:
        model = self._models.get(entry[2])  # none: it left the pool (remove_model)
        return model is not None and model.candidate is not None and model.version == entry[3] and model.candidate.pending == pending

    def _clean(self, heap: list, pending: bool) -> None:
        while heap and not self._valid(heap[0], pending):
            heapq.heappop(heap)

    # -- matchmaking (the paper's RankThread) ------------------------------------------------
    def _idle_key(self, unit: _Unit) -> tuple:
        return (unit.index,) if self.settings.gpu_choice == "lowest-id" else (unit.free, unit.index)

    def _advance(self, now: Time, actions: list[Action]) -> None:
        """Fire every timer due by ``now``: GPU timers first, then model timers."""
        while True:
            if self._busy and self._busy[0][0] <= now:
                free, index = heapq.heappop(self._busy)
                if index not in self._gone and free == self._units[index].free:  # else feedback moved it later
                    self._on_gpu_timer(self._units[index], now, actions)
                continue
            self._clean(self._model_timers, pending=False)
            if self._model_timers and self._model_timers[0][0] <= now:
                _, _, name, _ = heapq.heappop(self._model_timers)
                self._on_model_timer(self._models[name], now, actions)
                continue
            if self._covers_windows and self._run_uncovered(now, actions):
                continue
            return

    @property
    def _covers_windows(self) -> bool:
        return self.settings.cover_windows

    def _any_idle(self) -> bool:
        """Whether a unit is idle, the units taken out (``remove_slot``) dropped from the idle heap's top."""
        while self._idle and self._idle[0][-1] in self._gone:
            heapq.heappop(self._idle)
        return bool(self._idle)

    def _candidates(self) -> int:
        return sum(m.candidate is not None for m in self._models.values())

    def _run_uncovered(self, now: Time, actions: list[Action]) -> bool:
        """With a unit idle and two candidates or more waiting: would the units, as planned, start
        every candidate by the time its window opens, the most urgent first? If not, and the most
        urgent going now, on the idle unit, leaves no more of them without a start in time, it goes (True).

        Alg. 1 defers a batch to a window ``alpha`` wide; where a pool has few GPUs for its models
        and batches of about one request, that makes it a loss system: a request whose window finds
        every GPU busy is dropped, though the GPUs idled while it waited. The plan also counts a
        request that any model with a request in the last ``rate_window_s`` and none waiting may
        send now (its window comes ``SLO - l(2)`` from now): a request that arrives after the check
        with an earlier window than those waiting is what the check alone missed. Where the units
        cover every window (one GPU a model or more, Symphony's evaluation), nothing goes early."""
        if not self._any_idle():
            return False
        waiting = [(c.latest, max(c.exec, now), m.l(c.samples), m.name) for m in self._models.values() if (c := m.candidate) is not None]
        if len(waiting) < 2:
            return False  # one candidate always has the idle unit
        recent = now - self.settings.rate_window_s
        for m in self._models.values():
            if m.candidate is None and m.arrivals and m.arrivals[-1] >= recent:
                waiting.append((now + m.slo - m.l(1), now + m.slo - m.l(2), m.l(1), ""))
        waiting.sort()
        free = sorted(max(u.free, now) for u in self._units if u.index not in self._gone)
        deferred = self._misses(free, waiting)
        if not deferred:
            return False
        first = next(i for i, entry in enumerate(waiting) if entry[3])  # the most urgent that is waiting
        free[0] = now + waiting[first][2]  # free[0] is an idle unit's: now
        heapq.heapify(free)
        if self._misses(free, waiting[:first] + waiting[first + 1 :]) > deferred:
            return False
        unit = self._units[heapq.heappop(self._idle)[-1]]
        if self._dispatch(self._models[waiting[first][3]], unit, now, actions, early=True):
            return True
        heapq.heappush(self._idle, self._idle_key(unit))
        return False

    @staticmethod
    def _misses(free: list[Time], waiting: list[tuple[Time, Time, float, str]]) -> int:
        """How many of ``waiting`` (latest, when its window opens, its batch's duration, model), the
        most urgent first, find no unit free by the time their window opens, each taking the
        earliest-free unit (``free``: a heap, copied). The start's test is the opening, not the
        latest start: a plan that starts a batch at the end of its window, ``alpha`` wide, leaves
        nothing for what it did not foresee."""
        free, missed = list(free), 0
        for _, opens, duration, _ in waiting:
            if free[0] > opens:
                missed += 1
                continue
            heapq.heappush(free, max(heapq.heappop(free), opens) + duration)
        return missed

    def _on_model_timer(self, model: ModelQueue, now: Time, actions: list[Action]) -> None:
        if self._any_idle():
            unit = self._units[heapq.heappop(self._idle)[-1]]
            if not self._dispatch(model, unit, now, actions):
                heapq.heappush(self._idle, self._idle_key(unit))
            return
        candidate = model.candidate
        assert candidate is not None, "a live model timer belongs to a candidate"
        candidate.pending = True
        heapq.heappush(self._pending, (self._rank(model), next(self._seq), model.name, model.version))

    def _on_gpu_timer(self, unit: _Unit, now: Time, actions: list[Action]) -> None:
        while True:
            self._clean(self._pending, pending=True)
            if not self._pending:
                break
            _, _, name, _ = heapq.heappop(self._pending)
            model = self._models[name]
            candidate = model.candidate
            assert candidate is not None, "a live pending entry belongs to a candidate"
            if (
                now + model.l(candidate.samples) > candidate.deadline
            ):  # expired (GetBatch's own test, not latest < now, so rounding cannot loop)
                self._update_candidate(model, now, actions)
                if model.candidate is not None and model.candidate.exec <= now:
                    model.candidate.pending = True
                    heapq.heappush(self._pending, (self._rank(model), next(self._seq), name, model.version))
                continue
            if self._dispatch(model, unit, now, actions):
                return
        heapq.heappush(self._idle, self._idle_key(unit))

    def _dispatch(self, model: ModelQueue, unit: _Unit, now: Time, actions: list[Action], early: bool = False) -> bool:
        """Refresh the candidate (more requests may have come, heads may have expired) and run it
        on ``unit``; False when the refreshed candidate is gone or may not go yet (``early``: it may)."""
        self._update_candidate(model, now, actions)
        candidate = model.candidate
        if candidate is None or (candidate.exec > now and not early):
            return False
        count, samples = candidate.requests, candidate.samples
        while True:  # later partitions may queue: shrink the batch until its route meets the head's deadline
            pipeline, hops, free = self.route.probe(model.name, unit.slot, now, samples)
            if hops[-1].compute.end <= candidate.deadline:
                break
            count = model.queue.count_fitting(samples - 1)
            if count == 0:
                self._drop(model.queue.pop(1), "deadline", "its route's later stages would finish after its deadline", actions)
                self._update_candidate(model, now, actions)
                return False
            samples = model.queue.head_samples(count)
        self.route.commit(hops)
        requests = model.queue.pop(count)
        unit.free = free
        heapq.heappush(self._busy, (unit.free, unit.index))
        dispatch = next(self._dispatch_ids)
        self._running[dispatch] = (unit.index, hops[0].compute.end, unit.shifted)
        if len(self._running) > RUNNING_KEPT * len(self._units):  # reports of a lost worker's batches never come
            self._running.popitem(last=False)
        actions.append(Dispatch(dispatch, model.name, pipeline, samples, requests, hops))
        self.stats.dispatched_batches += 1
        self.stats.dispatched_requests += len(requests)
        self._update_candidate(model, now, actions)
        return True

    def _drop(self, requests: list[Request], reason: DropReason, detail: str, actions: list[Action]) -> list[Action]:
        for request in requests:
            actions.append(Drop(request, reason, detail))
        if requests:
            self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + len(requests)
        return actions


class PlanRoute:
    """One model's plan as Symphony "GPUs" plus routes.

    Every first-partition slot of every pipeline is a Symphony GPU; the deferred decision is taken
    for the first partition. The window uses the slowest pipeline's end-to-end latency (compute
    plus transfers at ``bw_gbps``), as Symphony uses the slowest GPU's profile. Later partitions go
    to the earliest-free slot of their pool, after the feature map crosses the sender's uplink and
    the receiver's downlink (FIFOs the route books ahead, like the slots).
    """

    def __init__(self, model_plan, placement: Placement, profile, *, bw_gbps: float) -> None:
        if not (bw_gbps > 0 and math.isfinite(bw_gbps)):
            raise ValueError(f"bw_gbps must be a positive number, got {bw_gbps!r}")
        if not model_plan.pipelines:
            raise ValueError(f"model {model_plan.name!r} has no pipeline in the plan")
        self.plan, self.profile, self.bw_gbps = model_plan, profile, bw_gbps
        self.slots = placement.slots
        self.slo = model_plan.slo_us / 1e6
        self.first: list[Slot] = []
        self._pipeline_of: dict[str, int] = {}
        for p, pipeline in enumerate(model_plan.pipelines):
            for q in range(len(pipeline.partitions)):
                if not placement.pools.get((p, q)):
                    raise ValueError(f"placement of {model_plan.name!r} has no slots for pipeline {p} partition {q}")
            for slot_id in placement.pools[(p, 0)]:
                self.first.append(self.slots[slot_id])
                self._pipeline_of[slot_id] = p
        self.max_batch = min(profile.max_batch(part.gpu, part.slices) for pl in model_plan.pipelines for part in pl.partitions)
        self._later: dict[tuple[int, int], list[tuple[Time, str]]] = {
            key: [(0.0, s) for s in ids] for key, ids in placement.pools.items() if key[1] > 0
        }
        self._nic_free: dict[str, Time] = {}

    def _compute_s(self, p: int, q: int, batch: int) -> float:
        part = self.plan.pipelines[p].partitions[q]
        return self.profile.latency(part.gpu, part.slices, batch, *part.blocks) / 1e6

    def _transfer_s(self, p: int, q: int, batch: int) -> float:
        boundary = self.plan.pipelines[p].partitions[q].blocks[0]
        return batch * self.profile.cut_bytes(boundary) * 8 / (self.bw_gbps * 1e9)

    def latency(self, batch: int) -> float:
        """The window's latency: the slowest pipeline's end to end, without queueing."""
        return max(
            sum(self._compute_s(p, q, batch) + (self._transfer_s(p, q, batch) if q else 0.0) for q in range(len(pl.partitions)))
            for p, pl in enumerate(self.plan.pipelines)
        )

    def probe(self, model: str, slot: str, start: Time, batch: int) -> tuple[int, tuple[Hop, ...], Time]:
        p = self._pipeline_of[slot]
        end = start + self._compute_s(p, 0, batch)
        hops = [Hop(0, slot, Reservation(slot, start, end))]
        first_free, previous = end, slot
        for q in range(1, len(self.plan.pipelines[p].partitions)):
            free, target = self._later[(p, q)][0]
            transfer, ready = None, end
            sender, receiver = self.slots[previous].server, self.slots[target].server
            if sender != receiver:
                ul, dl = f"{sender}/ul", f"{receiver}/dl"
                t0 = max(end, self._nic_free.get(ul, 0.0), self._nic_free.get(dl, 0.0))
                ready = t0 + self._transfer_s(p, q, batch)
                transfer = (Reservation(ul, t0, ready), Reservation(dl, t0, ready))
            begin = max(ready, free)
            end = begin + self._compute_s(p, q, batch)
            hops.append(Hop(q, target, Reservation(target, begin, end), transfer))
            previous = target
        return p, tuple(hops), first_free

    def commit(self, hops: tuple[Hop, ...]) -> None:
        p = self._pipeline_of[hops[0].slot]
        for hop in hops[1:]:
            heapq.heapreplace(self._later[(p, hop.partition)], (hop.compute.end, hop.slot))
            if hop.transfer_in is not None:
                for reservation in hop.transfer_in:
                    self._nic_free[reservation.resource] = reservation.end
