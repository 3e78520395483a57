"""Worker loss and elastic serving: a dead worker's batches are retried, the plan follows the cluster and the load."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import torch
from distributed import Client, default_client, wait

import daskpipe
from daskpipe.profiles.small_model import estimated_profile, small_cnn
from daskpipe.runtime.adaptive import add_emulated_gpus
from daskpipe.runtime.cluster import EmulatedCluster
from daskpipe.runtime.errors import RequestDropped
from daskpipe.runtime.scheduler.elastic.state import ElasticSettings
from daskpipe.runtime.scheduler.plugin import plugin_of
from daskpipe.runtime.worker.stage import slow_down
from daskpipe.sched.registry import register
from tests.helpers import wait_until
from tests.runtime.helpers import PAPER_PPIPE, counted, example, frames, paper_ppipe, reference, tiny_model, two_stage

pytestmark = pytest.mark.timeout(180)


def deploy_pooled(client, stage_ms: tuple[float, float], slo_ms: float, second_pool: int, dispatcher: str = "ppipe"):
    """The tests' two-stage model, with ``second_pool`` T4 slots serving partition 1; no re-plans."""
    profile, plan = two_stage(stage_ms=stage_ms, slo_ms=slo_ms)
    model = plan.models[0]
    pipeline = model.pipelines[0]
    parts = (pipeline.partitions[0], replace(pipeline.partitions[1], vgpus=second_pool))
    plan = replace(plan, models=(replace(model, pipelines=(replace(pipeline, partitions=parts),)),))
    return daskpipe.deploy(
        client,
        {"tiny": tiny_model()},
        example_inputs={"tiny": example()},
        plan=plan,
        profiles={"tiny": profile},
        elastic=None,
        dispatcher=dispatcher,
    )


