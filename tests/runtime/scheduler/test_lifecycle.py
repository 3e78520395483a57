"""Models added, removed and updated while a service serves: nothing lost, the other models on time."""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import replace

import pytest
import torch
from distributed import Client, wait

import daskpipe
from daskpipe.profiles.memory import ModelMemory
from daskpipe.profiles.small_model import estimated_profile, small_cnn
from daskpipe.runtime.client.pools import SharedPools, SubCluster
from daskpipe.runtime.cluster import EmulatedCluster
from daskpipe.runtime.errors import DeployError, InvalidRequest, RequestDropped, RequestFailed
from daskpipe.runtime.scheduler.elastic.state import ElasticSettings
from daskpipe.runtime.scheduler.plugin import plugin_of
from tests.helpers import wait_until
from tests.runtime.helpers import counted

pytestmark = pytest.mark.timeout(180)

INPUT = (3, 32, 32)
DILATION = 1000.0  # an estimated batch of a few dozen microseconds held for tens of milliseconds: 2 shared cores keep up


def version(bias: float) -> torch.nn.Module:
    """The tests' small CNN, its outputs shifted by ``bias``: which version served a request shows in its output."""
    model = small_cnn()
    with torch.no_grad():
        model[-1].bias += bias
    return model


@functools.cache
def profile_of(name: str, slo_factor: float = 8.0):
    estimated = estimated_profile(small_cnn(), torch.randn(1, *INPUT), gpus=("L4", "T4"), name=name)
    # a request held through a switch still fits, and so does a batch paused while new stages load next to it: in-process
    # workers unpickle (re-trace) one stage at a time and compute no batch meanwhile (stage.LOADING), slow on 2 shared cores
    return replace(estimated, slo_us=slo_factor * estimated.slo_us)


@pytest.fixture(scope="module")
def cluster():
    with EmulatedCluster({"L4": 2, "T4": 2}, processes=False, dashboard_address=None) as emulated, Client(emulated) as client:
        yield emulated, client


def deploy(client, names=("a", "b"), slo_factor: float = 8.0, **kwargs):
    return daskpipe.deploy(
        client,
        {name: small_cnn() for name in names},
        example_inputs={name: torch.randn(1, *INPUT) for name in names},
        profiles={name: profile_of(name, slo_factor) for name in names},
        time_dilation=DILATION,
        **({"elastic": ElasticSettings(profile_band=5.0)} | kwargs),  # 2 shared cores run stages late: no re-plan on that here
    )


class Stream:
    """A steady stream of requests to ``model`` from a thread (every ``every_s``) while the test changes the service."""

    def __init__(self, svc, model: str, every_s: float = 0.01, least: int = 150):
        self.svc, self.model, self.every_s, self.least = svc, model, every_s, least  # 1% of ``least``: a miss or more
        self.futures: list = []
        self.before = svc.status()[model]
        self._inputs = torch.Generator().manual_seed(1)  # its own: models built meanwhile draw their weights from the global one
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.futures.append(self.svc.submit(self.model, torch.randn(1, *INPUT, generator=self._inputs)))
            time.sleep(self.every_s)

    def __enter__(self) -> Stream:
        self._thread.start()
        time.sleep(0.5)  # it is steady before the change starts
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.5)  # and after it ended
        wait_until(lambda: len(self.futures) >= self.least, timeout=30, what=f"{self.least} requests to {self.model}")
        self._stop.set()
        self._thread.join()

    def check(self) -> None:
        """Every request ended (a result, or an error with its reason), and at least 99% of them on time."""
        tally = ended(self.futures)
        before = self.before
        after = counted(self.svc, self.model, before["completed"] + sum(before["dropped"].values()) + len(self.futures))
        submitted, on_time = (after[c] - before[c] for c in ("submitted", "on_time"))
        assert submitted == sum(tally.values()) == len(self.futures) >= self.least, tally
        assert on_time / submitted >= 0.99, (tally, after)


