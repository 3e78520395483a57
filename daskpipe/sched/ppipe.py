"""PPipe's data plane: reservation-based adaptive batching over pooled pipelines (paper §5.4).

One :class:`PPipeDispatcher` serves one model. It keeps a deadline-ordered queue and reservation
timelines of every slot and every server NIC (uplink, downlink). Each time it runs (arrival,
wake, feedback that changed a table) it repeats Algorithm 1 while requests are queued:

1. **Choose the pipeline**: probe every pipeline at its planned batch size, take the least
   waiting time (finish - now - pure work).
2. **Shrink the batch**: from the planned size down to the head request's size, probe until the
   batch finishes by the head's deadline.
3. **Act**: none fits -> drop the head ("deadline"), unless the largest batch that finishes
   within the head's tolerance (:attr:`~daskpipe.sched.api.Request.tolerance`, 0 in the
   simulator) runs at once instead; fewer samples queued than the batch and the last moment not
   come -> wait (with ``join_chance``, only if another request is likely to come by then); else
   reserve the path and dispatch the head's batch.

The last moment is when a batch of one more sample would still finish by the head's deadline on
an idle pipeline. With ``slack_quantile`` (the default) that is at the quantile of the latency
each stage was measured at, from compute feedback, not at the profiled mean: a batch sent at the
mean's last moment ends after its deadline whenever it runs over (``daskpipe.sched.latency``).

``probe`` (Algorithm 2) walks the partitions, picking in each pool the slot that finishes the
stage first (with ``uplink_aware``, the artifact's choice: whose output can leave first); for
every stage after the first it reserves the sender's uplink and the receiver's
downlink together, then the receiver's slot. It reads the tables and changes nothing.

Complexity. A pool keeps its slots in a list sorted (by bisect) on the time their last
reservation ends; slots with a gap that could take the pool's shortest batch (gap timelines only)
sort first. ``probe`` scans that list in order and stops as soon as no later slot can finish
sooner: the next slot's tail is past the best finish, or the best meets the stage's lower bound
(inputs ready, sender uplink free). The usual scan is 1-2 slots, so a probe costs
O(partitions · log pool) and a dispatched batch about 3 probes (at most pipelines + planned batch
size), amortised over its requests; the queue is a heap, so a request costs O(log queue) plus
its share of its batch. Gaps that cannot be filled, as every slot of a pool holding one, would
make a scan O(pool).

Between two runs the chosen pipeline and batch size are held: an arrival that leaves the queue
short of the batch, before the last moment, only queues (O(log n)), and the arrival that fills
the batch skips Step 1; ``reevaluate_on_arrival`` re-runs Algorithm 1 on every arrival instead,
as the artifact does.

Elasticity: ``remove_slot`` (a lost worker: its pending reservations are released, pipelines
left with an empty pool retire) and ``add_slot`` (a pool grows).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from itertools import count
from typing import Iterator

from daskpipe.plan.schema import ModelPlan, Partition, Pipeline
from daskpipe.profiles.model import Profile
from daskpipe.sched.api import (
    Action,
    Dispatch,
    Dispatcher,
    Drop,
    DropReason,
    Feedback,
    Hop,
    Placement,
    Request,
    Reservation,
    Slot,
    Stats,
    Time,
)
from daskpipe.sched.arrivals import OutstandingArrivals
from daskpipe.sched.latency import MeasuredLatency
from daskpipe.sched.timeline import NEVER, TIMELINE_MODES, Timeline, make_timeline

INF = float("inf")


@dataclass(frozen=True)
class PPipeSettings:
    """The choices where PPipe's paper and its published simulator (the artifact) differ.

    Defaults follow the paper, except ``uplink_aware`` (the artifact's choice, never worse on the
    shared profiles), and ``slack_quantile`` and ``lead_batches`` (daskpipe's, the same as the
    paper's where execution keeps to the profile; docs/dataplane.md); :meth:`artifact` gives the
    simulator's choices.

    timeline
        ``"gaps"`` (paper, Algorithm 2's earliestSlot): interval tables, later requests may fill
        gaps before earlier reservations. ``"append"`` (artifact): one reserved-till stamp per
        resource, reservations only append.
    two_pass_admission
        ``False`` (paper): every look at the head tries batch sizes planned..1. ``True``
        (artifact): the first look at a head request tries only sizes >= round(0.95 · planned);
        if none meets its deadline the head is dropped at once, later looks try planned..1.
    bs1_penalty
        ``False`` (paper). ``True`` (artifact): in step 1, a pipeline planned at batch size 1
        whose offer misses the head's deadline has the SLO added to its waiting time.
    max_queued
        Bound on queued requests (``None``: unbounded, the default; deadline drops already bound
        the queue by arrival rate x SLO). A request arriving to a full queue is dropped at once
        with reason "overload".
    reevaluate_on_arrival
        ``False`` (default): an arrival that leaves the queue short of the chosen batch before
        its last moment only queues. ``True`` (artifact): every arrival re-runs Algorithm 1,
        so the pipeline choice follows the clock between dispatches (costs a few probes each).
    uplink_aware
        ``True`` (artifact, the default): a stage followed by another takes the slot whose
        output can leave first (compute done and its server's uplink free for the next
        transfer), so a batch does not finish early on a server whose uplink is booked.
        ``False`` (paper, Algorithm 2): each stage takes the slot that finishes first.
    feedback_horizon_s
        A dispatch's reservations are remembered for feedback until its last compute feedback
        arrives, or this long after its planned finish (memory stays bounded if feedback never
        comes).
    slack_quantile
        ``0.95`` (default): slack-aware dispatch. Compute feedback corrects each stage's latency
        (:class:`~daskpipe.sched.latency.MeasuredLatency`): reservations take the measured ratio
        to the profile once the stage is shown to run slower, and a batch that is not full waits
        only until the last moment at which one more sample would still meet the head's deadline
        at this quantile of the measured latency. ``None`` (paper, artifact): the profile as it
        is, and the last moment by its mean. Execution that keeps to the profile makes both
        decide alike.
    latency_window, latency_min_samples
        The recent compute feedbacks per stage the quantile is taken over, and how many it needs
        before it departs from the profile.
    lead_batches
        ``1.0`` (default): a batch is sent no earlier than this many of its first stage's batch
        times before that stage can start it, so a slot holds the batch it computes and the next
        one, and the rest wait in the queue, where later batches form from what is queued then,
        in deadline order, on the slot that really frees first. ``None`` (paper, artifact): a
        batch is reserved and sent at once however far ahead its slot is booked; a slot that runs
        slower than its profile then holds a growing line of batches that were planned on time.
    keep_full
        ``False`` (paper, artifact, the default): step 2 shrinks the batch whenever the head's
        deadline needs it. ``True``: while at least a full batch is queued, the head's batch is
        not shrunk; a head that no full batch can serve in time is dropped. Where a batch costs
        much less than its samples alone (a GPU), shrinking near capacity lowers the throughput
        the backlog needs and makes it grow, and ``True`` keeps the plan served; where it does not
        (a CPU), the drops cost more than the shrinking (docs/dataplane.md).
    join_chance
        ``0.5`` (default): a batch that is not full waits for its last moment only if the next
        request has at least this chance of arriving between its head's arrival and that moment
        (Poisson arrivals at the rate measured while the model had work outstanding,
        :class:`~daskpipe.sched.arrivals.OutstandingArrivals`); else it goes once the requests
        that arrived at the same instant are in (a wake at once), since waiting would most
        likely grow it by nothing. A lone request on an idle pipeline then takes its compute, not
        its SLO; under load the next request is all but sure to come, and batches wait as
        before. ``None`` (paper, artifact): a batch always waits.
    arrival_window_slos
        ``4.0``: the arrival rate is measured over the arrivals of the last this many SLOs, as if
        the window began with half of it outstanding and joined by none: at the rate where
        waiting starts to pay that is about three arrivals, a pair of requests that meet by
        chance is no rate, and a burst is forgotten as soon.
    """

    timeline: str = "gaps"
    two_pass_admission: bool = False
    bs1_penalty: bool = False
    max_queued: int | None = None
    reevaluate_on_arrival: bool = False
    uplink_aware: bool = True
    feedback_horizon_s: float = 10.0
    slack_quantile: float | None = 0.95
    latency_window: int = 100
    latency_min_samples: int = 20
    lead_batches: float | None = 1.0
    keep_full: bool = False
    join_chance: float | None = 0.5
    arrival_window_slos: float = 4.0

    def __post_init__(self) -> None:
        if self.timeline not in TIMELINE_MODES:
            raise ValueError(f"PPipeSettings.timeline must be one of {', '.join(TIMELINE_MODES)}, got {self.timeline!r}")
        if self.max_queued is not None and (
            isinstance(self.max_queued, bool) or not isinstance(self.max_queued, int) or self.max_queued < 1
        ):
            raise ValueError(f"PPipeSettings.max_queued must be None or an integer >= 1, got {self.max_queued!r}")
        if not self.feedback_horizon_s > 0:
            raise ValueError(f"PPipeSettings.feedback_horizon_s must be > 0, got {self.feedback_horizon_s!r}")
        if self.lead_batches is not None and not (0 < self.lead_batches < INF):
            raise ValueError(f"PPipeSettings.lead_batches must be None or a positive number, got {self.lead_batches!r}")
        if self.slack_quantile is not None and not 0.5 <= self.slack_quantile < 1:
            raise ValueError(f"PPipeSettings.slack_quantile must be None or in [0.5, 1), got {self.slack_quantile!r}")
        if not 1 <= self.latency_min_samples <= self.latency_window:
            raise ValueError(
                f"PPipeSettings needs 1 <= latency_min_samples <= latency_window, got {self.latency_min_samples!r} and "
                f"{self.latency_window!r}"
            )
        if self.join_chance is not None and not 0 < self.join_chance < 1:
            raise ValueError(f"PPipeSettings.join_chance must be None or in (0, 1), got {self.join_chance!r}")
        if not 0 < self.arrival_window_slos < INF:
            raise ValueError(f"PPipeSettings.arrival_window_slos must be a positive number, got {self.arrival_window_slos!r}")

    @classmethod
    def artifact(cls, **overrides: object) -> PPipeSettings:
        """The published simulator's behaviour (digest §3.6)."""
        choices: dict[str, object] = dict(
            timeline="append",
            two_pass_admission=True,
            bs1_penalty=True,
            reevaluate_on_arrival=True,
            uplink_aware=True,
            slack_quantile=None,
            lead_batches=None,
            keep_full=False,
            join_chance=None,
        )
        choices.update(overrides)
        return cls(**choices)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Offer:
    """What ``probe`` found: the batch would run along ``hops`` and finish at ``finish``."""

    pipeline: int
    batch_size: int
    finish: Time
    wait: Time  # time spent waiting for slots and NICs: finish - now - pure work
    hops: tuple[Hop, ...]

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(hop.slot for hop in self.hops)

    @property
    def reservations(self) -> tuple[Reservation, ...]:
        out: list[Reservation] = []
        for hop in self.hops:
            if hop.transfer_in is not None:
                out.extend(hop.transfer_in)
            out.append(hop.compute)
        return tuple(out)


class _Stage:
    """One partition of a pipeline: its pool, ordered by when each slot's reservations end."""

    __slots__ = ("index", "slots", "ul", "dl", "order", "keys", "gappy", "profiled", "compute", "headroom", "transfer", "measured")

    def __init__(
        self,
        index: int,
        slots: list[str],
        ul: list[str],
        dl: list[str],
        compute: list[float],
        transfer: list[float],
        measured: MeasuredLatency | None,
    ):
        self.index = index
        self.slots = slots
        self.ul = ul  # uplink resource of each slot's server
        self.dl = dl
        self.keys: list[tuple[Time, int]] = [(NEVER, i) for i in range(len(slots))]
        self.order = sorted(self.keys)  # kept sorted with bisect: pools are small, a memmove is cheap
        self.gappy: set[int] = set()  # slots keyed NEVER: a gap before their tail fits the shortest batch
        self.profiled = compute  # seconds by batch size (index 0 unused), as profiled
        self.compute = compute  # ... as reserved: profiled x measured.typical
        self.headroom = [0.0] * len(compute)  # seconds beyond ``compute`` at the slack quantile
        self.transfer = transfer  # seconds to bring the batch's input in, by batch size
        self.measured = measured  # None: the profile is trusted as it is

    def rescale(self, typical: float, high: float) -> None:
        """Tables from the profile and the measured factors (:class:`MeasuredLatency`)."""
        self.compute = [typical * seconds for seconds in self.profiled]
        self.headroom = [(high - typical) * seconds for seconds in self.profiled]


class _Pipe:
    __slots__ = ("index", "batch_size", "stages", "work", "safe_work")

    def __init__(self, index: int, batch_size: int, stages: list[_Stage]):
        self.index = index
        self.batch_size = batch_size
        self.stages = stages
        self.retable()

    def retable(self) -> None:
        """Pure work by batch size: as reserved (``work``), and at the slack quantile (``safe_work``)."""
        sizes = range(self.batch_size + 1)
        self.work = [sum(st.compute[b] + st.transfer[b] for st in self.stages) for b in sizes]
        self.safe_work = [self.work[b] + sum(st.headroom[b] for st in self.stages) for b in sizes]


class _Waiting:
    """Held between runs while the queue waits: the batch chosen for the head, the head's
    deadline and arrival, and the table epoch."""

    __slots__ = ("pipe", "batch_size", "deadline", "arrival", "epoch")

    def __init__(self, pipe: _Pipe, batch_size: int, deadline: Time, arrival: Time, epoch: int):
        self.pipe = pipe
        self.batch_size = batch_size
        self.deadline = deadline
        self.arrival = arrival
        self.epoch = epoch


class PPipeDispatcher(Dispatcher):
    """PPipe's data plane for one model (see the module docstring for the algorithm and its cost).

    ``placement`` gives the slots of each pool; ``profile`` the latency of every batch size up to
    the planned one (made non-decreasing in the batch size, so a smaller batch is never planned
    slower than a larger one); transfers of b samples take b · boundary bytes · 8 / (bw_gbps · 1e9)
    seconds through the sender server's uplink and the receiver's downlink. Slots with no server
    get a NIC of their own. ``timeline`` may be shared by the dispatchers of models whose slots
    share servers, so that they see each other's NIC reservations (from their next run on: an
    arrival that only queues does not look). Dispatch ids count from 0 per dispatcher; route
    feedback by ``Dispatch.model``.
    """

    supports_pools = True

    def __init__(
        self,
        model: ModelPlan,
        placement: Placement,
        profile: Profile,
        *,
        bw_gbps: float,
        settings: PPipeSettings | None = None,
        timeline: Timeline | None = None,
    ):
        self.settings = settings or PPipeSettings()
        check_inputs(model, placement, profile, bw_gbps)
        if timeline is not None and timeline.mode != self.settings.timeline:
            raise ValueError(f"the shared timeline is {timeline.mode!r} but settings ask for {self.settings.timeline!r}")
        self.model = model
        self.placement = placement
        self.slo: Time = model.slo_us * 1e-6
        self.timeline = timeline or make_timeline(self.settings.timeline)
        self.stats = Stats()
        self._slot_entries: dict[str, list[tuple[_Stage, int]]] = {}
        self._pipes = [self._build_pipe(pi, p, profile, bw_gbps) for pi, p in enumerate(model.pipelines)]
        self._stages = [stage for pipe in self._pipes for stage in pipe.stages]
        self._gaps_checked_at = NEVER
        self._earliest = self.timeline.earliest
        self._gap_tables = self.timeline.mode == "gaps"  # append tables have no gaps to track
        self._earliest_pair = self.timeline.earliest_pair
        self._refresh_capacity()
        self._queue: list[tuple[Time, int, Request]] = []  # heap by (deadline, arrival order)
        self._queued_samples = 0
        self._seq = count()
        self._dispatch_ids = count()
        self._epoch = 0  # bumped whenever a table changes
        self._waiting: _Waiting | None = None
        self._send_at: Time | None = None  # when the head's batch, held back (``lead_batches``, or to the end of an instant), is to be sent
        self._looked_at: set[int] = set()  # queue seq numbers of heads already looked at (two-pass admission)
        self._live: dict[
            int, tuple[tuple[Hop, ...], int, _Pipe, int]
        ] = {}  # dispatch id -> (hops, timeline corrections then, pipeline, samples), until feedback is complete
        self._live_order: deque[int] = deque()  # dispatch ids in dispatch order, to forget old records
        window_s = self.settings.arrival_window_slos * self.slo
        self._arrivals = OutstandingArrivals(window_s, prior_s=window_s / 2)
        join_chance = self.settings.join_chance
        # arrivals a wait must expect for the next one to come with ``join_chance`` (Poisson: 1 - e^-x)
        self._expected_joins = None if join_chance is None else -math.log1p(-join_chance)

    # -- construction --------------------------------------------------------------------------
    def _build_pipe(self, pi: int, pipeline: Pipeline, profile: Profile, bw_gbps: float) -> _Pipe:
        bs = pipeline.batch_size
        stages = []
        for di, part in enumerate(pipeline.partitions):
            pool = pool_slots(self.placement, pi, di, part)
            compute, transfer = latency_tables(profile, part, bs, bw_gbps)
            ul = [f"{nic_of(slot)}/ul" for slot in pool]
            dl = [f"{nic_of(slot)}/dl" for slot in pool]
            stage = _Stage(di, [slot.id for slot in pool], ul, dl, compute, transfer, self._measured_latency())
            for i, slot_id in enumerate(stage.slots):
                self._slot_entries.setdefault(slot_id, []).append((stage, i))
            stages.append(stage)
        return _Pipe(pi, bs, stages)

    def _measured_latency(self) -> MeasuredLatency | None:
        settings = self.settings
        if settings.slack_quantile is None:
            return None
        return MeasuredLatency(settings.slack_quantile, settings.latency_window, settings.latency_min_samples)

    # -- Dispatcher interface ------------------------------------------------------------------
    def submit(self, request: Request, now: Time) -> list[Action]:
        if (
            request.model != self.model.name
            or request.start_block
            or type(request.size) is not int
            or request.size < 1
            or not 0 <= request.tolerance < INF
        ):
            check_request(request, self.model.name)  # raises, saying what is wrong
        stats = self.stats
        stats.submitted += 1
        size = request.size
        if size > self._max_batch:
            detail = (
                "no pipeline of this model has slots in every pool"
                if not self._active
                else f"size {size} exceeds the largest planned batch ({self._max_batch})"
            )
            return [self._drop(request, "no-capacity", detail)]
        if now + self._min_work[size] > request.drop_after:
            return [self._drop(request, "deadline", "cannot finish by its deadline even alone on an idle pipeline")]
        queue = self._queue
        if self.settings.max_queued is not None and len(queue) >= self.settings.max_queued:
            return [self._drop(request, "overload", f"{len(queue)} requests queued (max_queued)")]
        self._arrivals.arrive(now, bool(queue))
        heappush(queue, (request.deadline, next(self._seq), request))
        n = self._queued_samples = self._queued_samples + size
        waiting = self._waiting
        if waiting is None or waiting.epoch != self._epoch or request.deadline < waiting.deadline or self.settings.reevaluate_on_arrival:
            return self._run(now, arriving=True)
        if (
            n < waiting.batch_size
            and now < (last_moment := waiting.deadline - waiting.pipe.safe_work[n + 1])
            and self._worth_waiting(waiting.arrival, last_moment)
        ):
            return []  # still short of the batch, and its last moment has not come
        return self._run(now, held=waiting, arriving=True)

    def wake(self, now: Time) -> list[Action]:
        return self._run(now) if self._queue else []

    def next_wake(self) -> Time | None:
        waiting = self._waiting
        if waiting is None:
            return self._send_at if self._queue else None
        return waiting.deadline - waiting.pipe.safe_work[self._queued_samples + 1]

    def feedback(self, fb: Feedback, now: Time) -> list[Action]:
        record = self._live.get(fb.dispatch)
        if record is None:  # finished and forgotten, or never ours: nothing left to correct
            return []
        hops, corrections_then, pipe, samples = record
        if fb.kind != "compute" and fb.kind != "transfer":
            raise ValueError(f"feedback kind must be 'compute' or 'transfer', got {fb.kind!r}")
        if not 0 <= fb.partition < len(hops):
            raise ValueError(f"feedback for dispatch {fb.dispatch} names partition {fb.partition}; it has {len(hops)}")
        if not fb.start <= fb.end:
            raise ValueError(f"feedback for dispatch {fb.dispatch} ends before it starts: [{fb.start}, {fb.end})")
        hop = hops[fb.partition]
        last = fb.partition == len(hops) - 1 and fb.kind == "compute"
        changed = fb.kind == "compute" and self._measure(pipe, pipe.stages[fb.partition], samples, fb.end - fb.start)
        planned = hop.compute if fb.kind == "compute" else hop.transfer_in[0] if hop.transfer_in is not None else None
        if corrections_then != self.timeline.corrections or planned is None or planned.start != fb.start or planned.end != fb.end:
            changed |= self._correct(fb, hop, now)  # else on time, and no correction moved it since it was reserved
        if last:
            del self._live[fb.dispatch]
            if not self._live and not self._queue:
                self._arrivals.settled(now)
        if not changed:
            return []
        self._epoch += 1
        return self._run(now) if self._queue else []

    def _correct(self, fb: Feedback, hop: Hop, now: Time) -> bool:
        """Move ``hop``'s reservation to what really happened; True when a table changed."""
        token = (fb.dispatch, fb.partition)
        actual = (fb.start, fb.end)
        self.timeline.advance(now)
        if fb.kind == "compute":
            changed = self.timeline.correct(hop.slot, (hop.compute.start, hop.compute.end), actual, token)
            if changed and hop.slot in self._slot_entries:  # else the slot left the pools since
                self._retail(hop.slot)
            return changed
        if hop.transfer_in is None:
            raise ValueError(f"feedback reports a transfer into partition {fb.partition} of dispatch {fb.dispatch}, which has none")
        changed = False
        for resv in hop.transfer_in:
            changed |= self.timeline.correct(resv.resource, (resv.start, resv.end), actual, token)
        return changed

    def _measure(self, pipe: _Pipe, stage: _Stage, samples: int, seconds: float) -> bool:
        """Learn from one measured compute of ``stage``; True when its latency tables changed.

        Only computes are measured: a transfer's feedback spans two hosts' clocks and the
        messaging around it, so its ratio to the modelled wire time says little."""
        measured = stage.measured
        profiled = stage.profiled[samples]
        if measured is None or not profiled > 0 or not measured.add(seconds / profiled):
            return False
        stage.rescale(measured.typical, measured.high)
        pipe.retable()
        self._refresh_capacity()
        return True

    def drain(self, now: Time, reason: DropReason = "shutdown") -> list[Action]:
        actions: list[Action] = []
        while self._queue:
            actions.append(self._drop(self._pop(), reason, "drained"))
        self._waiting = self._send_at = None
        return actions

    @property
    def queued(self) -> int:
        return len(self._queue)

    def measured_ratios(self) -> dict[tuple[int, int], float]:
        return {
            (pipe.index, stage.index): median
            for pipe in self._pipes
            for stage in pipe.stages
            if stage.measured is not None and (median := stage.measured.median) is not None
        }

    def ratio_samples(self) -> dict[tuple[int, int], list[float]]:
        return {
            (pipe.index, stage.index): list(stage.measured.ratios)
            for pipe in self._pipes
            for stage in pipe.stages
            if stage.measured is not None and stage.measured.ratios
        }

    # -- elasticity ------------------------------------------------------------------------------
    def continue_ids(self, first: int) -> None:
        """Number the next batches from ``first`` on: a dispatcher that takes over from another (a
        re-plan) must not reuse the ids of batches the old one still has reporting."""
        self._dispatch_ids = count(first)

    def remove_slot(self, slot_id: str, now: Time, reason: DropReason = "worker-lost") -> list[Action]:
        """``slot_id`` is gone (worker lost, or taken away): plan nothing more on it.

        Batches already dispatched through it are the executor's to fail or retry; their
        reservations that have not ended are given back so they block nobody. A pipeline left
        with an empty pool stops taking requests; queued requests no pipeline can hold any more
        are dropped with ``reason``. Returns the actions of the re-run of Algorithm 1.
        """
        entries = self._slot_entries.pop(slot_id, None)
        if entries is None:
            raise ValueError(f"{slot_id!r} is not a slot of {self.model.name!r}'s pools")
        for stage, i in entries:
            del stage.order[bisect_left(stage.order, stage.keys[i])]
            stage.gappy.discard(i)
        for dispatch_id, (hops, *_) in list(self._live.items()):
            if any(hop.slot == slot_id for hop in hops) and hops[-1].compute.end > now:
                self._release(dispatch_id, hops)
        self._refresh_capacity()
        return self._after_capacity_change(now, reason)

    def add_slot(self, slot: Slot, pipeline: int, partition: int, now: Time) -> list[Action]:
        """Grow pool (``pipeline``, ``partition``) by ``slot`` (a new or returning worker)."""
        if not 0 <= pipeline < len(self._pipes) or not 0 <= partition < len(self._pipes[pipeline].stages):
            raise ValueError(f"model {self.model.name!r} has no pool (pipeline {pipeline}, partition {partition})")
        part = self.model.pipelines[pipeline].partitions[partition]
        if slot.gpu != part.gpu or slot.slices != part.slices:
            raise ValueError(
                f"slot {slot.id!r} is {slot.gpu}/v{slot.slices} but pool (pipeline {pipeline}, partition {partition}) needs "
                f"{part.gpu}/v{part.slices}"
            )
        stage = self._pipes[pipeline].stages[partition]
        if any(s is stage for s, _ in self._slot_entries.get(slot.id, ())):
            raise ValueError(f"slot {slot.id!r} is already in pool (pipeline {pipeline}, partition {partition})")
        i = len(stage.slots)
        stage.slots.append(slot.id)
        stage.ul.append(f"{nic_of(slot)}/ul")
        stage.dl.append(f"{nic_of(slot)}/dl")
        stage.keys.append((NEVER, i))
        insort(stage.order, (NEVER, i))
        self._slot_entries.setdefault(slot.id, []).append((stage, i))
        self._retail(slot.id)
        self._refresh_capacity()
        return self._after_capacity_change(now, "no-capacity")

    def _release(self, dispatch_id: int, hops: tuple[Hop, ...]) -> None:
        release = self.timeline.release
        for hop, resource, start, end, token in _reservations(hops, dispatch_id):
            release(resource, start, end, token)
            if resource == hop.slot and hop.slot in self._slot_entries:
                self._retail(hop.slot)
        del self._live[dispatch_id]

    def _refresh_capacity(self) -> None:
        """Which pipelines can run (every pool has a slot), what admission may accept, and the
        shortest batch (how often gaps are refreshed)."""
        self._shortest_batch = min((stage.compute[1] for stage in self._stages), default=0.0)
        self._active = [pipe for pipe in self._pipes if all(stage.order for stage in pipe.stages)]
        self._max_batch = max((p.batch_size for p in self._active), default=0)
        # least pure work of a batch of s samples over the pipelines that can hold it
        self._min_work = [min((p.work[s] for p in self._active if p.batch_size >= s), default=INF) for s in range(self._max_batch + 1)]

    def _after_capacity_change(self, now: Time, reason: DropReason) -> list[Action]:
        self._epoch += 1
        self._waiting = self._send_at = None
        actions: list[Action] = []
        if any(entry[2].size > self._max_batch for entry in self._queue):
            kept = []
            for entry in self._queue:
                if entry[2].size > self._max_batch:
                    actions.append(self._drop(entry[2], reason, "no pipeline left can hold it"))
                    self._queued_samples -= entry[2].size
                    self._looked_at.discard(entry[1])
                else:
                    kept.append(entry)
            heapify(kept)
            self._queue = kept
        if self._queue:
            actions.extend(self._run(now))
        return actions

    # -- probe and reserve (Algorithm 2) ---------------------------------------------------------
    def probe(self, pipeline: int, batch_size: int, now: Time) -> Offer:
        """Where and when a batch of ``batch_size`` samples would run on ``pipeline``; changes nothing."""
        if not 0 <= pipeline < len(self._pipes):
            raise ValueError(f"model {self.model.name!r} has pipelines 0..{len(self._pipes) - 1}, not {pipeline}")
        pipe = self._pipes[pipeline]
        if pipe not in self._active:
            raise ValueError(f"pipeline {pipeline} has a pool with no slot left")
        if not 1 <= batch_size <= pipe.batch_size:
            raise ValueError(f"pipeline {pipeline} takes batch sizes 1..{pipe.batch_size}, not {batch_size}")
        finish, path = self._probe(pipe, batch_size, now)
        return Offer(pipeline, batch_size, finish, finish - now - pipe.work[batch_size], self._hops(pipe, batch_size, path))

    def reserve(self, offer: Offer, dispatch_id: int) -> None:
        """Commit ``offer``'s reservations under ``dispatch_id`` (the token feedback refers to)."""
        self._reserve_hops(offer.hops, dispatch_id)

    def _reserve_hops(self, hops: tuple[Hop, ...], dispatch_id: int) -> None:
        reserve = self.timeline.reserve
        for hop, resource, start, end, token in _reservations(hops, dispatch_id):
            reserve(resource, start, end, token)
            if resource == hop.slot:
                self._retail(hop.slot)
        self._epoch += 1

    def _probe(self, pipe: _Pipe, bs: int, now: Time) -> tuple[Time, list[tuple[int, Time, Time]]]:
        """(finish, [(slot index, transfer start, compute start) per stage]): the greedy path.

        Each stage picks the slot that finishes first (Algorithm 2) or, with ``uplink_aware``
        and a stage after it, the slot whose output can leave first: compute done and its
        server's uplink free for the next transfer (the artifact's choice). A pool is scanned in
        key order: slots with a usable gap first (key ``NEVER``), then the others by tail; as
        those cannot finish before tail + compute, and a rank is never below the finish, the
        scan stops once a tail is past the best rank, or once the best meets the stage's lower
        bound (inputs ready, sender uplink free)."""
        self.stats.probes += 1
        earliest = self._earliest
        earliest_pair = self._earliest_pair
        stages = pipe.stages
        last = len(stages) - 1
        uplink_aware = self.settings.uplink_aware
        t = now
        sender_ul = None
        path = []
        for si, stage in enumerate(stages):
            li = stage.compute[bs]
            slots = stage.slots
            uls = stage.ul
            out_ln = stages[si + 1].transfer[bs] if uplink_aware and si < last else 0.0  # 0: rank by finish
            best = INF  # the pick's rank
            best_end = INF  # the pick's finish
            pick = None
            if sender_ul is None:  # the first stage: its inputs come from the clients, off the planned NICs
                sent = t + stage.transfer[bs]
                lower = sent + li
            else:
                ln = stage.transfer[bs]
                dls = stage.dl
                uplink_free = earliest(sender_ul, t, ln)
                lower = uplink_free + ln + li
            for key, i in stage.order:
                if best <= lower or key + li >= best:
                    break
                if sender_ul is not None:
                    sent = earliest_pair(sender_ul, dls[i], uplink_free, ln)
                    start = earliest(slots[i], sent + ln, li)
                else:
                    start = earliest(slots[i], sent, li)
                end = start + li
                rank = earliest(uls[i], end, out_ln) if out_ln else end
                if rank < best:
                    best, best_end = rank, end
                    pick = (i, sent, start)
            assert pick is not None, "every stage has a slot"
            path.append(pick)
            t = best_end
            sender_ul = uls[pick[0]]
        return t, path

    def _hops(self, pipe: _Pipe, bs: int, path: list[tuple[int, Time, Time]]) -> tuple[Hop, ...]:
        hops = []
        previous: _Stage | None = None
        previous_slot = 0
        for stage, (i, sent, start) in zip(pipe.stages, path):
            transfer_in = None
            if previous is not None:
                end = sent + stage.transfer[bs]
                transfer_in = (Reservation(previous.ul[previous_slot], sent, end), Reservation(stage.dl[i], sent, end))
            hops.append(Hop(stage.index, stage.slots[i], Reservation(stage.slots[i], start, start + stage.compute[bs]), transfer_in))
            previous, previous_slot = stage, i
        return tuple(hops)

    def _retail(self, slot_id: str) -> None:
        """Re-key ``slot_id`` in every pool that holds it: ``NEVER`` if a gap could take the
        pool's shortest batch (it may start before its tail), else its tail."""
        timeline = self.timeline
        tail = timeline.tail(slot_id)
        for stage, i in self._slot_entries[slot_id]:
            gappy = self._gap_tables and timeline.has_gap(slot_id, stage.compute[1])
            key = (NEVER if gappy else tail, i)
            if key != stage.keys[i]:
                order = stage.order
                del order[bisect_left(order, stage.keys[i])]
                insort(order, key)
                stage.keys[i] = key
            if gappy:
                stage.gappy.add(i)
            else:
                stage.gappy.discard(i)

    def _refresh_gaps(self, now: Time) -> None:
        """Gaps close as the horizon passes them: re-key slots whose gaps are all behind it.
        Called at most once per shortest batch time (a stale entry only costs a longer scan)."""
        self._gaps_checked_at = now
        for stage in self._stages:
            for i in list(stage.gappy):
                self._retail(stage.slots[i])

    # -- Algorithm 1 ---------------------------------------------------------------------------
    def _run(self, now: Time, held: _Waiting | None = None, arriving: bool = False) -> list[Action]:
        """Algorithm 1 while requests are queued. ``held``: the head's pipeline and batch size
        from the previous run, still valid (same head, tables unchanged), so Step 1 is skipped.
        ``arriving``: run on an arrival, which others may follow at the same instant."""
        actions: list[Action] = []
        self._waiting = self._send_at = None
        self.timeline.advance(now)
        self._arrivals.outstanding_until(now)  # a request is queued: work is outstanding until now, even if it is dropped below
        if self._live_order:
            self._forget_old(now)
        if now >= self._gaps_checked_at + self._shortest_batch:
            self._refresh_gaps(now)
        queue = self._queue
        settings = self.settings
        probe = self._probe
        while queue:
            deadline, seq, head = queue[0]
            size = head.size
            if now + self._min_work[size] > head.drop_after:  # hopeless whatever the tables say
                self._pop()
                actions.append(self._drop(head, "deadline", "can no longer finish by its deadline, even on an idle pipeline"))
                continue
            if held is not None:
                pipe, bs = held.pipe, held.batch_size
                finish, path = probe(pipe, bs, now)
                held = None
            else:  # Step 1: the pipeline with the least waiting time at its planned batch size.
                pipe, finish, path = self._choose(size, deadline, now)
                bs = pipe.batch_size
            # Step 2: shrink the batch until the head's deadline is met; failing that, the largest
            # batch that finishes within its tolerance runs (a drop is a sure miss).
            smallest = size
            if settings.two_pass_admission and seq not in self._looked_at:
                self._looked_at.add(seq)
                smallest = max(size, round(0.95 * bs))
            drop_after = head.drop_after
            tolerated = None
            if settings.keep_full and self._queued_samples >= bs:  # a backlog: a smaller batch would only grow it
                smallest = bs
            while finish > deadline and bs > smallest:
                if tolerated is None and finish <= drop_after:
                    tolerated = (bs, finish, path)
                bs -= 1
                finish, path = probe(pipe, bs, now)
            # Step 3: drop, wait, or dispatch.
            if finish > deadline and tolerated is not None:
                bs, finish, path = tolerated
            elif finish > drop_after:
                self._pop()
                actions.append(self._drop(head, "deadline", f"no batch of {smallest}..{bs} samples on pipeline {pipe.index} meets it"))
                continue
            n = self._queued_samples
            if n < bs and finish <= deadline and now < (last_moment := deadline - pipe.safe_work[n + 1]):  # a late batch never waits
                if self._worth_waiting(head.arrival, last_moment):
                    self._waiting = _Waiting(pipe, bs, deadline, head.arrival, self._epoch)
                    break
                if arriving:  # the requests of a burst come one call each: the batch goes once all are in
                    self._send_at = now
                    break
            if settings.lead_batches is not None:  # not bound to a slot long before it is free; its inputs arrive meanwhile
                first = pipe.stages[0]
                send_by = path[0][2] - first.transfer[bs] - settings.lead_batches * first.compute[bs]
                if send_by > now:
                    self._send_at = send_by
                    break
            actions.append(self._dispatch(pipe, bs, finish, path, now))
        return actions

    def _worth_waiting(self, head_arrival: Time, last_moment: Time) -> bool:
        """Whether a batch short of its size waits for its last moment: always in the paper; with
        ``join_chance``, if the next request is that likely to come between its head's arrival
        and then. Counted from the arrival, not from now, so that a batch that waits is not sent
        early on a later look: under load the deferred batches are the paper's."""
        expected = self._expected_joins
        return expected is None or self._arrivals.rate * (last_moment - head_arrival) >= expected

    def _choose(self, size: int, deadline: Time, now: Time) -> tuple[_Pipe, Time, list[tuple[int, Time, Time]]]:
        """Step 1: probe every pipeline that holds ``size`` samples at its planned batch size and
        take the one that waits least (with the artifact's bs=1 penalty if asked)."""
        best: tuple[_Pipe, Time, list[tuple[int, Time, Time]]] | None = None
        best_wait = INF
        penalty = self.settings.bs1_penalty
        for pipe in self._active:
            bs = pipe.batch_size
            if bs < size:
                continue
            finish, path = self._probe(pipe, bs, now)
            wait = finish - now - pipe.work[bs]
            if penalty and bs == 1 and finish > deadline:
                wait += self.slo
            if wait < best_wait:
                best, best_wait = (pipe, finish, path), wait
        if best is None:  # admission drops what no pipeline can hold, so this is a bug
            raise RuntimeError(f"no pipeline of {self.model.name!r} holds {size} samples")
        return best

    def _dispatch(self, pipe: _Pipe, bs: int, finish: Time, path: list[tuple[int, Time, Time]], now: Time) -> Dispatch:
        """Reserve ``path`` and send the head's batch (requests in deadline order, none split)."""
        queue = self._queue
        looked_at = self._looked_at
        requests = []
        taken = 0
        while queue and taken + queue[0][2].size <= bs:
            _, seq, request = heappop(queue)
            requests.append(request)
            taken += request.size
            if looked_at:
                looked_at.discard(seq)
        self._queued_samples -= taken
        if taken != bs:  # fewer samples than probed (short queue, or sizes that do not add up)
            finish, path = self._probe(pipe, taken, now)
        dispatch_id = next(self._dispatch_ids)
        hops = self._hops(pipe, taken, path)
        self._reserve_hops(hops, dispatch_id)
        self._live[dispatch_id] = (hops, self.timeline.corrections, pipe, taken)
        self._arrivals.outstanding_until(hops[-1].compute.end)
        self._live_order.append(dispatch_id)
        stats = self.stats
        stats.dispatched_batches += 1
        stats.dispatched_requests += len(requests)
        return Dispatch(dispatch_id, self.model.name, pipe.index, taken, requests, hops)

    def _pop(self) -> Request:
        _, seq, request = heappop(self._queue)
        self._queued_samples -= request.size
        if self._looked_at:
            self._looked_at.discard(seq)
        return request

    def _drop(self, request: Request, reason: DropReason, detail: str) -> Drop:
        return counted_drop(self.stats, request, reason, detail)

    def _forget_old(self, now: Time) -> None:
        """Drop the ids of finished dispatches from the front of the order, and the records of
        those whose feedback is overdue by the horizon."""
        order = self._live_order
        live = self._live
        horizon = now - self.settings.feedback_horizon_s
        while order:
            record = live.get(order[0])
            if record is not None:
                if record[0][-1].compute.end >= horizon:
                    break
                del live[order[0]]
            order.popleft()


# -- shared with the reactive baseline ---------------------------------------------------------------
def pool_slots(placement: Placement, pipeline: int, partition: int, part: Partition) -> list[Slot]:
    """The slots of pool (``pipeline``, ``partition``), checked against what the plan asks of them."""
    pool = placement.pools.get((pipeline, partition))
    if not pool:
        raise ValueError(f"placement of {placement.model!r} has no slots for pool (pipeline {pipeline}, partition {partition})")
    slots = []
    for slot_id in pool:
        slot = placement.slots.get(slot_id)
        if slot is None:
            raise ValueError(
                f"pool (pipeline {pipeline}, partition {partition}) names slot {slot_id!r}, which the placement does not define"
            )
        if slot.gpu != part.gpu or slot.slices != part.slices:
            raise ValueError(
                f"slot {slot_id!r} is {slot.gpu}/v{slot.slices} but pool (pipeline {pipeline}, partition {partition}) needs "
                f"{part.gpu}/v{part.slices}"
            )
        slots.append(slot)
    return slots


def nic_of(slot: Slot) -> str:
    """The server whose NIC ``slot`` uses; a slot with no server has a NIC of its own."""
    return slot.server or slot.id


def latency_tables(profile: Profile, part: Partition, batch_size: int, bw_gbps: float) -> tuple[list[float], list[float]]:
    """Seconds by batch size 0..``batch_size``: compute of ``part`` on one slice, and transfer of
    its input: the requests' own inputs (``profile.input_bytes``, from the clients that hold them)
    into the first partition, the previous partition's feature map into the others. Compute is made
    non-decreasing in the batch size: measured tables can dip, and batch shrinking assumes a smaller
    batch is never slower."""
    have = profile.max_batch(part.gpu, part.slices)
    if have < batch_size:
        raise ValueError(f"profile of {profile.model!r} on {part.gpu}/v{part.slices} stops at batch {have}, the plan needs {batch_size}")
    compute = [0.0]
    for b in range(1, batch_size + 1):
        compute.append(max(compute[-1], profile.latency(part.gpu, part.slices, b, *part.blocks) * 1e-6))
    seconds_per_sample = profile.bytes_into(part.blocks[0]) * 8 / (bw_gbps * 1e9)
    return compute, [b * seconds_per_sample for b in range(batch_size + 1)]


def check_request(request: Request, model: str) -> None:
    """Refuse a request this model's dispatcher cannot take, saying why."""
    if request.model != model:
        raise ValueError(f"request {request.id!r} is for model {request.model!r}, this dispatcher serves {model!r}")
    if request.start_block != 0:
        raise ValueError(
            f"request {request.id!r} enters at block {request.start_block}; pooled pipelines serve whole models (start_block 0)"
        )
    if isinstance(request.size, bool) or not isinstance(request.size, int) or request.size < 1:
        raise ValueError(f"request {request.id!r} has size {request.size!r}; it must be an integer >= 1")
    if not 0 <= request.tolerance < INF:
        raise ValueError(f"request {request.id!r} has tolerance {request.tolerance!r}; it must be a finite number of seconds >= 0")


def check_inputs(model: ModelPlan, placement: Placement, profile: Profile, bw_gbps: float) -> None:
    """Refuse a placement, profile or bandwidth that does not belong with ``model``'s plan."""
    if placement.model != model.name:
        raise ValueError(f"placement is for model {placement.model!r}, the plan for {model.name!r}")
    if profile.model != model.name:
        raise ValueError(f"profile is of model {profile.model!r}, the plan of {model.name!r}")
    if not bw_gbps > 0:
        raise ValueError(f"bw_gbps must be > 0, got {bw_gbps!r}")


def counted_drop(stats: Stats, request: Request, reason: DropReason, detail: str) -> Drop:
    """A ``Drop``, counted in ``stats`` under its reason."""
    stats.dropped[reason] = stats.dropped.get(reason, 0) + 1
    return Drop(request, reason, detail)


def _reservations(hops: tuple[Hop, ...], dispatch_id: int) -> Iterator[tuple[Hop, str, Time, Time, tuple[int, int]]]:
    """Every (hop, resource, start, end, token) a dispatch holds: each hop's transfer (uplink and
    downlink together), then its compute; the token is what feedback refers to."""
    for hop in hops:
        token = (dispatch_id, hop.partition)
        if hop.transfer_in is not None:
            for resv in hop.transfer_in:
                yield hop, resv.resource, resv.start, resv.end, token
        yield hop, hop.slot, hop.compute.start, hop.compute.end, token
