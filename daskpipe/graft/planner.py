"""Graft's scheduler: merge uniform fragments, group similar ones, re-align each group (Algorithm 1).

All fragments here belong to one model (re-alignment shares the model's last blocks). The plan
serves every fragment through at most two stages: a private *alignment* stage ``[k_i, p)`` and a
*shared* stage ``[p, N)`` whose instances batch requests from every private stage of its level.

Fixes to the paper, each explained in docs/hybrid.md:

* Grouping weights edges by *similarity* ``1 / (1 + d)`` of min-max normalised ``<k, t, q>``
  vectors (``d`` = weighted Euclidean distance), so Eq. 1's "minimise external weight" keeps
  similar fragments together, as the text intends (it defines the weight as a distance, which
  would group dissimilar fragments).
* Algorithm 1: the cost is ``sum r * c`` on both lines 11 and 12; the loop collects candidates and
  returns after it; fragments with ``k_i = p`` join the shared stage with an empty alignment
  stage (so ``F_A`` is never empty and the recursion ends); ``p = N`` ("no sharing") serves each
  fragment alone on its own ``t_i / 2``, so Graft is never worse than per-fragment serving.
* The exponential time-budget enumeration of line 8 is replaced by an exact loop over the shared
  stage's efficient configurations: given the shared stage's latency, alignment stages are
  independent and each takes its cheapest configuration within the time left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import groupby
from typing import Iterator, Sequence

import numpy as np

from daskpipe.graft.costs import StageConfig, StageCosts
from daskpipe.graft.fragments import Fragment

DEFAULT_MERGE_THRESHOLD = 0.2
DEFAULT_GROUP_SIZE = 5
DEFAULT_BUDGET_QUANTUM_MS = 1.0
DEFAULT_RESTARTS = 8
DEFAULT_EXTRA_GROUPS = 1


class PlanningError(ValueError):
    """No plan can serve the fragments within their budgets; the message names the fragment."""


# -- plan structure ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Level:
    """Fragments re-aligned at block ``point``: private stages ``[k_i, point)`` feed one shared stage.

    ``point == N`` means no sharing: each fragment's private stage is its whole suffix and
    ``shared`` is None. A private stage is None when the fragment starts at ``point``.
    """

    point: int
    fragments: tuple[Fragment, ...]
    private: tuple[StageConfig | None, ...]
    shared: StageConfig | None

    @property
    def cost(self) -> int:
        return sum(s.cost for s in self.stages())

    def stages(self) -> Iterator[StageConfig]:
        yield from (s for s in self.private if s is not None)
        if self.shared is not None:
            yield self.shared


@dataclass(frozen=True)
class GroupPlan:
    """One group's re-alignment: Algorithm 1's recursion gives one level per distinct point."""

    levels: tuple[Level, ...]

    @property
    def cost(self) -> int:
        return sum(level.cost for level in self.levels)


@dataclass(frozen=True)
class ServingPlan:
    """Stages and the route (stage indices, in order) every input fragment's requests take.

    The form the simulator (and, later, the runtime) consumes; baselines produce it too.
    """

    model: str
    gpu: str
    stages: tuple[StageConfig, ...]
    routes: dict[str, tuple[int, ...]]  # device id -> stage indices

    @property
    def gpu_share(self) -> int:
        """Total GPU share in percent of one GPU (sum of share x instances)."""
        return sum(s.cost for s in self.stages)

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "gpu": self.gpu,
            "gpu_share": self.gpu_share,
            "stages": [
                {
                    "blocks": [s.start, s.end],
                    "batch": s.batch,
                    "share": s.share,
                    "instances": s.instances,
                    "latency_ms": round(s.latency_ms, 3),
                    "rate_rps": s.rate_rps,
                }
                for s in self.stages
            ],
            "routes": {device: list(route) for device, route in self.routes.items()},
        }


@dataclass(frozen=True)
class GraftPlan:
    """Graft's execution plan for one model: merged fragments, groups, and each group's levels."""

    model: str
    gpu: str
    groups: tuple[GroupPlan, ...]

    @property
    def gpu_share(self) -> int:
        return sum(g.cost for g in self.groups)

    def serving(self) -> ServingPlan:
        stages: list[StageConfig] = []
        routes: dict[str, tuple[int, ...]] = {}
        for group in self.groups:
            for level in group.levels:
                shared_index = None
                if level.shared is not None:
                    stages.append(level.shared)
                    shared_index = len(stages) - 1
                for fragment, private in zip(level.fragments, level.private):
                    route: list[int] = []
                    if private is not None:
                        stages.append(private)
                        route.append(len(stages) - 1)
                    if shared_index is not None:
                        route.append(shared_index)
                    routes.update({member: tuple(route) for member in fragment.members})
        return ServingPlan(self.model, self.gpu, tuple(stages), routes)


# -- step 1: merging ---------------------------------------------------------------------------
def merge(
    costs: StageCosts,
    fragments: Sequence[Fragment],
    *,
    threshold: float = DEFAULT_MERGE_THRESHOLD,
    budget_quantum_ms: float = DEFAULT_BUDGET_QUANTUM_MS,
) -> list[Fragment]:
    """Merge uniform fragments (same start block, same budget rounded down to ``budget_quantum_ms``)
    one at a time until the merged fragment's resource margin drops to ``threshold``.

    A merged fragment carries the summed rate and the smallest member budget. Lower thresholds
    merge more (threshold <= -1 never closes a merged fragment: merge all uniform ones, GSLICE+).
    """
    if budget_quantum_ms <= 0:
        raise ValueError(f"budget_quantum_ms must be positive, got {budget_quantum_ms}")

    def uniform_key(f: Fragment) -> tuple[int, float]:
        return f.start_block, math.floor(f.budget_ms / budget_quantum_ms)

    merged: list[Fragment] = []
    for _, uniform in groupby(sorted(fragments, key=lambda f: (*uniform_key(f), f.rate_rps)), key=uniform_key):
        current: Fragment | None = None
        for fragment in uniform:
            current = (
                fragment
                if current is None
                else Fragment(
                    fragment.model,
                    fragment.start_block,
                    min(current.budget_ms, fragment.budget_ms),
                    current.rate_rps + fragment.rate_rps,
                    current.members + fragment.members,
                )
            )
            config = serve_alone(costs, current)
            if config.margin <= threshold:
                merged.append(current)
                current = None
        if current is not None:
            merged.append(current)
    return merged


def serve_alone(costs: StageCosts, fragment: Fragment) -> StageConfig:
    """The fragment served by itself on ``t / 2`` (Graft's worst-case queueing rule)."""
    config = costs.min_resource(fragment.start_block, costs.num_blocks, fragment.rate_rps, fragment.budget_ms / 2)
    if config is None:
        raise PlanningError(
            f"fragment {fragment.members} of {fragment.model!r} (blocks {fragment.start_block}..{costs.num_blocks}, "
            f"{fragment.rate_rps:g} req/s) cannot run within half its {fragment.budget_ms:.1f} ms budget on any "
            f"share of a {costs.gpu}; raise the SLO or move the split later"
        )
    return config


# -- step 2: grouping --------------------------------------------------------------------------
def similarity_matrix(fragments: Sequence[Fragment], weights: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> np.ndarray:
    """Edge weights ``1 / (1 + d)``, ``d`` the weighted Euclidean distance of min-max normalised
    ``<start block, budget, rate>`` (a constant feature contributes nothing)."""
    features = np.array([[f.start_block, f.budget_ms, f.rate_rps] for f in fragments], dtype=float)
    spread = features.max(axis=0) - features.min(axis=0)
    normalised = (features - features.min(axis=0)) / np.where(spread > 0, spread, 1.0)
    diff = normalised[:, None, :] - normalised[None, :, :]
    distance = np.sqrt((np.asarray(weights, dtype=float) * diff**2).sum(axis=2))
    return 1.0 / (1.0 + distance)


def _internal_variance(similarity: np.ndarray, members: list[int]) -> float:
    if len(members) < 3:
        return 0.0  # fewer than two edges: no spread
    inner = similarity[np.ix_(members, members)][np.triu_indices(len(members), k=1)]
    return float(inner.var())


def group(
    fragments: Sequence[Fragment],
    *,
    size: int = DEFAULT_GROUP_SIZE,
    count: int | None = None,
    weights: tuple[float, float, float] = (1.0, 1.0, 1.0),
    rng: np.random.Generator,
) -> list[list[Fragment]]:
    """Greedy balanced partition into ``count`` (default ``ceil(n / size)``) groups of at most
    ``size`` fragments (Graft §4.2).

    Random seeds start the groups; every other fragment, in input order, joins the open group
    whose Eq. 1 cost rises least: the change in that group's internal similarity variance minus
    twice its *mean* similarity to the group's members. Eq. 1 counts the sum (the edges that stop
    crossing groups), which grows with the group and so drew every fragment into the first group
    to fill up; the mean keeps the intent, joining the most similar group, without that pull.
    """
    if size < 1:
        raise ValueError(f"group size must be >= 1, got {size}")
    if not fragments:
        return []
    similarity = similarity_matrix(fragments, weights)
    count = math.ceil(len(fragments) / size) if count is None else count
    if not math.ceil(len(fragments) / size) <= count <= len(fragments):
        raise ValueError(
            f"{len(fragments)} fragments in groups of at most {size} need {math.ceil(len(fragments) / size)}.."
            f"{len(fragments)} groups, got {count}"
        )
    seeds = [int(i) for i in rng.choice(len(fragments), size=count, replace=False)]
    members = [[s] for s in seeds]
    for i in (i for i in range(len(fragments)) if i not in seeds):

        def rise(k: int) -> float:
            variance_change = _internal_variance(similarity, members[k] + [i]) - _internal_variance(similarity, members[k])
            return variance_change - 2.0 * float(similarity[i, members[k]].mean())

        open_groups = [k for k in range(count) if len(members[k]) < size]
        members[min(open_groups, key=rise)].append(i)
    return [[fragments[i] for i in sorted(m)] for m in members]


# -- step 3: re-partitioning (Algorithm 1, cleaned) ---------------------------------------------
def realign(costs: StageCosts, fragments: Sequence[Fragment]) -> GroupPlan:
    """The cheapest re-alignment of one group: Algorithm 1 with the fixes in the module docstring.

    For each point ``p`` from the smallest start block to ``N``: fragments starting at or before
    ``p`` (``F_A``) share ``[p, N)``, the rest (``F_B``) are re-aligned recursively (memoised;
    ``F_B`` is always a suffix of the fragments sorted by start block).
    """
    ordered = tuple(sorted(fragments, key=lambda f: (f.start_block, f.budget_ms, f.members)))
    for fragment in ordered:
        serve_alone(costs, fragment)  # raises, naming the fragment, if even serving it alone cannot work
    memo: dict[int, tuple[Level, ...] | None] = {}

    def best_from(first: int) -> tuple[Level, ...] | None:
        if first == len(ordered):
            return ()
        if first not in memo:
            candidates = []
            for point in range(ordered[first].start_block, costs.num_blocks + 1):
                split = first
                while split < len(ordered) and ordered[split].start_block <= point:
                    split += 1
                level = _level(costs, ordered[first:split], point)
                rest = best_from(split)
                if level is not None and rest is not None:
                    candidates.append((level,) + rest)
            memo[first] = min(candidates, key=lambda levels: sum(lv.cost for lv in levels), default=None)
        return memo[first]

    levels = best_from(0)
    assert levels is not None  # p = N serves every remaining fragment alone, which was checked feasible
    return GroupPlan(levels)


def _level(costs: StageCosts, fragments: Sequence[Fragment], point: int) -> Level | None:
    """The cheapest way to serve ``fragments`` re-aligned at ``point``, or None if none fits."""
    if point == costs.num_blocks:  # no sharing: each fragment alone on its own t / 2
        alone = [costs.min_resource(f.start_block, point, f.rate_rps, f.budget_ms / 2) for f in fragments]
        return None if any(a is None for a in alone) else Level(point, tuple(fragments), tuple(alone), None)
    execution_budget = min(f.budget_ms for f in fragments) / 2
    total_rate = sum(f.rate_rps for f in fragments)
    best: Level | None = None
    for shared in costs.pareto_configs(point, costs.num_blocks, total_rate, execution_budget):
        left = execution_budget - shared.latency_ms
        private = [None if f.start_block == point else costs.min_resource(f.start_block, point, f.rate_rps, left) for f in fragments]
        if any(p is None and f.start_block != point for p, f in zip(private, fragments)):
            break  # later shared configs are slower: the alignment stages only get less time
        level = Level(point, tuple(fragments), tuple(private), shared)
        if best is None or level.cost < best.cost:
            best = level
    return best


# -- the scheduler -----------------------------------------------------------------------------
def plan_graft(
    costs: StageCosts,
    fragments: Sequence[Fragment],
    *,
    threshold: float = DEFAULT_MERGE_THRESHOLD,
    group_size: int = DEFAULT_GROUP_SIZE,
    weights: tuple[float, float, float] = (1.0, 1.0, 1.0),
    budget_quantum_ms: float = DEFAULT_BUDGET_QUANTUM_MS,
    restarts: int = DEFAULT_RESTARTS,
    extra_groups: int = DEFAULT_EXTRA_GROUPS,
    seed: int = 0,
) -> GraftPlan:
    """Graft's plan for the fragments of one model: merge, group, re-align each group.

    The grouping greedy depends on its random seeds, and Algorithm 1 cannot split fragments with
    the same start block but far-apart budgets inside one group. So grouping is run ``restarts``
    times for each group count from ``ceil(n / group_size)`` to ``extra_groups`` more, and the
    grouping whose re-aligned plan is cheapest wins (``restarts=1, extra_groups=0`` is the paper's
    single greedy pass). Re-alignments are memoised per group.
    """
    check_fragments(costs, fragments)
    if restarts < 1 or extra_groups < 0:
        raise ValueError(f"need restarts >= 1 and extra_groups >= 0, got {restarts} and {extra_groups}")
    merged = merge(costs, fragments, threshold=threshold, budget_quantum_ms=budget_quantum_ms)
    rng = np.random.default_rng(seed)
    realigned: dict[frozenset[tuple[str, ...]], GroupPlan] = {}
    best: tuple[GroupPlan, ...] = ()
    fewest = math.ceil(len(merged) / group_size)
    for count in range(fewest, min(len(merged), fewest + extra_groups) + 1):
        for _ in range(restarts):
            plans = []
            for members in group(merged, size=group_size, count=count, weights=weights, rng=rng):
                key = frozenset(f.members for f in members)
                if key not in realigned:
                    realigned[key] = realign(costs, members)
                plans.append(realigned[key])
            if not best or sum(p.cost for p in plans) < sum(p.cost for p in best):
                best = tuple(plans)
    return GraftPlan(costs.profile.model, costs.gpu, best)


def check_fragments(costs: StageCosts, fragments: Sequence[Fragment]) -> None:
    for f in fragments:
        if f.model != costs.profile.model:
            raise PlanningError(f"fragment {f.members} is of model {f.model!r}; this planner serves {costs.profile.model!r}")
        if f.start_block >= costs.num_blocks:
            raise PlanningError(f"fragment {f.members} starts at block {f.start_block}; {f.model!r} has {costs.num_blocks} blocks")
