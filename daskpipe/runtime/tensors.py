"""Small tensors as plain msgpack values: raw bytes, dtype name and shape; large ones, and large
request inputs, as Dask frames of their own.

Dask serializes a ``to_serialize(tensor)`` through its serializer families, a header and frames of
its own: right for large feature maps, whose bytes then travel without a copy, but for a tensor of
a few kilobytes the machinery costs more than the bytes (a quarter of a millisecond per hop on a
2-core machine). Feature maps and outputs up to :data:`PACKED_BYTES` travel packed instead.

Request inputs are raw bytes, not tensors: :mod:`daskpipe.runtime.inputs`.
"""

from __future__ import annotations

from typing import Any

import torch
from distributed.protocol import to_serialize

from daskpipe.runtime.inputs import FRAME_BYTES

PACKED_BYTES = FRAME_BYTES
"""Tensors up to this many bytes travel packed; larger ones through Dask's serialization."""


def pack_tensor(t: torch.Tensor) -> dict[str, Any]:
    """``t`` (on the host) as a msgpack-able dict; :func:`unpack_tensor` rebuilds it."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"bytes": raw, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def unpack_tensor(packed: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, packed["dtype"])
    if not packed["bytes"]:
        return torch.empty(packed["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(packed["bytes"]), dtype=dtype).reshape(packed["shape"])


def wire_tensor(t: torch.Tensor) -> Any:
    """What to put in a message for ``t``: packed when small, else Dask's serialization."""
    return pack_tensor(t) if t.nbytes <= PACKED_BYTES else to_serialize(t)


def from_wire(value: Any) -> Any:
    """A tensor sent by :func:`wire_tensor` (Dask has already deserialized a large one)."""
    return unpack_tensor(value) if isinstance(value, dict) else value
