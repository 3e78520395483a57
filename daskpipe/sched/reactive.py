"""The reactive baseline of PPipe's ablation: one independent, Nexus-like batcher per pool.

Nothing is planned ahead: no reservation tables, no NIC tracking. A request is assigned to a
pipeline on arrival (weighted round robin by the plan's throughputs) and queues at that
pipeline's first pool. Whenever a pool's earliest-free slot is free and requests wait there, the
pool sends the largest batch b <= planned batch with

    transfer_in(b) + compute(b) <= head deadline - downstream slack - now,

where the downstream slack is the planned latency (compute + transfer at the planned batch size)
of the partitions after this one, and the head is the earliest deadline queued at the pool. If
no b fits, or (``first_look_drop``, as the artifact's ``SlaAwareLoadBalancer``) the first b
that fits a head is below ``first_look_fraction`` of the planned batch, the head is dropped.

The batch goes through this one partition only (a *staged* dispatch, see
:class:`~daskpipe.sched.api.Dispatch`): its ``"compute"`` feedback tells the dispatcher when the
requests reach the next pool, where they queue again and may be batched with others. Slot free
times are the dispatcher's own estimates, corrected by that feedback.

Cost: O(pipelines + pool size) per batch (earliest-free slot by scan), O(log n) per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from heapq import heappop, heappush
from itertools import count

from daskpipe.plan.schema import ModelPlan
from daskpipe.profiles.model import Profile
from daskpipe.sched.api import Action, Dispatch, Dispatcher, Drop, DropReason, Feedback, Hop, Placement, Request, Reservation, Stats, Time
from daskpipe.sched.ppipe import INF, check_inputs, check_request, counted_drop, latency_tables, nic_of, pool_slots


@dataclass(frozen=True)
class ReactiveSettings:
    """Choices of the reactive baseline (defaults: the artifact's).

    first_look_drop
        ``True`` (artifact): when a pool first looks at a head request and the largest batch
        that still meets its deadline is below ``first_look_fraction`` · planned batch, the head
        is dropped at once. ``False``: any batch >= the head's size is sent.
    first_look_fraction
        See above; 0.95 in the artifact (so with batches <= 8 the planned size itself).
    max_queued
        Bound on requests queued at first pools; beyond it arrivals are dropped ("overload").
    """

    first_look_drop: bool = True
    first_look_fraction: float = 0.95
    max_queued: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.first_look_fraction <= 1:
            raise ValueError(f"ReactiveSettings.first_look_fraction must be in (0, 1], got {self.first_look_fraction!r}")
        if self.max_queued is not None and (
            isinstance(self.max_queued, bool) or not isinstance(self.max_queued, int) or self.max_queued < 1
        ):
            raise ValueError(f"ReactiveSettings.max_queued must be None or an integer >= 1, got {self.max_queued!r}")


class _Pool:
    """One pool's batcher: its queue, its slots' estimated free times, its latency tables."""

    __slots__ = ("pipeline", "partition", "batch_size", "slots", "free_at", "compute", "transfer", "slack", "queue", "next")

    def __init__(self, pipeline: int, partition: int, batch_size: int, slots: list[str], compute: list[float], transfer: list[float]):
        self.pipeline = pipeline
        self.partition = partition
        self.batch_size = batch_size
        self.slots = slots
        self.free_at = [-INF] * len(slots)
        self.compute = compute
        self.transfer = transfer
        self.slack = 0.0  # planned latency of the partitions after this one
        self.queue: list[tuple[Time, int, Request, str | None]] = []  # (deadline, seq, request, slot of its previous partition)
        self.next: _Pool | None = None


class ReactiveDispatcher(Dispatcher):
    """The per-pool reactive scheduler (see the module docstring)."""

    def __init__(
        self, model: ModelPlan, placement: Placement, profile: Profile, *, bw_gbps: float, settings: ReactiveSettings | None = None
    ):
        self.settings = settings or ReactiveSettings()
        check_inputs(model, placement, profile, bw_gbps)
        self.model = model
        self.placement = placement
        self.stats = Stats()
        self._entry: list[_Pool] = []  # first pool of each pipeline
        self._pools: list[_Pool] = []
        work: list[list[float]] = []  # pure work of each pipeline by batch size
        for pi, pipeline in enumerate(model.pipelines):
            bs = pipeline.batch_size
            chain = []
            for di, part in enumerate(pipeline.partitions):
                slots = [slot.id for slot in pool_slots(placement, pi, di, part)]
                compute, transfer = latency_tables(profile, part, bs, bw_gbps)
                chain.append(_Pool(pi, di, bs, slots, compute, transfer))
            slack = 0.0
            for upstream, pool in zip(reversed(chain[:-1]), reversed(chain)):
                slack += pool.compute[bs] + pool.transfer[bs]
                upstream.slack = slack
                upstream.next = pool
            self._entry.append(chain[0])
            self._pools.extend(chain)
            work.append([sum(pool.compute[b] + pool.transfer[b] for pool in chain) for b in range(bs + 1)])
        total = sum(p.throughput for p in model.pipelines)
        self._weights = [p.throughput / total if total > 0 else 1.0 for p in model.pipelines]
        self._assigned = [0] * len(model.pipelines)
        self._max_batch = max((p.batch_size for p in model.pipelines), default=0)
        self._min_work = [min((w[s] for w in work if len(w) > s), default=INF) for s in range(self._max_batch + 1)]
        self._seq = count()
        self._dispatch_ids = count()
        self._looked_at: set[int] = set()
        self._inflight: dict[int, tuple[_Pool, int, Time, list[Request]]] = {}  # dispatch id -> (pool, slot index, planned end, requests)
        self._queued = 0

    # -- Dispatcher interface ------------------------------------------------------------------
    def submit(self, request: Request, now: Time) -> list[Action]:
        check_request(request, self.model.name)
        self.stats.submitted += 1
        size = request.size
        if size > self._max_batch:
            detail = (
                "the plan gives this model no pipeline"
                if not self._entry
                else f"size {size} exceeds the largest planned batch ({self._max_batch})"
            )
            return [self._drop(request, "no-capacity", detail)]
        if now + self._min_work[size] > request.drop_after:
            return [self._drop(request, "deadline", "cannot finish by its deadline even alone on an idle pipeline")]
        if self.settings.max_queued is not None and self._queued >= self.settings.max_queued:
            return [self._drop(request, "overload", f"{self._queued} requests queued (max_queued)")]
        # weighted round robin over the pipelines that can hold it
        choice = min((i for i, e in enumerate(self._entry) if e.batch_size >= size), key=self._share_after)
        self._assigned[choice] += 1
        pool = self._entry[choice]
        self._enqueue(pool, request, None)
        return self._serve(pool, now)

    def wake(self, now: Time) -> list[Action]:
        actions: list[Action] = []
        for pool in self._pools:
            if pool.queue:
                actions.extend(self._serve(pool, now))
        return actions

    def next_wake(self) -> Time | None:
        wakes = [min(pool.free_at) for pool in self._pools if pool.queue]
        return min(wakes) if wakes else None

    def feedback(self, fb: Feedback, now: Time) -> list[Action]:
        if fb.kind not in ("compute", "transfer"):
            raise ValueError(f"feedback kind must be 'compute' or 'transfer', got {fb.kind!r}")
        if fb.kind == "transfer":  # no NIC tracking
            return []
        record = self._inflight.pop(fb.dispatch, None)
        if record is None:
            return []
        pool, i, planned_end, requests = record
        if fb.partition != pool.partition:
            self._inflight[fb.dispatch] = record
            raise ValueError(f"feedback for dispatch {fb.dispatch} names partition {fb.partition}; it ran partition {pool.partition}")
        if pool.free_at[i] == planned_end:
            pool.free_at[i] = fb.end
        elif fb.end > planned_end:  # batches queued behind it on the slot start later too
            pool.free_at[i] += fb.end - planned_end
        actions: list[Action] = []
        if pool.next is not None:
            slot = pool.slots[i]
            for request in requests:
                self._enqueue(pool.next, request, slot)
            actions.extend(self._serve(pool.next, now))
        if pool.queue:
            actions.extend(self._serve(pool, now))
        return actions

    def drain(self, now: Time, reason: DropReason = "shutdown") -> list[Action]:
        actions: list[Action] = []
        for pool in self._pools:
            while pool.queue:
                actions.append(self._drop(self._pop(pool), reason, "drained"))
        return actions

    @property
    def queued(self) -> int:
        return self._queued

    def continue_ids(self, first: int) -> None:
        self._dispatch_ids = count(first)

    def _share_after(self, pipeline: int) -> float:
        """How far over its weight ``pipeline`` would be with one more request."""
        weight = self._weights[pipeline]
        return (self._assigned[pipeline] + 1) / weight if weight > 0 else INF

    # -- one pool's batcher --------------------------------------------------------------------
    def _enqueue(self, pool: _Pool, request: Request, from_slot: str | None) -> None:
        heappush(pool.queue, (request.deadline, next(self._seq), request, from_slot))
        self._queued += 1

    def _pop(self, pool: _Pool) -> Request:
        _, seq, request, _ = heappop(pool.queue)
        self._looked_at.discard(seq)
        self._queued -= 1
        return request

    def _serve(self, pool: _Pool, now: Time) -> list[Action]:
        actions: list[Action] = []
        queue = pool.queue
        settings = self.settings
        while queue:
            free_at = pool.free_at
            i = min(range(len(free_at)), key=free_at.__getitem__)
            if free_at[i] > now:
                break  # every slot busy: wake when the first frees
            deadline, seq, head, _ = queue[0]
            budget = deadline - pool.slack - now
            bs = pool.batch_size
            while bs >= head.size and pool.transfer[bs] + pool.compute[bs] > budget:
                bs -= 1
            if bs < head.size and head.tolerance:  # none in time: the largest within the tolerance runs
                bs = pool.batch_size
                while bs >= head.size and pool.transfer[bs] + pool.compute[bs] > budget + head.tolerance:
                    bs -= 1
            first_look = seq not in self._looked_at
            self._looked_at.add(seq)
            if bs < head.size or (settings.first_look_drop and first_look and bs < round(settings.first_look_fraction * pool.batch_size)):
                self._pop(pool)
                actions.append(
                    self._drop(
                        head, "deadline", f"pool (pipeline {pool.pipeline}, partition {pool.partition}): largest batch in budget is {bs}"
                    )
                )
                continue
            actions.append(self._dispatch(pool, i, bs, now))
        return actions

    def _dispatch(self, pool: _Pool, i: int, bs: int, now: Time) -> Dispatch:
        queue = pool.queue
        sender = queue[0][3]
        requests = [self._pop(pool)]
        taken = requests[0].size
        while queue and taken + queue[0][2].size <= bs:
            requests.append(self._pop(pool))
            taken += requests[-1].size
        slot = pool.slots[i]
        transfer_in = None
        start = now + pool.transfer[taken]  # a first pool's: the requests' inputs, from their clients
        if sender is not None:
            slots = self.placement.slots
            transfer_in = (
                Reservation(f"{nic_of(slots[sender])}/ul", now, start),
                Reservation(f"{nic_of(slots[slot])}/dl", now, start),
            )
        end = start + pool.compute[taken]
        pool.free_at[i] = end
        dispatch_id = next(self._dispatch_ids)
        self._inflight[dispatch_id] = (pool, i, end, requests)
        self.stats.dispatched_batches += 1
        if pool.next is None:
            self.stats.dispatched_requests += len(requests)
        hop = Hop(pool.partition, slot, Reservation(slot, start, end), transfer_in)
        return Dispatch(dispatch_id, self.model.name, pool.pipeline, taken, requests, (hop,))

    def _drop(self, request: Request, reason: DropReason, detail: str) -> Drop:
        return counted_drop(self.stats, request, reason, detail)
