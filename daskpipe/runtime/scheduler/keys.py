"""Requests as real Dask keys on the scheduler.

On submission the plugin creates a ``released`` task without a run spec for each key and records
that the submitting client wants it (:func:`make_keys`); when the last stage reports its outputs
stored, the keys move to memory on that worker, as ``scatter``'s ``Scheduler.update_data`` moves
them (:func:`store`), and the clients' futures finish, told on their daskpipe streams
(:func:`resolve`); a drop or failure puts the key in ``erred`` with a daskpipe exception, which the
client's future raises (:func:`err_keys`). A request refused on arrival never becomes a key at all
(:func:`refuse`).

Dask's own ``key-in-memory`` report goes at once to a client without a daskpipe stream, and in
bulk :data:`REPORT_DELAY_S` later to one with a stream, which holds the future finished by then
(:class:`InMemoryReports`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

from distributed.comm import CommClosedError
from distributed.protocol import Serialized, serialize

from daskpipe.runtime.dask_internals import put_in_memory, report_in_memory
from daskpipe.runtime.errors import refusal_error
from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.messages import Resolved
from daskpipe.runtime.wire.streams import ImmediateSend

REPORT_DELAY_S = 0.1
"""How much later than its daskpipe resolution a client gets Dask's ``key-in-memory`` for a key:
the report is the backstop should a resolution be lost, and one report message per request cost
the client and the scheduler 0.2 ms of CPU in a closed loop of 2.2 ms on 2 cores."""

Refusal = tuple[str, str, str, list]
"""Requests refused on arrival alike: ``("invalid" | "dropped", text, reason, their keys)``. A
whole submission refused is one refusal: one text for all its keys, on the wire as in memory."""


def make_keys(scheduler: Any, client: str, keys: Sequence) -> None:
    """A ``released`` task for each of ``keys``, without a run spec, that ``client`` wants."""
    for key in keys:
        scheduler.new_task(key, None, "released")
    scheduler.client_desires_keys(keys=list(keys), client=client)


def clients_of(scheduler: Any, streams: dict[str, ImmediateSend], keys: list) -> dict[str, list[int]]:
    """The clients with a daskpipe stream that want ``keys``: client id -> the indices of its keys."""
    wanted: dict[str, list[int]] = {}
    tasks = scheduler.tasks
    for i, key in enumerate(keys):
        ts = tasks.get(key)
        for cs in (ts.who_wants if ts is not None else None) or ():
            if cs.client_key in streams:
                wanted.setdefault(cs.client_key, []).append(i)
    return wanted


def resolve(
    scheduler: Any,
    streams: dict[str, ImmediateSend],
    keys: list,
    outputs: dict[Any, Any] | None,
    worker: str,
    told: frozenset[str] = frozenset(),
) -> bool:
    """Tell the clients that want ``keys`` on their daskpipe ``streams``, ahead of Dask's report
    stream, with the small ``outputs`` that came with them (never deserialized here); not those
    the last stage, ``worker``, has ``told`` itself. The message names ``worker``: a client opens
    its own stream to it, so that it tells the client itself from then on. Whether any client
    was told here."""
    per_client: dict[str, list] = {}
    for client, indices in clients_of(scheduler, streams, keys).items():
        if client not in told:
            per_client[client] = [keys[i] for i in indices]
    for client, wanted in per_client.items():
        message: Resolved = {"op": messages.RESOLVED, "keys": wanted, "worker": worker}
        if outputs is not None:
            message["outputs"] = [outputs[key] for key in wanted]
        try:
            streams[client].send(message)
        except CommClosedError:  # the client is leaving; Dask's report stream still ends its futures
            pass
    return bool(per_client)


def store(scheduler: Any, worker: str, keys: list, nbytes: list, reports: InMemoryReports) -> None:
    """The pending ``keys`` in memory on ``worker`` (as ``scatter``'s ``update_data`` puts them,
    its report to the clients left to ``reports``); the others freed there."""
    tasks = scheduler.tasks
    stored = []
    for key, size in zip(keys, nbytes):
        ts = tasks.get(key)
        if ts is not None and ts.state == "released":
            put_in_memory(scheduler, ts, worker, size)
            stored.append(ts)
    if stored:
        reports.in_memory(scheduler, stored)
    orphans = [
        k for k in keys if (ts := tasks.get(k)) is None or (ts.state == "memory" and all(ws.address != worker for ws in ts.who_has or ()))
    ]
    if orphans:  # released by their client while the batch ran, or stored by a retry elsewhere: the worker must not keep them
        free_keys(scheduler, worker, orphans, "released")


class InMemoryReports:
    """Dask's ``key-in-memory`` reports: at once to the clients without a daskpipe stream, whom
    nothing else tells; in bulk :data:`REPORT_DELAY_S` later to the others (in ``streams``), for
    the keys still in memory and still wanted by them then."""

    def __init__(self, streams: dict[str, ImmediateSend]) -> None:
        self.streams = streams
        self.later: dict[Any, Any] = {}  # key -> its task, reported to its daskpipe clients when due
        self.due: asyncio.TimerHandle | None = None

    def in_memory(self, scheduler: Any, stored: list) -> None:
        """The tasks of ``stored`` are in memory now."""
        for ts in stored:
            for cs in ts.who_wants or ():
                if cs.client_key in self.streams:
                    self.later[ts.key] = ts
                else:
                    report_in_memory(scheduler, cs.client_key, ts)
        if self.later and self.due is None:
            self.due = asyncio.get_running_loop().call_later(REPORT_DELAY_S, self._report_later, scheduler)

    def _report_later(self, scheduler: Any) -> None:
        self.due = None
        later, self.later = self.later, {}
        for key, ts in later.items():
            if ts.state == "memory" and scheduler.tasks.get(key) is ts:
                for cs in ts.who_wants or ():
                    if cs.client_key in self.streams:
                        report_in_memory(scheduler, cs.client_key, ts)


def free_keys(scheduler: Any, worker: str, keys: list, why: str) -> None:
    """``worker`` drops what it stored for ``keys``."""
    scheduler.worker_send(worker, {"op": "free-keys", "keys": keys, "stimulus_id": f"daskpipe-{why}-{time.time()}"})


def refuse(scheduler: Any, streams: dict[str, ImmediateSend], client: str, model: Any, refusals: list[Refusal]) -> None:
    """End requests refused on arrival.

    They never become keys: the client's stream takes one REFUSED message, whose errors the
    client raises in their futures (:class:`~daskpipe.runtime.client.futures.ClientStream`). A flood of
    them then costs the scheduler no task, transition or report of Dask's, and its text once per
    refusal, not per key (100k keys refused one by one were 5.9 MB, 0.33 s to write and read). A
    submission from a client without a daskpipe stream is refused through Dask's erred keys instead."""
    refusals = [refusal for refusal in refusals if refusal[3]]
    if not refusals:
        return
    stream = streams.get(client)
    if stream is not None:
        try:
            stream.send({"op": messages.REFUSED, "model": model, "refused": [list(refusal) for refusal in refusals]})
            return
        except CommClosedError:  # the client is leaving: nothing is waiting for these
            return
    make_keys(scheduler, client, [key for _, _, _, keys in refusals for key in keys])
    for kind, text, reason, keys in refusals:
        for key in keys:
            err_key(scheduler, key, refusal_error(kind, text, reason, model, key))


def serialized(exc: Exception) -> Serialized:
    """``exc`` as Dask keeps a task's exception (serialized once for all the keys it ends)."""
    return Serialized(*serialize(exc))


def err_key(scheduler: Any, key: Any, exc: Exception) -> None:
    err_keys(scheduler, [key], serialized(exc))


def err_keys(scheduler: Any, keys: list, exception: Serialized) -> None:
    """Put pending ``keys`` in ``erred`` with ``exception``; their clients' futures raise it."""
    recommendations = {}
    for key in keys:
        ts = scheduler.tasks.get(key)
        if ts is None or ts.state != "released":  # released by its client already
            continue
        ts.exception = exception
        ts.exception_blame = ts
        ts.traceback = None
        recommendations[key] = "erred"
    if recommendations:
        scheduler.transitions(recommendations, stimulus_id=f"daskpipe-err-{time.time()}")
