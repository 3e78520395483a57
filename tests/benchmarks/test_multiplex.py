"""``daskpipe bench multiplex``: how its goodput is searched (the runtime half needs a cluster: run the bench)."""

from __future__ import annotations

import pytest

from daskpipe.benchmarks.multiplex import Policy, Trials, pool_bound, pool_plan, sim_goodput, sim_trial, workload, zoo_profiles


@pytest.fixture(scope="module")
def zoo():
    profiles, _module, _example = zoo_profiles()
    return pool_plan(profiles), profiles


def test_the_pool_bound_spends_every_gpu_second_at_the_models_largest_batches(zoo):
    """At the bound, each model's equal share of the requests takes its share of the pool at its
    own throughput, and the shares fill the pool: a bound above it (the models' mean throughput,
    2.4x higher here) made the bisection's steps as large as deferred's whole goodput."""
    plan, _profiles = zoo
    bound = pool_bound(plan)
    assert sum(bound / len(plan.models) / m.throughput for m in plan.models) == pytest.approx(1.0)
    assert bound < sum(m.throughput for m in plan.models) / len(plan.models) / 2


def test_a_trial_at_a_low_rate_runs_long_enough_for_its_requests():
    names = [f"m{i}" for i in range(12)]
    assert 550 < len(workload(names, 100.0, 1.0, 1, min_requests=600)) < 650
    assert 80 < len(workload(names, 100.0, 1.0, 1)) < 120
    assert 1800 < len(workload(names, 2000.0, 1.0, 1, min_requests=600)) < 2200


def test_the_simulators_goodput_is_found_to_its_precision(zoo):
    """The rate found passes and one step of the search's precision above it fails."""
    plan, profiles = zoo
    trials = Trials()
    names = [m.name for m in plan.models]
    found = sim_goodput(plan, profiles, Policy("eager"), trials)
    step = trials.precision * pool_bound(plan)
    assert sim_trial(plan, profiles, Policy("eager"), trials.arrivals(names, found))["attainment"] >= 0.99
    assert sim_trial(plan, profiles, Policy("eager"), trials.arrivals(names, found + step))["attainment"] < 0.99
