from __future__ import annotations

import pytest

from daskpipe.graft import Fragment, GraftPlan, GroupPlan, Level, StageCosts, per_fragment
from daskpipe.graft.simulate import simulate


def test_shared_stage_batches_requests_of_different_devices(costs: StageCosts) -> None:
    fragments = [Fragment("toy", start, 60.0, 40.0, (f"dev{start}",)) for start in (0, 1)]
    level = Level(1, tuple(fragments), (costs.min_resource(0, 1, 40.0, 10.0), None), costs.min_resource(1, 4, 80.0, 20.0))
    plan = GraftPlan("toy", "V100", (GroupPlan((level,)),)).serving()
    assert plan.routes == {"dev0": (1, 0), "dev1": (0,)}
    result = simulate(plan, costs, fragments, duration_s=5.0, seed=1)
    assert result.arrivals > 300
    assert result.mixed_batches > 0
    assert result.slo_attainment >= 0.99
    assert result.p99_ms <= 60.0


def test_per_fragment_plan_simulates_without_mixing(costs: StageCosts) -> None:
    fragments = [Fragment("toy", start, 80.0, 30.0, (f"dev{start}",)) for start in (0, 2)]
    result = simulate(per_fragment(costs, fragments).serving(), costs, fragments, duration_s=3.0)
    assert result.mixed_batches == 0 and result.slo_attainment >= 0.99


def test_simulate_rejects_unplanned_devices(costs: StageCosts) -> None:
    planned = [Fragment("toy", 0, 80.0, 30.0, ("a",))]
    plan = per_fragment(costs, planned).serving()
    with pytest.raises(ValueError, match="no route for device"):
        simulate(plan, costs, planned + [Fragment("toy", 1, 80.0, 30.0, ("b",))])
    with pytest.raises(ValueError, match="duration_s"):
        simulate(plan, costs, planned, duration_s=0)


def test_simulate_checks_each_device_enters_where_its_route_starts(costs: StageCosts) -> None:
    plan = per_fragment(costs, [Fragment("toy", 0, 80.0, 30.0, ("a",))]).serving()
    with pytest.raises(ValueError, match="device 'a' enters at block 1 but its route starts at block 0"):
        simulate(plan, costs, [Fragment("toy", 1, 80.0, 30.0, ("a",))], duration_s=1.0)
