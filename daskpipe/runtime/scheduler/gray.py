"""Gray failures: stages that stall or slow down without dying, and inputs that fail their batch.

A worker that dies is noticed by Dask (``remove_worker``). A worker that freezes (SIGSTOP, a hung
driver) or runs slow (a throttled GPU, a noisy MPS neighbour) is not: its batches simply end late.
The scheduler plugin knows when each batch's hops should start and how long they should take (their
reservations), so it watches them. A slot becomes a *suspect* when a hop has not reported
``suspect_factor`` planned latencies past its planned start, plus ``overdue_floor_slos`` of the SLO
(at least the measured control-path margin), and still has not that long again (two strikes, so
that a report delayed by the scheduler's own loop lag is read in between): it stalled. It also becomes one when ``slow_batches``
batches in a row computed over ``suspect_factor`` x their planned latency, and over that many times
the pace its pool-mates keep now, while another slot of its pools keeps in line: it slowed down (a
whole pool that runs slow is the machine, which the dispatcher's measured latencies and the
profile-drift re-plan follow; ``daskpipe.sched.latency``). A suspect gets no new batches; its
batches are re-dispatched while their deadlines allow (else dropped as ``slow-worker``), and
whatever it reports for them later is discarded. It is then probed, one batch-1 computation at a
time: when a probe computes within ``readmit_ratio`` of the profiled latency, the slot rejoins its
pools. A request still in flight ``late_limit_slos`` SLOs after it arrived is dropped
(``deadline``), so no result comes later than that.

A stage that raises fails its batch; the plugin then retries the batch's requests apart, so that
only an input that fails on its own fails, with its cause (:func:`isolation_split`): in halves
(bisection, the least compute) when the worst case of bisecting down to one request still ends by
their deadlines, else each request alone when that still does, the parts spread over the slots of
the batch's pools. A stage that hangs on an input raises nothing: its batch stalls (the first
rule), and a thread cannot be stopped, so the stalled batch's requests are re-dispatched each
alone on other slots of their pools; one whose slot then computes nothing for a hop bound (while
the request waits on it) is the input that hangs, and fails alone (:mod:`daskpipe.runtime.scheduler.watch`).
Those retries are bounded: at most ``isolation_share`` of the model's batches, plus a burst of
``isolation_burst``, so a stream of poisoned or hanging inputs cannot eat the cluster.

The knobs are Dask config keys under ``daskpipe.gray`` (docs/operations.md), read when a model is
served.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Collection, Generic, Sequence, TypeVar

from daskpipe.config import check, setting

CONFIG = "daskpipe.gray"


@dataclass(frozen=True)
class GrayPolicy:
    """How the plugin treats stalled and slow stages and failing batches (the module docstring);
    its fields are the keys under :data:`CONFIG`, checked against their schema however it is made."""

    suspect_factor: float = 2.0
    overdue_floor_slos: float = 0.25
    slow_batches: int = 3
    late_limit_slos: float = 2.0
    readmit_ratio: float = 1.5
    probe_interval_s: float = 0.5
    isolation_share: float = 0.1
    isolation_burst: int = 16

    def __post_init__(self) -> None:
        check(CONFIG, {name.replace("_", "-"): value for name, value in asdict(self).items()})

    @classmethod
    def from_config(cls) -> GrayPolicy:
        """The policy of ``daskpipe.gray.*`` in Dask's config, defaults for keys not set."""
        return cls(**{key.replace("-", "_"): value for key, value in setting(CONFIG).items()})

    def hop_bound(self, planned_s: float, margin_s: float, slo_s: float) -> float:
        """Seconds past a hop's planned start after which it is overdue."""
        return planned_s * self.suspect_factor + max(margin_s, self.overdue_floor_slos * slo_s)

    def may_isolate(self, isolated: int, batches: int) -> bool:
        """Whether one more isolation batch fits the budget, ``isolated`` of ``batches`` so far."""
        return isolated + 1 <= self.isolation_share * batches + self.isolation_burst


