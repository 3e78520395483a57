"""A first stage fetching its batch's inputs from the clients that hold them (worker side).

The scheduler's batch names, per client, the requests whose inputs that client holds
(:mod:`daskpipe.runtime.wire.inputs`); the first stage asks each client over the client's stream to
this worker (FETCH), and runs the batch once every answer is in (INPUTS). An input that cannot be
had ends its request alone, and its batch-mates run without it: its client answered that it no
longer holds it, the client's stream closed (it left: ``client-gone``), or no answer came by the
batch's late limit (``expires``): dropped as late when the client's stream is open (a busy client),
failed when it never opened (a client that cannot reach this worker).
A fetch asked of a client whose stream is not open yet waits for it: the scheduler has asked the
client to open it (REACH).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from distributed.comm import CommClosedError

from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.messages import BatchHeader, Ended, Fetch
from daskpipe.runtime.wire.streams import ImmediateSend

logger = logging.getLogger(__name__)

UNAVAILABLE = "input-unavailable"
CLIENT_GONE = "client-gone"
LATE = "deadline"


@dataclass
class PendingBatch:
    """A batch waiting for the inputs its first stage fetches."""

    batch: BatchHeader
    inputs: list[Any]  # per request: its raw bytes, None until fetched
    waiting: dict[str, list[int]]  # client -> the indices it has not answered yet
    lost: dict[int, tuple[str, str]] = field(default_factory=dict)  # index -> (reason, detail) of an input that cannot be had
    timer: asyncio.TimerHandle | None = None


def subset(batch: BatchHeader, indices: Sequence[int]) -> BatchHeader:
    """``batch`` for its requests at ``indices`` only: keys, sizes and the clients' indices renumbered."""
    renumber = {old: new for new, old in enumerate(indices)}
    clients = {c: [renumber[i] for i in wanted if i in renumber] for c, wanted in (batch.get("clients") or {}).items()}
    return {
        **batch,
        "keys": [batch["keys"][i] for i in indices],
        "sizes": [batch["sizes"][i] for i in indices],
        "clients": {c: wanted for c, wanted in clients.items() if wanted},
    }


class InputFetches:
    """This worker's first stages' fetches in progress, keyed by (model, dispatch).

    ``clients`` are the streams of the clients connected to this worker (client id -> stream);
    ``run(batch, inputs)`` starts a batch whose inputs are all here; ``report(message)`` goes to
    the scheduler."""

    def __init__(
        self,
        address: str,
        clients: dict[str, ImmediateSend],
        run: Callable[[BatchHeader, list[Any]], None],
        report: Callable[[Ended], None],
    ) -> None:
        self.address = address
        self.clients = clients
        self.run = run
        self.report = report
        self.pending: dict[tuple[str, int], PendingBatch] = {}
        self.asks: dict[str, list[Fetch]] = {}  # client -> FETCH messages waiting for its stream to open

    def start(self, batch: BatchHeader, inputs: Sequence[Any], fetch: dict[str, list[int]]) -> None:
        """Ask each client of ``fetch`` for its inputs of ``batch``; ``inputs`` has the ones that came along."""
        key = (batch["model"], batch["dispatch"])
        pending = self.pending[key] = PendingBatch(batch, list(inputs), {client: list(indices) for client, indices in fetch.items()})
        expires = batch.get("expires")
        if expires is not None:
            pending.timer = asyncio.get_running_loop().call_later(max(0.0, expires - time.time()), self._expire, key)
        for client, indices in fetch.items():
            ask: Fetch = {"op": messages.FETCH, "model": key[0], "dispatch": key[1], "keys": [batch["keys"][i] for i in indices]}
            self._ask(client, ask)

    def on_inputs(self, client: str, model: str, dispatch: int, keys: Sequence[Any], inputs: Sequence[Any]) -> None:
        """``client`` answered a fetch: the inputs of ``keys``, ``None`` for one it no longer holds."""
        pending = self.pending.get((model, dispatch))
        if pending is None:  # given up on already
            return
        indices = pending.waiting.pop(client, [])
        where = {pending.batch["keys"][i]: i for i in indices}
        for request, raw in zip(keys, inputs):
            index = where.pop(request, None)
            if index is None:
                continue
            if isinstance(raw, (bytes, bytearray, memoryview)):
                pending.inputs[index] = raw
            else:
                pending.lost[index] = (UNAVAILABLE, f"client {client} no longer held the input of request {request!r} when it was fetched")
        for index in where.values():
            pending.lost[index] = (UNAVAILABLE, f"client {client} did not send the input of request {pending.batch['keys'][index]!r}")
        self._finish_if_complete((model, dispatch))

    def client_opened(self, client: str) -> None:
        """``client``'s stream to this worker is open: send it the fetches that waited for it."""
        for message in self.asks.pop(client, []):
            self._ask(client, message)

    def client_left(self, client: str) -> None:
        """``client``'s stream closed, or the scheduler said it left: the inputs still to come from it never will."""
        self.asks.pop(client, None)
        for key, pending in list(self.pending.items()):
            indices = pending.waiting.pop(client, None)
            if indices:
                for index in indices:
                    pending.lost[index] = (CLIENT_GONE, f"client {client} left before worker {self.address} fetched its input")
                self._finish_if_complete(key)

    def _ask(self, client: str, message: Fetch) -> None:
        stream = self.clients.get(client)
        if stream is None or stream.please_stop:
            self.asks.setdefault(client, []).append(message)
            return
        try:
            stream.send(message)
        except CommClosedError:
            self.client_left(client)

    def _expire(self, key: tuple[str, int]) -> None:
        """The batch's late limit passed with inputs still to come: its requests without them end."""
        pending = self.pending.get(key)
        if pending is None:
            return
        for client, indices in pending.waiting.items():
            if client in self.clients:  # it is connected, and busy: the request is late
                why = (LATE, f"its input from client {client} did not reach worker {self.address} by the request's late limit")
            else:
                why = (
                    UNAVAILABLE,
                    f"worker {self.address} could not fetch the input from client {client}: the client opened no stream to it by the "
                    "request's late limit (can the client reach this worker? docs/deploying.md)",
                )
            for index in indices:
                pending.lost[index] = why
        pending.waiting.clear()
        self._finish_if_complete(key)

    def _finish_if_complete(self, key: tuple[str, int]) -> None:
        pending = self.pending.get(key)
        if pending is None or pending.waiting:
            return
        del self.pending[key]
        if pending.timer is not None:
            pending.timer.cancel()
        batch = pending.batch
        by_reason: dict[tuple[str, str], list[Any]] = {}
        for index, why in pending.lost.items():
            by_reason.setdefault(why, []).append(batch["keys"][index])
        for (reason, detail), keys in by_reason.items():
            logger.warning("daskpipe: %d requests of %s end unfetched: %s", len(keys), batch["model"], detail)
            unfetched: Ended = {
                "op": messages.UNFETCHED,
                "model": batch["model"],
                "dispatch": batch["dispatch"],
                "keys": keys,
                "reason": reason,
                "detail": detail,
            }
            self.report(unfetched)
        present = [i for i in range(len(pending.inputs)) if i not in pending.lost]
        if present:
            self.run(subset(batch, present) if pending.lost else batch, [pending.inputs[i] for i in present])
