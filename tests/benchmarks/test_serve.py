"""``daskpipe bench serve`` end to end on an emulated GPU: load from sender processes, every
request accounted for, and a refusal at deploy time."""

from __future__ import annotations

import gc
import json

import pytest
from click.testing import CliRunner

from daskpipe.benchmarks.serve import CollectionPauses
from daskpipe.cli import main
from daskpipe.runtime.cluster import EmulatedCluster


def test_bench_serve_offers_load_from_processes_and_checks_a_refusal(tmp_path):
    out = tmp_path / "serve.json"
    with EmulatedCluster({"L4": 1}, processes=False, dashboard_address=None, protocol="tcp") as cluster:
        args = ["bench", "serve", cluster.scheduler_address, "--model", "resnet18", "--input-shape", "3,32,32", "--input-dtype", "uint8"]
        args += ["--slo-ms", "100", "--loads", "0.25", "--seconds", "2", "--senders", "2", "--time-dilation", "20", "--json", str(out)]
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["workers"] == ["node-0/L4-0/0"] and figures["plan_rate_per_s"] > 0
    trial = figures["loads"]["0.25"]
    assert trial["offered_rate_per_s"] == pytest.approx(0.25 * figures["plan_rate_per_s"])
    assert trial["requests"] > 20 and trial["batches"] > 0
    assert 0 <= trial["latest_sender_start_ms"] < 500, "the senders start together, once all are connected"
    assert trial["sender_gc_pause_max_ms"] >= 0 and trial["sender_gc_pauses_over_10ms"] >= 0
    assert trial["on_time"] + trial["late"] + sum(trial["ended_otherwise"].values()) == trial["requests"], "every request ends"
    assert len(trial["misses_by_second"]) == 2 and sum(trial["misses_by_second"]) == trial["requests"] - trial["on_time"]
    assert trial["attainment"] >= 0.95, trial  # a quarter of the plan's load, with a 2 s SLO
    assert figures["refusal"]["refused"] and "at least" in figures["refusal"]["error"]


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--loads", "0", "each load must be in (0, 2]"),
        ("--loads", "half", "comma-separated fractions"),
        ("--input-shape", "3,x", "expected comma-separated integers"),
        ("--model", "no-such-net", "no-such-net"),
    ],
)
def test_bench_serve_names_a_bad_option(option, value, message):
    result = CliRunner().invoke(main, ["bench", "serve", "tcp://127.0.0.1:1", option, value])
    assert result.exit_code == 2 and option in result.output and message in result.output, result.output


def test_a_senders_collection_pauses_are_timed_only_within_the_block():
    with CollectionPauses() as pauses:
        gc.collect()
    timed = len(pauses.pauses_ms)
    gc.collect()
    assert timed >= 1 and min(pauses.pauses_ms) >= 0
    assert len(pauses.pauses_ms) == timed, "nothing is timed after the block"