def isolation_split(
    sizes: Sequence[int], time_left_s: float, hop_s: Callable[[int], list[float]], lanes: int, report_s: float
) -> list[list[int]] | None:
    """The parts (lists of indices into ``sizes``, the failed batch's requests' samples) to retry a
    failed batch in, so that an input that fails alone is found within ``time_left_s``: its two
    halves when bisecting down to one request fits in the worst case, each request alone when only
    that fits, ``None`` when neither does. ``hop_s(samples)``: the seconds of each hop of the
    batch's route at that size. A round's parts are dealt onto ``lanes`` routes through different
    slots (as wide as the narrowest pool); a lane runs its parts one after another, hops
    overlapping as a pipeline does; a round's failure is known ``report_s`` after its last part."""
    indices = list(range(len(sizes)))

    def round_s(parts: list[list[int]]) -> float:
        slowest = 0.0
        for lane in range(min(lanes, len(parts))):
            hops = [hop_s(sum(sizes[i] for i in part)) for part in parts[lane::lanes]]
            slowest = max(slowest, sum(max(h) for h in hops) + sum(hops[0]) - max(hops[0]))
        return slowest + report_s

    def bisection_s(part: list[int]) -> float:
        if len(part) < 2:
            return 0.0
        halves = [part[: len(part) // 2], part[len(part) // 2 :]]
        return round_s(halves) + max(bisection_s(half) for half in halves)

    if bisection_s(indices) <= time_left_s:
        return [indices[: len(indices) // 2], indices[len(indices) // 2 :]]
    singles = [[i] for i in indices]
    return singles if round_s(singles) <= time_left_s else None


@dataclass
class SlowSlots:
    """The rule for a slot that slowed down, over one model's ``stages`` ((pipeline, partition,
    address) each; the module docstring): ``slow_batches`` of its batches in a row computed over
    ``suspect_factor`` x their planned latency and x the pace its pool-mates keep now. It keeps no
    clock: what it knows of time comes with each batch it is told of (:meth:`observe`), measured
    by the runtime's stages or by the simulator's virtual clock alike."""

    policy: GrayPolicy
    stages: Sequence[tuple[int, int, str]]
    streaks: dict[str, int] = field(default_factory=dict)  # address -> its latest batches in a row computed too slow
    ratios: dict[str, float] = field(default_factory=dict)  # address -> its latest batch's measured / planned compute

    def observe(self, address: str, seconds: float, planned_s: float, out: Collection[str] = ()) -> str | None:
        """``address`` computed a batch in ``seconds``, planned ``planned_s``: why its slot is slow
        once it is, else ``None``. Slots ``out`` of line (suspects) are not suspected again, nor
        counted in their pool-mates' pace."""
        policy = self.policy
        ratio = self.ratios[address] = seconds / planned_s if planned_s > 0 else 1.0
        pace = self._pace(address, ratio, out)
        streak = self.streaks[address] = self.streaks.get(address, 0) + 1 if ratio > policy.suspect_factor * pace else 0
        if streak < policy.slow_batches or address in out:
            return None
        return (
            f"computed {streak} batches in a row at over {policy.suspect_factor:g}x their planned latency and its pool-mates' pace (the "
            f"last {seconds * 1e3:.1f} ms, planned {planned_s * 1e3:.1f} ms, pool-mates at {pace:.2f}x)"
        )

    def _pace(self, address: str, ratio: float, out: Collection[str]) -> float:
        """What ``address``'s pool-mates measure now (their median ratio, at least 1); looked up
        only for a batch over ``suspect_factor``, as the pace can only raise the bar: the runtime
        runs this for every batch on the scheduler's event loop."""
        if ratio <= self.policy.suspect_factor:
            return 1.0
        mine = {(p, q) for p, q, a in self.stages if a == address}
        mates = [self.ratios[a] for p, q, a in self.stages if (p, q) in mine and a != address and a in self.ratios and a not in out]
        return max(1.0, statistics.median(mates)) if mates else 1.0


@dataclass
class Suspect:
    """A slot that stopped keeping its reservations: out of its ``pools`` until a probe is in line."""

    since: float
    detail: str
    pools: list[tuple[int, int]]
    probe: tuple[int, float] | None = None  # (token, profiled seconds) of the probe in flight
    probes: int = 0
    last_ratio: float | None = None  # measured / profiled of the last probe that came back

    def summary(self, now: float) -> dict[str, Any]:
        return {"since_s": round(now - self.since, 3), "detail": self.detail, "probes": self.probes, "last_ratio": self.last_ratio}


Item = TypeVar("Item")


@dataclass
class Watchlist(Generic[Item]):
    """Moments at which something must have happened, earliest first; entries are checked when due
    and are skipped by the checker if what they wait for happened meanwhile (lazy deletion)."""

    heap: list[tuple[float, int, Item]] = field(default_factory=list)
    order: itertools.count = field(default_factory=itertools.count)

    def push(self, due: float, item: Item) -> None:
        heapq.heappush(self.heap, (due, next(self.order), item))

    def due(self, now: float) -> list[Item]:
        """The items due by ``now``, removed."""
        out: list[Item] = []
        while self.heap and self.heap[0][0] <= now:
            out.append(heapq.heappop(self.heap)[2])
        return out

    def skim(self, pending: Callable[[Item], bool]) -> None:
        """Remove the earliest entries while what they wait for has happened (not ``pending``), so
        that the next due is one that may still need a check."""
        while self.heap and not pending(self.heap[0][2]):
            heapq.heappop(self.heap)

    @property
    def next_due(self) -> float | None:
        return self.heap[0][0] if self.heap else None

    def __len__(self) -> int:
        return len(self.heap)
