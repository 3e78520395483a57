"""``daskpipe bench planning``: per case, time, objective, bound and gap."""

from __future__ import annotations

import json

from click.testing import CliRunner

from daskpipe.benchmarks.planning_scale import SUITE, bench_planning


def test_the_default_suite_is_the_issues_table():
    names = {c.name for c in SUITE}
    assert {"ppipe-40", "3-parts-100", "4-types-40", "20-models-1000"} <= names
    assert all(sum(c.gpus.values()) in (40, 100, 400, 1000) for c in SUITE)


def test_bench_planning_reports_time_objective_bound_and_gap(ppipe_dir, tmp_path):
    out = tmp_path / "planning.json"
    result = CliRunner().invoke(bench_planning, ["--profiles", str(ppipe_dir), "--cases", "ppipe-40", "--json", str(out)])
    assert result.exit_code == 0, result.output
    (case,) = json.loads(out.read_text())["cases"]
    assert case["case"] == "ppipe-40" and case["seconds"] <= case["time_limit"] + 5
    assert case["bound"] >= case["objective"] > 0 and case["gap"] <= 0.005 and case["status"] == "optimal"
    assert 0 < case["cpu_seconds"]
