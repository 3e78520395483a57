"""The planner's co-location strategies: plans that share GPUs between models, executable by the simulator."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from daskpipe.cli import main
from daskpipe.colocation.execute import colocated_stages
from daskpipe.colocation.policy import Strategy
from daskpipe.plan.milp import make_plan
from daskpipe.plan.options import COLOCATION_STRATEGIES, PlannerOptions
from daskpipe.plan.schema import Plan, PlanError
from daskpipe.sim.config import SimulationConfig
from daskpipe.sim.simulate import simulate
from tests.colocation.helpers import sliced_profile


@pytest.fixture
def three_models():
    """Three light models: with one GPU each, whole GPUs sit mostly idle at their SLOs."""
    return {name: sliced_profile(name, ms, slo_ms=slo) for name, ms, slo in (("a", 3.0, 60.0), ("b", 5.0, 80.0), ("c", 2.0, 50.0))}


def test_every_policy_is_a_planner_strategy():
    assert set(COLOCATION_STRATEGIES) == {s.value for s in Strategy}


@pytest.mark.parametrize("strategy", COLOCATION_STRATEGIES)
def test_colocation_strategy_plans_a_simulatable_shared_gpu_plan(strategy, three_models):
    weights = {"a": 1.0, "b": 2.0, "c": 1.0}
    plan = make_plan(three_models, {"L4": 2, "T4": 1}, weights=weights, options=PlannerOptions(strategy=strategy, time_limit=10))
    assert plan.strategy == strategy and plan.solver["status"] == "feasible"
    again = Plan.from_dict(plan.to_dict())
    parts = [part for m in again.models for p in m.pipelines for part in p.partitions]
    assert parts and all(part.device in {"L4-0", "L4-1", "T4-0"} and 0 < part.share <= 1 and part.blocks == (0, 2) for part in parts)
    assert all(m.throughput > 0 for m in again.models)
    assert again.objective == pytest.approx(min(m.throughput / weights[m.name] for m in again.models))
    colocated_stages(again)  # one GPU type per device, shares within the GPU
    result = simulate(again, three_models, SimulationConfig(duration=4.0, seed=2), load_factor=0.5)
    for name, r in result.models.items():
        assert r.submitted > 0 and r.on_time + r.late + r.dropped_total == r.submitted
        assert r.attainment >= 0.9, (name, r)


def test_colocation_serves_more_models_than_gpus(three_models):
    shared = make_plan(three_models, {"L4": 2}, options=PlannerOptions(strategy="inss"))
    alone = make_plan(three_models, {"L4": 2}, options=PlannerOptions(strategy="np"))
    assert min(m.throughput for m in alone.models) == 0  # three models, two whole GPUs
    assert min(m.throughput for m in shared.models) > 0
    assert len({p.partitions[0].device for m in shared.models for p in m.pipelines}) <= 2


def test_gpus_profiled_at_one_slice_count_cannot_be_shared():
    single = {"a": sliced_profile("a", 3.0, slo_ms=60.0, slices=(1,))}
    with pytest.raises(PlanError, match=r"strategy 'gslice': no \(model, GPU\) pair has tables for >= 2 slice counts on a GPU of \['L4'\]"):
        make_plan(single, {"L4": 2}, options=PlannerOptions(strategy="gslice"))
    sliced_l4 = sliced_profile("a", 3.0, slo_ms=60.0, gpus=("L4",))
    whole_t4 = sliced_profile("a", 3.0, slo_ms=60.0, gpus=("T4",), slices=(1,))
    mixed = {"a": dataclasses.replace(sliced_l4, latency_us={**sliced_l4.latency_us, **whole_t4.latency_us})}
    plan = make_plan(mixed, {"L4": 1, "T4": 1}, options=PlannerOptions(strategy="gslice"))
    assert plan.settings["unused_gpus"] == ["T4"]
    assert {p.partitions[0].gpu for p in plan.model("a").pipelines} == {"L4"}


def test_an_slo_no_gpu_meets_is_a_clear_error(three_models):
    with pytest.raises(PlanError, match="strategy 'inss': no placement serves every model"):
        make_plan(three_models, {"T4": 1}, slo_us={"b": 1000.0}, options=PlannerOptions(strategy="inss"))


def test_plan_cli_writes_a_colocated_plan(three_models, tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir()
    for name, profile in three_models.items():
        profile.save(folder / f"{name}.json")
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        main, ["plan", "--profiles", str(folder), "--models", "a,b,c", "--gpus", "L4=2", "--strategy", "inss", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    assert plan.strategy == "inss" and plan.interference["name"] == "from-profiles"
    assert "L4-" in result.output and "share" in result.output
