from __future__ import annotations

import numpy as np
import pytest

from daskpipe.colocation.defaults import inss_testbed
from daskpipe.colocation.fit import emulate_profiling, fit_line, fit_model, fit_running, model_info
from daskpipe.colocation.latency import ColocationError


def test_fit_running_recovers_known_coefficients():
    truth = (0.05, 30.0, 12.0, 1.5, 0.7)
    b, s = np.meshgrid([1, 2, 4, 8, 16], [4.0, 8.0, 14.0, 20.0, 34.0])
    b, s = b.ravel(), s.ravel()
    y = (truth[0] * b * b + truth[1] * b + truth[2]) / (s + truth[3]) + truth[4]
    assert fit_running(b, s, y) == pytest.approx(truth, rel=1e-4)


def test_fit_running_allows_concave_batch_curves_but_stays_increasing():
    b, s = np.meshgrid([1, 4, 8, 16], [10.0, 20.0, 34.0])
    y = (-0.2 * b.ravel() ** 2 + 12 * b.ravel() + 5) / s.ravel() + 0.5
    k1, k2, *_ = fit_running(b.ravel(), s.ravel(), y)
    assert k1 < 0 and 2 * k1 * 32 + k2 >= -1e-9


def test_fit_line_and_errors():
    assert fit_line([0, 1, 2], [1, 3, 5]) == pytest.approx((2.0, 1.0))
    assert fit_line([1, 2], [2, 4], through_origin=True) == pytest.approx((2.0, 0.0))
    with pytest.raises(ColocationError):
        fit_line([1], [1])
    with pytest.raises(ColocationError, match="distinct SM counts"):
        fit_running([1, 2, 3, 4, 5], [10] * 5, [1, 2, 3, 4, 5])


def test_fit_model_recovers_every_parameter_from_noiseless_profiling():
    truth = inss_testbed()
    solo, co = emulate_profiling(truth, "RTX2060S", truth.models, noise=0.0, seed=3)
    fitted, report = fit_model(solo, co, truth.gpus.values(), model_info(truth))
    assert report.max_error_pct < 1e-6
    gpu, fit_gpu = truth.gpu("RTX2060S"), fitted.gpu("RTX2060S")
    assert (fit_gpu.sched_alpha_us, fit_gpu.sched_beta_us) == pytest.approx((gpu.sched_alpha_us, gpu.sched_beta_us), abs=1e-6)
    for name in truth.models:
        want, got = truth.coeff(name, "RTX2060S"), fitted.coeff(name, "RTX2060S")
        assert got.running == pytest.approx(want.running, rel=1e-3, abs=1e-3)
        assert (got.l2_alpha, got.l2_beta, got.cache_sensitivity) == pytest.approx(
            (want.l2_alpha, want.l2_beta, want.cache_sensitivity), abs=1e-6
        )
        assert (got.mem_base_mb, got.mem_per_sample_mb, got.sched_us_per_kernel) == pytest.approx(
            (want.mem_base_mb, want.mem_per_sample_mb, want.sched_us_per_kernel)
        )


def test_fit_error_with_measurement_noise_is_reported():
    truth = inss_testbed()
    solo, co = emulate_profiling(truth, "RTX2060", truth.models, noise=0.01, seed=0)
    _, report = fit_model(solo, co, truth.gpus.values(), model_info(truth))
    figures = report.to_dict()
    assert figures["samples"] == len(solo) + len(co)
    assert 0 < figures["mean_error_pct"] < 3.9


def test_fit_model_names_missing_inputs():
    truth = inss_testbed()
    solo, co = emulate_profiling(truth, "RTX2060", ["alexnet"], noise=0.0)
    with pytest.raises(ColocationError, match="ModelInfo"):
        fit_model(solo, co, truth.gpus.values(), {})
    with pytest.raises(ColocationError, match="not among the given GPU specs"):
        fit_model(solo, co, [truth.gpu("RTX2060S")], model_info(truth))
