"""``daskpipe bench goodput``: the rate search, the options, and one small real run's JSON."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from daskpipe.benchmarks.goodput import PRECISION, Trial, search_max_rate, sim_max_rate
from daskpipe.cli import main
from tests.sim.helpers import batching_plan


def _threshold_trials(capacity: float):
    """Trials met below ``capacity`` req/s, missed above it, as a served model would be."""
    rates: list[float] = []

    def trial(rate: float) -> Trial:
        rates.append(rate)
        on_time = 100 if rate <= capacity else 90
        return Trial(
            rate,
            submitted=100,
            in_hand=100,
            on_time=on_time,
            dropped=0,
            failed=0,
            pending=0,
            latency_p50_ms=1.0,
            latency_p99_ms=2.0,
            mean_batch=1.0,
        )

    return trial, rates


@pytest.mark.parametrize("start", [4.0, 10.0, 40.0])
def test_search_closes_in_on_the_capacity_from_either_side(start):
    trial, _ = _threshold_trials(capacity=10.0)
    done = search_max_rate(trial, start, trials=12)
    best = max(t.rate for t in done if t.met)
    failed = min(t.rate for t in done if not t.met)
    assert best <= 10.0 < failed <= best * (1 + PRECISION)
    assert len(done) < 12, "stops once the bracket is tight"


def test_search_keeps_to_its_budget_and_ceiling():
    trial, _ = _threshold_trials(capacity=100.0)
    assert len(search_max_rate(trial, 10.0, trials=3)) == 3
    trial, rates = _threshold_trials(capacity=100.0)
    search_max_rate(trial, 10.0, trials=10, ceiling=15.0)
    assert rates == [10.0, 12.5, 15.0], "met at the ceiling: nothing higher to try"


@pytest.mark.parametrize(
    "args, option",
    [
        (["--workers", "2"], "--workers"),
        (["--workers", "0x1"], "--workers"),
        (["--slo-ms", "500,-1"], "--slo-ms"),
        (["--slo-ms", "fast"], "--slo-ms"),
        (["--model", "no-such-net"], "--model"),
        (["--duration", "0"], "--duration"),
        (["--trials", "0"], "--trials"),
    ],
)
def test_bad_options_name_the_option(args, option):
    result = CliRunner().invoke(main, ["bench", "goodput", *args])
    assert result.exit_code == 2 and option in result.output, result.output


def test_the_simulator_serves_less_with_the_compute_noise_it_is_given():
    """One stage at batch 8 on 2 GPUs (444 req/s of capacity, SLO 100 ms): computes as profiled
    keep it near its capacity (388 req/s), computes drawn 1.0-1.3x the profile take it down (324)."""
    plan, profiles = batching_plan()
    exact = sim_max_rate(plan, profiles["g"], [], 500.0, duration=2.0, seed=1)
    noisy = sim_max_rate(plan, profiles["g"], [1.0, 1.1, 1.2, 1.3], 500.0, duration=2.0, seed=1)
    assert exact >= 0.85 * plan.models[0].throughput
    assert 0 < noisy < 0.9 * exact


def test_small_run_writes_the_figures(tmp_path):
    """resnet18 on 32 x 32 images at a few req/s: every figure is there and every request accounted
    for. Whether the runtime meets the SLO is the runtime's business; the search is tested above."""
    out = tmp_path / "goodput.json"
    args = ["--image-size", "32", "--slo-ms", "2000", "--duration", "2", "--trials", "2", "--limit-seconds", "1", "--max-rate", "4"]
    result = CliRunner().invoke(main, ["bench", "goodput", *args, "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["workers"] == "2x1" and figures["input_shape"] == [3, 32, 32] and figures["worker_warnings"] == []
    limit = figures["machine_limit"]
    assert len(limit["runs"]) == 2 and limit["img_per_s"] == max(limit["runs"]) > 0
    row = figures["slos"]["2000"]
    assert row["plan_throughput"] > 0 and row["machine_limit"] == limit["img_per_s"] and row["profile_threads"] == 1
    assert 1 <= len(row["trials"]) <= 2 and row["trials"][0]["rate"] == 4.0, "starts at the ceiling, below the plan and the limit"
    for trial in row["trials"]:
        assert trial["in_hand"] + trial["dropped"] + trial["failed"] + trial["pending"] == trial["submitted"] > 0
        assert trial["on_time"] <= trial["in_hand"] and trial["met"] == (trial["attainment"] >= 0.99)
    assert row["max_rate"] == max((t["rate"] for t in row["trials"] if t["met"]), default=0.0)
    ratios = row["compute_ratios"]
    assert (ratios["samples"] > 0) == any(t["met"] for t in row["trials"]), "the batches of the met trials"
    assert ratios["samples"] == 0 or 0 < ratios["p50"] <= ratios["p99"]
    assert 0 <= row["sim_max_rate"] <= 4.0, "the simulator's search keeps to --max-rate too"
    assert 0 < row["sim_exact_max_rate"] <= 4.0 and row["sim_exact_of_plan"] == row["sim_exact_max_rate"] / row["plan_throughput"]
