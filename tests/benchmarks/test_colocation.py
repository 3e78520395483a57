"""``daskpipe bench colocation``: INSS's gains over the other co-location policies, in simulation."""

from __future__ import annotations

import json

from click.testing import CliRunner


def test_bench_cli_writes_per_policy_figures(tmp_path):
    from daskpipe.cli import main

    out = tmp_path / "colo.json"
    args = [
        "bench",
        "colocation",
        "--json",
        str(out),
        "--duration",
        "1",
        "--scales",
        "0.5,1",
        "--strategy",
        "inss",
        "--strategy",
        "gpulet",
        "--fit-noise",
        "0.01",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    for name in ("inss", "gpulet"):
        assert {"throughput", "slo_violation_rate"} <= set(figures["policies"][name])
    assert figures["gains_of_inss"]["gpulet"]["paper_pct"] == 28.1
    assert figures["latency_model"]["fit_on_own_data"]["samples"] > 0
    assert "paper +28.1%" in result.output


def test_bench_cli_rejects_bad_options():
    from daskpipe.cli import main

    result = CliRunner().invoke(main, ["bench", "colocation", "--strategy", "fifo"])
    assert result.exit_code != 0 and "unknown strategy" in result.output
