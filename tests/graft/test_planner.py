from __future__ import annotations

import numpy as np
import pytest

from daskpipe.graft import (
    Fragment,
    PlanningError,
    StageCosts,
    group,
    merge,
    optimum,
    per_fragment,
    plan_graft,
    realign,
)
from daskpipe.graft.planner import Level

from .helpers import instances_needed


def frag(start: int, budget: float, rate: float = 30.0, name: str = "") -> Fragment:
    return Fragment("toy", start, budget, rate, (name or f"d{start}-{budget}-{rate}",))


def test_merging_stops_at_the_threshold(costs: StageCosts) -> None:
    uniform = [frag(1, 60.0, 30.0, f"u{i}") for i in range(6)]
    other = frag(2, 60.0, 30.0, "other")
    everything = merge(costs, uniform + [other], threshold=-1.0)
    assert sorted(len(f.members) for f in everything) == [1, 6]
    partial = merge(costs, uniform + [other], threshold=0.2)
    assert sum(len(f.members) for f in partial) == 7
    assert all(f.members == ("other",) or f.start_block == 1 for f in partial)
    for merged in partial:
        assert merged.rate_rps == pytest.approx(30.0 * len(merged.members))


def test_grouping_keeps_similar_fragments_together() -> None:
    early = [frag(0, 20.0 + i, name=f"e{i}") for i in range(3)]
    late = [frag(3, 80.0 + i, name=f"l{i}") for i in range(3)]
    mixed = [early[0], late[0], early[1], late[1], early[2], late[2]]
    split_seeds = 0
    for seed in range(8):
        groups = group(mixed, size=3, rng=np.random.default_rng(seed))
        assert sorted(len(g) for g in groups) == [3, 3]
        seeds = np.random.default_rng(seed).choice(6, size=2, replace=False)  # the group seeds group() draws
        if len({mixed[i].members[0][0] for i in seeds}) == 2:  # one seed per cluster: the greedy must keep them apart
            split_seeds += 1
            assert {frozenset(f.members[0][0] for f in g) for g in groups} == {frozenset("e"), frozenset("l")}
    assert split_seeds > 0


def brute_force_level(costs: StageCosts, fragments: list[Fragment], point: int) -> float:
    """Every shared-stage configuration (no pruning), each alignment stage at its cheapest."""
    if point == costs.num_blocks:
        return sum(costs.min_resource(f.start_block, point, f.rate_rps, f.budget_ms / 2).cost for f in fragments)
    budget = min(f.budget_ms for f in fragments) / 2
    rate = sum(f.rate_rps for f in fragments)
    best = np.inf
    for batch in range(1, costs.max_batch + 1):
        for share in range(1, 101):
            latency = costs.latency_ms(point, costs.num_blocks, batch, share)
            if latency > budget:
                continue
            shared = share * instances_needed(costs, rate, latency, batch)
            private = [
                None if f.start_block == point else costs.min_resource(f.start_block, point, f.rate_rps, budget - latency)
                for f in fragments
            ]
            if all(p is not None or f.start_block == point for p, f in zip(private, fragments)):
                best = min(best, shared + sum(p.cost for p in private if p is not None))
    return best


def test_realign_matches_brute_force(costs: StageCosts) -> None:
    fragments = [frag(0, 70.0, name="a"), frag(1, 90.0, name="b"), frag(2, 60.0, name="c")]
    # all three share from each point, or none do: the recursion's other branches cost more or the same
    brute = min(brute_force_level(costs, fragments, p) for p in range(2, costs.num_blocks + 1))
    plan = realign(costs, fragments)
    assert plan.cost <= brute
    members = sorted(m for level in plan.levels for f in level.fragments for m in f.members)
    assert members == ["a", "b", "c"]


def test_no_sharing_is_kept_so_graft_never_loses(costs: StageCosts) -> None:
    rng = np.random.default_rng(3)
    fragments = [frag(int(rng.integers(0, 4)), float(rng.uniform(25, 120)), name=f"x{i}") for i in range(7)]
    graft = plan_graft(costs, fragments, threshold=10.0)  # no merging: compare like with like
    assert graft.gpu_share <= per_fragment(costs, fragments).gpu_share
    best = optimum(costs, fragments, threshold=10.0)
    assert best.gpu_share <= graft.gpu_share
    served = graft.serving()
    assert set(served.routes) == {f"x{i}" for i in range(7)}
    assert served.gpu_share == graft.gpu_share


def test_shared_stage_has_the_summed_rate(costs: StageCosts) -> None:
    fragments = [frag(0, 60.0, name="a"), frag(1, 60.0, name="b")]
    plan = realign(costs, fragments)
    shared_levels = [lv for lv in plan.levels if lv.shared is not None]
    for level in shared_levels:
        assert level.shared.rate_rps == pytest.approx(sum(f.rate_rps for f in level.fragments))
        execution = max((p.latency_ms if p else 0.0) for p in level.private) + level.shared.latency_ms
        assert execution <= min(f.budget_ms for f in level.fragments) / 2 + 1e-9
    assert isinstance(plan.levels[0], Level)


def test_clear_errors(costs: StageCosts) -> None:
    with pytest.raises(PlanningError, match="cannot run within half"):
        plan_graft(costs, [frag(0, 0.5, name="tight")])
    with pytest.raises(PlanningError, match="model 'other'"):
        plan_graft(costs, [Fragment("other", 0, 50.0, 30.0, ("o",))])
    with pytest.raises(PlanningError, match="starts at block 4"):
        plan_graft(costs, [frag(4, 50.0)])


def test_merged_devices_share_a_route_and_settings_are_checked(costs: StageCosts) -> None:
    uniform = [frag(1, 60.0, 30.0, f"u{i}") for i in range(4)]
    plan = plan_graft(costs, uniform, threshold=-1.0).serving()
    assert len({plan.routes[f"u{i}"] for i in range(4)}) == 1
    with pytest.raises(ValueError, match="restarts"):
        plan_graft(costs, uniform, restarts=0)
    with pytest.raises(ValueError, match="groups"):
        group(uniform, size=2, count=1, rng=np.random.default_rng(0))
