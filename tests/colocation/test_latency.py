from __future__ import annotations

import pytest

from daskpipe.colocation.defaults import ANCHOR_GPU, ANCHORS, inss_testbed
from daskpipe.colocation.latency import Colocated, ColocationError, GpuSpec, InterferenceModel, ModelCoefficients, worst_task_latency_ms


def coefficients(model: str = "m", **changes) -> ModelCoefficients:
    values = dict(
        model=model,
        gpu="g",
        kernels=100,
        sched_us_per_kernel=5.0,
        running=(0.0, 10.0, 5.0, 0.0, 1.0),
        l2_alpha=0.5,
        l2_beta=0.1,
        cache_sensitivity=0.2,
        input_bytes=1e6,
        output_bytes=1e3,
        mem_base_mb=500,
        mem_per_sample_mb=10,
    )
    values.update(changes)
    return ModelCoefficients(**values)


@pytest.fixture
def two_models() -> InterferenceModel:
    gpu = GpuSpec("g", sm_count=40, memory_mb=8000, pcie_gb_per_s=10.0, sched_alpha_us=2.0, sched_beta_us=-1.0)
    return InterferenceModel(gpus={"g": gpu}, coefficients={("a", "g"): coefficients("a"), ("b", "g"): coefficients("b")})


def test_solo_breakdown_matches_the_formulas(two_models):
    parts = two_models.breakdown("g", Colocated("a", 0.5, 4))
    assert parts.upload_ms == pytest.approx(4 * 1e6 / 1e7)
    assert parts.download_ms == pytest.approx(4 * 1e3 / 1e7)
    assert parts.sched_ms == pytest.approx(100 * 5.0 / 1000)
    assert parts.running_ms == pytest.approx((10 * 4 + 5) / 20 + 1)


def test_corunners_add_scheduling_delay_and_l2_inflation(two_models):
    me, other = Colocated("a", 0.5, 4), Colocated("b", 0.4, 4)
    solo = two_models.breakdown("g", me)
    shared = two_models.breakdown("g", me, [other])
    assert shared.sched_ms == pytest.approx(100 * (5.0 + 2.0 * 2 - 1.0) / 1000)
    assert shared.running_ms == pytest.approx(solo.running_ms * (1 + 0.2 * (0.5 * 0.4 + 0.1)))
    assert two_models.exec_ms("g", me, [other], interference=False) == pytest.approx(solo.total_ms)


def test_oversubscribed_shares_are_scaled_down(two_models):
    alone = two_models.breakdown("g", Colocated("a", 0.8, 1), interference=False).running_ms
    crowded = two_models.breakdown("g", Colocated("a", 0.8, 1), [Colocated("b", 0.8, 1)], interference=False).running_ms
    assert crowded > alone


def test_task_latency_waits_for_the_batch_to_fill():
    # batch 4 at 100 req/s: the first task waits for three more (30 ms), then 5 ms of execution
    assert worst_task_latency_ms(5.0, 4, 100.0) == pytest.approx(35.0)
    # a backlog of four batches that each take 20 ms pushes the worst task later
    assert worst_task_latency_ms(20.0, 4, 100.0, queued=16) > worst_task_latency_ms(20.0, 4, 100.0) == pytest.approx(50.0)
    # too slow for the rate: the queue grows and the latency with it
    assert worst_task_latency_ms(50.0, 4, 100.0, queued=8) > 100.0


def test_bad_inputs_are_named():
    with pytest.raises(ColocationError, match="share"):
        Colocated("a", 1.5)
    with pytest.raises(ColocationError, match="kernels"):
        coefficients(kernels=0)
    model = inss_testbed()
    with pytest.raises(ColocationError, match="no interference coefficients"):
        model.coeff("bert", "RTX2060")
    with pytest.raises(ColocationError, match="unknown GPU type"):
        model.gpu("TPU")


def test_testbed_reproduces_the_paper_measurements_roughly():
    model = inss_testbed()
    errors = [
        abs(model.exec_ms(ANCHOR_GPU.name, Colocated(name, a.share, a.batch), a.others) - a.total_ms) / a.total_ms
        for name, anchors in ANCHORS.items()
        for a in anchors
    ]
    assert sum(errors) / len(errors) < 0.10
    for name in model.models:  # latency grows with batch and falls with share over BDA's range
        c = model.coeff(name, "RTX2060")
        by_batch = [model.exec_ms("RTX2060", Colocated(name, 0.5, b)) for b in range(1, 33)]
        assert by_batch == sorted(by_batch)
        assert model.exec_ms("RTX2060", Colocated(name, 0.3, 4)) > model.exec_ms("RTX2060", Colocated(name, 0.9, 4))
        assert c.memory_mb(8) > c.memory_mb(1)
