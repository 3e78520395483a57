"""Overload: the scheduler's queue bound, its drops with reason "overload", and a short run of
``daskpipe bench overload`` (no timing thresholds here: the goodput target is the bench's)."""

from __future__ import annotations

import json
import math
import re

import pytest
from click.testing import CliRunner

import daskpipe
from daskpipe.cli import main
from daskpipe.runtime.errors import DeployError, RequestDropped
from daskpipe.runtime.served import QUEUE_SLOS, queue_bound
from tests.runtime.helpers import example, frames, tiny_model, two_stage

pytestmark = pytest.mark.timeout(180)


def deploy_bounded(client, max_queued):
    profile, plan = two_stage(slo_ms=20_000.0)  # a partial batch waits for its last moment: requests stay queued
    return daskpipe.deploy(
        client, {"tiny": tiny_model()}, example_inputs={"tiny": example()}, plan=plan, profiles={"tiny": profile}, max_queued=max_queued
    )


def test_a_full_queue_drops_new_requests_with_reason_overload(emulated_inproc):
    cluster, client = emulated_inproc
    svc = deploy_bounded(client, max_queued=2)
    futures = svc.map("tiny", frames(5))
    for future in futures[2:]:
        with pytest.raises(RequestDropped, match=r"\(overload\).*2 requests queued \(max_queued\)") as info:
            future.result(timeout=30)
        assert info.value.reason == "overload"
    status = svc.status()["tiny"]
    assert status["queued"] == status["max_queued"] == 2 and status["dropped"] == {"overload": 3}
    svc.close()
    for future in futures[:2]:  # the queued ones end too, nothing is lost
        with pytest.raises(RequestDropped, match=r"\(shutdown\)"):
            future.result(timeout=30)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_a_bad_queue_bound_fails_the_deploy_before_any_stage_starts(emulated_inproc, bad):
    cluster, client = emulated_inproc
    before = stage_keys(cluster)
    with pytest.raises(DeployError, match=re.escape(f"max_queued (None for the default) must be an integer >= 1, got {bad!r}")):
        deploy_bounded(client, max_queued=bad)
    assert stage_keys(cluster) <= before


def stage_keys(cluster) -> set:
    return {key for key in cluster.scheduler.tasks if str(key).startswith("daskpipe-stage-")}


def test_the_default_bound_is_two_slos_of_requests_at_the_plans_capacity():
    _, plan = two_stage(slo_ms=500.0)
    model = plan.model("tiny")
    assert queue_bound(model, None) == math.ceil(QUEUE_SLOS * model.throughput * 0.5) > 2 * 4
    assert queue_bound(model, 7) == 7


@pytest.mark.parametrize("dispatcher", ["ppipe", "ppipe-two-pass"])
def test_bench_overload_loses_nothing_and_keeps_the_queue_bound(tmp_path, dispatcher):
    out = tmp_path / "overload.json"
    args = [
        "bench",
        "overload",
        "--loads",
        "1,3",
        "--duration",
        "2",
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
