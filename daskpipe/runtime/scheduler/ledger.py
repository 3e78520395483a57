"""Each served model's ledger on the scheduler: the one owner of its requests' lives.

A request is in a model's :class:`Ledger` from the moment it becomes a Dask key
(:meth:`Ledger.admit`) to its end: queued, in flight (in a :class:`Flight`), parked between two
stages, queued again (a retry, a staged batch's next stage), and ended once by :meth:`Ledger.end`
with an :data:`Outcome`. Ending is one place: it frees what the request held (its queued input,
its deadline, the data parked on a worker), ends its Dask key (the client's future raises what
it ended with; an output's key is in memory already) and counts it, in the ledger's counts and
in the metrics that ``/metrics`` shows, so that the two agree. A key that has ended already is
skipped: a batch and its retry may both report.

The scheduler's parts (:class:`~daskpipe.runtime.scheduler.models.Models`, the batches, the gray
watch, the re-planner) each act on a model through its ledger.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Union

from distributed.protocol import Serialized

from daskpipe.plan.schema import ModelPlan
from daskpipe.profiles.model import Profile
from daskpipe.runtime.errors import DeployError, RequestDropped, RequestFailed
from daskpipe.runtime.scheduler.control import ControlPath
from daskpipe.runtime.scheduler.gray import GrayPolicy, SlowSlots, Suspect
from daskpipe.runtime.scheduler.keys import err_key, err_keys, serialized
from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.inputs import input_nbytes
from daskpipe.runtime.wire.messages import Hop, WorkerSlot
from daskpipe.sched.api import Dispatcher, Request
from daskpipe.sched.durations import BatchDurations
from daskpipe.sched.metrics import ServiceMetrics

logger = logging.getLogger(__name__)

QUEUE_SLOS = 2.0
"""The default queue bound, in SLOs of requests at the plan's capacity: a request queued behind
more than one SLO's worth cannot finish in time anyway, and the bound keeps what the scheduler
holds (requests and their input bytes) independent of how fast clients submit."""


@dataclass
class Flight:
    """A dispatched batch until its last stage reports: what to re-dispatch if a worker dies."""

    keys: list[Any]
    addresses: frozenset[str]
    retries: list[tuple[Request, Any, int]] = field(default_factory=list)  # per key: (request, its input, samples), kept for a retry
    planned: list[tuple[int, float, float]] = field(
        default_factory=list
    )  # per hop: (partition, planned start, planned transfer s); none for an isolation batch
    ran: dict[int, tuple[float, float]] = field(default_factory=dict)  # partition -> actual compute (start, end), scheduler clock
    slot_free: dict[int, float] = field(default_factory=dict)  # partition -> when its slot ended the batch before this one
    route: list[Hop] = field(default_factory=list)  # as sent: where each hop runs
    spans: list[float] = field(default_factory=list)  # per hop: planned compute seconds
    isolating: bool = False  # a part of a failed or stalled batch, retried apart (poison and hang isolation)
    trial: bool = False  # a deploy's trial batch: measured, never policed (no hop bound, no late limit)
    stalled_on: str = ""  # a request of a batch that stalled on this worker, re-dispatched alone (hang isolation)
    pipeline: int = 0  # the plan's pipeline it runs on
    sources: list[str] = field(
        default_factory=list
    )  # per key: the worker its input is parked on (a staged dispatch past partition 0); else none

    @property
    def staged(self) -> bool:
        """Covers part of its pipeline: it takes parked data, or parks its own (it cannot be sent again)."""
        return bool(self.sources) or bool(self.route and self.route[-1].get("park"))

    def control_delays(self) -> tuple[float, list[float]] | None:
        """(dispatch delay, hop delays) once every hop has reported (see :mod:`daskpipe.runtime.scheduler.control`).

        A stage that started late because its slot was still computing the batch before (one that
        ran over its reservation) was not held up by the control path: such a wait is compute
        variance, which dispatch plans for with the measured latencies, and is not counted."""
        if not self.planned or any(partition not in self.ran for partition, _, _ in self.planned):
            return None
        (first, first_start, _), *rest = self.planned
        free = self.slot_free
        hops, previous_end = [], self.ran[first][1]
        for partition, start, transfer in rest:
            actual_start, actual_end = self.ran[partition]
            hops.append(actual_start - max(previous_end + transfer, start, free.get(partition, -math.inf)))
            previous_end = actual_end
        return self.ran[first][0] - max(first_start, free.get(first, -math.inf)), hops

    def legs(self, done: float) -> dict[str, float] | None:
        """Seconds this batch ran past its plan, by leg, once every hop has reported (``done``: the
        completion read on the scheduler): ``behind``, its first slot still computing the batch
        before; ``dispatch`` and ``hops``, the control path (:meth:`control_delays`); ``compute``,
        the stages' compute beyond their planned spans (negative when faster); ``done``, the last
        stage's end to its completion."""
        delays = self.control_delays()
        if delays is None or len(self.spans) != len(self.planned):
            return None
        dispatch, hops = delays
        (first, first_start, _), last = self.planned[0], self.planned[-1][0]
        ran = self.ran
        return {
            "behind": max(0.0, self.slot_free.get(first, -math.inf) - first_start),
            "dispatch": max(0.0, dispatch),
            "hops": sum(max(0.0, h) for h in hops),
            "compute": sum(ran[partition][1] - ran[partition][0] - span for (partition, _, _), span in zip(self.planned, self.spans)),
            "done": max(0.0, done - ran[last][1]),
        }


