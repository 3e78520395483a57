"""``daskpipe profile`` subcommands, run through click."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from daskpipe.profiles import load_profiles
from daskpipe.profiles.cli import parse_batch_sizes, profile


def test_torchvision_profile_with_estimates_then_show(tmp_path):
    out = tmp_path / "r18.json"
    runner = CliRunner()
    result = runner.invoke(
        profile,
        [
            "torchvision",
            "resnet18",
            "--blocks",
            "2",
            "--batch-sizes",
            "1,3",
            "--input-shape",
            "3,32,32",
            "--repeats",
            "1",
            "--cpu-threads",
            "1",
            "--estimate",
            "L4,T4",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    prof = load_profiles(out)["resnet18"]
    assert prof.num_blocks == 2 and prof.gpu_types == ["L4", "T4", "cpu"]
    assert prof.max_batch("cpu") == 3 and prof.max_batch("L4", 2) == 1
    assert prof.meta["interpolated_batch_sizes"] == [2]
    shown = runner.invoke(profile, ["show", str(out)])
    assert shown.exit_code == 0 and "resnet18: 2 blocks" in shown.output and "cpu" in shown.output


def test_show_published_profiles_by_prefix(ppipe_dir):
    result = CliRunner().invoke(profile, ["show", str(ppipe_dir), "--model", "fcn"])
    assert result.exit_code == 0, result.output
    assert "fcn-d6_r101-d16_4xb2-40k_cityscapes-512x1024" in result.output and "V100" in result.output


def test_clear_errors(tmp_path):
    runner = CliRunner()
    result = runner.invoke(profile, ["torchvision", "not_a_model", "--out", str(tmp_path / "x.json")])
    assert result.exit_code != 0 and "not a torchvision classification model" in result.output
    result = runner.invoke(profile, ["torchvision", "resnet18", "--input-shape", "3,x", "--out", str(tmp_path / "x.json")])
    assert result.exit_code != 0 and "comma-separated integers" in result.output


@pytest.mark.parametrize("text, sizes", [("1-4", [1, 2, 3, 4]), ("1,2,8", [1, 2, 8]), ("3", [1, 2, 3])])
def test_parse_batch_sizes(text, sizes):
    assert parse_batch_sizes(text) == sizes


@pytest.mark.parametrize("text", ["0-2", "a", "2,-1"])
def test_parse_batch_sizes_rejects(text):
    with pytest.raises(click.BadParameter):
        parse_batch_sizes(text)


def test_unknown_estimate_gpu_is_refused_before_profiling(tmp_path):
    result = CliRunner().invoke(profile, ["torchvision", "resnet18", "--estimate", "L4,B300", "--out", str(tmp_path / "x.json")])
    assert result.exit_code != 0 and "the catalog knows" in result.output and not (tmp_path / "x.json").exists()


def test_input_errors_are_one_line_messages(tmp_path):
    result = CliRunner().invoke(profile, ["show", str(tmp_path)])
    assert result.exit_code == 1 and "neither profile JSON files nor a block-timing/" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
