"""daskpipe's own streams: which writes Dask may serialize off the event loop, and writes started in the sender's call."""

from __future__ import annotations

import asyncio

import torch
from distributed.comm import utils as comm_utils
from distributed.protocol import to_serialize

from daskpipe.runtime.tensors import pack_tensor
from daskpipe.runtime.wire.streams import allowed_offload, run_eagerly


def test_only_messages_that_may_be_large_are_left_to_dasks_offloading():
    threshold = comm_utils.OFFLOAD_THRESHOLD
    small = [{"op": "daskpipe-batch", "keys": ["k"], "inputs": [b"\0" * 1024], "route": [{"address": "tcp://a:1"}]}]
    assert not allowed_offload(small)
    forwarded = [
        {"op": "daskpipe-batch", "keys": ("k",), "sizes": (1,), "route": ({"address": "tcp://a:1"},), "data": pack_tensor(torch.zeros(16))}
    ]
    assert not allowed_offload(forwarded), "a batch a stage forwards as Dask read it (tuples for lists) is small"
    large_inputs = [{"op": "daskpipe-batch", "keys": ["a", "b"], "inputs": [b"\0" * (threshold // 2), b"\0" * (threshold // 2)]}]
    assert allowed_offload(large_inputs)
    many_outputs = [{"op": "daskpipe-done", "outputs": [pack_tensor(torch.zeros(16384))]} for _ in range(threshold // 65536 + 1)]
    assert allowed_offload(many_outputs), "a write that took many completions together is as large as their outputs"
    assert allowed_offload([{"op": "daskpipe-batch", "data": to_serialize(torch.zeros(4))}]), "Dask sizes what it serializes itself"


def test_a_coroutine_run_eagerly_ends_in_the_call_or_goes_on_as_a_task_where_it_waits():
    async def scenario():
        steps = []

        async def no_wait():
            steps.append("wrote")

        assert run_eagerly(no_wait()) is None and steps == ["wrote"]

        gate = asyncio.get_running_loop().create_future()

        async def waits():
            steps.append("started")
            steps.append(await gate)
            await asyncio.sleep(0)
            steps.append("ended")

        task = run_eagerly(waits())
        assert task is not None and steps[-1] == "started"
        gate.set_result("gate opened")
        await asyncio.wait_for(task, 5)
        assert steps[-2:] == ["gate opened", "ended"]

    asyncio.run(scenario())
