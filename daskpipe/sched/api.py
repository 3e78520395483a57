"""The contract between the scheduling core and whatever executes its decisions.

The core is a state machine stepped by its caller (the simulator, or the scheduler plugin of the
Dask runtime). It never reads a clock: every call carries ``now`` in seconds, and the caller asks
``next_wake()`` when to call ``wake`` again. Inputs are arrivals, timer ticks and feedback (the
actual start and end of each use of a GPU or a NIC); outputs are actions: dispatch a batch along a
path with its reservations, or drop a request with a reason.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Hashable, Literal, Union

Time = float  # seconds; the simulator's virtual clock or the runtime's monotonic clock

DropReason = Literal["deadline", "overload", "no-capacity", "shutdown", "worker-lost", "slow-worker", "client-gone"]
"""Why a request was dropped: ``deadline`` (no batch can finish before its deadline), ``overload``
(the queue bound was hit), ``no-capacity`` (no pipeline can take it: none planned, a pool empty for
now, or more samples than the largest batch), ``shutdown`` (the service stopped), ``worker-lost`` (a
worker of its pipeline died, and the retry could not serve it: its detail says why), ``slow-worker``
(a worker of its pipeline stalled or slowed down, and the retry elsewhere could not serve it),
``client-gone`` (its client left before it was served: it holds the input, and nobody waits for the output)."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One schedulable (virtual) GPU: 1/``slices`` of a physical ``gpu`` on ``server``.

    Slots of one server share that server's NIC uplink and downlink.
    """

    id: str
    gpu: str
    slices: int = 1
    server: str = ""


@dataclass(frozen=True)
class Placement:
    """Concrete slots behind a model's plan: ``pools[(pipeline, partition)]`` lists slot ids."""

    model: str
    pools: dict[tuple[int, int], tuple[str, ...]]
    slots: dict[str, Slot]


@dataclass(slots=True)
class Request:
    """One request as a dispatcher sees it.

    ``deadline`` is the finish that dispatch plans to. ``tolerance`` (seconds, >= 0) is how far
    past it a batch may still be planned to finish rather than drop the request: the runtime plans
    to the SLO less a high percentile of its control path's delays, but a request whose batch
    would finish within the *typical* delay of the SLO is usually on time, while a drop is a sure
    miss. The PPipe, reactive, deferred, eager and timeout dispatchers honour it when they decide
    to drop; deadline order and the last moment of a waiting batch stay on ``deadline``. The
    simulator, which has no control path, leaves it 0.
    """

    id: Hashable
    model: str
    arrival: Time
    deadline: Time
    size: int = 1  # samples it carries; batch limits count samples (a request is never split)
    start_block: int = 0  # hybrid inference: the block it enters at
    tolerance: float = 0.0

    @property
    def drop_after(self) -> Time:
        """The latest planned finish worth running the request for."""
        return self.deadline + self.tolerance


@dataclass(frozen=True, slots=True)
class Reservation:
    """Resource ``resource`` (a slot id, or ``"<server>/ul"`` / ``"<server>/dl"``) held for [start, end)."""

    resource: str
    start: Time
    end: Time


@dataclass(frozen=True, slots=True)
class Hop:
    """Where partition ``partition`` of the batch runs and when, as planned at dispatch."""

    partition: int
    slot: str
    compute: Reservation
    transfer_in: tuple[Reservation, Reservation] | None = None  # (sender ul, receiver dl); None for the first hop


@dataclass(slots=True)
class Dispatch:
    """Run ``requests`` as one batch on pipeline ``pipeline`` along ``hops``.

    ``hops`` is a run of consecutive partitions. A planning dispatcher (PPipe) covers the whole
    pipeline at once. A *staged* dispatcher (the reactive baseline) covers part of it, usually
    one partition, and sends the rest later:

    * the first hop's partition is the one every request of the batch needs next (0 for new
      requests); a later stage is a new ``Dispatch`` (new ``id``) carrying the same ``Request``
      objects, possibly batched with requests from other upstream batches;
    * a hop with ``partition > 0`` takes its input from the slot that ran the previous
      partition of the batch's first request (the executor remembers it); when that slot is on
      another server the input crosses the network, planned over ``transfer_in`` if given (else
      from ``compute.start``);
    * the executor must report the ``"compute"`` :class:`Feedback` of every hop: a staged
      dispatcher learns from it that the batch's requests reached the next pool, so without it
      they would wait forever;
    * a request is complete when the hop of its pipeline's last partition ends; a staged
      dispatcher may still ``Drop`` a request between stages (its intermediate data is discarded).
    """

    id: int
    model: str
    pipeline: int
    batch_size: int
    requests: list[Request]
    hops: tuple[Hop, ...]

    @property
    def finish(self) -> Time:
        return self.hops[-1].compute.end


