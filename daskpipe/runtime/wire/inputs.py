"""Request inputs on the wire: held by their client and fetched by the first stage, or, when small,
riding the submission as raw bytes. No torch here: the scheduler side imports this.

One Python process cannot relay a cluster's inputs: with every 6.3 MB frame read from its client
and written on to a first stage, the scheduler moved 12.6 MB and spent milliseconds of CPU per
request, about a thousand images a second at most. So the submission carries an input's byte
count only, the client keeps the bytes until the request has ended, and the worker that runs the
batch's first stage fetches them from the client when the batch is dispatched (Symphony's backends
read their inputs from the frontends the same way). An input of at most
:data:`INLINE_INPUT_BYTES_CONFIG` bytes still rides the submission, where the fetch's round trip
would cost more than the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distributed.protocol import Serialized, to_serialize

from daskpipe.config import setting

FRAME_BYTES = 65536
"""Raw bytes above this size travel as a Dask frame of their own, which Dask's comms write and the
scheduler keeps without copying; a ``bin`` inside msgpack is copied out of the message it came in.
The frame is sent as a ``memoryview``, which Dask deserializes as a view of the buffer it read
into: sent as ``bytes``, the receiver joined the frame into new bytes, a copy of every input
(0.5 ms and more of a first stage's CPU per 6.3 MB frame)."""
INLINE_INPUT_BYTES_CONFIG = "daskpipe.inline-input-bytes"
"""Dask config key: inputs of at most this many bytes ride the submission through the scheduler;
larger ones are fetched from their client by the first stage (0: every input is fetched)."""


TRIAL_INPUTS = 400
"""Zero inputs a deploying client holds for its deploy's trial of the control path, one per trial
batch at most (:mod:`daskpipe.runtime.scheduler.trial`): the trial's first stages fetch them from
the client, as they fetch served inputs."""
TRIAL_KEY_PREFIX = "daskpipe-trial-"
"""How the keys of a trial's inputs start: no request's future holds them."""


@dataclass(frozen=True, slots=True)
class HeldInput:
    """What the scheduler knows of an input its client holds: who holds it, and its size."""

    client: str
    nbytes: int


def inline_input_bytes() -> int:
    """The configured :data:`INLINE_INPUT_BYTES_CONFIG` (read, and the config checked, once per client stream)."""
    return int(setting(INLINE_INPUT_BYTES_CONFIG))


def wire_input(raw: Any) -> Any:
    """What to put in a message for a request's raw input bytes: inline when small, else a frame of its own."""
    return to_serialize(memoryview(raw)) if isinstance(raw, bytes) and len(raw) > FRAME_BYTES else raw


def input_nbytes(payload: Any) -> int | None:
    """The size of a request's input as the scheduler holds it: raw bytes inline, the frame
    :func:`wire_input` made, or a :class:`HeldInput`; ``None`` for anything else (no other object
    is an input). A frame compressed on the way (``distributed.comm.compression``) counts as
    ``-1``: its size is unknown here, and the first stage checks it when it rebuilds the batch."""
    if isinstance(payload, bytes):
        return len(payload)
    if isinstance(payload, HeldInput):
        return payload.nbytes
    if not isinstance(payload, Serialized) or payload.header.get("type") != "memoryview" or payload.header.get("serializer") != "dask":
        return None
    if any(payload.header.get("compression") or ()):
        return -1
    return sum(memoryview(frame).nbytes for frame in payload.frames)


def held_count(value: Any) -> bool:
    """Whether a submission's input entry is the byte count of an input its client holds."""
    return type(value) is int and value >= 0
