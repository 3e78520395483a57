from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from daskpipe.benchmarks import graft as bench
from tests.graft.helpers import toy_profile


def test_bench_writes_the_contract_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "estimated_profile", lambda *args, **kwargs: toy_profile())
    out = tmp_path / "graft.json"
    result = CliRunner().invoke(
        bench.bench_graft,
        [
            "--models",
            "vgg11",
            "--devices",
            "10",
            "--small-devices",
            "4",
            "--small-cases",
            "2",
            "--duration",
            "2",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["gpu_share_graft"] <= data["gpu_share_per_fragment"]
    assert 0 <= data["slo_attainment"] <= 1
    assert data["small_cases"] and all(c["optimum"] <= c["graft"] for c in data["small_cases"])


def test_bench_rejects_unknown_models() -> None:
    result = CliRunner().invoke(bench.bench_graft, ["--models", "alexnet"])
    assert result.exit_code != 0 and "unknown model" in result.output