@pytest.fixture
def l4_and_three_t4():
    with EmulatedCluster({"L4": 1, "T4": 3}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        yield cluster, client


def close_worker(cluster, address: str) -> None:
    """The worker at ``address`` leaves at once, whatever it is running."""
    worker = next(w for w in cluster.workers.values() if w.address == address)
    cluster.sync(worker.close, executor_wait=False)


def kill_second_stage_mid_batch(cluster, plugin, after_s: float) -> str:
    """Close the partition-1 worker of the first batch in flight, ``after_s`` after its dispatch."""
    ledger = plugin.models.ledgers["tiny"]
    wait_until(lambda: ledger.flights, timeout=10, interval=0.001, what="a batch in flight")
    dispatched = time.monotonic()
    flight = next(iter(ledger.flights.values()))
    victim = next(a for (_, q, a) in ledger.stages if q == 1 and a in flight.addresses)
    time.sleep(max(0.0, dispatched + after_s - time.monotonic()))
    close_worker(cluster, victim)
    return victim


def test_a_worker_lost_mid_batch_has_its_requests_re_dispatched_to_the_rest_of_its_pool(l4_and_three_t4):
    cluster, client = l4_and_three_t4
    svc = deploy_pooled(client, stage_ms=(20.0, 200.0), slo_ms=5000.0, second_pool=2)
    plugin = plugin_of(cluster.scheduler)
    with svc:
        xs = frames(4)
        futures = svc.map("tiny", xs)  # one batch of 4
        victim = kill_second_stage_mid_batch(cluster, plugin, after_s=0.1)  # stage 2 runs 350 ms from ~35 ms
        for out, ref in zip(client.gather(futures), reference(xs)):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        status = svc.status()["tiny"]
        assert status["retried"] == 4 and status["completed"] == 4 and status["dropped"] == {}
        assert victim not in plugin.models.slots
        later = svc.map("tiny", frames(8, seed=3))  # the dead slot is out of the pool: nothing is sent to it
        wait(later, timeout=30)
        assert [f.status for f in later] == ["finished"] * 8
        assert svc.status()["tiny"]["dropped"] == {}


def test_a_retry_that_cannot_meet_its_deadline_is_dropped_as_worker_lost(l4_and_three_t4):
    cluster, client = l4_and_three_t4
    # one request alone: 100 ms per stage, dispatched at the paper's last moment (~230 ms); the
    # retry after a loss at ~380 ms would need 200 ms more, past its 430 ms deadline
    register(PAPER_PPIPE, paper_ppipe)
    svc = deploy_pooled(client, stage_ms=(100.0, 100.0), slo_ms=450.0, second_pool=1, dispatcher=PAPER_PPIPE)
    plugin = plugin_of(cluster.scheduler)
    with svc:
        future = svc.submit("tiny", frames(1)[0])
        victim = kill_second_stage_mid_batch(cluster, plugin, after_s=0.15)
        with pytest.raises(RequestDropped, match=r"dropped \(worker-lost\)") as info:
            future.result(timeout=30)
        assert info.value.reason == "worker-lost"
        assert f"worker {victim} died while its batch ran" in info.value.detail
        status = svc.status()["tiny"]
        assert status["retried"] == 1 and status["dropped"] == {"worker-lost": 1} and status["completed"] == 0


def test_a_retry_that_finds_its_pool_empty_is_dropped_saying_so_not_blaming_the_deadline(l4_and_three_t4):
    cluster, client = l4_and_three_t4
    svc = deploy_pooled(client, stage_ms=(20.0, 200.0), slo_ms=5000.0, second_pool=1)  # time to spare: only the pool is missing
    plugin = plugin_of(cluster.scheduler)
    with svc:
        future = svc.submit("tiny", frames(1)[0])
        victim = kill_second_stage_mid_batch(cluster, plugin, after_s=0.1)
        with pytest.raises(RequestDropped) as info:
            future.result(timeout=30)
        message = str(info.value)
        assert info.value.reason == "worker-lost" and "deadline" not in message, message
        assert (
            f"worker {victim} died while its batch ran; the retry was dropped (no-capacity): no pipeline of this model has slots in every "
            f"pool" in message
        )
        later = svc.submit("tiny", frames(1)[0])  # while the pool is empty
        with pytest.raises(RequestDropped) as info:
            later.result(timeout=30)
        assert info.value.reason == "no-capacity" and "the plan gives" not in str(info.value)
        assert "a pool empty for now" in str(info.value) and "no pipeline of this model has slots in every pool" in str(info.value)


def test_workers_joining_and_leaving_are_planned_in_without_losing_a_request():
    model, ex = small_cnn(), torch.randn(1, 3, 32, 32)
    # an SLO long against a batch: a request held through the switch's flush (at most the batches
    # in flight) still fits, so every request must complete (docs/operations.md, "Migration")
    estimated = estimated_profile(model, ex, name="cnn")
    profile = replace(estimated, slo_us=4 * estimated.slo_us)
    with EmulatedCluster({"L4": 1, "T4": 1}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        svc = daskpipe.deploy(
            client,
            {"cnn": model},
            example_inputs={"cnn": ex},
            profiles={"cnn": profile},
            time_dilation=2000.0,
            elastic=ElasticSettings(debounce_s=0.5),
        )
        plugin = plugin_of(cluster.scheduler)
        with svc:
            assert {q.gpu for p in svc.plan.model("cnn").pipelines for q in p.partitions} == {"L4", "T4"}
            xs = [torch.randn(1, 3, 32, 32) for _ in range(150)]
            futures = []
            for i, x in enumerate(xs):  # a steady stream across the join, the re-plan and the switch
                futures.append(svc.submit("cnn", x))
                if i == 30:
                    new = add_emulated_gpus(cluster, {"A10": 2})
                time.sleep(0.02)
            wait_until(lambda: plugin.elastic.history, timeout=60, interval=0.1, what="a re-plan")
            with ThreadPoolExecutor(1) as elsewhere:  # code outside `with client`: the process's default client
                assert elsewhere.submit(default_client).result() is client, "the scheduler's own client became the default"
            wait(futures, timeout=60)
            assert [f.status for f in futures] == ["finished"] * len(xs), [f.exception() for f in futures if f.status != "finished"]
            status = counted(svc, "cnn", len(xs))
            assert status["completed"] == status["submitted"] == len(xs) and status["dropped"] == {}

            assert len(plugin.elastic.history) == 1  # two joins, one re-plan
            a10 = {a for a, s in plugin.models.slots.items() if s.gpu == "A10"}
            assert {str(cluster.scheduler.workers[a].name) for a in a10} == set(new)
            in_force = svc.plan.model("cnn")
            assert any(q.gpu == "A10" and q.vgpus == 2 for p in in_force.pipelines for q in p.partitions)
            assert a10 <= set(plugin.metrics.models["cnn"].placement.slots)  # the dashboard shows it
            stages = {key for key, ts in cluster.scheduler.tasks.items() if ts.actor}
            assert stages == set(plugin.models.ledgers["cnn"].stages.values())  # the old stages were released

            close_worker(cluster, sorted(a10)[0])
            wait_until(lambda: len(plugin.elastic.history) >= 2, timeout=60, interval=0.1, what="a second re-plan")
            assert any(q.gpu == "A10" and q.vgpus == 1 for p in svc.plan.model("cnn").pipelines for q in p.partitions)
            more = svc.map("cnn", xs[:20])
            wait(more, timeout=30)
            assert [f.status for f in more] == ["finished"] * 20


def test_a_shift_in_the_load_mix_re_plans_with_the_observed_rates():
    model, ex = small_cnn(), torch.randn(1, 3, 32, 32)
    profiles = {name: estimated_profile(model, ex, name=name) for name in ("a", "b")}
    settings = ElasticSettings(load_window_s=2.0, load_interval_s=0.0, load_shift=0.25)
    with EmulatedCluster({"L4": 2, "T4": 2}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        svc = daskpipe.deploy(
            client, {"a": model, "b": model}, example_inputs={"a": ex, "b": ex}, profiles=profiles, time_dilation=2000.0, elastic=settings
        )
        plugin = plugin_of(cluster.scheduler)
        with svc:
            before = svc.plan
            futures = []

            def replanned_while_only_a_is_asked_for():
                futures.append(svc.submit("a", ex))
                return plugin.elastic.history

            wait_until(replanned_while_only_a_is_asked_for, timeout=30, interval=0.03, what="a re-plan")
            assert plugin.elastic.history and "load mix shifted" in plugin.elastic.history[0]["reasons"][0]
            after = svc.plan
            assert after.model("a").throughput > before.model("a").throughput
            wait(futures, timeout=60)
            status = counted(svc, "a", len(futures))
            assert status["completed"] + sum(status["dropped"].values()) == status["submitted"] == len(futures)


def test_stages_that_run_outside_the_profiles_band_re_plan_on_the_measured_latencies(caplog):
    profile, _ = two_stage(stage_ms=(20.0, 20.0), slo_ms=400.0)
    settings = ElasticSettings(load_interval_s=0.0, profile_band=1.3, debounce_s=0.1)
    with EmulatedCluster({"L4": 2, "T4": 2}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        svc = daskpipe.deploy(
            client, {"tiny": tiny_model()}, example_inputs={"tiny": example()}, profiles={"tiny": profile}, elastic=settings
        )
        plugin = plugin_of(cluster.scheduler)
        with svc:
            (dep,) = plugin.elastic.deployments.values()
            part = svc.plan.model("tiny").pipelines[0].partitions[0]
            slots = sorted(a for p, q, a in plugin.models.ledgers["tiny"].stages if q == 0)
            client.run(slow_down, 1.6, 30.0, workers=slots)  # every slot of the pool: the machine, not a suspect
            futures = []

            def replanned_while_serving() -> bool:
                futures.append(svc.submit("tiny", example()))
                return "re-planning on the measured latencies" in caplog.text

            wait_until(replanned_while_serving, timeout=30, what="a re-plan on the measured latencies")
            assert f"tiny blocks [{part.blocks[0]}, {part.blocks[1]}) on {part.gpu} run at 1.6" in caplog.text, caplog.text
            a, b = part.blocks
            measured = dep.models["tiny"].profile.latency_us[(part.gpu, part.slices)]
            ratio = measured[a:b] / profile.latency_us[(part.gpu, part.slices)][a:b]
            assert np.allclose(ratio, ratio.flat[0]) and 1.55 <= ratio.flat[0] <= 1.75, ratio
            assert svc.status()["tiny"]["suspected"] == 0
            wait(futures, timeout=60)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"debounce_s": -1}, "debounce_s must be a finite number >= 0"),
        ({"target_utilisation": 0}, "target_utilisation must be in"),
        ({"load_window_s": 0}, "load_window_s must be > 0"),
        ({"profile_band": 1.0}, "profile_band must be > 1"),
    ],
)
def test_bad_elastic_settings_are_refused_naming_the_setting(bad, message):
    with pytest.raises(ValueError, match=message):
        ElasticSettings(**bad)
    with pytest.raises(ValueError, match="unknown elastic settings"):
        ElasticSettings.from_dict({"debounce": 1.0})


