"""``daskpipe bench plan``: the MILP's gains over the baselines on the published profiles."""

from __future__ import annotations

from daskpipe.benchmarks.planning import run_bench


def test_bench_plan_reports_ratios_and_times(ppipe_dir):
    figures = run_bench(ppipe_dir, cluster_names=["HC3"], group_names=["G4"])
    (case,) = figures["cases"]
    assert case["ratio"]["ppipe/np"] > 1.2
    assert case["objective"]["ppipe"] >= case["objective"]["dart-r"] >= case["objective"]["np"]
    assert figures["per_cluster"]["HC3"]["ppipe/np"]["paper"] == 1.43
    assert figures["solve_seconds"]["median"] > 0
