"""The scheduler's queue bound, and its drops with reason "overload"."""

from __future__ import annotations

import math
import re

import pytest

import daskpipe
from daskpipe.runtime.errors import DeployError, RequestDropped
from daskpipe.runtime.scheduler.served import QUEUE_SLOS, queue_bound
from tests.runtime.helpers import PAPER_PPIPE, example, frames, tiny_model, two_stage

pytestmark = pytest.mark.timeout(180)


def deploy_bounded(client, max_queued):
    profile, plan = two_stage(slo_ms=20_000.0)  # the paper's partial batch waits for its last moment: requests stay queued
    return daskpipe.deploy(
        client,
        {"tiny": tiny_model()},
        example_inputs={"tiny": example()},
        plan=plan,
        profiles={"tiny": profile},
        max_queued=max_queued,
        dispatcher=PAPER_PPIPE,
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
