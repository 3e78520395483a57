"""The runtime's emulated workers hold a co-located stage as long as the interference model says."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed import Client

from daskpipe.runtime.cluster import EmulatedCluster
from daskpipe.runtime.scheduler.control import ControlPath
from daskpipe.runtime.scheduler.plugin import plugin_of
from daskpipe.runtime.wire.messages import ServeSettings
from daskpipe.sched.api import Dispatch, Hop, Request, Reservation
from tests.colocation.helpers import cache_model, shared_gpu_plan, sliced_profile


def held_seconds(dask_scheduler, plan: dict, profile: dict, dilation: float) -> float:
    """Serve model "a" of ``plan`` on the first emulated L4/2 slot, dispatch one batch of two, and
    return the hold time the plugin sends its worker (runs on the scheduler's event loop)."""
    plugin = plugin_of(dask_scheduler)
    address = sorted(a for a, s in plugin.models.slots.items() if s.gpu == "L4" and s.slices == 2)[0]
    plugin.serving.start_serving(
        "a", plan, profile, [[0, 0, address, "stage-a"]], control=ControlPath(0.0), settings=ServeSettings(time_dilation=dilation)
    )
    sent = []
    real_send = plugin.links.to_workers.send
    plugin.links.to_workers.send = lambda worker, msg: sent.append(msg)
    try:
        ledger = plugin.models.ledgers["a"]
        requests = [Request(f"colocated-{dilation}-{plan['models'][-1]['name']}-{i}", "a", 0.0, 10.0) for i in range(2)]
        for r in requests:  # as ``on_submit`` queues a request
            dask_scheduler.new_task(r.id, None, "released")
            ledger.queued[r.id] = (b"", 1)
        plugin.models.act(ledger, "a", [Dispatch(1, "a", 0, 2, requests, (Hop(0, address, Reservation(address, 0.0, 1.0)),))])
    finally:
        plugin.links.to_workers.send = real_send
        plugin.models.ledgers.pop("a")
    (message,) = sent
    return message["route"][0]["hold_s"]


@pytest.fixture(scope="module")
def l4_halves():
    with EmulatedCluster({"L4": 1}, slices=2, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        yield client


def test_an_emulated_colocated_stage_is_held_longer_than_a_solo_one(l4_halves):
    model = cache_model()
    profile = sliced_profile("a", 4.0, slo_ms=200.0).to_dict()
    together = shared_gpu_plan(model, [("a", 0.5), ("b", 0.5)]).to_dict()
    alone = shared_gpu_plan(model, [("a", 0.5)]).to_dict()
    held_together = l4_halves.run_on_scheduler(held_seconds, plan=together, profile=profile, dilation=2.0)
    held_alone = l4_halves.run_on_scheduler(held_seconds, plan=alone, profile=profile, dilation=2.0)
    from daskpipe.colocation.latency import Colocated

    assert held_together == pytest.approx(2.0 * model.exec_ms("L4", Colocated("a", 0.5, 2), [Colocated("b", 0.5, 2)]) / 1000)
    assert held_alone == pytest.approx(2.0 * model.exec_ms("L4", Colocated("a", 0.5, 2)) / 1000)
    assert held_together > 1.05 * held_alone


def sliced_tiny_profile(name: str, base_ms: float):
    """TinyCNN's blocks with tables on whole and half L4s (so the share can be fitted, and every
    co-located partition lands on a half-L4 worker)."""
    from tests.runtime.helpers import two_stage

    blocked, _ = two_stage(name)
    # the SLO leaves a loaded machine room: the test is about placement and outputs, not latency
    sliced = sliced_profile(name, base_ms, slo_ms=3000.0, gpus=("L4",), slices=(1, 2))
    return dataclasses.replace(blocked, latency_us=sliced.latency_us, slo_us=sliced.slo_us)


def test_deploy_with_a_colocation_strategy_shares_one_gpu_between_models(l4_halves):
    import daskpipe
    from daskpipe.plan.options import PlannerOptions
    from tests.runtime.helpers import example, tiny_model

    names = ("tiny-a", "tiny-b")
    profiles = {"tiny-a": sliced_tiny_profile("tiny-a", 4.0), "tiny-b": sliced_tiny_profile("tiny-b", 6.0)}
    svc = daskpipe.deploy(
        l4_halves,
        {n: tiny_model() for n in names},
        example_inputs={n: example() for n in names},
        profiles=profiles,
        planner=PlannerOptions(strategy="inss"),
    )
    try:
        parts = [p.partitions[0] for m in svc.plan.models for p in m.pipelines]
        assert {p.device for p in parts} == {"L4-0"} and len(parts) == 2 and all(p.slices == 2 for p in parts)
        xs = [torch.randn_like(example()) for _ in range(4)]
        outputs = l4_halves.gather([svc.submit(n, x) for n in names for x in xs])
        with torch.inference_mode():
            expected = [tiny_model()(x) for x in xs] * 2
        for out, ref in zip(outputs, expected):  # one partition: no fp16 hand-over
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    finally:
        svc.close()
