"""``daskpipe demo`` as users run it: a subprocess, its contract checked through the JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from daskpipe.cli import main

DASKPIPE = [sys.executable, "-c", "from daskpipe.cli import main; main()"]  # the console script's code


@pytest.mark.slow
def test_demo_serves_the_stream_and_matches_the_unpartitioned_model(tmp_path):
    out = tmp_path / "out.json"
    run = subprocess.run(
        [*DASKPIPE, "demo", "--duration", "3", "--json", str(out), "--dashboard-address", ":0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["submitted"] > 0
    assert summary["submitted"] == summary["completed"] + summary["dropped"] + summary["failed"]
    assert summary["failed"] == 0, summary["failures"]
    assert summary["attainment"] >= 0.8, "attainment far below plan (is the machine overloaded?)"
    assert summary["max_abs_error"] < 1e-2, "fp16 boundaries should cost at most ~1e-3"
    pools = {(pool["gpu"], pool["slices"]): pool["workers"] for pool in summary["pools"]}
    assert set(pools) == {("L4", 1), ("T4", 1)}, "the plan should pipeline across both pools"
    assert "daskpipe demo" in run.stderr and "SLO attainment" in run.stderr


def test_demo_options_are_documented():
    result = CliRunner().invoke(main, ["demo", "--help"])
    for option in ("--duration", "--dashboard-address", "--protocol", "--json"):
        assert option in result.output
