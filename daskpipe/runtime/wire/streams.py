"""daskpipe's own streams: Dask comms written as soon as there is something to send.

Dask's batched streams hold a message that follows another within their interval (client ->
scheduler 10 ms, scheduler -> worker 5 ms, worker -> scheduler 2 ms, scheduler -> client 2 ms,
worker -> worker 1 ms): right for task graphs, but each request crosses five of them, and at GPU
SLOs of 20-170 ms those waits were the runtime's whole overhead. daskpipe opens streams of its own
with ``distributed.comm.connect`` (so TCP, TLS and UCX alike, with the cluster's security) and
sends on them with :class:`ImmediateSend`: the first message of an event-loop turn on an idle
stream is written in the sender's call, and messages sent after it in the same turn, or while a
write is in progress, go out together in the next one, so batching still happens exactly when
the stream is busy. That is Dask's ``BatchedSend`` with no interval, without
its timer: with ``interval=0`` it still arms and fires a timeout after every write, and a
ping-pong over two processes took 0.42-0.50 ms a round trip with it against 0.35 ms with this.

A receiving end is Dask's own ``handle_stream``: workers take the ``connection_stream`` op that
every Dask server has, the scheduler the :data:`~daskpipe.runtime.wire.messages.STREAM` handler of
daskpipe's plugin, which adds who sent it (``worker=`` or ``client=``) to each message.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from typing import Any, Callable, Coroutine, Mapping

from distributed.comm import CommClosedError, connect
from distributed.comm import utils as comm_utils

from daskpipe.runtime.errors import DeployError
from daskpipe.runtime.wire import messages

logger = logging.getLogger(__name__)


class ImmediateSend:
    """Messages to one comm, written at once (the first of a loop turn) or on the next event-loop
    turn; those queued during a write go out together with the next. Messages sent before
    :meth:`start` wait for it. Must be used from the event loop the comm lives on."""

    def __init__(self) -> None:
        self.comm: Any = None
        self.buffer: list = []
        self.please_stop = False
        self._writer: asyncio.Future | None = None
        self._wrote_this_turn = False

    def start(self, comm: Any) -> None:
        self.comm = comm
        self._write_soon()

    def send(self, *messages: Any) -> None:
        """Queue ``messages``. On an idle stream the first send of a loop turn is written at once,
        in the caller's call (one loop turn sooner: 40-50 us a hop on a 2-core machine); what
        follows it in the same turn goes out together on the next."""
        if self.please_stop or (self.comm is not None and self.comm.closed()):
            raise CommClosedError(f"{self.comm!r} is closed")
        self.buffer.extend(messages)
        if self.comm is None or self._wrote_this_turn or not (self._writer is None or self._writer.done()):
            self._write_soon()
            return
        self._wrote_this_turn = True
        asyncio.get_running_loop().call_soon(self._end_turn)
        self._writer = run_eagerly(self._write())

    def _end_turn(self) -> None:
        self._wrote_this_turn = False
        self._write_soon()

    def _write_soon(self) -> None:
        if self.comm is not None and self.buffer and (self._writer is None or self._writer.done()):
            self._writer = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        try:
            while self.buffer and not self.please_stop:
                payload, self.buffer = self.buffer, []
                comm = self.comm
                allowed, comm.allow_offload = comm.allow_offload, allowed_offload(payload)
                try:
                    await comm.write(payload, on_error="raise")
                finally:
                    comm.allow_offload = allowed
        except CommClosedError:
            self.abort()
        except Exception:
            logger.exception("daskpipe: a write to %r failed; the stream is closed", self.comm)
            self.abort()

    async def close(self, timeout: float = 2.0) -> None:
        """Write what is queued, then close the comm."""
        if self._writer is not None:
            await asyncio.wait([self._writer], timeout=timeout)
        self.please_stop = True
        if self.comm is not None and not self.comm.closed():
            await self.comm.close()

    def abort(self) -> None:
        self.please_stop = True
        self.buffer = []
        if self.comm is not None and not self.comm.closed():
            self.comm.abort()


def run_eagerly(coro: Coroutine[Any, Any, None]) -> asyncio.Future | None:
    """Run ``coro`` in this call up to its first wait (a Dask TCP write of a message serialized on
    the loop has none); ``None`` if it ended there, else the task that finishes it. What Python
    3.12's eager tasks do."""
    try:
        waiting_on = coro.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_step_on(coro, waiting_on))