@dataclass
class LateLegs:
    """Where the batches whose requests ended late lost their time (:meth:`Flight.legs`), summed
    over those batches: what to look at when attainment falls short while the margin looks right."""

    requests: int = 0
    batches: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    peaks: dict[str, float] = field(default_factory=dict)

    def add(self, legs: dict[str, float], late_requests: int) -> None:
        self.requests += late_requests
        self.batches += 1
        for leg, seconds in legs.items():
            self.sums[leg] = self.sums.get(leg, 0.0) + seconds
            self.peaks[leg] = max(self.peaks.get(leg, -math.inf), seconds)

    def summary(self) -> dict[str, Any]:
        """Milliseconds: each leg's mean and largest over the late batches."""
        return {
            "requests": self.requests,
            "batches": self.batches,
            "mean_ms": {leg: total / self.batches * 1e3 for leg, total in self.sums.items()} if self.batches else {},
            "max_ms": {leg: peak * 1e3 for leg, peak in self.peaks.items()},
        }


@dataclass(frozen=True)
class Output:
    """The request's output is stored on its last stage's worker (its Dask key is in memory
    there already), ``done`` on the scheduler's clock: on time when by its deadline."""

    done: float


@dataclass(frozen=True)
class Dropped:
    """The request is not served, for ``reason`` (a :data:`~daskpipe.sched.api.DropReason`, or
    "released": its client let it go): its future raises a :class:`~daskpipe.runtime.errors.RequestDropped`
    saying so, with ``detail``."""

    reason: str
    detail: str = ""


@dataclass(frozen=True)
class Failed:
    """Serving the request raised: its future raises ``error``, a stage's own (serialized on its
    worker, never deserialized here) or the scheduler's :class:`~daskpipe.runtime.errors.RequestFailed`."""

    error: Exception | Serialized


Outcome = Union[Output, Dropped, Failed]
"""How a request ends (:meth:`Ledger.end`)."""


def worker_lost(detail: str) -> Dropped:
    """A worker the request needed died: ``detail`` says which, and what it held."""
    return Dropped("worker-lost", detail)


def client_gone(detail: str) -> Dropped:
    """The request's client left: nobody waits for it any more."""
    return Dropped("client-gone", detail)


@dataclass(frozen=True)
class Endings:
    """What ending a request touches beyond its ledger: its Dask key on ``scheduler``, the slot
    workers that may hold its parked data (``slots``, told through ``to_worker``), and the
    ``metrics`` that the dashboard and ``/metrics`` show. One for all of a plugin's ledgers."""

    scheduler: Any
    slots: Mapping[str, WorkerSlot]
    to_worker: Callable[[str, dict], None]
    metrics: ServiceMetrics


