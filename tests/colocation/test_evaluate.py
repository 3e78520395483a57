from __future__ import annotations

import pytest

from daskpipe.colocation.defaults import inss_testbed
from daskpipe.colocation.evaluate import evaluate, load_sweep, sustainable
from daskpipe.colocation.latency import ColocationError
from daskpipe.colocation.policy import Gpu, PlacementPlan, Replica, Workload, make_policy


@pytest.fixture(scope="module")
def model():
    return inss_testbed()


GPU = [Gpu("g0", "RTX2060S")]


def test_underloaded_replica_meets_its_slo(model):
    plan = PlacementPlan("manual", (Replica("resnet50", "g0", 1.0, 4),))
    result = evaluate(plan, [Workload("resnet50", 50, 80)], GPU, model, duration_s=5, noise=0.0)
    stats = result.per_model["resnet50"]
    assert stats.arrived > 150 and stats.dropped == stats.late == 0
    assert result.goodput == pytest.approx(stats.arrived / 5)


def test_overload_and_missing_models_count_as_violations(model):
    plan = PlacementPlan("manual", (Replica("resnet50", "g0", 0.1, 1),))
    result = evaluate(plan, [Workload("resnet50", 500, 80), Workload("vgg16", 10, 150)], GPU, model, duration_s=3)
    assert result.per_model["vgg16"].dropped == result.per_model["vgg16"].arrived
    assert result.per_model["resnet50"].violations > 0.5 * result.per_model["resnet50"].arrived
    assert result.slo_violation_rate > 0.5


def test_colocation_slows_a_replica_down(model):
    alone = PlacementPlan("a", (Replica("vgg16", "g0", 0.5, 1),))
    shared = PlacementPlan("b", (Replica("vgg16", "g0", 0.5, 1), Replica("vgg19", "g0", 0.5, 1)))
    load = [Workload("vgg16", 5, 150)]
    mean = []
    for plan in (alone, shared):
        latencies = evaluate(plan, load, GPU, model, duration_s=5, noise=0.0).per_model["vgg16"].latencies_ms
        mean.append(sum(latencies) / len(latencies))
    assert mean[1] > mean[0]


def test_evaluate_rejects_unknown_gpus(model):
    plan = PlacementPlan("x", (Replica("resnet50", "nowhere", 1.0, 1),))
    with pytest.raises(ColocationError, match="unknown GPU"):
        evaluate(plan, [Workload("resnet50", 10, 80)], GPU, model)


def test_sweep_and_sustainable_point(model):
    points = load_sweep(make_policy("gpulet", model), [Workload("alexnet", 100, 25)], GPU, model, [0.5, 1.0], duration_s=2)
    assert [p.scale for p in points] == [0.5, 1.0]
    best = sustainable(points, 1.0)
    assert best.result.goodput == max(p.result.goodput for p in points)