async def _step_on(coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
    """Step a started coroutine as a task does: resume it each time what it waits on is done."""
    while True:
        if waiting_on is None:  # a bare yield: the next loop turn
            await asyncio.sleep(0)
        else:
            await asyncio.wait([waiting_on])
        try:
            waiting_on = coro.send(None)
        except StopIteration:
            return


_PLAIN = (str, int, float, bool, type(None), list, tuple, dict)
"""Values msgpack writes as they are; a message Dask read has tuples where it was sent lists."""


def packed_nbytes(packed: dict[str, Any]) -> int:
    """Bytes of the tensors in an output :func:`~daskpipe.runtime.tensors.pack_output` packed."""
    if "bytes" in packed:
        return len(packed["bytes"])
    items = packed.get("tuple") or packed.get("list") or [value for _, value in packed.get("dict", [])]
    return sum(packed_nbytes(item) for item in items)


def bulk_nbytes(messages: list[dict[str, Any]]) -> float:
    """The bytes daskpipe's ``messages`` carry in bulk inside msgpack, counted where daskpipe puts
    them: requests' raw ``inputs`` (a large one is a frame of its own, which no serializing touches),
    packed tensors' ``bytes`` (``data``, ``outputs``); ``inf`` when one carries something Dask
    serializes itself (a large tensor, an exception), whose size Dask measures."""
    total = 0
    for message in messages:
        if not all(isinstance(value, _PLAIN) for value in message.values()):
            return math.inf
        inputs: list[Any] = message.get("inputs") or []
        outputs: list[dict[str, Any]] = message.get("outputs") or []
        data = message.get("data")
        total += sum(len(raw) for raw in inputs if isinstance(raw, bytes)) + sum(packed_nbytes(packed) for packed in outputs)
        if isinstance(data, dict):
            total += len(data["bytes"])
    return total


def allowed_offload(messages: list[dict]) -> bool:
    """Whether Dask may serialize ``messages`` off the event loop: only when they may be large.
    Deciding costs Dask a ``sizeof`` of the whole message, 23 us for one batch message against
    2 us to pack it, on every write of every hop (a request crosses four)."""
    threshold = comm_utils.OFFLOAD_THRESHOLD
    return bool(threshold) and bulk_nbytes(messages) >= threshold


async def open_comm(address: str, connection_args: Mapping[str, Any], handshake: Mapping[str, Any], name: str) -> Any:
    """A comm to ``address``, named ``name``, whose first message ``handshake`` makes the peer read it as a stream."""
    comm = await connect(address, **connection_args)
    comm.name = name
    await comm.write(dict(handshake))
    return comm


PEER_HANDSHAKE = {"op": "connection_stream", "reply": False}
"""Opens a stream to a Dask worker: its ``handle_stream`` runs the messages' stream handlers."""


class Streams:
    """Outgoing immediate streams of one process, one per peer address, opened on first use.

    ``handshake`` is the first message on each new comm (what makes the peer read it as a
    stream). Sends to a peer whose stream is still opening queue in its :class:`ImmediateSend` and go
    out once it is open; a stream found closed is replaced, so a peer that came back is reached
    again. Must be used from the event loop it was made on.
    """

    def __init__(self, connection_args: Mapping[str, Any], handshake: Mapping[str, Any], name: str):
        self.connection_args = dict(connection_args)
        self.handshake = dict(handshake)
        self.name = name
        self._streams: dict[str, ImmediateSend] = {}
        self._opening: dict[str, asyncio.Task] = {}

    def send(self, address: str, message: Mapping[str, Any]) -> None:
        self._stream(address).send(message)

    def open(self, address: str) -> asyncio.Task | None:
        """Start opening the stream to ``address`` now; the task to await, ``None`` if it is open."""
        self._stream(address)
        return self._opening.get(address)

    def is_open(self, address: str) -> bool:
        stream = self._streams.get(address)
        return stream is not None and stream.comm is not None and not stream.comm.closed()

    def peer_addresses(self) -> list[str]:
        """Where the open streams' comms lead (the protocol in use, as the comm reports it)."""
        return [stream.comm.peer_address for stream in self._streams.values() if stream.comm is not None and not stream.comm.closed()]

    def _stream(self, address: str) -> ImmediateSend:
        stream = self._streams.get(address)
        if stream is not None and not stream.please_stop and not (stream.comm is not None and stream.comm.closed()):
            return stream
        stream = self._streams[address] = ImmediateSend()
        self._opening[address] = asyncio.ensure_future(self._connect(address, stream))
        return stream

    async def _connect(self, address: str, stream: ImmediateSend) -> None:
        try:
            stream.start(await open_comm(address, self.connection_args, self.handshake, self.name))
        except Exception as exc:  # the peer is gone: its messages are lost with it (the scheduler retries lost batches)
            logger.warning("daskpipe: could not open a %s stream to %s: %r", self.name, address, exc)
            stream.please_stop = True
            if self._streams.get(address) is stream:
                del self._streams[address]
        finally:
            if self._opening.get(address) is asyncio.current_task():
                del self._opening[address]

    async def close(self) -> None:
        """Flush and close every stream."""
        for task in list(self._opening.values()):
            task.cancel()
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            if stream.comm is not None:
                try:
                    await stream.close()
                except Exception:  # closing anyway: a peer that is gone cannot take the flush
                    stream.abort()


class Pings:
    """PING -> PONG round trips from the scheduler to stage workers, each matched by its token."""

    def __init__(self) -> None:
        self._pongs: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()

    async def round_trips(self, send: Callable[[str, dict], None], address: str, count: int, timeout: float = 10.0) -> list[float]:
        """Seconds of ``count`` round trips to ``address``'s stage worker (``send`` writes to it),
        after one to open the streams."""
        times = []
        for i in range(count + 1):
            token = next(self._tokens)
            pong = self._pongs[token] = asyncio.get_running_loop().create_future()
            sent = time.monotonic()
            send(address, {"op": messages.PING, "token": token})
            try:
                await asyncio.wait_for(pong, timeout)
            except asyncio.TimeoutError:
                raise DeployError(f"worker {address} did not answer daskpipe's ping within {timeout:g} s") from None
            finally:
                self._pongs.pop(token, None)
            if i:
                times.append(time.monotonic() - sent)
        return times

    def on_pong(self, worker: str, token: int) -> None:
        pong = self._pongs.get(token)
        if pong is not None and not pong.done():
            pong.set_result(None)
