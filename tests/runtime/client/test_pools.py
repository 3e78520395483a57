"""Shared pools on the runtime: every model on every slot, one dispatcher for all of them."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch
from distributed import Client, wait

import daskpipe
from daskpipe.profiles.fx import segment_model
from daskpipe.profiles.memory import ModelMemory
from daskpipe.profiles.model import Profile
from daskpipe.runtime.adaptive import DaskpipeAdaptive, add_emulated_gpus
from daskpipe.runtime.client.pools import SharedPools, SubCluster
from daskpipe.runtime.cluster import EmulatedCluster
from daskpipe.runtime.errors import DeployError, RequestDropped
from daskpipe.runtime.scheduler.elastic.state import ElasticSettings
from daskpipe.runtime.scheduler.plugin import plugin_of
from tests.helpers import wait_until
from tests.runtime.helpers import INPUT, TinyCNN, example

MODELS = 6


def whole_profile(name: str, module: torch.nn.Module, ms: float, slo_ms: float = 400.0) -> Profile:
    """One block of ``module`` on a whole T4, ``ms * (1 + (b - 1) / 4)`` ms at batch ``b`` <= 8."""
    segmented = segment_model(module, example())
    bounds = [0, segmented.num_segments]
    blocked = segmented.cut(bounds)
    return Profile(
        model=name,
        slo_us=slo_ms * 1e3,
        num_blocks=1,
        latency_us={("T4", 1): np.array([[ms * 1e3 * (1 + (b - 1) / 4) for b in range(1, 9)]])},
        boundary_bytes=tuple(float(b) for b in blocked.boundary_bytes),
        input_shape=blocked.input_shape,
        boundary_shapes=tuple(blocked.boundary_shapes),
        meta={"segment_boundaries": bounds},
    )


def six_models() -> dict[str, torch.nn.Module]:
    models = {}
    for i in range(MODELS):
        torch.manual_seed(i)
        models[f"m{i}"] = TinyCNN().eval()
    return models


@pytest.fixture(scope="module")
def two_t4():
    with EmulatedCluster({"T4": 2}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        yield cluster, client


def deploy_six(client, dispatcher: str = "deferred", pools: SharedPools | None = None, elastic: ElasticSettings | None = None):
    models = six_models()
    profiles = {name: whole_profile(name, module, ms=5.0 + i) for i, (name, module) in enumerate(models.items())}
    service = daskpipe.deploy(
        client,
        models,
        example_inputs={m: example() for m in models},
        profiles=profiles,
        dispatcher=dispatcher,
        pools=pools or SharedPools(),
        elastic=elastic or ElasticSettings(),
    )
    return service, models


def frames(n: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, *INPUT, generator=generator) for _ in range(n)]


def test_six_models_share_two_t4s_under_one_deferred_dispatcher_and_serve_their_own_outputs(two_t4):
    cluster, client = two_t4
    service, models = deploy_six(client)
    plugin = plugin_of(cluster.scheduler)
    with service:
        ledger = [plugin.models.ledgers[name] for name in models]
        assert len({id(s.dispatcher) for s in ledger}) == 1  # one dispatcher for the pool
        assert all(len({a for _, _, a in s.stages}) == 2 for s in ledger)  # every model on both slots
        # full batches (8), which go at once: what is checked is where each batch's outputs go, not the
        # deferred window, which this loaded 2-core machine's overruns would make late
        inputs = {name: frames(16, seed=i) for i, name in enumerate(models)}
        futures = {name: service.map(name, xs) for name, xs in inputs.items()}  # all queued at once
        for name, module in models.items():
            with torch.no_grad():
                expected = [module(x) for x in inputs[name]]
            for out, ref in zip(client.gather(futures[name]), expected):
                torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        status = service.status()
        assert all(status[name]["completed"] == 16 and status[name]["dropped"] == {} for name in models)
        assert service.plan.strategy == "shared"


def test_models_that_do_not_fit_a_gpu_are_refused_naming_them_and_the_figures(two_t4):
    _, client = two_t4
    big = {f"m{i}": ModelMemory(weights_bytes=3 * 10**9, activation_bytes=10**6) for i in range(MODELS)}
    with pytest.raises(DeployError) as info:
        deploy_six(client, pools=SharedPools(memory=big))
    message = str(info.value)
    assert "models ['m0', 'm1', 'm2', 'm3', 'm4', 'm5']" in message and "T4/v1 slot's 16.00 GB" in message
    assert "weights 18.00 GB" in message and "CUDA context 0.54 GB" in message
    assert not plugin_of(two_t4[0].scheduler).models.ledgers or all(
        s.closing for s in plugin_of(two_t4[0].scheduler).models.ledgers.values()
    )


def test_split_sub_clusters_each_get_their_own_dispatcher_and_slot(two_t4):
    cluster, client = two_t4
    addresses = sorted(cluster.scheduler.workers)
    pools = SharedPools(subclusters=(SubCluster(("m0", "m1", "m2"), (addresses[0],)), SubCluster(("m3", "m4", "m5"), 1)))
    service, models = deploy_six(client, dispatcher="eager", pools=pools)
    plugin = plugin_of(cluster.scheduler)
    with service:
        first, second = ({id(plugin.models.ledgers[m].dispatcher) for m in group} for group in (("m0", "m1", "m2"), ("m3", "m4", "m5")))
        assert len(first) == len(second) == 1 and first != second
        assert {a for m in ("m0", "m1", "m2") for _, _, a in plugin.models.ledgers[m].stages} == {addresses[0]}
        assert {a for m in ("m3", "m4", "m5") for _, _, a in plugin.models.ledgers[m].stages} == {addresses[1]}
        xs = frames(4, seed=9)
        with torch.no_grad():
            expected = [models["m4"](x) for x in xs]
        for out, ref in zip(client.gather(service.map("m4", xs)), expected):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_a_sub_cluster_split_that_leaves_a_model_out_is_refused(two_t4):
    _, client = two_t4
    with pytest.raises(DeployError, match=r"in none: \['m5'\]"):
        deploy_six(client, pools=SharedPools(subclusters=(SubCluster(("m0", "m1", "m2", "m3", "m4"), 2),)))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"subclusters": (("m0",), 1)}, "SharedPools.subclusters must be a tuple of SubCluster"),
        ({"context_bytes": -1}, "SharedPools.context_bytes must be a number of bytes >= 0, got -1"),
        ({"timeout_ms": -2.0}, "SharedPools.timeout_ms must be None, a number of milliseconds >= 0"),
        ({"resplit_s": 0}, "SharedPools.resplit_s must be None or a number of seconds > 0, got 0"),
        ({"resplit_s": True}, "SharedPools.resplit_s must be None or a number of seconds > 0, got True"),
        ({"adopt_s": -1}, "SharedPools.adopt_s must be None or a number of seconds > 0, got -1"),
    ],
)
def test_bad_shared_pool_settings_are_refused_naming_them(settings, message):
    with pytest.raises(DeployError, match=re.escape(message)):
        SharedPools(**settings)


def test_a_shared_pool_needs_a_multiplexing_data_plane(two_t4):
    _, client = two_t4
    with pytest.raises(DeployError, match="a shared pool needs a data plane that shares slots between models"):
        deploy_six(client, dispatcher="ppipe")


def test_a_slot_killed_under_a_shared_pool_loses_no_request():
    with EmulatedCluster({"T4": 2}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        service, models = deploy_six(client)
        with service:
            futures = [f for i, name in enumerate(models) for f in service.map(name, frames(16, seed=i))]
            victim = next(w for w in cluster.workers.values())
            address = victim.address
            cluster.sync(victim.close, executor_wait=False)
            wait_until(lambda: address not in cluster.scheduler.workers, timeout=30, what="the scheduler to lose the worker")
            wait(futures, timeout=60)  # the retries end first: requests sent behind them could miss their SLO on a slow machine
            later = [f for i, name in enumerate(models) for f in service.map(name, frames(8, seed=10 + i))]
            wait(later, timeout=60)
            assert all(f.status in ("finished", "error") for f in futures)  # every request ends
            assert all(isinstance(f.exception(), RequestDropped) for f in futures if f.status == "error")
            assert {f.exception().reason for f in futures if f.status == "error"} <= {"worker-lost"}  # a retry out of time
            assert [f.status for f in later] == ["finished"] * len(later)  # the dead slot is out of the pool for every model
            joining = TinyCNN().eval()
            service.add_model("m6", joining, example(), profile=whole_profile("m6", joining, ms=5.0))  # on the slot left only
            assert {a for _, _, a in plugin_of(cluster.scheduler).models.ledgers["m6"].stages} == set(cluster.scheduler.workers)
            assert [f.status for f in wait(service.map("m6", frames(4, seed=30)), timeout=60).done] == ["finished"] * 4


def test_the_models_of_a_shared_pool_plan_with_one_control_path_measured_from_all_their_batches(two_t4):
    """They share its scheduler, workers and links, and one model alone runs too few batches for a
    tail: the margin of a model that has run none is measured from the others' batches."""
    _, client = two_t4
    service, models = deploy_six(client)
    with service:
        client.gather(service.map("m0", frames(16, seed=1)) + service.map("m1", frames(16, seed=2)))
        controls = [service.status()[name]["control"] for name in models]
        assert controls[0]["batches"] >= 4  # full batches of 8: two a model at least
        assert all(c["batches"] == controls[0]["batches"] and c["margin_ms"] == controls[0]["margin_ms"] for c in controls)
        assert len({c["cap_ms"] for c in controls}) == 1  # the tightest model's cap, so that each stays servable


