"""``daskpipe bench dashboard``: its JSON contract, with each viewer (figures are for the benchmark, not asserted)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from daskpipe.benchmarks.dashboard import bench_dashboard

pytestmark = pytest.mark.timeout(180)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def run_bench(tmp_path, viewer: str, rounds: int = 1) -> dict:
    out = tmp_path / "dashboard.json"
    result = CliRunner().invoke(
        bench_dashboard, ["--requests", "64", "--rounds", str(rounds), "--viewer", viewer, "--in-process", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["viewer"] == viewer and figures["requests_per_round"] == 64
    for side in ("pages_closed", "pages_open"):
        assert figures[side]["requests_per_second"] > 0 and figures[side]["python_cpu_us_per_request"] > 0
    assert len(figures["rounds"]["closed"]) == len(figures["rounds"]["open"]) == rounds
    assert figures["throughput_drop"] == pytest.approx(
        1 - figures["pages_open"]["requests_per_second"] / figures["pages_closed"]["requests_per_second"]
    )
    return figures


def test_bench_with_bokeh_clients_following_the_pages(tmp_path):
    figures = run_bench(tmp_path, "bokeh-client", rounds=2)
    assert figures["pages_open"]["chromium_cpu_s"] == 0
    assert len(figures["opening_pages"]) == 1  # closed, open, open, closed: the two open rounds share one set of pages


@pytest.mark.heavy
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_bench_with_the_pages_open_in_chromium(tmp_path):
    figures = run_bench(tmp_path, "chromium")
    assert figures["opening_pages"][0]["chromium_cpu_s"] > 0  # Chromium really loaded the four pages


def test_bench_refuses_a_round_of_no_requests():
    result = CliRunner().invoke(bench_dashboard, ["--requests", "0"])
    assert result.exit_code != 0 and "--requests" in result.output
