"""daskpipe's own streams: which writes Dask may serialize off the event loop."""

from __future__ import annotations

import torch
from distributed.comm import utils as comm_utils
from distributed.protocol import to_serialize

from daskpipe.runtime.streams import allowed_offload
from daskpipe.runtime.tensors import pack_tensor


def test_only_messages_that_may_be_large_are_left_to_dasks_offloading():
    threshold = comm_utils.OFFLOAD_THRESHOLD
    small = [{"op": "daskpipe-batch", "keys": ["k"], "inputs": [b"\0" * 1024], "route": [{"address": "tcp://a:1"}]}]
    assert not allowed_offload(small)
    large_inputs = [{"op": "daskpipe-batch", "keys": ["a", "b"], "inputs": [b"\0" * (threshold // 2), b"\0" * (threshold // 2)]}]
    assert allowed_offload(large_inputs)
    many_outputs = [{"op": "daskpipe-done", "outputs": [pack_tensor(torch.zeros(16384))]} for _ in range(threshold // 65536 + 1)]
    assert allowed_offload(many_outputs), "a write that took many completions together is as large as their outputs"
    assert allowed_offload([{"op": "daskpipe-batch", "data": to_serialize(torch.zeros(4))}]), "Dask sizes what it serializes itself"