def ended(futures) -> dict[str, int]:
    """How each future ended: a result, or the reason it was dropped, or failed; none is left pending."""
    wait(futures, timeout=60)
    tally: dict[str, int] = {}
    for future in futures:
        assert future.done()
        error = future.exception()
        kind = "result" if error is None else f"dropped ({error.reason})" if isinstance(error, RequestDropped) else type(error).__name__
        assert error is None or isinstance(error, (RequestDropped, RequestFailed)), error
        tally[kind] = tally.get(kind, 0) + 1
    return tally


def only_stages_of(emulated, models) -> None:
    """Wait until the cluster's stage actors are those ``models`` serve on: the old ones were released."""
    plugin = plugin_of(emulated.scheduler)

    def released() -> bool:
        actors = {key for key, ts in emulated.scheduler.tasks.items() if ts.actor}
        return actors == {key for m in models for key in plugin.models.ledgers[m].stages.values()}

    try:
        wait_until(released, timeout=30, what=f"the stages of {models} alone")
    except AssertionError as exc:  # say which
        actors = {key for key, ts in emulated.scheduler.tasks.items() if ts.actor}
        wanted = {key for m in models for key in plugin.models.ledgers[m].stages.values()}
        raise AssertionError(f"{exc}: stages left over {sorted(actors - wanted)}, missing {sorted(wanted - actors)}") from None


def test_a_model_added_under_load_is_profiled_planned_and_served_while_the_others_stay_on_time(cluster):
    emulated, client = cluster
    plugin = plugin_of(emulated.scheduler)
    with deploy(client) as svc:
        replans = len(plugin.elastic.history)
        with Stream(svc, "a") as stream:
            svc.add_model("c", version(0.0), torch.randn(1, *INPUT), slo_ms=profile_of("c").slo_us / 1e3)  # profiled on the cluster
        stream.check()
        assert svc.models == ["a", "b", "c"]
        assert svc.plan.model("c").pipelines and len(plugin.elastic.history) == replans + 1
        assert "model 'c' added" in plugin.elastic.history[-1]["reasons"]
        xs = [torch.randn(1, *INPUT) for _ in range(12)]
        outputs = client.gather(svc.map("c", xs))
        with torch.inference_mode():
            for out, x in zip(outputs, xs):
                torch.testing.assert_close(out, version(0.0)(x), atol=1e-2, rtol=1e-2)
        only_stages_of(emulated, ["a", "b", "c"])


def remove_b_under_load(svc) -> None:
    """Remove model "b" with 40 requests of it queued and in flight, under a stream to "a": they are
    served to their end, none lost, "a" stays on time, and "b" takes no more requests."""
    with Stream(svc, "a") as stream:
        burst = svc.map("b", [torch.randn(1, *INPUT) for _ in range(40)])
        svc.remove_model("b")
    stream.check()
    tally = ended(burst)
    assert sum(tally.values()) == 40 and tally.get("result", 0) >= 39, tally
    with pytest.raises(InvalidRequest, match="model 'b' was removed from this service"):
        svc.submit("b", torch.randn(1, *INPUT)).result(timeout=10)


def test_a_model_removed_under_load_ends_what_it_was_sent_and_frees_its_slots(cluster):
    emulated, client = cluster
    plugin = plugin_of(emulated.scheduler)
    with deploy(client) as svc:
        remove_b_under_load(svc)
        assert svc.models == ["a"] and "b" not in plugin.models.ledgers
        assert [m.name for m in svc.plan.models] == ["a"]
        only_stages_of(emulated, ["a"])
        assert {a for _, _, a in plugin.models.ledgers["a"].stages} == set(plugin.models.slots)  # a plans on the freed slots
        with pytest.raises(DeployError, match="model 'a' is the service's last model; close the service instead"):
            svc.remove_model("a")
    with deploy(client):  # at once, under the same names: the closed service's re-planned stages go, not only its deploy's
        only_stages_of(emulated, ["a", "b"])


