"""A short run of ``daskpipe bench overload`` (no timing thresholds here: the goodput target is
the bench's)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from daskpipe.cli import main

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("dispatcher", ["ppipe", "ppipe-two-pass"])
def test_bench_overload_loses_nothing_and_keeps_the_queue_bound(tmp_path, dispatcher):
    out = tmp_path / "overload.json"
    args = [
        "bench",
        "overload",
        "--loads",
        "1,3",
        "--duration",
        "1",
        "--capacity",
        "20",
        "--max-queued",
        "4",
        "--dispatcher",
        dispatcher,
        "--in-process",
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["max_queued"] == 4 and report["dispatcher"] == dispatcher and [level["load"] for level in report["levels"]] == [1.0, 3.0]
    for level in report["levels"]:
        assert level["lost"] == 0 and level["keys_left"] == 0, level
        assert level["completed"] + sum(level["dropped"].values()) + level["failed"] == level["submitted"], level
        assert set(level["dropped"]) <= {"deadline", "overload"}, level
        assert level["queued_peak"] <= 4 and level["queued_bytes_peak"] <= 4 * 3 * 32 * 32 * 4, level
    three = report["levels"][1]
    assert three["offered_per_s"] > report["levels"][0]["offered_per_s"] and three["submitted"] > three["completed"]


def test_bench_overload_refuses_bad_options():
    for args, problem in (
        (["--loads", "1,x"], "comma-separated numbers"),
        (["--duration", "0"], "--duration"),
        (["--max-queued", "0"], "--max-queued"),
    ):
        result = CliRunner().invoke(main, ["bench", "overload", *args])
        assert result.exit_code == 2 and problem in result.output, result.output
