"""A model's ledger on the scheduler: the one end of every request, its queue bound and its drops with reason "overload"."""

from __future__ import annotations

import math
import re
import time
import uuid

import pytest
from distributed import Future

import daskpipe
from daskpipe.runtime.errors import DeployError, RequestDropped, RequestFailed
from daskpipe.runtime.scheduler.keys import make_keys
from daskpipe.runtime.scheduler.ledger import QUEUE_SLOS, Dropped, Failed, client_gone, queue_bound, worker_lost
from daskpipe.runtime.scheduler.plugin import plugin_of
from tests.runtime.helpers import PAPER_PPIPE, counted, deploy_two_stage, example, frames, request_outcomes, tiny_model, two_stage

pytestmark = pytest.mark.timeout(180)


def test_every_way_a_request_ends_ends_its_key_once_and_the_counts_and_metrics_agree(emulated_inproc):
    """Outputs end through the runtime; the other ways through the ledger's one ``end``. Each key
    ends in Dask (in memory, or erred with what its future raises), its parked data is freed, a
    second end changes nothing, and ``status`` and ``/metrics`` count the same ends."""
    cluster, client = emulated_inproc
    svc = deploy_two_stage(client)
    outputs = svc.map("tiny", frames(3))
    client.gather(outputs)
    counted(svc, "tiny", 3)
    worker = sorted(plugin_of(cluster.scheduler).models.slots)[0]
    ways = {
        "deadline": (Dropped("deadline", "a test drops it"), RequestDropped, "a test drops it"),
        "failed": (Failed(RequestFailed("a test fails it")), RequestFailed, "a test fails it"),
        "worker-lost": (worker_lost(f"worker {worker} died holding its data"), RequestDropped, "died holding its data"),
        "client-gone": (client_gone("a test's client left"), RequestDropped, "a test's client left"),
    }
    keys = {way: f"ledger-{way}-{uuid.uuid4().hex}" for way in ways}
    futures = {way: Future(key, client) for way, key in keys.items()}

    def end_each_way(client_id: str, dask_scheduler=None) -> list[list]:
        ledger = plugin_of(dask_scheduler).models.ledgers["tiny"]
        make_keys(dask_scheduler, client_id, list(keys.values()))
        for key in keys.values():
            ledger.admit(key, b"", 1, time.monotonic() + 60.0)
        lost = keys["worker-lost"]
        ledger.queued.pop(lost)  # dispatched, then parked on ``worker`` for its next stage
        assert ledger.requeue(lost, b"", 1, parked_on=worker)
        return [[ledger.end([keys[way]], outcome), ledger.end([keys[way]], outcome)] for way, (outcome, _, _) in ways.items()]

    ends = client.run_on_scheduler(end_each_way, client.id)
    assert ends == [[[key], []] for key in keys.values()]  # each ends once
    for way, (_, error, says) in ways.items():
        with pytest.raises(error, match=re.escape(says)) as info:
            futures[way].result(timeout=30)
        if error is RequestDropped:
            assert info.value.reason == way
    tasks = cluster.scheduler.tasks
    assert [tasks[f.key].state for f in outputs] == ["memory"] * 3 and [tasks[key].state for key in keys.values()] == ["erred"] * 4
    ledger = plugin_of(cluster.scheduler).models.ledgers["tiny"]
    assert not ledger.queued and not ledger.deadlines and not ledger.parked
    status = svc.status()["tiny"]
    assert (status["submitted"], status["completed"], status["failed"]) == (7, 3, 1)
    assert status["dropped"] == {"deadline": 1, "worker-lost": 1, "client-gone": 1}
    outcomes = request_outcomes(cluster.scheduler)
    assert (outcomes["completed"], outcomes["failed"]) == (status["completed"], status["failed"])
    assert {reason: outcomes[f"dropped/{reason}"] for reason in status["dropped"]} == status["dropped"]
    svc.close()


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
