"""Tensors and inputs on the wire: small ones packed in msgpack, large ones as Dask frames the
scheduler forwards as they came."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from distributed.protocol import to_serialize
from distributed.protocol.core import dumps, loads

from daskpipe.runtime.tensors import (
    PACKED_BYTES,
    from_wire,
    output_nbytes,
    pack_output,
    split_output,
    unpack_output,
    unwire_output,
    wire_output,
    wire_tensor,
)
from daskpipe.runtime.wire.inputs import input_nbytes, wire_input
from daskpipe.runtime.wire.streams import packed_nbytes


def through_the_scheduler(message: dict, compression: str | None = None) -> tuple[list, dict, dict]:
    """``message`` written by a client, read and written on by the scheduler (which never
    deserializes what the client serialized), then read by a worker: the frames of each write,
    what the scheduler held, and what the worker got."""
    sent = dumps(message, context={"sender": "client", "recipient": "scheduler", "compression": compression})
    held = loads(sent, deserialize=False)
    forwarded = dumps(held, context={"sender": "scheduler", "recipient": "worker"})
    return [sent, forwarded], held, loads(forwarded, deserialize=True)


def test_a_large_input_is_a_frame_of_its_own_that_the_scheduler_forwards_and_counts_without_copying():
    small, large = b"s" * 100, np.random.default_rng(0).bytes(PACKED_BYTES + 1)
    writes, held, got = through_the_scheduler({"op": "daskpipe-submit", "inputs": [wire_input(small), wire_input(large)]})
    assert [input_nbytes(payload) for payload in held["inputs"]] == [100, PACKED_BYTES + 1]
    assert list(got["inputs"]) == [small, large]
    for frames in writes:  # the large input is a frame of its own in both writes, never inside msgpack's
        assert sum(len(memoryview(frame)) for frame in frames) > PACKED_BYTES + 1
        assert any(len(memoryview(frame)) == PACKED_BYTES + 1 for frame in frames)
        assert all(len(memoryview(frame)) < 4096 for frame in frames if len(memoryview(frame)) != PACKED_BYTES + 1)


def test_only_raw_bytes_count_as_an_input():
    _, held, _ = through_the_scheduler({"inputs": [to_serialize(np.zeros(10_000)), to_serialize({"a": 1}), "text", 3]})
    assert [input_nbytes(payload) for payload in held["inputs"]] == [None, None, None, None]
    assert wire_input("text") == "text" and wire_input(3) == 3  # a hostile client's payloads pass as they are, for the scheduler to refuse


def test_a_frame_compressed_on_the_way_counts_as_of_unknown_size():
    _, held, got = through_the_scheduler({"inputs": [wire_input(b"\0" * (PACKED_BYTES + 1))]}, compression="zlib")
    assert input_nbytes(held["inputs"][0]) == -1 and got["inputs"][0] == b"\0" * (PACKED_BYTES + 1)


def test_tensors_travel_packed_up_to_the_limit_and_as_dask_frames_beyond():
    small, large = torch.randn(4, 4), torch.randn(PACKED_BYTES // 4 + 1)
    _, _, got = through_the_scheduler({"data": [wire_tensor(small), wire_tensor(large)]})
    assert isinstance(wire_tensor(small), dict)
    for sent, received in zip((small, large), got["data"]):
        torch.testing.assert_close(from_wire(received), sent)


def test_outputs_of_any_form_split_per_request_and_pack_as_they_were():
    boxes = [torch.randn(k, 4) for k in (2, 0, 3)]
    per_sample = [{"boxes": b, "labels": torch.arange(len(b))} for b in boxes]  # a detector's: one dict per sample
    assert [len(part) for part in split_output(per_sample, [2, 1])] == [2, 1]
    batched = {"out": torch.randn(3, 2), "aux": (torch.randn(3), None)}  # a segmentation model's: rows of the batch
    first, second = split_output(batched, [1, 2])
    torch.testing.assert_close(second["out"], batched["out"][1:])
    assert second["aux"][1] is None and first["aux"][0].shape == (1,)
    with pytest.raises(ValueError, match="cannot split"):
        split_output({"total": torch.tensor(1.0)}, [1, 2])
    for output in (per_sample, first, torch.randn(2, 3)):
        packed = loads(dumps(pack_output(output)))  # msgpack gives lists back as tuples
        torch.testing.assert_close(unpack_output(packed), output)
        assert packed_nbytes(packed) == output_nbytes(output)


def test_an_output_of_any_size_and_form_crosses_the_wire_and_reads_back_as_it_was():
    small = {"out": torch.randn(2, 3), "aux": [torch.arange(4)]}
    large = {"out": torch.randn(PACKED_BYTES // 4 + 1), "aux": (torch.zeros(2),)}
    for output in (small, large, torch.randn(5)):
        got = loads(dumps({"op": "daskpipe-resolved", "outputs": [wire_output(output)]}))["outputs"][0]
        back = unwire_output(got)
        torch.testing.assert_close(back, output)
    assert "frame" in wire_output(large) and "frame" not in wire_output(small)