def test_the_timeout_plane_gives_each_model_of_a_pool_its_own_wait_and_names_one_given_none(two_t4):
    cluster, client = two_t4
    waits = {f"m{i}": 1.0 + i for i in range(MODELS)}
    service, models = deploy_six(client, dispatcher="timeout", pools=SharedPools(timeout_ms=waits))
    with service:
        dispatcher = plugin_of(cluster.scheduler).models.ledgers["m0"].dispatcher
        assert dispatcher.max_wait_s == pytest.approx({name: ms * 1e-3 for name, ms in waits.items()})
        assert client.gather(service.map("m3", frames(2, seed=3)))[0].shape[0] == 1
    with pytest.raises(DeployError, match=r"gives no wait for model\(s\) \['m5'\]"):
        deploy_six(client, dispatcher="timeout", pools=SharedPools(timeout_ms={f"m{i}": 1.0 for i in range(MODELS - 1)}))


def test_a_worker_that_joins_a_running_pool_serves_its_models_and_nothing_is_lost():
    """One T4 serves six models; a second T4 joins the cluster while they serve and ``add_workers``
    puts it in the pool: every model gets a stage there, batches of a burst go to it, and every
    request sent before, across and after the join ends with its output. Workers that cannot join
    are refused by name."""
    with EmulatedCluster({"T4": 1}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        service, models = deploy_six(client)
        plugin = plugin_of(cluster.scheduler)
        with service:
            first = set(cluster.scheduler.workers)
            before = [f for i, name in enumerate(models) for f in service.map(name, frames(8, seed=i))]
            add_emulated_gpus(cluster, {"T4": 1, "L4": 1})
            client.wait_for_workers(3, timeout=60)
            kinds = {a: s.gpu for a, s in plugin.models.slots.items()}
            t4, l4 = (next(a for a, gpu in kinds.items() if gpu == kind and a not in first) for kind in ("T4", "L4"))
            with pytest.raises(DeployError, match=r"no sub-cluster serving a model has slots of kind L4/v1: a new kind needs a deploy"):
                service.add_workers([l4])
            with pytest.raises(DeployError, match=r"\['tcp://nowhere:1'\] are not workers of this cluster"):
                service.add_workers(["tcp://nowhere:1"])
            assert service.add_workers([t4]) == [t4]
            with pytest.raises(DeployError, match=rf"serve a sub-cluster already: \['{re.escape(t4)}'\]"):
                service.add_workers([t4])
            assert all({a for _, _, a in plugin.models.ledgers[name].stages} == first | {t4} for name in models)
            bad = {name: [[0, 0, l4, "no-actor"]] for name in models}  # the scheduler's own check, whoever asks
            with pytest.raises(DeployError, match=rf"{re.escape(l4)} is a L4/v1, a kind the pool has no slot of"):
                client.sync(client.scheduler.daskpipe_grow_pool, pool=list(models), plan=service.plan.to_dict(), stages=bad, serving={})
            assert {q.vgpus for p in service.plan.model("m0").pipelines for q in p.partitions} == {2}
            after = [f for i, name in enumerate(models) for f in service.map(name, frames(16, seed=20 + i))]  # all at once
            wait(before + after, timeout=120)
            assert [f.status for f in before + after] == ["finished"] * len(before + after)
            on_new = {name for name in models for _, hops in plugin.metrics.models[name].dispatches if hops[0].slot == t4}
            assert on_new, "the burst's batches go to the slot that joined too"
            assert t4 in plugin.metrics.models["m0"].placement.slots  # the dashboard shows it
            status = service.status()
            assert all(status[name]["completed"] == 24 and status[name]["dropped"] == {} for name in models)


def test_a_pool_that_adopts_workers_takes_those_of_its_kinds_as_they_join(caplog):
    with EmulatedCluster({"T4": 1}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        service, models = deploy_six(client, pools=SharedPools(adopt_s=0.2))
        plugin = plugin_of(cluster.scheduler)
        with service, caplog.at_level("WARNING", logger="daskpipe.runtime.client.service"):
            add_emulated_gpus(cluster, {"T4": 1, "L4": 1})
            client.wait_for_workers(3, timeout=60)
            kinds = {a: s.gpu for a, s in plugin.models.slots.items()}
            wait_until(
                lambda: all(len({a for _, _, a in plugin.models.ledgers[m].stages}) == 2 for m in models),
                timeout=30,
                what="the T4 that joined to be adopted",
            )
            time.sleep(1.0)  # rounds after the L4 was refused: it is not tried again
            assert all({kinds[a] for _, _, a in plugin.models.ledgers[m].stages} == {"T4"} for m in models)
            refusals = [r for r in caplog.records if "stays out of the service's pools" in r.getMessage()]
            assert len(refusals) == 1 and "L4/v1" in refusals[0].getMessage()
            assert client.gather(service.map("m2", frames(4, seed=5)))[0].shape[0] == 1


def test_adaptive_grows_a_pool_that_adopts_workers_when_its_requests_end_badly():
    """An overloaded pool on one T4 (a stream beyond what it serves: drops) is advised more T4s;
    Dask's Adaptive (``DaskpipeAdaptive``) starts one and the service adopts it; every request
    ends. A pool that does not adopt workers is not advised any: a worker would join for nothing."""
    # a worker that joined is closable after idle_grace_s without a stage: longer than adopting it takes
    settings = ElasticSettings(load_window_s=2.0, scale_cooldown_s=0.5, idle_grace_s=5.0)
    with EmulatedCluster({"T4": 1}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        plugin = plugin_of(cluster.scheduler)
        sent: list = []

        def overload(service, models, then):
            sent.extend(f for i, name in enumerate(models) for f in service.map(name, frames(30, seed=len(sent) + i)))
            time.sleep(0.3)
            return then()

        service, models = deploy_six(client, pools=SharedPools(), elastic=settings)
        with service:
            started = time.monotonic()
            wait_until(lambda: overload(service, models, lambda: time.monotonic() - started > 3.0), timeout=30, interval=0, what="3 s")
            assert plugin.elastic.scaling()["wanted"] == {}
            wait(sent, timeout=60)
        service, models = deploy_six(client, pools=SharedPools(adopt_s=0.3), elastic=settings)
        adaptive = cluster.adapt(Adaptive=DaskpipeAdaptive, minimum=1, maximum=2, interval="300ms", wait_count=1)
        with service:
            sent.clear()

            def adopted() -> bool:
                return all(len({a for _, _, a in plugin.models.ledgers[m].stages}) == 2 for m in models)

            wait_until(
                lambda: overload(service, models, adopted),
                timeout=60,
                interval=0,
                what="a T4 started by Adaptive and adopted by the pool",
            )
            adaptive.stop()
            assert len(cluster.worker_spec) == 2  # Adaptive's maximum, though the bad rate wanted more
            wait(sent, timeout=60)
            status = service.status()
            for name in models:
                ended = status[name]["completed"] + sum(status[name]["dropped"].values()) + status[name]["failed"]
                assert ended == status[name]["submitted"] and set(status[name]["dropped"]) <= {"overload", "deadline"}
            assert sum(status[name]["submitted"] for name in models) == len(sent)
            assert sum(sum(status[name]["dropped"].values()) for name in models) > 0  # it was overloaded
