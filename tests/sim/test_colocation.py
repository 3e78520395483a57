"""The simulator executes co-located plans with the interference model."""

from __future__ import annotations

import dataclasses

import pytest

from daskpipe.colocation.latency import Colocated
from daskpipe.sim.config import SimulationConfig
from daskpipe.sim.simulate import simulate
from tests.colocation.helpers import cache_model, shared_gpu_plan, sliced_profile
from tests.sim.helpers import toy_plan


def compute_ms(result, model: str) -> set[tuple[int, float]]:
    """(batch, duration ms) of every compute of ``model`` in its reported run."""
    _, trace = result.runs[model]
    return {(batch, round((end - start) * 1e3, 6)) for m, _, batch, _, start, end in trace.computes if m == model}


def test_a_stage_runs_as_long_as_the_model_says_next_to_its_corunners():
    model = cache_model()
    profiles = {name: sliced_profile(name, 4.0, slo_ms=200.0) for name in ("a", "b")}
    together = simulate(shared_gpu_plan(model, [("a", 0.5), ("b", 0.5)]), profiles, SimulationConfig(duration=3.0), load_factor=0.8)
    alone = simulate(shared_gpu_plan(model, [("a", 0.5)]), profiles, SimulationConfig(duration=3.0), load_factor=0.8)
    for result in (together, alone):
        r = result.models["a"]
        assert r.submitted > 50 and r.on_time + r.late + r.dropped_total == r.submitted
    shared_runs = compute_ms(together, "a")
    solo_runs = compute_ms(alone, "a")
    assert shared_runs and solo_runs
    for batch, ms in shared_runs:
        assert ms == pytest.approx(model.exec_ms("L4", Colocated("a", 0.5, batch), [Colocated("b", 0.5, 2)]), rel=1e-6)
    for batch, ms in solo_runs:
        assert ms == pytest.approx(model.exec_ms("L4", Colocated("a", 0.5, batch)), rel=1e-6)
    assert together.models["a"].p50_ms > alone.models["a"].p50_ms


def test_plans_mixing_pools_and_colocated_partitions_are_refused():
    plan = shared_gpu_plan(cache_model(), [("a", 0.5)])
    pooled = toy_plan().models[0]
    mixed = dataclasses.replace(plan, models=plan.models + (pooled,))
    profiles = {"a": sliced_profile("a", 4.0, slo_ms=200.0), pooled.name: sliced_profile(pooled.name, 4.0, slo_ms=200.0)}
    with pytest.raises(ValueError, match="the simulator executes plans that are one or the other"):
        simulate(mixed, profiles, SimulationConfig(duration=1.0))
