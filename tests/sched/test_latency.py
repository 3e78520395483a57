"""MeasuredLatency: the profile stands until a stage's window shows otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from daskpipe.sched.latency import MeasuredLatency


def fed(ratios, quantile: float = 0.95, window: int = 100, min_samples: int = 20) -> MeasuredLatency:
    measured = MeasuredLatency(quantile, window, min_samples)
    for ratio in ratios:
        measured.add(float(ratio))
    return measured


def test_the_profile_stands_until_min_samples():
    measured = fed([2.0] * 19)
    assert (measured.typical, measured.high) == (1.0, 1.0)
    assert measured.add(2.0)  # the 20th sample moves both
    assert (measured.typical, measured.high) == (2.0, 2.0)


def test_execution_as_profiled_leaves_both_factors_at_exactly_one():
    measured = fed([1.0, 1.0 + 1e-12, 1.0 - 1e-12, 0.97] * 50)
    assert (measured.typical, measured.high) == (1.0, 1.0)


def test_unbiased_noise_widens_the_quantile_not_the_reservations():
    rng = np.random.default_rng(0)
    measured = fed(np.exp(rng.normal(-0.02, 0.2, 300)))  # mean-one log-normal, sigma 0.2
    assert measured.typical == 1.0
    assert measured.high == pytest.approx(np.exp(1.645 * 0.2 - 0.02), abs=0.08)


def test_a_slower_stage_lengthens_reservations_from_the_recent_window():
    rng = np.random.default_rng(1)
    measured = fed(1.14 * np.exp(rng.normal(0.0, 0.1, 100)))  # the runtime's case: 14% over the profile
    assert 1.08 <= measured.typical <= 1.14 < measured.high
    fed_back = fed(np.concatenate([np.full(100, 1.5), np.ones(100)]))  # the window forgets the slow spell
    assert (fed_back.typical, fed_back.high) == (1.0, 1.0)


def test_the_median_follows_the_stage_both_ways_once_min_samples_are_in():
    assert fed([0.6] * 19).median is None
    assert fed([0.6] * 20).median == pytest.approx(0.6)  # faster than profiled: typical stays 1, the median says so
    assert fed(np.concatenate([np.full(60, 1.6), np.full(40, 1.0)])).median == pytest.approx(1.6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="quantile"):
        MeasuredLatency(1.0, 100, 20)
    with pytest.raises(ValueError, match="min_samples"):
        MeasuredLatency(0.95, 10, 20)
