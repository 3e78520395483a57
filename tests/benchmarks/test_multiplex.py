"""``daskpipe bench multiplex``: how its goodput is searched (the runtime half needs a cluster: run the bench)."""

from __future__ import annotations

import pytest

from daskpipe.benchmarks.experiments import highest_rate
from daskpipe.benchmarks.multiplex import (
    Policy,
    Trials,
    attainments,
    gpus_of,
    pool_bound,
    pool_plan,
    sim_goodput,
    sim_trial,
    workload,
    zoo_models,
    zoo_profiles,
)


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


def test_a_trial_at_a_low_rate_runs_long_enough_for_each_models_requests():
    names = [f"m{i}" for i in range(12)]
    assert 550 < len(workload(names, 100.0, 1.0, 1, min_requests=50)) < 650
    assert 80 < len(workload(names, 100.0, 1.0, 1)) < 120
    assert 1800 < len(workload(names, 2000.0, 1.0, 1, min_requests=50)) < 2200


def test_goodput_is_read_against_the_model_that_misses_most():
    """Symphony's goodput: every model's p99 within its SLO, so 2 misses of 100 fail a pool
    whose 200 requests miss 1% in all."""
    outcomes = [("a", True)] * 100 + [("b", True)] * 98 + [("b", False)] * 2
    assert attainments(outcomes) == {"attainment": 0.98, "worst_model": "b", "overall": 0.99}


def test_the_simulators_goodput_is_found_to_its_precision(zoo, monkeypatch):
    """The rate found passes, and the search tried a rate at most one step of its precision above
    it that failed (the search's bracket)."""
    from daskpipe.benchmarks import multiplex

    plan, profiles = zoo
    trials = Trials()
    tried: dict[float, bool] = {}

    def recording(meets, upper, precision):
        def recorded(rate: float) -> bool:
            tried[rate] = meets(rate)
            return tried[rate]

        return highest_rate(recorded, upper, precision)

    monkeypatch.setattr(multiplex, "highest_rate", recording)
    found = sim_goodput(plan, profiles, Policy("eager"), trials)
    names = [m.name for m in plan.models]
    assert tried[found] and sim_trial(plan, profiles, Policy("eager"), trials.arrivals(names, found))["attainment"] >= 0.99
    assert any(not passed and found < rate <= found + trials.precision * pool_bound(plan) for rate, passed in tried.items())


def test_the_timeout_policy_waits_a_share_of_each_models_slo_on_a_pool_of_any_size():
    profiles, _module, _example = zoo_profiles()
    plan = pool_plan(profiles, gpus=8)
    assert gpus_of(plan) == 8
    waits = Policy("timeout", 0.1).waits_ms(plan)
    assert waits is not None and waits["DenseNet121"] == pytest.approx(2.9) and waits["EfficientNetV2M"] == pytest.approx(21.0)
    a100 = pool_plan(zoo_profiles(zoo_models("a100"))[0])
    assert Policy("timeout", 0.1).waits_ms(a100) == pytest.approx({m.name: m.slo_ms / 10 for m in zoo_models("a100")})
    assert {m.name: m.slo_ms for m in zoo_models("a100")}["DenseNet121"] == 21.0
    assert Policy("eager").waits_ms(plan) is None and Policy("timeout", 0.1).label == "timeout 0.1 SLO"


def test_the_simulator_alone_compares_the_policies_on_the_pool_and_on_more_gpus(tmp_path):
    import json

    from click.testing import CliRunner

    from daskpipe.benchmarks.multiplex import bench_multiplex

    out = tmp_path / "multiplex.json"
    args = ["--sim-only", "--min-requests", "20", "--timeouts", "0.1", "--sweep-gpus", "8", "--json", str(out)]
    result = CliRunner().invoke(bench_multiplex, args)
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert "runtime" not in figures and figures["sim"]["best_timeout"] == "timeout 0.1 SLO"
    assert set(figures["sim"]["policies"]) == {"deferred", "eager", "timeout 0.1 SLO"}
    (swept,) = figures["sim_sweep_gpus"]
    assert swept["gpus"] == 8 and swept["policies"]["eager"]["goodput_per_s"] > figures["sim"]["policies"]["eager"]["goodput_per_s"]
    bad = CliRunner().invoke(bench_multiplex, ["--sim-only", "--timeouts", "0"])
    assert bad.exit_code != 0 and "each in (0, 1)" in bad.output


def test_fig6s_profile_shares_a_pool_of_the_gpus_asked_for(tmp_path):
    """``--fig6-beta`` serves copies of Symphony's Fig. 6a profile (alpha 1 ms, SLO 2 l(8)) in place of the zoo, on ``--gpus`` GPUs."""
    import json

    from click.testing import CliRunner

    from daskpipe.benchmarks.multiplex import bench_multiplex

    out = tmp_path / "fig6.json"
    fig6 = ["--fig6-beta", "15", "--fig6-models", "3", "--gpus", "2"]
    args = ["--sim-only", *fig6, "--min-requests", "20", "--timeouts", "0.2", "--json", str(out)]
    result = CliRunner().invoke(bench_multiplex, args)
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["models"] == [{"name": f"m{i}", "alpha_ms": 1.0, "beta_ms": 15.0, "slo_ms": 46.0} for i in range(3)]
    assert figures["gpus"].startswith("2 x") and figures["sim"]["gpus"] == 2
    assert figures["sim"]["policies"]["eager"]["goodput_per_s"] > 0
    bad = CliRunner().invoke(bench_multiplex, ["--sim-only", "--fig6-beta", "0"])
    assert bad.exit_code != 0 and "--fig6-beta" in bad.output
