"""The client's end of daskpipe's fast path: its own stream to the scheduler, and futures whose
small results arrive with the completion.

Requests leave on the client's :class:`ClientStream` (an :class:`~daskpipe.runtime.streams.ImmediateSend`, see
:mod:`daskpipe.runtime.streams`), and the scheduler answers on the same comm with
:data:`~daskpipe.runtime.messages.RESOLVED` as soon as a batch's last stage reports: the futures
finish at once, without waiting out Dask's report stream. A batch whose outputs are small
(``daskpipe.runtime.stage.INLINE_OUTPUT_BYTES``) carries them, so that :meth:`ServedFuture.result` returns
without the scheduler round trip of a ``gather``. Dask's own ``key-in-memory`` report still follows,
and every other way of reading a future (``client.gather``, ``as_completed``, passing it to a task)
works as for any future: the outputs are in the last worker's memory under the request's key.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

from distributed import Client, Future
from distributed.comm import CommClosedError, connect

from daskpipe.runtime import messages
from daskpipe.runtime.errors import refusal_error
from daskpipe.runtime.streams import ImmediateSend
from daskpipe.runtime.tensors import unpack_tensor

logger = logging.getLogger(__name__)

_NOTHING = object()


class ServedFuture(Future):
    """A ``distributed.Future`` of one daskpipe request (``isinstance(f, Future)``; pickles as one).

    When the output rode the completion message, ``result()`` (and ``await``) return it without
    fetching it from the worker."""

    def __init__(self, key: str, client: Client):
        super().__init__(key, client)
        self.inline: Any = _NOTHING

    def result(self, timeout: float | None = None) -> Any:
        """As ``Future.result``. A finished future whose output came with the completion hands it
        over at once: through the client's event loop, as Dask's ``result`` goes, each call cost
        140-200 us on a 2-core machine, a second and more for the results of a 5000-request burst."""
        if self.output_in_hand and not self.client.asynchronous:
            return unpack_tensor(self.inline)
        return super().result(timeout)

    @property
    def output_in_hand(self) -> bool:
        """Finished, with its output come along with the completion (unpacked only when asked for:
        a burst's futures are often gathered instead)."""
        return self.inline is not _NOTHING and self.status == "finished"

    async def _result(self, raiseit: bool = True) -> Any:
        state = self._state
        assert state is not None, "a future made with its client is bound at construction"
        await state.wait()
        if self.output_in_hand:
            return unpack_tensor(self.inline)
        return await super()._result(raiseit)


class ClientStream:
    """One client's daskpipe stream to the scheduler: submissions out, resolutions in.

    Opened by :meth:`open` on the client's loop; ``send`` may be called from any thread."""

    def __init__(self, client: Client):
        self.client = client
        self.pending: weakref.WeakValueDictionary[str, ServedFuture] = weakref.WeakValueDictionary()
        self._out = ImmediateSend()
        self._reader: asyncio.Task | None = None

    async def open(self) -> None:
        comm = await connect(self.client.scheduler.address, **self.client.connection_args)
        comm.name = "daskpipe Client->Scheduler"
        await comm.write({"op": messages.STREAM, "client": self.client.id, "reply": False})
        self._out.start(comm)
        self._reader = asyncio.ensure_future(self._read(comm))

    def send(self, message: dict) -> None:
        loop = self.client.loop
        assert loop is not None, "an open stream's client runs a loop"
        loop.add_callback(self._out.send, message)

    async def close(self) -> None:
        if self._out.comm is not None:
            await self._out.close()
        if self._reader is not None:
            await asyncio.wait([self._reader], timeout=2)

    async def _read(self, comm: Any) -> None:
        try:
            while True:
                for message in await comm.read():
                    op = message.get("op")
                    if op == messages.RESOLVED:
                        self.resolve(message["keys"], message.get("outputs"))
                    elif op == messages.REFUSED:
                        self.refuse(message["model"], message["refused"])
        except (CommClosedError, OSError):
            pass
        except Exception:
            logger.exception("daskpipe: the client's stream from the scheduler failed; futures still finish through Dask's report stream")

    def refuse(self, model: str, refused: list) -> None:
        """Err the futures of requests the scheduler refused on arrival; they never became keys there."""
        futures = self.client.futures
        for key, kind, text, reason in refused:
            state = futures.get(key)
            if state is not None:
                state.set_error(refusal_error(kind, text, reason, model, key), None)

    def resolve(self, keys: list[str], outputs: list[Any] | None) -> None:
        """Finish the futures of ``keys`` (their outputs are in memory on a worker), keeping the
        outputs that came along. A key this client no longer holds, because its future was dropped
        before the submission reached the scheduler, is released again: the scheduler registered
        it after the release, and would keep its output for the client's lifetime."""
        futures = self.client.futures
        orphans = []
        for i, key in enumerate(keys):
            state = futures.get(key)
            if state is None:
                orphans.append(key)
                continue
            future = self.pending.pop(key, None)
            if future is not None and outputs is not None:
                future.inline = outputs[i]
            state.finish()
        if orphans:
            self.client._send_to_scheduler({"op": "client-releases-keys", "keys": orphans, "client": self.client.id})
