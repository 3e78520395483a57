"""The client's end of daskpipe's fast path: its own stream to the scheduler, streams to the
workers that fetch its inputs and run last stages, and futures whose small results arrive with the
completion.

The client holds each request's input until the request has ended: the worker that runs its
batch's first stage fetches it over the client's stream to that worker
(:mod:`daskpipe.runtime.wire.inputs`), so input bytes never cross the scheduler.

Requests leave on the client's :class:`ClientStream` (an :class:`~daskpipe.runtime.wire.streams.ImmediateSend`, see
:mod:`daskpipe.runtime.wire.streams`). A batch's last stage sends :data:`~daskpipe.runtime.wire.messages.RESOLVED`
straight to the client over the client's reply stream from that worker, and the scheduler on the
client's stream for any client the worker could not tell: the futures finish at once, without
waiting out Dask's report stream. A batch whose outputs are small
(``daskpipe.runtime.worker.stage.INLINE_OUTPUT_BYTES``) carries them, so that :meth:`ServedFuture.result` returns
without the scheduler round trip of a ``gather``. Dask's own ``key-in-memory`` report still follows,
and every other way of reading a future (``client.gather``, ``as_completed``, passing it to a task)
works as for any future: the outputs are in the last worker's memory under the request's key.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import queue
import sys
import threading
import time
import uuid
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import msgspec
from distributed import Client, Future
from distributed.client import FutureState
from distributed.comm import CommClosedError
from distributed.core import clean_exception
from distributed.utils import wait_for

from daskpipe.runtime.dask_internals import gate_state_changes
from daskpipe.runtime.errors import refusal_error
from daskpipe.runtime.tensors import unwire_output
from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.inputs import TRIAL_INPUTS, TRIAL_KEY_PREFIX, inline_input_bytes, wire_input
from daskpipe.runtime.wire.messages import Fetch, Inputs, Submission
from daskpipe.runtime.wire.streams import ImmediateSend, open_comm

logger = logging.getLogger(__name__)

_NOTHING = object()
HELD: weakref.WeakKeyDictionary[Client, dict[str, bytes]] = weakref.WeakKeyDictionary()
"""The inputs each client holds, whichever of its services' streams sent them: a worker fetches
them over whichever stream of the client it has."""
SWEEP_HELD = 1024
"""Every this many inputs held since the last sweep, the inputs of requests whose futures were let go
before they ended are dropped (their futures never end here, so nothing else would)."""


class LandedState(FutureState):
    """Dask's state of a future, which also wakes threads waiting for it to end: a synchronous
    ``result()`` then needs no trip through the client's event loop.

    The gate is a bare lock, held while the future is pending: a burst makes thousands of
    futures, and a ``threading.Event`` each (five objects for the garbage collector) cost a
    5000-request burst a fifth of its rate in collections. For the same reason the ``asyncio.Event``
    that Dask sets on every state change exists only once a coroutine waits: Dask made one for
    each future it finished, two of a served request's eight objects for the collector."""

    __slots__ = ("_gate", "_shut", "_listeners", "output")

    def __init__(self, key: str):
        super().__init__(key)
        self._gate = threading.Lock()
        self._gate.acquire()
        self._shut = True
        self._listeners: list[Callable[[], object]] | None = None
        self.output: Any = _NOTHING  # the output, as it came with the completion (packed, or a tensor)

    @property
    def output_in_hand(self) -> bool:
        return self.output is not _NOTHING and self.status == "finished"

    def on_landed(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` when the future has ended: from the thread that ends it (the client's
        event loop), or here and now if it has. Where the two meet it may be called twice, so it
        must not mind."""
        if self._listeners is None:
            self._listeners = []
        self._listeners.append(callback)
        if not self._shut:
            callback()

    def _get_event(self) -> asyncio.Event | _Unwatched:
        """What Dask's state changes set or clear: the event of a coroutine waiting, else nothing."""
        return _UNWATCHED if self._event is None else self._event

    def done(self) -> bool:
        return not self._shut

    async def wait(self, timeout: float | None = None) -> None:
        event: asyncio.Event | None = self._event
        if event is None:  # made in the event loop's thread, where Dask changes the state
            event = self._event = asyncio.Event()  # type: ignore[assignment]  # Dask's annotation knows only its None
            if not self._shut:
                event.set()
        await (event.wait() if timeout is None else wait_for(event.wait(), timeout))

    def wait_landed(self, timeout: float | None) -> bool:
        """Block until the future has ended (finished, erred or cancelled); ``False`` on timeout."""
        if not self._gate.acquire(True, -1 if timeout is None else timeout):
            return False
        self._gate.release()
        return True

    def _mark(self) -> None:
        """Open the gate when the future ended, shut it when it is pending again (Dask retries a lost key)."""
        landed = self.status in ("finished", "error", "cancelled")
        if landed and self._shut:
            self._shut = False
            self._gate.release()
            listeners, self._listeners = self._listeners, None
            for callback in listeners or ():
                callback()
        elif not landed and not self._shut:
            self._gate.acquire()  # a waiter holds it only for an instant
            self._shut = True


class _Unwatched:
    """Stands in for the ``asyncio.Event`` of a future no coroutine waits for."""

    def set(self) -> None:
        pass

    def clear(self) -> None:
        pass


_UNWATCHED = _Unwatched()


def _marking(change: Callable[..., None]) -> Callable[..., None]:
    """``change`` (a state change of Dask's ``FutureState``), then the gate set to match. A future
    whose output is in this client's hands stays finished when Dask loses or cancels its key (its
    worker died, or released it): the output is here, and nothing is lost."""

    undoes_an_end = change.__name__ in ("lose", "cancel")

    @functools.wraps(change)
    def marked(self: LandedState, *args: Any, **kwargs: Any) -> None:
        if undoes_an_end and self.output_in_hand:
            return
        change(self, *args, **kwargs)
        self._mark()

    return marked


gate_state_changes(LandedState, _marking)


class ServedFuture(Future):
    """A ``distributed.Future`` of one daskpipe request (``isinstance(f, Future)``; pickles as one).

    When the output rode the completion message, ``result()`` (and ``await``) return it without
    fetching it from the worker."""

    def __init__(self, key: str, client: Client):
        client.futures.setdefault(key, LandedState(key))
        super().__init__(key, client)

    def result(self, timeout: float | None = None) -> Any:
        """As ``Future.result``. A synchronous client's caller waits in its own thread, and takes an
        output that came with the completion at once: through the client's event loop, as Dask's
        ``result`` goes, each call cost 140-200 us more on a 2-core machine, a second and more for
        the results of a 5000-request burst, and 0.1-0.2 ms on every lone request's way back."""
        state = self._state
        if not self.client.asynchronous and isinstance(state, LandedState):
            if not state.wait_landed(timeout):
                raise TimeoutError(f"timed out after {timeout} s.")
            if state.output_in_hand:
                return unwire_output(state.output)
            if state.status == "error":
                _, error, traceback = clean_exception(state.exception, state.traceback)
                assert error is not None, "an erred future holds its exception"
                raise error.with_traceback(traceback)
        return super().result(timeout)

    @property
    def output_in_hand(self) -> bool:
        """Finished, with its output come along with the completion (unpacked only when asked for:
        a burst's futures are often gathered instead)."""
        state = self._state
        return isinstance(state, LandedState) and state.output_in_hand

    async def _result(self, raiseit: bool = True) -> Any:
        state = self._state
        assert state is not None, "a future made with its client is bound at construction"
        await state.wait()
        if isinstance(state, LandedState) and state.output_in_hand:
            return unwire_output(state.output)
        return await super()._result(raiseit)


class LandedFutures:
    """Served futures as each ends (finished, erred or cancelled), in the caller's thread: what
    :meth:`daskpipe.runtime.client.service.Service.as_completed` returns.

    Each future's state puts it in a queue the moment it ends, from the client's event loop, and
    ``next`` takes it from there: Dask's ``as_completed`` instead tracks each future with a task
    on that loop, which wakes its caller several loop turns after the future ended (0.65 ms p50,
    2.3 ms p99 on ``bench fidelity``, with the scheduler on the same loop). As Dask's: ``add``
    more while iterating, ``next`` raises ``StopIteration`` when none is left, and
    ``TimeoutError`` once ``timeout`` seconds have passed since the start. A future added again
    while it is outstanding is yielded once."""

    def __init__(self, futures: Iterable[Any] = (), timeout: float | None = None):
        self._landed: queue.SimpleQueue[ServedFuture] = queue.SimpleQueue()
        self._outstanding: dict[int, ServedFuture] = {}  # id -> future, added and not yet yielded
        self._lock = threading.Lock()
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        for future in futures:
            self.add(future)

    def add(self, future: Any) -> None:
        state = future._state if isinstance(future, ServedFuture) else None
        if not isinstance(state, LandedState):
            raise TypeError(
                f"a daskpipe service's as_completed takes that service's futures, got {future!r}: use distributed.as_completed for others"
            )
        with self._lock:
            if id(future) in self._outstanding:
                return
            self._outstanding[id(future)] = future
        state.on_landed(functools.partial(self._landed.put, future))

    def __iter__(self) -> LandedFutures:
        return self

    def __next__(self) -> ServedFuture:
        while True:
            with self._lock:
                if not self._outstanding:
                    raise StopIteration
            wait = None if self._deadline is None else self._deadline - time.monotonic()
            try:
                if wait is not None and wait <= 0:
                    raise queue.Empty
                future = self._landed.get(timeout=wait)
            except queue.Empty:
                raise TimeoutError(
                    f"as_completed: {len(self._outstanding)} futures had not ended {self._timeout} s after it started"
                ) from None
            with self._lock:
                if self._outstanding.pop(id(future), None) is not None:  # else yielded already: its state called twice
                    return future


class ClientStream:
    """One client's daskpipe stream to the scheduler: submissions out, resolutions in; and its
    streams to workers, which fetch the inputs it holds and resolve its futures themselves.

    The scheduler names the workers: REACH those of the first stages its inputs go to, and a
    resolution the worker whose last stage computed the outputs; the first mention of a worker
    opens a stream to it (a worker this client cannot reach is left to the scheduler, and cannot
    fetch this client's inputs: docs/deploying.md). Opened by :meth:`open` on the client's loop;
    ``send`` and :meth:`send_requests` may be called from any thread."""

    def __init__(self, client: Client):
        self.client = client
        self.pending: weakref.WeakValueDictionary[str, ServedFuture] = weakref.WeakValueDictionary()
        self.held = HELD.setdefault(client, {})  # request key -> its raw input, until the request has ended
        self.inline_bytes = inline_input_bytes()  # inputs up to this size ride the submission
        self._held_since_sweep = 0
        self._out = ImmediateSend()
        self._queued: collections.deque[dict] = collections.deque()  # sent, not yet written (see send)
        self._sending: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None
        self._replies: dict[str, asyncio.Task] = {}  # worker address -> the task reading its stream
        self._reply_comms: dict[str, Any] = {}
        self._to_workers: dict[str, ImmediateSend] = {}  # worker address -> what this client writes to it
        self._unreachable: set[str] = set()

    def send_requests(
        self, model: str, keys: list[str], inputs: list[bytes], sizes: list[int], start_block: int = 0, sent_at: float | None = None
    ) -> None:
        """Send requests of ``model`` (their futures made already) with raw ``inputs`` of ``sizes``
        samples in one message. An input larger than ``daskpipe.inline-input-bytes`` stays here,
        the message carrying its byte count, until its request has ended."""
        inline, states = self.inline_bytes, self.client.futures
        entries: list[Any] = []
        if len(keys) != len(inputs):  # malformed: sent as it is, for the scheduler to refuse whole
            inline = sys.maxsize
        for key, raw in zip(keys, inputs):
            if not isinstance(raw, bytes) or len(raw) <= inline:  # anything but bytes goes as it is, for the scheduler to refuse
                entries.append(wire_input(raw))
                continue
            self.held[key] = raw
            self._held_since_sweep += 1
            state = states.get(key)
            if isinstance(state, LandedState):
                state.on_landed(functools.partial(self.held.pop, key, None))
            entries.append(len(raw))
        if self._held_since_sweep >= SWEEP_HELD:
            self._sweep_held()
        entries.extend(wire_input(raw) for raw in inputs[len(entries) :])
        submission = Submission(model=model, keys=keys, inputs=entries, sizes=sizes, start_block=start_block, sent_at=sent_at)
        self.send({"op": messages.SUBMIT, **msgspec.structs.asdict(submission)})

    def _sweep_held(self) -> None:
        """Drop the inputs of requests this client no longer holds a future of (not a deploy's trial's, which have none)."""
        self._held_since_sweep = 0
        futures = self.client.futures
        # ``list`` copies the keys at once (no Python code runs meanwhile): the client's loop thread
        # pops ended requests' inputs while the caller's thread sweeps
        for key in [k for k in list(self.held) if k not in futures and not k.startswith(TRIAL_KEY_PREFIX)]:
            self.held.pop(key, None)

    @contextmanager
    def trial_inputs(self, sample_nbytes: int) -> Iterator[dict[str, Any]]:
        """Hold zero samples for a deploy's trial of its control path while it runs, when served
        samples of ``sample_nbytes`` are fetched from their client rather than sent along: the
        trial's first stages then fetch them, as served batches do. The serve call's arguments."""
        if sample_nbytes <= self.inline_bytes:
            yield {}
            return
        zero = bytes(sample_nbytes)  # one buffer under every key
        token = uuid.uuid4().hex
        keys = [f"{TRIAL_KEY_PREFIX}{token}-{i}" for i in range(TRIAL_INPUTS)]
        self.held.update(dict.fromkeys(keys, zero))
        try:
            yield {"trial_client": self.client.id, "trial_keys": keys}
        finally:
            for key in keys:
                self.held.pop(key, None)

    async def open(self) -> None:
        comm = await open_comm(
            self.client.scheduler.address,
            self.client.connection_args,
            {"op": messages.STREAM, "client": self.client.id, "reply": False},
            "daskpipe Client->Scheduler",
        )
        self._out.start(comm)
        self._reader = asyncio.ensure_future(self._read(comm))

    def send(self, message: dict) -> None:
        """Queue ``message`` for the scheduler. The client's loop writes the first at once and
        the rest one a loop turn, so that a ``map``'s chunks reach the scheduler as payloads of
        their own, each read in a loop turn of its own there: sent together, 100k requests'
        chunks were one 4 MB payload, 90-170 ms to decode on the scheduler's loop."""
        loop = self.client.loop
        assert loop is not None, "an open stream's client runs a loop"
        self._queued.append(message)
        loop.add_callback(self._send_queued)

    def _send_queued(self) -> None:
        if self._queued and (self._sending is None or self._sending.done()):
            self._out.send(self._queued.popleft())
            if self._queued:
                self._sending = asyncio.ensure_future(self._send_one_a_turn())

    async def _send_one_a_turn(self) -> None:
        while self._queued:
            await asyncio.sleep(0)
            try:
                self._out.send(self._queued.popleft())
            except CommClosedError:  # the stream is closing: nothing more goes out on it
                self._queued.clear()

    async def close(self) -> None:
        if self._sending is not None:
            await self._sending
        if self._out.comm is not None:
            await self._out.close()
        for comm in self._reply_comms.values():
            comm.abort()
        tasks = [t for t in (self._reader, *self._replies.values()) if t is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=2)

    async def _read(self, comm: Any, worker: str | None = None) -> None:
        """Read the scheduler's stream, or ``worker``'s."""
        try:
            while True:
                for message in await comm.read():
                    op = message.get("op")
                    if op == messages.RESOLVED:
                        self.resolve(message["keys"], message.get("outputs"))
                        if "worker" in message:
                            self.reach(message["worker"])
                    elif op == messages.FETCH and worker is not None:
                        self.hand_over(worker, message)
                    elif op == messages.REACH:
                        for address in message["workers"]:
                            self.reach(address)
                    elif op == messages.REFUSED:
                        self.refuse(message["model"], message["refused"])
        except (CommClosedError, OSError):
            pass
        except Exception:
            logger.exception("daskpipe: a daskpipe stream to this client failed; futures still finish through Dask's report stream")

    def hand_over(self, worker: str, fetch: Fetch) -> None:
        """Send ``worker`` the inputs its first stage fetches; ``None`` for one this client no
        longer holds (its request ended, or its future was let go)."""
        stream = self._to_workers.get(worker)
        if stream is None:
            return
        held = self.held
        reply: Inputs = {
            "op": messages.INPUTS,
            "client": self.client.id,
            "model": fetch["model"],
            "dispatch": fetch["dispatch"],
            "keys": fetch["keys"],
            "inputs": [wire_input(held.get(key)) for key in fetch["keys"]],
        }
        try:
            stream.send(reply)
        except CommClosedError:  # the worker is gone: the scheduler retries its batch elsewhere
            pass

    def reach(self, worker: str) -> None:
        """Open a stream to ``worker`` unless one is open, opening, or could not be."""
        if worker not in self._replies and worker not in self._unreachable and self._out.comm is not None and not self._out.please_stop:
            self._replies[worker] = asyncio.ensure_future(self._reply_from(worker))

    async def _reply_from(self, worker: str) -> None:
        try:
            comm = self._reply_comms[worker] = await open_comm(
                worker,
                self.client.connection_args,
                {"op": messages.REPLY, "client": self.client.id, "reply": False},
                "daskpipe Worker<->Client",
            )
            stream = self._to_workers[worker] = ImmediateSend()
            stream.start(comm)
            await self._read(comm, worker)  # until the worker or this client leaves
        except Exception as exc:  # the scheduler keeps resolving this worker's outputs
            logger.warning(
                "daskpipe: could not open a stream to worker %s (%r): its results come through the scheduler, and it cannot fetch "
                "this client's inputs (the client must reach the workers' ports, docs/deploying.md)",
                worker,
                exc,
            )
            self._unreachable.add(worker)
        finally:
            self._reply_comms.pop(worker, None)
            to_worker = self._to_workers.pop(worker, None)
            if to_worker is not None:
                to_worker.abort()
            if self._replies.get(worker) is asyncio.current_task():
                del self._replies[worker]

    def refuse(self, model: str, refused: list) -> None:
        """Err the futures of requests the scheduler refused on arrival; they never became keys there."""
        futures = self.client.futures
        for kind, text, reason, keys in refused:
            for key in keys:
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
            if state.status != "pending":  # ended already: e.g. dropped while a worker that had stalled still computed it
                continue
            self.pending.pop(key, None)
            if outputs is not None and isinstance(state, LandedState):
                state.output = outputs[i]
            state.finish()
        if orphans:
            self.client._send_to_scheduler({"op": "client-releases-keys", "keys": orphans, "client": self.client.id})