@pytest.mark.parametrize("pools", [None, SharedPools()], ids=["re-planned", "shared-pool"])
def test_a_model_updated_under_load_serves_new_requests_on_the_new_version_and_finishes_the_old_ones_on_the_old(cluster, pools):
    """Re-planned in the old version's place, or (a shared pool) beside it in its sub-cluster."""
    emulated, client = cluster
    plugin = plugin_of(emulated.scheduler)
    shared = {"elastic": None, "dispatcher": "deferred", "pools": pools} if pools is not None else {}
    # a burst of 30 queued behind the new version's stages loading, then 20 behind the switch: 8x the SLO (1.6 s) let one
    # of the old miss on a loaded CI machine, 16x (3.2 s) one of the new in a clean-clone run
    with deploy(client, slo_factor=24.0, **shared) as svc:
        with Stream(svc, "a") as stream:
            old_xs = [torch.randn(1, *INPUT) for _ in range(30)]
            old = svc.map("b", old_xs)
            svc.update_model("b", version(100.0))
            new_xs = [torch.randn(1, *INPUT) for _ in range(20)]
            new = svc.map("b", new_xs)
        stream.check()
        assert ended(old) == {"result": 30} and ended(new) == {"result": 20}
        with torch.inference_mode():
            for future, x in zip(old, old_xs):
                torch.testing.assert_close(future.result(), version(0.0)(x), atol=1e-2, rtol=1e-2)
            for future, x in zip(new, new_xs):
                torch.testing.assert_close(future.result(), version(100.0)(x), atol=5e-2, rtol=1e-2)
        assert "b" not in plugin.models.ledgers and "b@v2" in plugin.models.ledgers  # the old version is retired
        if pools is not None:
            assert plugin.models.ledgers["b@v2"].dispatcher is plugin.models.ledgers["a"].dispatcher
        only_stages_of(emulated, ["a", "b@v2"])
        assert svc.status()["b"]["completed"] >= 20 and svc.plan.model("b").pipelines
        svc.update_model("b", version(200.0))  # and again: version 3
        assert svc.submit("b", torch.randn(1, *INPUT)).result(timeout=30).mean() > 150
    with deploy_shared(client):  # at once, under the same names, not elastic: the closed service's re-planned stages go
        only_stages_of(emulated, ["a", "b"])


def test_bad_changes_are_refused_naming_what_is_wrong(cluster):
    emulated, client = cluster
    with deploy(client) as svc:
        with pytest.raises(DeployError, match="model 'a' is already served by this service; update_model"):
            svc.add_model("a", small_cnn(), torch.randn(1, *INPUT))
        with pytest.raises(DeployError, match=r"unknown model 'zzz'; this service serves \['a', 'b'\]"):
            svc.remove_model("zzz")
        with pytest.raises(DeployError, match="unknown model 'zzz'"):
            svc.update_model("zzz", small_cnn())
        kept = r"update_model keeps the requests of model 'b' as they are: \(n, 3, 32, 32\).*\(n, 3, 16, 16\)"
        with pytest.raises(DeployError, match=kept):
            svc.update_model("b", small_cnn(), torch.randn(1, 3, 16, 16))
        with pytest.raises(DeployError, match="the module of 'c' must be a torch.nn.Module"):
            svc.add_model("c", lambda x: x, torch.randn(1, *INPUT))
        impossible = replace(profile_of("c"), slo_us=1.0)  # no pipeline meets a microsecond SLO
        with pytest.raises(DeployError, match="cannot serve"):
            svc.add_model("c", small_cnn(), torch.randn(1, *INPUT), profile=impossible)
        assert svc.models == ["a", "b"]
        assert client.gather(svc.map("b", [torch.randn(1, *INPUT)] * 4)) and "c" not in plugin_of(emulated.scheduler).models.ledgers
    with pytest.raises(DeployError, match=r"add_model\('c'\): the service is closed"):
        svc.add_model("c", small_cnn(), torch.randn(1, *INPUT))
    with deploy(client, names=("a",), elastic=None) as fixed:
        with pytest.raises(DeployError, match="this service keeps its plan .*elastic=ElasticSettings"):
            fixed.add_model("c", small_cnn(), torch.randn(1, *INPUT))


