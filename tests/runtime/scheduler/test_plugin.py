"""The scheduler plugin: installation by preload, hooks that log instead of raising, and every
data plane of the registry served on a real cluster."""

from __future__ import annotations

import asyncio
import logging
import re

import dask.config
import pytest
from distributed import Scheduler
from distributed.utils_test import captured_logger

import daskpipe
from daskpipe.runtime.errors import DeployError, RequestDropped
from daskpipe.runtime.scheduler.plugin import DaskpipeSchedulerPlugin, plugin_of
from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.messages import ServeSettings, worker_slot
from daskpipe.sched.registry import DATAPLANES


async def _preloaded_scheduler_has_handlers() -> None:
    async with Scheduler(preload=["daskpipe"], dashboard_address=":0", port=0) as scheduler:
        plugin = plugin_of(scheduler)
        assert isinstance(plugin, DaskpipeSchedulerPlugin)
        assert {messages.INVENTORY, messages.SERVE, messages.CLOSE, messages.STATUS} <= set(scheduler.handlers)
        assert {messages.SUBMIT, messages.FEEDBACK, messages.DONE, messages.FAILED} <= set(scheduler.stream_handlers)


def test_dask_scheduler_preload_daskpipe_installs_the_plugin_without_pickle():
    import asyncio

    asyncio.run(_preloaded_scheduler_has_handlers())


def test_dask_setup_refuses_a_worker():
    with pytest.raises(TypeError, match="scheduler preload"):
        daskpipe.dask_setup(object())


def test_the_preload_refuses_a_bad_key_naming_it_before_installing():
    scheduler = Scheduler(dashboard_address=None, port=0)
    with (
        dask.config.set({"daskpipe.scheduler-extensions": "notalist"}),
        pytest.raises(daskpipe.ConfigError, match="^daskpipe.scheduler-extensions: "),
    ):
        daskpipe.dask_setup(scheduler)
    assert DaskpipeSchedulerPlugin.name not in scheduler.plugins


def test_stream_handlers_log_their_own_errors_and_keep_the_stream():
    plugin = DaskpipeSchedulerPlugin()
    with captured_logger("daskpipe.runtime.scheduler.batches", level=logging.ERROR) as log:
        assert plugin.batches.on_done(worker="tcp://x", model="m", dispatch=0, keys=["k"], nbytes=[1], timings=[]) is None  # no scheduler
    assert "on_done failed" in log.getvalue()


def test_serving_an_unknown_dispatcher_is_a_clear_error():
    plugin = DaskpipeSchedulerPlugin()
    with pytest.raises(DeployError, match="unknown dispatcher 'nope'"):
        asyncio.run(plugin.serving.serve(model="m", plan={}, profile={}, stages=[], serving=ServeSettings(dispatcher="nope").to_wire()))


def test_serve_settings_that_are_wrong_are_refused_naming_the_field():
    plugin = DaskpipeSchedulerPlugin()
    for serving, problem in [
        ({"dispatcher": 3}, "Expected `str`, got `int` - at `$.dispatcher`"),
        ({"time_dilation": 0.0}, "time_dilation must be > 0, got 0.0"),
        ({"max_queue": 5}, "Object contains unknown field `max_queue`"),
    ]:
        with pytest.raises(DeployError, match=re.escape(problem)):
            asyncio.run(plugin.serving.serve(model="m", plan={}, profile={}, stages=[], serving=serving))


def test_worker_slots_follow_the_worker_contract():
    gpu = worker_slot(
        "tcp://a", "node-0/L4-1/0", {"daskpipe.slot": 1, "daskpipe.gpu.L4": 1, "daskpipe.slices.2": 1, "daskpipe.emulated": 1}, "10.0.0.1"
    )
    assert (gpu.gpu, gpu.slices, gpu.server, gpu.emulated) == ("L4", 2, "node-0", True)
    plain = worker_slot("tcp://b", "w-1", {}, "10.0.0.2")
    assert (plain.gpu, plain.slices, plain.server, plain.emulated) == ("cpu", 1, "10.0.0.2", False)
    assert worker_slot("tcp://c", "node/x", {"daskpipe.slot": 1}, "h") is None


def test_drop_errors_name_the_reason_and_survive_pickling():
    import pickle

    exc = pickle.loads(pickle.dumps(RequestDropped("overload", "1000 queued", "resnet50", "k1")))
    assert exc.reason == "overload" and "dropped (overload): the model's queue was full; 1000 queued" in str(exc)


@pytest.fixture(scope="module")
def two_slots():
    """One emulated L4 and one emulated T4 slot in this process (TCP)."""
    from distributed import Client

    from daskpipe.runtime.cluster import EmulatedCluster

    with EmulatedCluster({"L4": 1, "T4": 1}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        yield cluster, client


DILATION = 10.0  # the plan's 457 requests/s become 46: two cores carry 70% of it with room to spare


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dataplane", DATAPLANES)
def test_every_data_plane_serves_70_percent_of_the_plans_capacity_on_time(two_slots, dataplane):
    """Each registered data plane, staged ones (reactive: one partition per batch, the data parked
    between them) included, serves an open-loop stream at 70% of the plan's capacity with at least
    99% of the requests on time, and the outputs are the model's. Balanced stages: the eager and
    timeout policies decide on the first stage only and fall behind a slower second one (so does
    the simulator, tests/sim/test_simulate.py)."""
    import torch
    from distributed import wait

    from tests.helpers import paced
    from tests.runtime.helpers import example, tiny_model, two_stage

    cluster, client = two_slots
    profile, plan = two_stage(slo_ms=60.0, stage_ms=(5.0, 5.0))
    capacity = plan.model("tiny").throughput / DILATION
    model = tiny_model()
    with daskpipe.deploy(
        client,
        {"tiny": model},
        example_inputs={"tiny": example()},
        plan=plan,
        profiles={"tiny": profile},
        time_dilation=DILATION,
        dispatcher=dataplane,
    ) as svc:
        generator = torch.Generator().manual_seed(2)
        xs = [torch.randn(1, *example().shape[1:], generator=generator) for _ in range(8)]
        sent = iter(range(1_000_000))
        futures = paced(lambda: svc.submit("tiny", xs[next(sent) % len(xs)]), 0.7 * capacity, seconds=2.5)
        _, pending = wait(futures, timeout=30)
        status = svc.status()["tiny"]
        assert not pending and all(f.status == "finished" for f in futures), [f.exception() for f in futures if f.status == "error"][:3]
        assert status["submitted"] == len(futures) >= 0.7 * capacity * 2.5 * 0.7
        assert status["on_time"] / status["submitted"] >= 0.99, status
        assert status["queued"] == status["in_flight"] == 0
        with torch.inference_mode():
            for i, future in enumerate(futures[: len(xs)]):
                torch.testing.assert_close(future.result(), model.tail(model.head(xs[i]).half().float()), atol=1e-4, rtol=1e-4)
    if dataplane == "reactive":  # a batch per partition
        assert status["batches"] > 1.5 * len(futures) / 4


def test_deploying_an_unknown_data_plane_names_the_known_ones(two_slots):
    from tests.runtime.helpers import example, tiny_model, two_stage

    cluster, client = two_slots
    profile, plan = two_stage()
    with pytest.raises(
        DeployError, match="unknown dispatcher 'fastest'; known: ppipe, ppipe-two-pass, deferred, eager, timeout, reactive, hybrid"
    ):
        daskpipe.deploy(
            client, {"tiny": tiny_model()}, example_inputs={"tiny": example()}, plan=plan, profiles={"tiny": profile}, dispatcher="fastest"
        )
