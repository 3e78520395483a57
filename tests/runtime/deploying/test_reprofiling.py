from __future__ import annotations

import asyncio
import pickle

from daskpipe.plan.options import PlannerOptions
from daskpipe.plan.schema import Plan
from daskpipe.profiles.store import ProfileStore
from daskpipe.runtime.client.service import inventory
from daskpipe.runtime.deploying.profiling import profile_on_cluster
from daskpipe.runtime.deploying.reprofiling import kind_tables, profile_missing
from daskpipe.runtime.scheduler.elastic.state import Deployment, ModelSpec
from daskpipe.runtime.wire.messages import ServeSettings
from tests.runtime.helpers import example, tiny_model


def test_a_real_kind_is_measured_on_its_worker_the_way_deploy_measures_it(fake_gpu_cluster):
    cluster, client = fake_gpu_cluster
    slots = inventory(client)
    l4 = [s for s in slots if s.gpu == "L4"]
    result = profile_on_cluster(client, l4, "tiny", tiny_model(), example(), slo_us=None, num_blocks=2, batch_sizes=(1, 2, 4))
    blocks = [pickle.dumps([block]) for block in result.blocked.blocks]
    shapes = [result.blocked.input_shape, *result.blocked.boundary_shapes]
    t4 = next(s.address for s in slots if s.gpu == "T4")
    measured = client.submit(
        kind_tables, "tiny", blocks, shapes, result.blocked.output_shape, result.profile, [("T4", 1)], True, workers=[t4]
    ).result()
    assert list(measured) == [("T4", 1)] and measured[("T4", 1)].shape == result.profile.table("L4", 2).shape
    estimated = client.submit(
        kind_tables, "tiny", blocks, shapes, result.blocked.output_shape, result.profile, [("V100", 1)], False, workers=[t4]
    ).result()
    assert list(estimated) == [("V100", 1)] and (estimated[("V100", 1)] > 0).all()


def test_kinds_that_join_are_measured_or_estimated_and_a_stored_table_is_reused(fake_gpu_cluster, tmp_path):
    cluster, client = fake_gpu_cluster
    slots = inventory(client)
    store = tmp_path / "store"
    l4 = [s for s in slots if s.gpu == "L4"]
    result = profile_on_cluster(
        client, l4, "tiny", tiny_model(), example(), slo_us=None, num_blocks=2, batch_sizes=(1, 2, 4), store=ProfileStore(store)
    )
    blocks = [pickle.dumps([block]) for block in result.blocked.blocks]
    shapes = [result.blocked.input_shape, *result.blocked.boundary_shapes]
    spec = ModelSpec(blocks, shapes, tuple(result.blocked.output_shape), "float32", result.profile)
    dep = Deployment({"tiny": spec}, Plan(0.0, ()), {}, PlannerOptions(), {}, {"tiny": 1.0}, ServeSettings(), profile_store=str(store))
    names = {address: str(ws.name) for address, ws in cluster.scheduler.workers.items()}

    async def profile() -> None:
        from distributed import Client

        own = await Client(cluster.scheduler.address, asynchronous=True)
        try:
            await profile_missing(dep, slots, names, lambda: asyncio.sleep(0, own))
        finally:
            await own.close()

    client.sync(profile)
    first = spec.profile
    assert (first.origin("T4", 1), first.origin("A10", 1)) == ("measured", "estimated")
    stored = {path: path.stat().st_mtime_ns for path in store.rglob("*.json")}
    assert len(stored) == 2  # L4 by deploy's profiling, T4 by the re-profiling
    spec.profile = result.profile
    client.sync(profile)  # the T4 table is read from the store now, not measured again
    assert {path: path.stat().st_mtime_ns for path in store.rglob("*.json")} == stored and (
        spec.profile.table("T4", 1) == first.table("T4", 1)
    ).all()