def test_the_changes_are_awaitable_with_an_asynchronous_client(cluster):
    emulated, _ = cluster

    async def change() -> None:
        async with Client(emulated.scheduler_address, asynchronous=True) as client:
            svc = await deploy(client, elastic=ElasticSettings())
            async with svc:
                await svc.add_model("c", small_cnn(), torch.randn(1, *INPUT), profile=profile_of("c"))
                assert (await svc.submit("c", torch.randn(1, *INPUT))).shape == (1, 10)
                await svc.update_model("c", version(100.0), profile=profile_of("c"))
                assert (await svc.submit("c", torch.randn(1, *INPUT))).mean() > 50
                await svc.remove_model("c")
                assert svc.models == ["a", "b"] and set((await svc.status())) == {"a", "b"}

    emulated.sync(change)


def deploy_shared(client, names=("a", "b"), slo_factor: float = 8.0, **pools):
    """``names`` on one shared pool of the cluster's four slots, under one deferred dispatcher."""
    return deploy(client, names, slo_factor, elastic=None, dispatcher="deferred", pools=SharedPools(**pools))


def serves_a_full_batch(client, svc, model: str) -> None:
    """``model`` answers a full batch of requests. Not one request: on a deferred pool a lone
    request waits for its window, to end a control-path margin (tens of ms) before its deadline,
    which a stall of the loaded test machine then takes; a full batch goes at once."""
    batch = max(pipeline.batch_size for pipeline in svc.plan.model(model).pipelines)
    assert all(out.shape == (1, 10) for out in client.gather(svc.map(model, [torch.randn(1, *INPUT) for _ in range(batch)])))


def test_a_shared_pool_takes_a_model_added_and_gives_up_one_removed_under_load_with_no_replan(cluster):
    emulated, client = cluster
    plugin = plugin_of(emulated.scheduler)
    with deploy_shared(client) as svc:
        shared, replans = plugin.models.ledgers["a"].dispatcher, len(plugin.elastic.history)
        with Stream(svc, "a") as stream:
            svc.add_model("c", version(50.0), torch.randn(1, *INPUT), profile=profile_of("c"))
        stream.check()
        assert plugin.models.ledgers["c"].dispatcher is shared and len(plugin.elastic.history) == replans  # it joined: no re-plan
        assert {a for _, _, a in plugin.models.ledgers["c"].stages} == set(plugin.models.slots)  # on every slot of it
        xs = [torch.randn(1, *INPUT) for _ in range(16)]  # two full batches: none waits for its window (serves_a_full_batch)
        with torch.inference_mode():
            for out, x in zip(client.gather(svc.map("c", xs)), xs):
                torch.testing.assert_close(out, version(50.0)(x), atol=5e-2, rtol=1e-2)
        assert [m.name for m in svc.plan.models] == ["a", "b", "c"]
        remove_b_under_load(svc)
        assert svc.models == ["a", "c"] and [m.name for m in svc.plan.models] == ["a", "c"]
        only_stages_of(emulated, ["a", "c"])
        serves_a_full_batch(client, svc, "c")  # the pool serves on without it


def test_a_model_joining_a_timeout_pool_of_per_model_waits_without_its_own_is_refused_before_any_stage_starts(cluster):
    emulated, client = cluster
    waits = SharedPools(timeout_ms={"a": 1.0, "b": 1.0})
    with deploy(client, ("a", "b"), elastic=None, dispatcher="timeout", pools=waits) as svc:
        with pytest.raises(DeployError, match=r"SharedPools.timeout_ms gives no wait for model\(s\) \['c'\]"):
            svc.add_model("c", version(0.0), torch.randn(1, *INPUT), profile=profile_of("c"))
        only_stages_of(emulated, ["a", "b"])