@dataclass
class Ledger:
    """One model being served: its dispatcher, its stages, and its requests in the plugin's care
    until :meth:`end` (the module docstring)."""

    model: ModelPlan  # time-dilated
    profile: Profile  # time-dilated
    dispatcher: Dispatcher
    stages: dict[tuple[int, int, str], str]  # (pipeline, partition, address) -> stage actor key
    emulated: frozenset[str]  # addresses of emulated slots: their stages hold batches
    durations: BatchDurations  # what an emulated slot holds a batch for (time-dilated); the simulator's model
    endings: Endings
    queued: dict[Any, tuple[Any, int]] = field(default_factory=dict)  # key -> (raw input or HeldInput, samples)
    deadlines: dict[Any, float] = field(default_factory=dict)  # key -> deadline, until it ends
    flights: dict[int, Flight] = field(default_factory=dict)
    counts: dict[str, int] = field(
        default_factory=lambda: {
            "submitted": 0,
            "completed": 0,
            "on_time": 0,
            "failed": 0,
            "invalid": 0,
            "batches": 0,
            "overruns": 0,
            "isolated": 0,
            "suspected": 0,
            "readmitted": 0,
        }
    )
    dropped: dict[str, int] = field(default_factory=dict)
    closing: bool = False
    parked: dict[Any, str] = field(
        default_factory=dict
    )  # key -> the worker holding its intermediate data between two stages of a staged data plane
    max_queued: int = 1  # queued requests at most; a submission beyond is dropped ("overload")
    sample_nbytes: int = 0  # raw input bytes per sample of requests entering at block 0 (0: not checked)
    budgets: dict[int, float] = field(default_factory=dict)  # entry block -> latency budget (s, dilated); hybrid plans have several
    control: ControlPath = field(default_factory=lambda: ControlPath(0.0))  # measured control-path delays, and the margin
    late: LateLegs = field(default_factory=LateLegs)  # where the batches that ended late lost their time
    gray: GrayPolicy = field(default_factory=GrayPolicy)
    suspects: dict[str, Suspect] = field(default_factory=dict)  # address -> why its slot gets no batches
    slow: SlowSlots = field(init=False)  # which of its slots computed slow lately (the gray policy's rule)
    abandoned: OrderedDict[int, str] = field(default_factory=OrderedDict)  # dispatch id -> the suspect it was taken from

    def __post_init__(self) -> None:
        self.slow = SlowSlots(self.gray, list(self.stages))

    def add_stages(self, model: ModelPlan, stages: Mapping[tuple[int, int, str], str], emulated: Iterable[str]) -> None:
        """``stages`` on slots that joined the model's pools (a shared pool grown while it serves),
        ``model`` the plan with them."""
        self.model = model
        self.stages.update(stages)
        self.emulated = self.emulated | frozenset(emulated)
        self.slow.stages = list(self.stages)

    def refusal(self, payload: Any, size: Any, start_block: int = 0) -> str | None:
        """Why a submitted input cannot be served, or ``None``. The client checks every input, but
        the scheduler does not trust the wire: a bad one would fail the whole batch it joins."""
        most = self.model.max_batch
        if type(size) is not int or not 1 <= size <= most:
            return f"a request must hold 1 to {most} samples (the largest planned batch), got {size!r}"
        nbytes = input_nbytes(payload)
        if nbytes is None:
            what = f"a serialized {payload.header.get('type', 'object')}" if isinstance(payload, Serialized) else type(payload).__name__
            return f"the input must arrive as its byte count or as raw bytes, got {what}"
        if self.sample_nbytes and start_block == 0 and nbytes >= 0 and nbytes != size * self.sample_nbytes:
            return f"{size} samples take {size * self.sample_nbytes} bytes, the input has {nbytes}"
        return None

    # -- a request's life ----------------------------------------------------------------------
    def admit(self, key: Any, payload: Any, size: int, deadline: float) -> None:
        """``key`` (a Dask key now) is queued, in this ledger's care until :meth:`end`."""
        self.counts["submitted"] += 1
        self.queued[key] = (payload, size)
        self.deadlines[key] = deadline

    def refuse(self, invalid: int, overloaded: int, overload: str) -> None:
        """Count requests refused on arrival, which never became keys (:func:`~daskpipe.runtime.scheduler.keys.refuse`
        ends them): ``invalid`` ones, and ``overloaded`` ones that found the queue full (``overload`` says how full)."""
        now = time.monotonic()
        metrics = self.endings.metrics
        self.counts["submitted"] += invalid + overloaded
        self.counts["invalid"] += invalid
        if invalid:
            metrics.refuse(self.model.name, invalid, now)
        if overloaded:
            self.dropped["overload"] = self.dropped.get("overload", 0) + overloaded
            metrics.drop(self.model.name, "overload", overloaded, now, overload)

    def requeue(self, key: Any, payload: Any, size: int, parked_on: str | None = None) -> bool:
        """Queue ``key`` again: retried after its batch was lost, or for its next stage, its data
        parked on ``parked_on``. ``False`` when it has ended, or is queued already."""
        if key not in self.deadlines or key in self.queued:
            return False
        self.queued[key] = (payload, size)
        if parked_on is not None:
            self.parked[key] = parked_on
        return True

    def end(self, keys: Iterable[Any], outcome: Outcome) -> list[Any]:
        """End ``keys`` with ``outcome``: each one not ended yet is freed (queued input, deadline,
        parked data), its Dask key ended and counted once. Returns the keys it ended."""
        endings, name = self.endings, self.model.name
        ended, on_time = [], 0
        discard: dict[str, list] = {}  # worker -> the keys whose parked data it drops
        for key in keys:
            deadline = self.deadlines.pop(key, None)
            if deadline is None:
                continue
            ended.append(key)
            self.queued.pop(key, None)
            parked = self.parked.pop(key, None)
            if parked is not None and parked in endings.slots:
                discard.setdefault(parked, []).append(key)
            if isinstance(outcome, Output):
                on_time += outcome.done <= deadline
        if not ended:
            return ended
        now = time.monotonic()
        if isinstance(outcome, Output):
            self.counts["completed"] += len(ended)
            self.counts["on_time"] += on_time
        elif isinstance(outcome, Dropped):
            self.dropped[outcome.reason] = self.dropped.get(outcome.reason, 0) + len(ended)
            endings.metrics.drop(name, outcome.reason, len(ended), now, outcome.detail)
            for key in ended:
                err_key(endings.scheduler, key, RequestDropped(outcome.reason, outcome.detail, name, key))
        else:
            self.counts["failed"] += len(ended)
            endings.metrics.fail(name, len(ended), now)
            err_keys(endings.scheduler, ended, outcome.error if isinstance(outcome.error, Serialized) else serialized(outcome.error))
        for address, parked_keys in discard.items():  # their intermediate data waits there for nothing now
            endings.to_worker(address, {"op": messages.DISCARD, "model": name, "keys": parked_keys})
        return ended

    def step(self, call: Callable[[], list], failing: list | None = None) -> list:
        """Run one call of the dispatcher, returning its actions; a dispatcher bug fails the
        requests at stake (``failing``, else every queued one), with the cause."""
        try:
            return call()
        except Exception as exc:
            name = self.model.name
            logger.exception("daskpipe: the dispatcher of %s raised", name)
            failure = RequestFailed(f"the dispatcher of {name!r} raised {type(exc).__name__}: {exc}", cause=exc)
            self.end(list(self.queued) if failing is None else failing, Failed(failure))
            return []

    def suspect_summaries(self) -> dict[str, dict[str, Any]]:
        """This model's suspect slots by address: since when (s), why, its probes."""
        now = time.monotonic()
        return {address: suspect.summary(now) for address, suspect in self.suspects.items()}

    def take_flights(self, address: str) -> list[tuple[int, Flight]]:
        """The batches that run through ``address``, no longer in flight."""
        return [(d, self.flights.pop(d)) for d in [d for d, flight in self.flights.items() if address in flight.addresses]]

    def carry_over(self, held: Ledger) -> None:
        """Take over what ``held`` (the same model on the plan a re-plan replaces) has in its care:
        its requests, batches in flight and counts, so that none is lost by the switch."""
        for kept in ("queued", "deadlines", "flights", "counts", "dropped", "abandoned"):
            setattr(self, kept, getattr(held, kept))


def queue_bound(model: ModelPlan, max_queued: int | None) -> int:
    """``max_queued`` checked, or the default: ``QUEUE_SLOS`` SLOs of requests at the plan's capacity."""
    if max_queued is None:
        return max(math.ceil(QUEUE_SLOS * model.throughput * model.slo_us * 1e-6), 2 * model.max_batch)
    if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
        raise DeployError(f"max_queued must be None or an integer >= 1, got {max_queued!r}")
    return max_queued
