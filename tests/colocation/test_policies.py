from __future__ import annotations

import pytest

from daskpipe.colocation.bda import decide_batch
from daskpipe.colocation.defaults import INSS_RATES, INSS_SLO_MS, inss_gpus, inss_testbed
from daskpipe.colocation.inss import InssPolicy
from daskpipe.colocation.latency import Colocated, ColocationError
from daskpipe.colocation.policy import Gpu, PlacementPlan, Strategy, Workload, make_policy, run_placement_policy
from daskpipe.colocation.usher import KernelLaunch, SmLimits, emulated_wsm, weighted_sm_utilisation


@pytest.fixture(scope="module")
def model():
    return inss_testbed()


@pytest.fixture(scope="module")
def gpus():
    return [Gpu(uid, kind) for uid, kind in inss_gpus()]


def workloads(scale: float = 1.0) -> list[Workload]:
    return [Workload(name, INSS_RATES[name] * scale, INSS_SLO_MS[name]) for name in INSS_SLO_MS]


def assert_valid(plan: PlacementPlan, gpus: list[Gpu], model) -> None:
    types = {g.uid: g.type for g in gpus}
    for uid in types:
        on_gpu = plan.on_gpu(uid)
        memory = sum(model.memory_mb(r.model, types[uid], r.batch) for r in on_gpu)
        assert memory <= model.gpu(types[uid]).memory_mb
    for r in plan.replicas:
        assert r.gpu in types and 0 < r.share <= 1 and 1 <= r.batch <= 32


@pytest.mark.parametrize("strategy", [s.value for s in Strategy])
def test_every_strategy_returns_a_valid_plan(strategy, model, gpus):
    plan = make_policy(strategy, model).place(workloads(), gpus)
    assert plan.policy == strategy
    assert plan.replicas
    assert_valid(plan, gpus, model)


def test_factory_rejects_unknown_strategy(model):
    with pytest.raises(ColocationError, match="Unknown co-location strategy 'fifo'"):
        make_policy("fifo", model)


def test_policies_reject_bad_inputs(model, gpus):
    policy = make_policy("gslice", model)
    with pytest.raises(ColocationError, match="at least one workload"):
        policy.place([], gpus)
    with pytest.raises(ColocationError, match="duplicate GPU uid"):
        policy.place(workloads(), gpus + gpus[:1])
    with pytest.raises(ColocationError, match="no interference coefficients"):
        policy.place([Workload("bert", 10, 100)], gpus)
    with pytest.raises(ColocationError, match="rate must be"):
        Workload("alexnet", -1, 25)
    with pytest.raises(ValueError, match="trainer"):
        InssPolicy(model, trainer="ppo")


def test_bda_picks_the_largest_batch_meeting_slo_and_rate(model):
    w = Workload("resnet50", 150, 80)
    decision = decide_batch(model, "RTX2060S", "resnet50", 0.6, [], w, memory_free_mb=8000, max_utilisation=0.85)
    assert decision.batch is not None and decision.violation == 0
    exec_ms = model.exec_ms("RTX2060S", Colocated("resnet50", 0.6, decision.batch))
    assert 1000 * decision.batch / exec_ms * 0.85 >= w.rate
    bigger = model.exec_ms("RTX2060S", Colocated("resnet50", 0.6, decision.batch + 1))
    from daskpipe.colocation.latency import worst_task_latency_ms

    assert worst_task_latency_ms(bigger, decision.batch + 1, w.rate) > w.slo_ms or decision.batch == 32
    starved = decide_batch(model, "RTX2060S", "resnet50", 0.06, [], Workload("resnet50", 2000, 80), 8000, 0.85)
    assert starved.batch is None and 0 < starved.violation <= 1


def test_inss_search_keeps_one_instance_per_model_and_fills_gpus(model, gpus):
    plan = make_policy("inss", model, search_budget=400).place(workloads(), gpus)
    assert sorted(r.model for r in plan.replicas) == sorted(INSS_SLO_MS)
    assert plan.info["bda_failed"] == []
    for g in gpus:
        assert sum(r.share for r in plan.on_gpu(g.uid)) <= 1.0 + 1e-9


def test_inss_sac_trains_and_returns_a_plan(model, gpus):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    small = [Workload("alexnet", 100, 25), Workload("resnet50", 60, 80)]
    plan = make_policy("inss", model, trainer="sac", sac_steps=120, sac_hidden=(32,)).place(small, gpus[:2])
    assert plan.info["trainer"] == "sac" and plan.info["sac_steps"] == 120
    assert sorted(r.model for r in plan.replicas) == ["alexnet", "resnet50"]
    assert_valid(plan, gpus, model)


def test_wsm_follows_the_thesis_formula():
    limits = SmLimits(sm_count=80)
    # 160 blocks of 1024 threads: 2 per SM -> 80 SMs (100%); 40 blocks of 256 threads -> 5 SMs
    kernels = [KernelLaunch(10.0, 160, 1024, 32, 0), KernelLaunch(30.0, 40, 256, 32, 0)]
    assert weighted_sm_utilisation(kernels, limits) == pytest.approx((10 * 100 + 30 * 100 * 5 / 80) / 40)


def test_emulated_wsm_grows_with_batch(model):
    assert emulated_wsm(model, "mnasnet", "RTX2060S", 1) <= emulated_wsm(model, "mnasnet", "RTX2060S", 16) <= 100


def test_run_placement_policy_uses_the_testbed_by_default(gpus):
    plan = run_placement_policy(workloads(0.5), gpus, "gpulet")
    assert plan.policy == "gpulet" and plan.info["rate_not_covered"] == []
