"""The rate a waiting batch can grow at: arrivals that find work outstanding, per second of it."""

from __future__ import annotations

import random

import pytest

from daskpipe.sched.arrivals import OutstandingArrivals

WORK_S = 0.010  # each request keeps the model busy this long once it arrives


def test_open_loop_arrivals_measure_the_arrival_rate():
    """Poisson arrivals come whatever the model does: those that find it busy, per busy second,
    are the arrival rate (about 5% of the time busy at 5 req/s of 10 ms each: a long window)."""
    rng = random.Random(1)
    meter = OutstandingArrivals(window_s=400.0, prior_s=0.1)
    t = 0.0
    for _ in range(2000):
        t += rng.expovariate(5.0)
        meter.arrive(t, queued=False)
        meter.outstanding_until(t + WORK_S)
    assert meter.rate == pytest.approx(5.0, rel=0.25)


def test_a_client_that_waits_for_each_answer_brings_nothing_to_join():
    """However often it sends, its next request comes once the last one's work has reported done."""
    meter = OutstandingArrivals(window_s=1.0, prior_s=0.5)
    t = 0.0
    for _ in range(100):
        meter.arrive(t, queued=False)
        meter.outstanding_until(t + WORK_S)  # planned; it ran faster
        meter.settled(t + WORK_S / 2)
        t += WORK_S / 2 + 0.001
    assert meter.rate == 0.0


def test_a_burst_at_one_instant_is_all_joinable_and_is_forgotten_after_the_window():
    meter = OutstandingArrivals(window_s=1.0, prior_s=0.5)
    meter.arrive(10.0, queued=False)
    for _ in range(3):
        meter.arrive(10.0, queued=True)
    assert meter.rate == pytest.approx(3 / 0.5)  # no time outstanding yet: the prior's alone
    meter.outstanding_until(10.02)
    meter.arrive(10.5, queued=False)
    assert meter.rate == pytest.approx(3 / 0.52)
    meter.arrive(11.2, queued=False)  # the burst is older than the window
    assert meter.rate == 0.0


def test_outstanding_time_counts_only_until_the_work_ended():
    meter = OutstandingArrivals(window_s=10.0, prior_s=0.1)
    meter.arrive(0.0, queued=False)
    meter.outstanding_until(0.1)
    meter.arrive(0.05, queued=False)  # in flight: joinable
    meter.arrive(0.5, queued=False)  # 0.05 s more of work, then idle
    assert meter.rate == pytest.approx(1 / 0.2)


def test_the_window_and_the_prior_must_be_positive_times():
    with pytest.raises(ValueError, match="window_s"):
        OutstandingArrivals(0.0, 1.0)
    with pytest.raises(ValueError, match="prior_s"):
        OutstandingArrivals(1.0, 0.0)
