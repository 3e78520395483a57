"""The scheduler's daskpipe streams: from and to each client, and out to the stage workers.

A client's stream (``STREAM``) carries its submissions in and its requests' resolutions out; the
scheduler asks a client to open its own streams to the workers whose first stages fetch its inputs
(``REACH``). The scheduler's streams to the workers carry batches, probes and pings.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from distributed.comm import CommClosedError
from distributed.core import Status

from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.streams import PEER_HANDSHAKE, ImmediateSend, Pings, Streams


class Links:
    """The scheduler's streams to clients and workers (see the module docstring); on its loop."""

    def __init__(self) -> None:
        self.client_streams: dict[str, ImmediateSend] = {}  # client id -> its daskpipe stream (RESOLVED goes there)
        self.reached: dict[str, set[str]] = {}  # client id -> the workers it was asked to open streams to (REACH)
        self.to_workers: Streams | None = None  # batches and pings, opened at start
        self.pings = Pings()  # round trips to stage workers, measured when a model is served

    def start(self, connection_args: Mapping[str, Any]) -> None:
        self.to_workers = Streams(connection_args, PEER_HANDSHAKE, "daskpipe Scheduler->Worker")

    async def close(self) -> None:
        if self.to_workers is not None:
            await self.to_workers.close()

    async def open_stream(self, scheduler: Any, comm: Any, client: str | None, worker: str | None) -> Status:
        """Read ``comm`` as a stream from ``client`` or ``worker`` (Dask's ``handle_stream`` on
        ``scheduler`` with the sender in every message); a client's stream also carries the
        resolutions of its requests back."""
        if client is None and worker is None:
            raise ValueError("a daskpipe stream names its client or its worker")
        reply = None
        if client is not None:
            reply = self.client_streams[client] = ImmediateSend()
            reply.start(comm)
            self.reached.pop(client, None)  # a new stream opens its own streams to the workers
        try:
            await scheduler.handle_stream(comm, extra={"client": client} if client is not None else {"worker": worker})
        finally:
            if client is not None and reply is not None:
                if self.client_streams.get(client) is reply:
                    del self.client_streams[client]
                reply.abort()
        return Status.dont_reply

    def reach(self, client: str, addresses: list[str]) -> None:
        """Ask ``client`` to open streams to those of ``addresses`` it was not asked to yet: their
        first stages fetch its inputs over them."""
        asked = self.reached.setdefault(client, set())
        new = [address for address in addresses if address not in asked]
        stream = self.client_streams.get(client)
        if not new or stream is None:
            return
        asked.update(new)
        try:
            stream.send({"op": messages.REACH, "workers": new})
        except CommClosedError:  # it is leaving: remove_client ends its requests
            pass

    def client_left(self, client: str, slots: Iterable[str]) -> None:
        """Tell the workers among ``slots`` that ``client`` was asked to reach that it left: their
        fetches from it end there at once."""
        live = set(slots)
        for address in sorted(self.reached.pop(client, ())):
            if address in live:
                self.to_worker(address, {"op": messages.CLIENT_GONE, "client": client})

    def to_worker(self, address: str, message: Mapping[str, Any]) -> None:
        """``message`` to ``address``'s worker on the scheduler's streams (opened at start)."""
        assert self.to_workers is not None, "the scheduler's streams are open (the plugin has started)"
        self.to_workers.send(address, message)
