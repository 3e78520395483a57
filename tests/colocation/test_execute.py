"""Executing co-located plans: co-runners per GPU, the co-located latency, plan (de)serialisation."""

from __future__ import annotations

import dataclasses

import pytest

from daskpipe.colocation.execute import colocated_latency, colocated_placements, colocated_profile, colocated_stages, is_colocated
from daskpipe.colocation.latency import Colocated, ColocationError, InterferenceModel
from daskpipe.plan.schema import Plan, PlanError
from tests.colocation.helpers import cache_model, shared_gpu_plan, sliced_profile


def test_interference_model_round_trips_and_names_bad_fields():
    model = cache_model()
    again = InterferenceModel.from_dict(model.to_dict())
    me, other = Colocated("a", 0.5, 3), Colocated("b", 0.5, 2)
    assert again.exec_ms("L4", me, [other]) == model.exec_ms("L4", me, [other]) and again.max_batch == 4
    broken = model.to_dict()
    del broken["coefficients"][0]["running"]
    with pytest.raises(ColocationError, match=r"coefficients\[0\] lacks field\(s\) \['running'\]"):
        InterferenceModel.from_dict(broken)
    with pytest.raises(ColocationError, match="non-empty 'gpus'"):
        InterferenceModel.from_dict({"gpus": [], "coefficients": []})


def test_a_stage_is_slowed_by_its_corunners_as_the_model_says():
    model = cache_model()
    shared = shared_gpu_plan(model, [("a", 0.5), ("b", 0.5)])
    alone = shared_gpu_plan(model, [("a", 0.5)])
    stages = colocated_stages(shared)
    assert stages[("a", 0, 0)].corunners == (Colocated("b", 0.5, 2),)
    together = colocated_latency(shared, "a").latency_us(0, 0, 2)
    solo = colocated_latency(alone, "a").latency_us(0, 0, 2)
    assert together == pytest.approx(1000 * model.exec_ms("L4", Colocated("a", 0.5, 2), [Colocated("b", 0.5, 2)]))
    assert solo == pytest.approx(1000 * model.exec_ms("L4", Colocated("a", 0.5, 2)))
    assert together > 1.05 * solo
    assert colocated_latency(shared, "a", scale=3.0).latency_us(0, 0, 2) == pytest.approx(3 * together)
    assert colocated_latency(shared, "a").latency_us(0, 1, 2) is None  # no such co-located stage


def test_plans_without_colocation_are_untouched():
    from tests.sim.helpers import toy_plan, toy_profile

    plan, profile = toy_plan(), toy_profile()
    assert not is_colocated(plan) and colocated_latency(plan, plan.models[0].name) is None
    assert colocated_profile(profile, plan) is profile
    assert "device" not in plan.to_dict()["models"][0]["pipelines"][0]["partitions"][0] and "interference" not in plan.to_dict()


def test_colocated_plan_round_trips_through_json(tmp_path):
    plan = shared_gpu_plan(cache_model(), [("a", 0.25), ("b", 0.75)])
    plan.save(tmp_path / "plan.json")
    again = Plan.load(tmp_path / "plan.json")
    part = again.model("b").pipelines[0].partitions[0]
    assert (part.device, part.share, part.slices, part.num_gpus) == ("L4-0", 0.75, 1, 0.75)
    assert colocated_latency(again, "b").latency_us(0, 0, 1) == colocated_latency(plan, "b").latency_us(0, 0, 1)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"share": 0.0}, "needs 0 < share <= 1"),
        ({"share": 1.5}, "needs 0 < share <= 1"),
        ({"vgpus": 2}, "needs 0 < share <= 1 and vgpus 1"),
        ({"device": 7}, "device must be a GPU id string"),
    ],
)
def test_malformed_colocated_partitions_are_refused(change, match):
    data = shared_gpu_plan(cache_model(), [("a", 0.5)]).to_dict()
    data["models"][0]["pipelines"][0]["partitions"][0].update(change)
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(data)


def test_oversubscribed_devices_slow_down_and_impossible_ones_are_refused():
    model = cache_model()
    oversubscribed = shared_gpu_plan(model, [("a", 0.6), ("b", 0.6)])  # MPS allows it: the SMs are time-shared
    assert colocated_latency(oversubscribed, "a").latency_us(0, 0, 1) > colocated_latency(
        shared_gpu_plan(model, [("a", 0.6), ("b", 0.4)]), "a"
    ).latency_us(0, 0, 1)
    plan = shared_gpu_plan(model, [("a", 0.5), ("b", 0.5)])
    b = plan.model("b")
    mixed_part = dataclasses.replace(b.pipelines[0].partitions[0], gpu="T4")
    mixed = dataclasses.replace(
        plan, models=(plan.model("a"), dataclasses.replace(b, pipelines=(dataclasses.replace(b.pipelines[0], partitions=(mixed_part,)),)))
    )
    with pytest.raises(ColocationError, match=r"GPU types \['L4', 'T4'\]"):
        colocated_stages(mixed)
    with pytest.raises(ColocationError, match="carries no interference model"):
        colocated_latency(dataclasses.replace(plan, interference={}), "a")


def test_placements_and_the_dispatchers_profile_follow_the_shares():
    model = cache_model()
    plan = shared_gpu_plan(model, [("a", 0.3), ("b", 0.7)])
    placements = colocated_placements(plan)
    (slot,) = placements["a"].slots.values()
    assert (slot.gpu, slot.slices, slot.server) == ("L4", 3, "L4-0") and placements["a"].pools == {(0, 0): (slot.id,)}
    profile = colocated_profile(sliced_profile("a", 4.0, slo_ms=200.0), plan)
    latency = colocated_latency(plan, "a")
    assert profile.max_batch("L4", 3) == model.max_batch
    for batch in range(1, 5):
        assert profile.latency("L4", 3, batch) == pytest.approx(latency.latency_us(0, 0, batch))
    assert profile.latency("L4", 2, 1) == sliced_profile("a", 4.0, slo_ms=200.0).latency("L4", 2, 1)  # other tables kept