@dataclass(slots=True)
class Drop:
    request: Request
    reason: DropReason
    detail: str = ""


Action = Union[Dispatch, Drop]


@dataclass(frozen=True, slots=True)
class Feedback:
    """What really happened to one reservation of dispatch ``dispatch``: hop ``partition``'s
    ``kind`` ("compute" or "transfer") ran over [start, end). Reported when it ends (``now`` =
    ``end``); a transfer is one report for the uplink and downlink it held together."""

    dispatch: int
    partition: int
    kind: Literal["compute", "transfer"]
    start: Time
    end: Time


class PoolsFixed(NotImplementedError):
    """The dispatcher plans on the pools it was built with; it cannot take a slot out or in."""


class Dispatcher(ABC):
    """A data plane policy. Every method returns the actions it decided, in order.

    These are all the calls an executor (the simulator's engine, the runtime's scheduler plugin
    and its elastic re-planner) makes. Beyond the abstract ones, each has a default: ``feedback``
    and ``drain`` do nothing, ``remove_slot`` and ``add_slot`` raise :class:`PoolsFixed` unless
    ``supports_pools`` says the dispatcher overrides them, and ``continue_ids`` raises
    ``NotImplementedError`` (a dispatcher that can take over from another must override it).
    """

    supports_pools: bool = False
    """Whether ``remove_slot`` and ``add_slot`` work (a class's, or one instance's). An executor never calls them otherwise: it
    leaves a lost worker's slot in the pools (its batches are dropped as "worker-lost" until a
    re-plan) and never suspects a slow one (gray failures need a pool to route around it)."""

    @abstractmethod
    def submit(self, request: Request, now: Time) -> list[Action]:
        """A request arrived."""

    @abstractmethod
    def wake(self, now: Time) -> list[Action]:
        """The time asked for by ``next_wake`` has come (calling it early or late is harmless)."""

    def feedback(self, fb: Feedback, now: Time) -> list[Action]:
        """Timing of an executed reservation; policies that keep tables correct them here."""
        return []

    @abstractmethod
    def next_wake(self) -> Time | None:
        """When the dispatcher next needs ``wake`` (``None``: only on new input)."""

    def drain(self, now: Time, reason: DropReason = "shutdown") -> list[Action]:
        """Drop everything still queued; the service is stopping or being re-planned."""
        return []

    def measured_ratios(self) -> dict[tuple[int, int], float]:
        """(pipeline, partition) -> the median measured/profiled compute time of its recent
        batches, for the stages that measured enough of them; empty when it does not measure.
        The elastic re-planner re-plans when one leaves the profile's band."""
        return {}

    def ratio_samples(self) -> dict[tuple[int, int], list[float]]:
        """(pipeline, partition) -> the measured/profiled compute ratios of its recent batches,
        oldest first; empty when it does not measure. The simulator replays them as latency noise
        (``SimulationConfig.latency_ratios``)."""
        return {}

    @property
    def queued(self) -> int:
        return 0

    def continue_ids(self, first: int) -> None:
        """Number the next dispatches from ``first`` on (at least): a dispatcher that takes over
        from another (a re-plan) must not reuse the ids of batches the old one still has reporting."""
        raise NotImplementedError(f"{type(self).__name__} cannot take over from another dispatcher (no continue_ids)")

    def remove_slot(self, slot_id: str, now: Time, reason: DropReason = "worker-lost") -> list[Action]:
        """``slot_id`` is gone (worker lost, or suspect): plan nothing more on it. Batches already
        dispatched through it are the executor's to retry; queued requests that no pipeline can
        hold any more are dropped with ``reason``. Only when ``supports_pools``."""
        raise PoolsFixed(f"{type(self).__name__} cannot take slot {slot_id!r} out of its pools")

    def add_slot(self, slot: Slot, pipeline: int, partition: int, now: Time) -> list[Action]:
        """Grow pool (``pipeline``, ``partition``) by ``slot`` (a new or returning worker); a
        ``ValueError`` if it is there already. Only when ``supports_pools``."""
        raise PoolsFixed(f"{type(self).__name__} cannot add slot {slot.id!r} to its pools")


@dataclass
class Stats:
    """Counters every dispatcher keeps (cheap enough for the hot path)."""

    submitted: int = 0
    dispatched_batches: int = 0
    dispatched_requests: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    probes: int = 0
