from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from daskpipe.cli import main
from daskpipe.plan.schema import Plan

from .helpers import synthetic_profile


@pytest.fixture
def profile_dir(tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir()
    synthetic_profile("two-block", {("A", 1): [1000, 1000], ("B", 1): [1200, 10000]}).save(folder / "two-block.json")
    synthetic_profile("other", {("A", 1): [500, 500], ("B", 1): [600, 5000]}).save(folder / "other.json")
    return folder


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_plan_writes_json_and_prints_a_summary(profile_dir, tmp_path):
    out = tmp_path / "plan.json"
    result = run(
        "plan",
        "--profiles",
        str(profile_dir),
        "--models",
        "two,other",
        "--weights",
        "1,2",
        "--gpus",
        "A=2,B=4",
        "--gpus-per-server",
        "A=1,B=2",
        "--bw-gbps",
        "6",
        "--slo-us",
        "two=100000",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert {"objective", "models", "solver"} <= set(data)
    assert [m["name"] for m in data["models"]] == ["two-block", "other"]
    part = data["models"][0]["pipelines"][0]["partitions"][0]
    assert {"blocks", "gpu", "slices", "num_gpus", "latency_us", "transfer_us"} <= set(part)
    assert {"name", "status", "seconds"} <= set(data["solver"])
    assert data["models"][0]["slo_us"] == 100000
    assert Plan.load(out).objective == pytest.approx(data["objective"])
    assert "objective" in result.output and "two-block" in result.output
    assert data["bound"] >= data["objective"] and f"gap {100 * data['gap']:.2f}%" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "A=x"], "'x' is not a valid COUNT"),
        (["--gpus", "A"], "is not KEY=COUNT"),
        (["--gpus", "A=1,A=2"], "'A' is given twice"),
        (["--weights", "1,2"], "2 weights for 1 models"),
        (["--weights", "a"], "--weights"),
        (["--strategy", "best"], "'best' is not one of"),
        (["--slo-us", "nope=5"], "--slo-us"),
        (["--gpus", "A=1,Z=1"], "no profile for GPU type(s) ['Z']"),
        (["--models", "zzz"], "unknown model 'zzz'"),
    ],
)
def test_bad_flags_name_flag_and_value(profile_dir, tmp_path, args, message):
    base = {"--profiles": str(profile_dir), "--models": "two", "--gpus": "A=1,B=1", "--out": str(tmp_path / "p.json")}
    flags = dict(zip(args[::2], args[1::2]))
    argv = ["plan"] + [x for k, v in {**base, **flags}.items() for x in (k, v)]
    result = run(*argv)
    assert result.exit_code != 0
    assert message in result.output


def test_golden_case_from_the_command_line(ppipe_dir, tmp_path):
    out = tmp_path / "plan.json"
    result = run(
        "plan",
        "--profiles",
        str(ppipe_dir),
        "--models",
        "fcn",
        "--gpus",
        "V100=4,P4=12",
        "--gpus-per-server",
        "V100=2,P4=1",
        "--bw-gbps",
        "6",
        "--slo-us",
        "fcn=33300",
        "--margin",
        "0.4",
        "--max-parts",
        "2",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["objective"] == pytest.approx(1212, abs=3)


def test_the_plan_marks_each_partition_measured_or_estimated_as_its_profile_does(tmp_path):
    from dataclasses import replace

    folder = tmp_path / "profiles"
    folder.mkdir()
    profile = synthetic_profile("mixed", {("A", 1): [1000, 1000], ("B", 1): [1200, 1500]})
    replace(profile, meta={**profile.meta, "tables": {"A/1": "measured", "B/1": "estimated"}}).save(folder / "mixed.json")
    out = tmp_path / "plan.json"
    result = run("plan", "--profiles", str(folder), "--models", "mixed", "--gpus", "A=1,B=1", "--slo-us", "mixed=100000", "--out", str(out))
    assert result.exit_code == 0, result.output
    marks = {(q["gpu"], q["table"]) for m in json.loads(out.read_text())["models"] for p in m["pipelines"] for q in p["partitions"]}
    assert marks and marks <= {("A", "measured"), ("B", "estimated")}
    assert "tables" in result.output and ("measured" in result.output or "estimated" in result.output)
    assert all(q.table for m in Plan.load(out).models for p in m.pipelines for q in p.partitions), "plan.json keeps the marks"