def test_re_planning_works_over_tls(tmp_path):
    from tests.runtime.helpers import tls_security

    model, ex = small_cnn(), torch.randn(1, 3, 32, 32)
    estimated = estimated_profile(model, ex, gpus=("L4", "T4"), name="cnn")
    profile = replace(estimated, slo_us=4 * estimated.slo_us)  # TLS handshakes on a loaded machine delay the first batch
    security = tls_security(tmp_path)
    with (
        EmulatedCluster({"L4": 1}, processes=False, dashboard_address=None, protocol="tls", security=security) as cluster,
        Client(cluster, security=security) as client,
    ):
        svc = daskpipe.deploy(
            client,
            {"cnn": model},
            example_inputs={"cnn": ex},
            profiles={"cnn": profile},
            time_dilation=2000.0,
            elastic=ElasticSettings(debounce_s=0.2),
        )
        plugin = plugin_of(cluster.scheduler)
        with svc:
            add_emulated_gpus(cluster, {"T4": 1})
            wait_until(lambda: plugin.elastic.history, timeout=60, interval=0.1, what="a re-plan")  # the scheduler's own client speaks TLS
            assert any(q.gpu == "T4" for p in svc.plan.model("cnn").pipelines for q in p.partitions)
            assert svc.submit("cnn", ex).result(timeout=30).shape == (1, 10)


