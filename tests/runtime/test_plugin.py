"""The scheduler plugin on its own: installation by preload, and hooks that log instead of raising."""

from __future__ import annotations

import asyncio
import logging

import pytest
from distributed import Scheduler
from distributed.utils_test import captured_logger

import daskpipe
from daskpipe.runtime import messages
from daskpipe.runtime.errors import DeployError, RequestDropped
from daskpipe.runtime.messages import worker_slot
from daskpipe.runtime.plugin import DaskpipeSchedulerPlugin, plugin_of


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


def test_stream_handlers_log_their_own_errors_and_keep_the_stream():
    plugin = DaskpipeSchedulerPlugin()
    with captured_logger("daskpipe.runtime.plugin", level=logging.ERROR) as log:
        assert plugin.on_done(worker="tcp://x", model="m", dispatch=0, keys=["k"], nbytes=[1], timings=[]) is None  # no scheduler
    assert "on_done failed" in log.getvalue()


def test_serving_an_unknown_dispatcher_is_a_clear_error():
    plugin = DaskpipeSchedulerPlugin()
    with pytest.raises(DeployError, match="unknown dispatcher 'nope'"):
        asyncio.run(plugin.serve(model="m", plan={}, profile={}, stages=[], dispatcher="nope"))


def test_worker_slots_follow_the_worker_contract():
    gpu = worker_slot("tcp://a", "node-0/L4-1/0", {"daskpipe.slot": 1, "daskpipe.gpu.L4": 1, "daskpipe.slices.2": 1, "daskpipe.emulated": 1}, "10.0.0.1")
    assert (gpu.gpu, gpu.slices, gpu.server, gpu.emulated) == ("L4", 2, "node-0", True)
    plain = worker_slot("tcp://b", "w-1", {}, "10.0.0.2")
    assert (plain.gpu, plain.slices, plain.server, plain.emulated) == ("cpu", 1, "10.0.0.2", False)
    assert worker_slot("tcp://c", "node/x", {"daskpipe.slot": 1}, "h") is None


def test_drop_errors_name_the_reason_and_survive_pickling():
    import pickle

    exc = pickle.loads(pickle.dumps(RequestDropped("overload", "1000 queued", "resnet50", "k1")))
    assert exc.reason == "overload" and "dropped (overload): the model's queue was full; 1000 queued" in str(exc)