def test_a_model_that_does_not_fit_a_shared_pools_memory_is_refused_naming_it_and_the_pool_serves_on(cluster):
    emulated, client = cluster
    huge = ModelMemory(weights_bytes=30 * 10**9, activation_bytes=10**6)
    with deploy_shared(client, memory={"huge": huge}) as svc:
        with pytest.raises(DeployError, match=r"no sub-cluster can serve 'huge' beside its models: sub-cluster 0 \(a, b\): .*'huge'"):
            svc.add_model("huge", version(0.0), torch.randn(1, *INPUT), profile=profile_of("huge"))
        assert svc.models == ["a", "b"] and "huge" not in plugin_of(emulated.scheduler).models.ledgers
        only_stages_of(emulated, ["a", "b"])  # none of its stages started
        serves_a_full_batch(client, svc, "a")


def test_a_resplit_moves_a_model_to_the_idle_sub_cluster_under_load_and_loses_nothing(cluster):
    """Sub-cluster 0 serves "a" and "b" (two streams), sub-cluster 1 only "c" (idle): a re-split of
    one move takes "a" or "b" to sub-cluster 1 as a new version, beside "c"; every request of both
    streams ends, the one that stayed >= 99% on time, and the old version's stages go."""
    emulated, client = cluster
    plugin = plugin_of(emulated.scheduler)
    split = (SubCluster(("a", "b"), 2), SubCluster(("c",), 2))
    # the moved model's new stages load in this (in-process) cluster's one process, holding the GIL from the stayed model's
    # batches: a clean CI run had 3 of 245 of them late at 8x the SLO
    with deploy_shared(client, ("a", "b", "c"), slo_factor=16.0, subclusters=split) as svc:
        with pytest.raises(DeployError, match="max_moves must be an integer >= 1, got 0"):
            svc.resplit(max_moves=0)
        with Stream(svc, "a") as a_stream, Stream(svc, "b") as b_stream:
            moves = svc.resplit(max_moves=1)
        ((moved, (home, to)),) = moves.items()
        assert moved in ("a", "b") and (home, to) == (0, 1), moves
        stayed, moved_stream = ("b", a_stream) if moved == "a" else ("a", b_stream)
        (b_stream if moved == "a" else a_stream).check()
        tally = ended(moved_stream.futures)
        assert tally.get("result", 0) >= 0.99 * len(moved_stream.futures), tally
        ledgers = plugin.models.ledgers
        assert ledgers[f"{moved}@v2"].dispatcher is ledgers["c"].dispatcher is not ledgers[stayed].dispatcher
        only_stages_of(emulated, [stayed, f"{moved}@v2", "c"])
        assert svc.resplit(max_moves=1) == {}, "balanced now: nothing moves"
        assert svc.resplit(max_moves=1) == {}, "no request since: nothing to balance"
    with deploy_shared(client) as svc:
        with pytest.raises(DeployError, match="only a service of two or more shared sub-clusters is re-split"):
            svc.resplit()
    with pytest.raises(DeployError, match="SharedPools.resplit_s re-splits models over two or more sub-clusters; this deploy has 1"):
        deploy_shared(client, resplit_s=60.0)


def test_the_service_re_splits_on_its_own_every_resplit_s(cluster):
    """``SharedPools(resplit_s=)``: the same imbalance as above, and no call: an epoch moves one of
    the busy models to the idle sub-cluster while the streams run."""
    emulated, client = cluster
    plugin = plugin_of(emulated.scheduler)
    split = (SubCluster(("a", "b"), 2), SubCluster(("c",), 2))
    with deploy_shared(client, ("a", "b", "c"), slo_factor=16.0, subclusters=split, resplit_s=2.0) as svc:  # as above
        with Stream(svc, "a") as a_stream, Stream(svc, "b") as b_stream:
            moved = wait_until(lambda: [m for m in ("a", "b") if f"{m}@v2" in plugin.models.ledgers], timeout=30, what="an epoch's move")
        assert len(moved) == 1 and plugin.models.ledgers[f"{moved[0]}@v2"].dispatcher is plugin.models.ledgers["c"].dispatcher
        for stream in (a_stream, b_stream):
            tally = ended(stream.futures)
            assert tally.get("result", 0) >= 0.99 * len(stream.futures), tally