def test_the_scheduler_uses_its_own_certificate_as_a_client():
    from distributed.security import Security

    from daskpipe.runtime.scheduler.elastic.controller import client_security

    scheduler_only = Security(tls_ca_file=__file__, tls_scheduler_cert=__file__, tls_scheduler_key=__file__, require_encryption=True)
    own = client_security(scheduler_only)
    assert (own.tls_client_cert, own.tls_client_key) == (__file__, __file__) and scheduler_only.tls_client_cert is None
    assert client_security(None) is None


def test_a_gpu_type_the_profile_lacks_is_estimated_when_it_joins_and_planned_in():
    model, ex = small_cnn(), torch.randn(1, 3, 32, 32)
    estimated = estimated_profile(model, ex, gpus=("L4",), name="cnn")
    profile = replace(estimated, slo_us=4 * estimated.slo_us)
    with EmulatedCluster({"L4": 1}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        svc = daskpipe.deploy(
            client,
            {"cnn": model},
            example_inputs={"cnn": ex},
            profiles={"cnn": profile},
            time_dilation=2000.0,
            elastic=ElasticSettings(debounce_s=0.2),
        )
        plugin = plugin_of(cluster.scheduler)
        with svc:
            assert svc.profiles["cnn"].gpu_types == ["L4"]
            add_emulated_gpus(cluster, {"T4": 2})
            wait_until(lambda: plugin.elastic.history, timeout=60, interval=0.1, what="a re-plan")
            known = next(iter(plugin.elastic.deployments.values())).models["cnn"].profile
            assert ("T4", 1) in known.latency_us and known.latency_us[("T4", 1)].shape == known.latency_us[("L4", 1)].shape
            assert known.origin("T4", 1) == "estimated", "an emulated kind that joins is estimated, and marked so"
            assert any(q.gpu == "T4" and q.vgpus == 2 for p in svc.plan.model("cnn").pipelines for q in p.partitions)
            futures = svc.map("cnn", [ex] * 24)
            wait(futures, timeout=30)
            assert [f.status for f in futures] == ["finished"] * 24
