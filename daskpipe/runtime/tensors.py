"""Small tensors as plain msgpack values: raw bytes, dtype name and shape; large ones, and large
request inputs, as Dask frames of their own.

Dask serializes a ``to_serialize(tensor)`` through its serializer families, a header and frames of
its own: right for large feature maps, whose bytes then travel without a copy, but for a tensor of
a few kilobytes the machinery costs more than the bytes (a quarter of a millisecond per hop on a
2-core machine). Feature maps and outputs up to :data:`PACKED_BYTES` travel packed instead.

Request inputs are raw bytes, not tensors: :mod:`daskpipe.runtime.wire.inputs`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from distributed.protocol import to_serialize
from torch.utils._pytree import tree_leaves, tree_map

from daskpipe.runtime.wire.inputs import FRAME_BYTES

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


def pack_output(output: Any) -> Any:
    """A request's output (a tensor, or tuples, lists and dicts of them, as the model returns) as
    msgpack-able values; :func:`unpack_output` rebuilds it. Containers are tagged, so that a dict
    the model returns is never read as a packed tensor."""
    if isinstance(output, torch.Tensor):
        return pack_tensor(output)
    if isinstance(output, (tuple, list)):
        return {"tuple" if isinstance(output, tuple) else "list": [pack_output(item) for item in output]}
    if isinstance(output, dict):
        return {"dict": [[key, pack_output(value)] for key, value in output.items()]}
    return {"value": output}


def unpack_output(packed: dict[str, Any]) -> Any:
    if "bytes" in packed:
        return unpack_tensor(packed)
    if "tuple" in packed:
        return tuple(unpack_output(item) for item in packed["tuple"])
    if "list" in packed:
        return [unpack_output(item) for item in packed["list"]]
    if "dict" in packed:
        return {key: unpack_output(value) for key, value in packed["dict"]}
    return packed["value"]


def output_nbytes(output: Any) -> int:
    """Bytes of the tensors in a request's output."""
    if isinstance(output, torch.Tensor):  # the common case, on every request's way: no tree walk
        return output.nbytes
    return sum(t.nbytes for t in tree_leaves(output) if isinstance(t, torch.Tensor))


def split_output(output: Any, sizes: Sequence[int]) -> list[Any]:
    """A batch's output as one output per request of ``sizes`` samples, each copied out of the
    batch so that it frees alone, on the host: a tensor by rows; a list with one entry per sample
    (as detection models return) by entries; any other tuple, list or dict by its tensors' rows."""
    if isinstance(output, torch.Tensor):
        return [chunk.clone() for chunk in torch.split(output.cpu(), list(sizes))]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    total = bounds[-1]
    on_host = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, output)
    if isinstance(output, list) and len(output) == total and not all(isinstance(item, torch.Tensor) for item in output):
        return [on_host[a:b] for a, b in zip(bounds, bounds[1:])]
    tensors = [t for t in tree_leaves(on_host) if isinstance(t, torch.Tensor)]
    if not tensors or any(t.dim() == 0 or t.shape[0] != total for t in tensors):
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors) or "no tensors"
        raise ValueError(
            f"cannot split an output of {type(output).__name__} holding tensors {shapes} into requests of {list(sizes)} samples"
        )
    return [tree_map(lambda t: t[a:b].clone() if isinstance(t, torch.Tensor) else t, on_host) for a, b in zip(bounds, bounds[1:])]


def wire_output(output: Any) -> Any:
    """What to put in a message for a request's output: packed when its tensors are small
    (:func:`pack_output`), else a Dask frame of its own, tagged; :func:`unwire_output` reads either."""
    return pack_output(output) if output_nbytes(output) <= PACKED_BYTES else {"frame": to_serialize(output)}


def unwire_output(value: dict[str, Any]) -> Any:
    """The output :func:`wire_output` sent (Dask has already deserialized a frame)."""
    return value["frame"] if "frame" in value else unpack_output(value)


def wire_tensor(t: torch.Tensor) -> Any:
    """What to put in a message for ``t``: packed when small, else Dask's serialization."""
    return pack_tensor(t) if t.nbytes <= PACKED_BYTES else to_serialize(t)


def from_wire(value: Any) -> Any:
    """A tensor sent by :func:`wire_tensor` (Dask has already deserialized a large one)."""
    return unpack_tensor(value) if isinstance(value, dict) else value
