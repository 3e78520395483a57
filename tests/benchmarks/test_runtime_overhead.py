"""``daskpipe bench runtime`` end to end on a small run: the figures it promises, nothing lost."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from daskpipe.cli import main


@pytest.mark.parametrize("shape, nbytes", [("16", 64), ("3,96,96", 110_592)], ids=["small", "large-inputs-as-frames"])
def test_bench_runtime_reports_both_paths_and_loses_nothing(tmp_path, shape, nbytes):
    out = tmp_path / "runtime.json"
    args = [
        "bench",
        "runtime",
        "--requests",
        "50",
        "--rounds",
        "1",
        "--latency-samples",
        "20",
        "--in-process",
        "--input-shape",
        shape,
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["input_bytes"] == nbytes and figures["load"]["attainment"] > 0
    assert figures["requests"] == 64  # rounded up to whole batches of 32
    assert figures["failed"] == 0 and figures["batches"] >= 2 * 2  # the warm-up's two batches and this round's
    assert figures["requests_per_second"] > 0 and figures["dask_tasks_per_second"] > 0
    assert figures["ratio"] == figures["requests_per_second"] / figures["dask_tasks_per_second"]
    assert 0 < figures["overhead_p50_ms"] <= figures["overhead_p99_ms"]
    assert "in-process" in figures["cluster"] and figures["loop_lag_max_ms"] is not None
    cpu = figures["cpu_ms_per_request"]
    assert set(cpu["closed_loop"]) == set(cpu["throughput"]) == {"all", "total"}, "client, scheduler and workers share this process"
    assert cpu["closed_loop"]["total"] == cpu["closed_loop"]["all"] > 0 and cpu["throughput"]["total"] == cpu["throughput"]["all"]
    assert figures["closed_loop_cores_busy"] > 0


def test_bench_runtime_names_a_bad_input_shape():
    result = CliRunner().invoke(main, ["bench", "runtime", "--input-shape", "3,x"])
    assert result.exit_code != 0 and "--input-shape" in result.output and "comma-separated integers" in result.output


def test_bench_runtime_names_too_few_latency_samples():
    result = CliRunner().invoke(main, ["bench", "runtime", "--latency-samples", "1"])
    assert result.exit_code == 2 and "--latency-samples" in result.output and "must be >= 2" in result.output
