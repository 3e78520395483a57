"""``daskpipe bench fidelity``: the stand-in model, a short real run, and its option errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from daskpipe.benchmarks.fidelity import bisect_grid, real_input_shape, stand_in
from daskpipe.cli import main
from daskpipe.profiles.fx import cut_model, segment_model
from daskpipe.profiles.model import Profile


def profile(shapes: tuple | None = None) -> Profile:
    """Four blocks; with ``shapes``, the input's and each boundary's per-sample shape."""
    return Profile(
        model="four",
        slo_us=50_000.0,
        num_blocks=4,
        latency_us={("L4", 1): np.full((4, 2), 1000.0)},
        boundary_bytes=(64.0, 64.0, 64.0),
        input_shape=shapes[0] if shapes else None,
        boundary_shapes=shapes[1:] if shapes else None,
    )


@pytest.mark.parametrize("shapes", [None, ((3, 8, 8), (4, 4, 4), (8,), (2, 5))])
def test_the_stand_in_cuts_exactly_at_the_profiles_blocks_with_its_shapes(shapes):
    recut, module, example, tensors = stand_in(profile(shapes))
    assert segment_model(module, example).num_segments == recut.num_blocks == 4
    blocked = cut_model(module, example, recut.meta["segment_boundaries"])
    assert blocked.num_blocks == 4 and tuple(blocked.boundary_shapes) == recut.boundary_shapes
    assert blocked.input_shape == recut.input_shape == (shapes[0] if shapes else (16,))
    assert ("the profile's" if shapes else "small:") in tensors
    assert blocked.run(example.repeat(3, *[1] * (example.dim() - 1))).shape[0] == 3


def test_the_stand_in_takes_a_models_real_input_size_at_the_cost_of_small_ones():
    recut, module, example, tensors = stand_in(profile(None), real_input_shape("fcn_r50-d8_4xb2-80k_cityscapes-512x1024"))
    assert recut.input_shape == example.shape[1:] == (3, 512, 1024) and tensors.startswith("inputs of (3, 512, 1024)")
    assert module(example).shape == (1, 16)
    assert real_input_shape("googlenet-v3") == (3, 299, 299) and real_input_shape("wide_resnet101_2") == (3, 224, 224)


def test_bisection_finds_the_highest_passing_load_in_few_trials():
    grid = [round(0.05 * k, 2) for k in range(1, 21)]
    tried = []

    def passes(load: float) -> bool:
        tried.append(load)
        return load <= 0.6

    assert bisect_grid(grid, passes) == 0.6 and len(tried) <= 6
    assert bisect_grid(grid, lambda load: False) == 0.0
    assert bisect_grid(grid, lambda load: True) == 1.0


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--duration", "0"], "--duration"),
        (["--max-rate", "-1"], "--max-rate"),
        (["--step", "0"], "--step"),
        (["--step", "0.75"], "--step"),
        (["--gpus", "L4"], "--gpus"),
        (["--gpus", "L4:2,T4:2"], "--gpus"),
        (["--models", " , "], "--models"),
        (["--profiles", "/nonexistent/ppipe"], "--profiles"),
        (["--inputs", "huge"], "--inputs"),
    ],
)
def test_a_bad_option_is_refused_by_name_before_any_cluster_starts(tmp_path, args, option):
    result = CliRunner().invoke(main, ["bench", "fidelity", "--profiles", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert option in result.output
    if option == "--profiles":
        assert "/nonexistent/ppipe" in result.output


@pytest.mark.shared
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--models", "no-such-model"], "unknown model 'no-such-model'"),
        (["--models", "fcn", "--max-rate", "10"], "over --max-rate 10"),
        (["--models", "fcn", "--gpus", "A100:1"], "cannot plan"),
    ],
)
def test_models_and_plans_that_cannot_be_benched_are_refused_by_option(ppipe_dir, args, message):
    result = CliRunner().invoke(main, ["bench", "fidelity", "--profiles", str(ppipe_dir), *args])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.shared
@pytest.mark.timeout(120)
def test_a_short_run_reports_both_max_load_factors_and_their_ratio(ppipe_dir, tmp_path):
    """textsnake (SLO 99.5 ms) on one L4 slot: short trials on a coarse grid, the whole path, a sane report."""
    out = tmp_path / "fidelity.json"
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "fidelity",
            "--profiles",
            str(ppipe_dir),
            "--models",
            "textsnake",
            "--gpus",
            "L4:1",
            "--duration",
            "1",
            "--step",
            "0.2",
            "--inputs",
            "real",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    (name,) = report["models"]
    assert list(report["models"][name]) == ["real"]
    model = report["models"][name]["real"]
    assert name.startswith("textsnake") and model["slo_ms"] == pytest.approx(99.50985)
    assert 0 < model["sim_max_load_factor"] <= 1 and 0 < model["runtime_max_load_factor"] <= 1
    assert model["ratio"] == pytest.approx(model["runtime_max_load_factor"] / model["sim_max_load_factor"])
    assert 0 < model["control_path_p50_ms"] < model["slo_ms"], "the median of the trials' measured control paths"
    assert 0 <= model["sim_with_control_path_max_load_factor"] <= 1
    assert model["tensors"].startswith("inputs of (3, 224, 224) float32") and model["emulated_gpus"] == {"L4": {"count": 1, "slices": 1}}
    assert 0 < model["planned_rate_per_s"] < 400 and model["plan"]
    assert report["step"] == 0.2 and 1 <= len(model["trials"]) <= 4, "the top of the grid, then at most 3 halvings of 5 loads"
    for found in (model["sim_max_load_factor"], model["runtime_max_load_factor"]):
        assert found / 0.2 == pytest.approx(round(found / 0.2)), "both searches on the grid of --step"
    for trial in model["trials"]:
        runtime = trial["runtime"]
        ended = runtime["on_time"] + runtime["late"] + sum(runtime["dropped_by_reason"].values()) + runtime["failed"] + runtime["lost"]
        assert ended == trial["requests"] and runtime["attainment"] == pytest.approx(runtime["on_time"] / trial["requests"])
        assert set(runtime["late_legs"]) == {"requests", "batches", "mean_ms", "max_ms"}
        assert 0 <= trial["sim"]["attainment"] <= 1
    passed = [t["load_factor"] for t in model["trials"] if t["runtime"]["attainment"] >= report["target_attainment"]]
    assert model["runtime_max_load_factor"] == max(passed)
