"""Baselines for Graft: per-fragment serving (GSLICE-like) and the exhaustive optimum.

* ``per_fragment``: every fragment gets its own instance set on ``t / 2`` (GSLICE: MPS shares and
  adaptive batch, no re-alignment). ``merge_uniform=True`` first merges all fragments with the same
  start block and budget (GSLICE+).
* ``optimum``: the same merged fragments as Graft, but every way of splitting them into groups
  of at most ``group_size`` is tried (Graft's "Optimal" enumerates groupings), each group
  re-aligned exactly. It bounds what a better grouping heuristic could save.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from daskpipe.graft.costs import StageCosts
from daskpipe.graft.fragments import Fragment
from daskpipe.graft.planner import (
    DEFAULT_BUDGET_QUANTUM_MS,
    DEFAULT_GROUP_SIZE,
    DEFAULT_MERGE_THRESHOLD,
    GraftPlan,
    GroupPlan,
    Level,
    check_fragments,
    merge,
    realign,
    serve_alone,
)

MAX_EXHAUSTIVE_FRAGMENTS = 12


def per_fragment(
    costs: StageCosts, fragments: Sequence[Fragment], *, merge_uniform: bool = False, budget_quantum_ms: float = DEFAULT_BUDGET_QUANTUM_MS
) -> GraftPlan:
    """Each fragment (or, with ``merge_uniform``, each class of uniform fragments) served alone."""
    check_fragments(costs, fragments)
    served = merge(costs, fragments, threshold=-1.0, budget_quantum_ms=budget_quantum_ms) if merge_uniform else list(fragments)
    groups = tuple(GroupPlan((Level(costs.num_blocks, (f,), (serve_alone(costs, f),), None),)) for f in served)
    return GraftPlan(costs.profile.model, costs.gpu, groups)


def optimum(
    costs: StageCosts,
    fragments: Sequence[Fragment],
    *,
    threshold: float = DEFAULT_MERGE_THRESHOLD,
    group_size: int = DEFAULT_GROUP_SIZE,
    budget_quantum_ms: float = DEFAULT_BUDGET_QUANTUM_MS,
) -> GraftPlan:
    """The cheapest grouping of Graft's merged fragments, by dynamic programming over subsets."""
    check_fragments(costs, fragments)
    merged = merge(costs, fragments, threshold=threshold, budget_quantum_ms=budget_quantum_ms)
    n = len(merged)
    if n > MAX_EXHAUSTIVE_FRAGMENTS:
        raise ValueError(f"exhaustive search is for small cases: {n} merged fragments > {MAX_EXHAUSTIVE_FRAGMENTS}")
    group_of: dict[int, GroupPlan] = {}
    for mask in range(1, 1 << n):
        if bin(mask).count("1") <= group_size:
            group_of[mask] = realign(costs, [merged[i] for i in range(n) if mask >> i & 1])
    no_groups: tuple[int, ...] = ()
    best = [(0.0, no_groups)] + [(np.inf, no_groups)] * ((1 << n) - 1)
    for mask in range(1, 1 << n):
        lowest = mask & -mask  # the group holding the lowest fragment left: enumerate each partition once
        rest = mask ^ lowest
        sub = rest
        while True:
            block = sub | lowest
            if block in group_of:
                cost = group_of[block].cost + best[mask ^ block][0]
                if cost < best[mask][0]:
                    best[mask] = (cost, best[mask ^ block][1] + (block,))
            if sub == 0:
                break
            sub = (sub - 1) & rest
    return GraftPlan(costs.profile.model, costs.gpu, tuple(group_of[b] for b in best[(1 << n) - 1][1]))
