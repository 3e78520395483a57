"""Stage actors: one partition of a model on one worker's (virtual) GPU.

A :class:`Stage` is created as a Dask actor (``client.submit(Stage, ..., actor=True,
workers=[address])``) so that Dask places it, keeps it alive while the service holds its future,
and shows it on the worker. The per-request path never goes through ActorFutures: batches reach
a stage through worker stream handlers (installed when the first stage lands on a worker) that
look the stage up in ``worker.actors``. A batch runs off the event loop on the slot's single
compute thread (the GPU runs one batch at a time), its boundary feature map is cast to fp16 and
sent straight to the next stage's worker over Dask's worker-to-worker stream (UCX when the
cluster runs ``protocol="ucx"``), and the last stage stores each request's output in
``worker.data`` under the request's key, where the client's future fetches it. Small outputs,
already in their clients' hands, are kept back a moment first (:meth:`_SlotRuntime.keep`).

A staged data plane (``reactive``) sends a batch through part of a pipeline: its last stage
*parks* each request's fp16 feature map in the slot runtime and reports its timings; the
scheduler later sends FORWARD to each worker holding part of a next batch, which sends its part
on to that batch's first stage, where the parts are gathered in the batch's key order.

An *emulated* stage (its worker carries the ``daskpipe.emulated`` resource) computes on the CPU
for real outputs and holds the batch until the latency its GPU type was profiled at (sent with
the batch, already time-dilated) has passed; it reports when real compute overran that latency.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import pickle
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Mapping, Sequence, cast

import torch
from dask.sizeof import sizeof
from distributed import get_worker
from distributed.comm import CommClosedError
from distributed.core import Status
from distributed.protocol import to_serialize
from torch import nn

from daskpipe.config import setting
from daskpipe.profiles.fx import TRACING
from daskpipe.profiles.graphs import device_runner
from daskpipe.runtime.dask_internals import wrap_worker_handlers, wrapped
from daskpipe.runtime.errors import RequestFailed
from daskpipe.runtime.gctune import freeze_heap, raise_gc_thresholds
from daskpipe.runtime.tensors import PACKED_BYTES, from_wire, output_nbytes, pack_output, split_output, wire_output, wire_tensor
from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.messages import BatchHeader, Done, Ended, Resolved, Timings
from daskpipe.runtime.wire.streams import PEER_HANDSHAKE, ImmediateSend, Streams
from daskpipe.runtime.worker.environ import compute_thread_setup, shorten_switch_interval
from daskpipe.runtime.worker.fetch import InputFetches
from daskpipe.runtime.worker.gpu import gpu_backend

logger = logging.getLogger(__name__)


INLINE_OUTPUT_BYTES = PACKED_BYTES
"""A batch's outputs go to every client with a stream to this worker, whatever their size, so that
its ``result()`` needs no fetch and survives this worker's death; the scheduler relays them to the
other clients only when they take at most this many bytes (it carries control, not data)."""
SLEEP_LEAD_GAIN = 0.1
"""How far one emulated hold's lateness moves the next one's aim: a running mean over ~10 holds."""
KEEP_S = 0.1
"""How long a last stage keeps outputs its clients already hold before storing them in Dask's
worker state (:meth:`_SlotRuntime.keep`): longer than a client takes to release a future it has
read (its report stream batches every 10 ms, the scheduler's to the worker every 5 ms)."""
REPLY_WAIT_S = 1.0
"""How long a last stage's large outputs wait for a client's stream that is not up yet (a
connect takes milliseconds), at most until the batch's late limit: outputs only Dask holds are
lost with this worker."""
STORE_SLICE = 64
"""Kept outputs stored per event-loop turn: Dask's worker state takes ~40 us per key."""


@dataclass
class _SlotRuntime:
    """What the stages of one worker share: the slot runs one batch at a time, on one thread, and
    talks to the scheduler and to the next stages over daskpipe's immediate streams."""

    executor: ThreadPoolExecutor
    to_scheduler: Streams
    to_peers: Streams
    clients: dict[str, ImmediateSend] = field(default_factory=dict)  # client id -> its stream here: RESOLVED and FETCH go there
    fetches: InputFetches | None = None  # first stages fetching their batches' inputs from clients (set by ``install``)
    tasks: set[asyncio.Task] = field(default_factory=set)
    slowdown: tuple[float, float] = (1.0, 0.0)  # (factor, until wall time): an emulated GPU's holds grow (``slow_down``)
    sleep_lead_s: float = 0.0  # how much before an emulated hold's end its sleep aims to wake, learned (``hold``)
    parked: dict[tuple[str, Any], torch.Tensor] = field(default_factory=dict)  # (model, key) -> its feature map between two staged batches
    gathering: dict[tuple[str, int], tuple[float | None, dict[Any, torch.Tensor]]] = field(
        default_factory=dict
    )  # (model, dispatch) -> (its late limit, the parts of it arrived so far)
    kept: dict[Any, torch.Tensor] = field(default_factory=dict)  # key -> an output its clients hold, not yet in Dask's worker state
    connects: dict[str, list[asyncio.Future]] = field(default_factory=dict)  # client id -> batches waiting for its stream here
    unreached: set[str] = field(default_factory=set)  # clients whose stream a batch waited for in vain (until they connect)
    storing: asyncio.Handle | None = None  # the next store of ``kept``

    def hold_factor(self) -> float:
        factor, until = self.slowdown
        return factor if time.time() < until else 1.0

    def hold(self, until: float) -> None:
        """Wait on the compute thread until ``until`` (wall clock), as a thread waits on its GPU.

        A sleep wakes late by the kernel's timer slack and a scheduler tick (measured here: 95 us
        p50 at Linux's default slack, 44 us at 1 us, :func:`~daskpipe.runtime.worker.environ.compute_thread_setup`),
        which would make every emulated stage a few percent slower than its profile: so the sleep
        aims that much early, learning how late it woke (a running mean), and the holds end on
        time on average."""
        now = time.time()
        if until - now > self.sleep_lead_s:
            time.sleep(until - now - self.sleep_lead_s)
            self.sleep_lead_s = max(0.0, self.sleep_lead_s + SLEEP_LEAD_GAIN * (time.time() - until))

    def report(self, worker: Any, message: Mapping[str, Any]) -> None:
        """Send ``message`` to the scheduler."""
        self.to_scheduler.send(worker.scheduler.address, message)

    def keep(self, worker: Any, outputs: dict[Any, torch.Tensor]) -> None:
        """Store ``outputs``, which their clients already hold, in Dask's worker state
        :data:`KEEP_S` from now, unless the scheduler frees them first (:meth:`drop_kept`).

        The scheduler has them in memory here from their completion on. Storing each batch's
        outputs at once ran Dask's worker state machine twice per request (in, and out when its
        client released it) in the moments a lone request's next hops needed the machine's
        cores: 0.15-0.2 ms of a closed loop's 2.3 ms on 2 cores. Whatever may read or release
        them through Dask stores them first (:func:`_store_kept_first`)."""
        self.kept.update(outputs)
        if self.storing is None:
            self.storing = asyncio.get_running_loop().call_later(KEEP_S, self._store_slice, worker)

    def _store_slice(self, worker: Any) -> None:
        self.storing = None
        keys = list(itertools.islice(self.kept, STORE_SLICE))
        worker.update_data(data={key: self.kept.pop(key) for key in keys}, stimulus_id=f"daskpipe-kept-{time.time()}")
        if self.kept:
            self.storing = asyncio.get_running_loop().call_soon(self._store_slice, worker)

    def store_kept(self, worker: Any) -> None:
        """Store every kept output now: something is about to read this worker's keys."""
        if self.storing is not None:
            self.storing.cancel()
            self.storing = None
        if self.kept:
            kept, self.kept = self.kept, {}
            worker.update_data(data=kept, stimulus_id=f"daskpipe-kept-{time.time()}")

    def drop_kept(self, keys: Sequence[Any]) -> list[Any]:
        """The scheduler freed ``keys`` here: those still kept are never stored. The others, which
        Dask's worker state may hold."""
        kept = self.kept
        return [key for key in keys if kept.pop(key, None) is None]


_SLOTS: weakref.WeakKeyDictionary[Any, _SlotRuntime] = weakref.WeakKeyDictionary()
FEATURE_MAP_DTYPE = torch.float16
"""What a stage hands the next one: half the bytes of fp32 on the wire and on the way to the GPU."""
CUDA_GRAPHS_CONFIG = "daskpipe.cuda-graphs"
"""Dask config key: whether a real GPU's stages, and their profiles, replay CUDA graphs (docs/tuning.md)."""


class BatchExpired(Exception):
    """A batch reached its stage after its requests' late limit: computing it would help nobody."""


class Stage:
    """Partition ``partition`` of ``model`` on this worker's device.

    ``modules`` is the pickled list of the partition's torch.fx blocks, or a sequence of such
    pickles, concatenated (every deployment sends its blocks pickled one by one,
    ``deployment.pickle_blocks``), loaded on the worker when the actor is created: a partition
    that does not fit fails the deploy with the cause, not the first requests. ``input_shape`` is
    the per-sample shape the partition takes; ``input_dtype`` (a torch dtype name) is what the
    partition receives: the requests' dtype, with which the first partition rebuilds a batch from
    the requests' raw bytes (``service.encode_input``), or :data:`FEATURE_MAP_DTYPE`.
    ``max_batch``: the largest batch it is sent (a real GPU's stage captures a CUDA graph for each
    size up to it).
    """

    def __init__(
        self,
        model: str,
        partition: int,
        modules: bytes | Sequence[bytes],
        *,
        input_shape: Sequence[int],
        input_dtype: str = "float32",
        device: str = "cpu",
        emulated: bool = False,
        max_batch: int = 1,
    ):
        self.model = model
        self.partition = partition
        self.device = torch.device(gpu_backend().compute_device() if device == messages.GPU_DEVICE else device)
        self.emulated = emulated
        self.batches = 0
        self.overruns = 0
        self.worker = get_worker()
        install(self.worker)
        # on the worker: load the partition on the device and run it once on the slot's compute
        # thread, so the first request pays neither for the move nor for lazy set-ups (the thread
        # itself and its torch threads, torch's kernels; dask's sizeof registrations, ~0.2 s, which
        # storing the outputs would trigger)
        chunks = [modules] if isinstance(modules, bytes) else modules
        with TRACING.write_lock():
            blocks = [block for chunk in chunks for block in pickle.loads(chunk)]
        self._module = nn.Sequential(*blocks).to(self.device).eval()
        self._dtype = next(self._module.parameters(), torch.empty(0)).dtype
        self._input_shape = tuple(input_shape)
        self._input_dtype = getattr(torch, input_dtype)
        executor = _SLOTS[self.worker].executor
        self._forward = executor.submit(self._device_forward, max_batch).result()
        sizeof(executor.submit(self._compute, torch.zeros((1, *input_shape)), [1]).result())
        freeze_heap()

    async def connect(self, peers: Sequence[str], timeout: float = 10.0) -> None:
        """Open the worker-to-worker streams to the next partition's workers before the first batch.

        The hello carries a feature map like the real ones, so that both ends have been through
        the tensor (de)serialisation path once.
        """
        sample = self._compute(torch.zeros((1, *self._input_shape)), split=None)
        assert isinstance(sample, torch.Tensor), "split=None computes one feature map"
        streams = _SLOTS[self.worker].to_peers
        others = [a for a in peers if a != self.worker.address]
        for address in others:
            streams.send(address, {"op": messages.HELLO, "data": wire_tensor(sample)})
        deadline = time.monotonic() + timeout
        while not all(streams.is_open(a) for a in others):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not open streams to {list(peers)} within {timeout}s")
            await asyncio.sleep(0.01)

    # -- introspection through the actor (tests, dashboards) -----------------------------------
    def info(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "partition": self.partition,
            "device": str(self.device),
            "emulated": self.emulated,
            "batches": self.batches,
            "overruns": self.overruns,
        }

    # -- the batch path (worker event loop) ----------------------------------------------------
    def run(self, batch: BatchHeader, data: torch.Tensor | Sequence[bytes], received_at: float | None = None) -> None:
        """Queue one batch on the slot's compute thread; when it has run, the thread hands it
        straight back to the event loop, which forwards the feature map or stores the outputs.

        A callback rather than an awaited executor future: asyncio's hand-back sets a future on
        one loop turn and resumes the awaiting task on the next, two turns and a task step per
        stage on a lone request's way."""
        hop, rest = batch["route"][0], batch["route"][1:]
        split = None if rest or hop.get("park") else batch["sizes"]
        slot = _SLOTS[self.worker]
        turn = slot.executor.submit(self._turn, slot, data, split, float(hop.get("hold_s") or 0.0), batch.get("expires"))
        loop = asyncio.get_running_loop()
        turn.add_done_callback(lambda turn: _on_loop(loop, self._ran, batch, received_at, turn))

    def _ran(self, batch: BatchHeader, received_at: float | None, turn: concurrent.futures.Future) -> None:
        try:
            output, start, end, overrun = turn.result()
        except BatchExpired:
            expired: Ended = {"op": messages.EXPIRED, "model": self.model, "dispatch": batch["dispatch"], "keys": list(batch["keys"])}
            _SLOTS[self.worker].report(self.worker, expired)
            return
        except Exception as exc:  # a stage error fails this batch only, with its cause
            self._fail(batch, exc)
            return
        self.batches += 1
        self._deliver(batch, output, self.partition, (start, end), received_at, overrun)

    async def probe(self, token: int, hold_s: float) -> None:
        """Compute one zero sample behind whatever the slot still runs, and report its timing:
        the scheduler re-admits a suspect slot whose probe is in line (daskpipe/runtime/scheduler/gray.py)."""
        try:
            _, start, end, _ = await self._compute_held(torch.zeros((1, *self._input_shape)), None, hold_s)
        except Exception:  # a probe that cannot compute leaves the slot suspect
            logger.exception("daskpipe: the probe of %s partition %d failed", self.model, self.partition)
            return
        _SLOTS[self.worker].report(self.worker, {"op": messages.PROBED, "model": self.model, "token": token, "start": start, "end": end})

    async def _compute_held(
        self, data: torch.Tensor | Sequence[bytes], split: Sequence[int] | None, hold: float, expires: float | None = None
    ) -> tuple[Any, float, float, bool]:
        """(output, start, end, overrun): the batch's turn on the slot's compute thread, which runs
        the batches of its queue back to back, as a GPU runs its stream: the next one starts the
        moment the last one ends, not a loop turn and a thread wake later (``bench fidelity``'s
        emulated stages measured 1.03-1.05x their holds that way, and googlenet-v3's plan,
        simulated at 1.04x, reaches 0.45 of its load instead of 0.55)."""
        slot = _SLOTS[self.worker]
        return await asyncio.get_running_loop().run_in_executor(slot.executor, self._turn, slot, data, split, hold, expires)

    def _turn(
        self, slot: _SlotRuntime, data: torch.Tensor | Sequence[bytes], split: Sequence[int] | None, hold: float, expires: float | None
    ) -> tuple[Any, float, float, bool]:
        """One batch on the slot's compute thread: a batch whose turn comes after ``expires`` is not
        computed; an emulated stage then holds the slot until ``hold`` seconds from the start
        (longer while it is slowed down), as a thread waits on its GPU. A timer on the event loop
        ended holds late (epoll waits whole milliseconds): an 11.1 ms stage measured 11.65-11.88 ms
        that way, 11.43 ms this way."""
        start = time.time()
        if expires is not None and start > expires:
            raise BatchExpired()
        output = self._compute(data, split)
        if not self.emulated:
            return output, start, time.time(), False
        computed = time.time()
        hold *= slot.hold_factor()
        overrun = computed - start > hold
        if overrun:
            self.overruns += 1
            logger.warning(
                "emulated %s partition %d: real compute %.1f ms overran the profiled %.1f ms",
                self.model,
                self.partition,
                (computed - start) * 1e3,
                hold * 1e3,
            )
        slot.hold(start + hold)
        return output, start, time.time(), overrun

    def _deliver(
        self, batch: BatchHeader, output: Any, partition: int, ran: tuple[float, float], received_at: float | None, overrun: bool
    ) -> None:
        """Forward ``output`` to the batch's next stage, or store it under its keys (last stage),
        reporting the timings of hop ``partition`` (its input's transfer, its compute over ``ran``)."""
        worker = self.worker
        slot = _SLOTS[worker]
        rest = batch["route"][1:]
        timings: list[list[Any]] = []
        report: Timings = {
            "op": messages.FEEDBACK,
            "model": self.model,
            "dispatch": batch["dispatch"],
            "timings": timings,
            "overrun": overrun,
        }
        if received_at is not None:  # the feature map's trip from the previous stage
            timings.append([partition, "transfer", batch["sent_at"], received_at])
        timings.append([partition, "compute", *ran])
        if not rest and batch["route"][0].get("park"):  # a staged batch's last stage: the data waits here for the next one
            for key, rows in zip(batch["keys"], torch.split(output, list(batch["sizes"]))):
                slot.parked[(self.model, key)] = rows
            slot.report(worker, report)
            return
        if rest:
            nxt = rest[0]
            forwarded: BatchHeader = {
                "op": messages.BATCH,
                "model": batch["model"],
                "dispatch": batch["dispatch"],
                "keys": batch["keys"],
                "sizes": batch["sizes"],
                "route": rest,
                "sent_at": time.time(),
                "data": wire_tensor(output),
            }
            for optional in ("expires", "clients"):
                if optional in batch:
                    forwarded[optional] = batch[optional]  # type: ignore[literal-required]
            slot.to_peers.send(nxt["address"], forwarded)
            slot.report(worker, report)
            return
        outputs = dict(zip(batch["keys"], output))
        nbytes = [output_nbytes(t) for t in output]
        wanted: dict[str, list[int]] = batch.get("clients") or {}  # client id -> the indices of its keys
        unconnected = [client for client in wanted if client not in slot.clients and client not in slot.unreached]
        if unconnected and sum(nbytes) > INLINE_OUTPUT_BYTES:  # only Dask would hold them: wait for their clients' streams
            wait_s = REPLY_WAIT_S if batch.get("expires") is None else min(REPLY_WAIT_S, batch["expires"] - time.time())
            slot.report(worker, report)  # its timings now: the watch does not take the wait for a stalled slot
            keep_running(worker, self._finish_when_connected(batch, outputs, nbytes, ran, unconnected, wait_s))
            return
        self._finish(batch, outputs, nbytes, timings, overrun, ran)

    async def _finish_when_connected(
        self,
        batch: BatchHeader,
        outputs: dict[Any, torch.Tensor],
        nbytes: list[int],
        ran: tuple[float, float],
        unconnected: list[str],
        wait_s: float,
    ) -> None:
        """Finish the batch once ``unconnected``'s streams here are up, or ``wait_s`` from now.

        The scheduler asks a client to open its streams with its first requests and with a
        re-plan's first batch on a new worker, so a whole pipeline pass can beat the connect. The
        batch stays in flight meanwhile: a death of this worker retries it from its inputs, where
        outputs stored only in Dask's worker state would be lost with it. A client whose stream is
        not up by then is not waited for again until it connects."""
        slot = _SLOTS[self.worker]
        waited = time.time()
        loop = asyncio.get_running_loop()
        connects = [loop.create_future() for _ in unconnected]
        for client, connect in zip(unconnected, connects):
            slot.connects.setdefault(client, []).append(connect)
        if wait_s > 0:
            await asyncio.wait(connects, timeout=wait_s)
        for client, connect in zip(unconnected, connects):
            if not connect.done():
                slot.unreached.add(client)
                slot.connects[client].remove(connect)
        self._finish(batch, outputs, nbytes, [], False, (ran[0], ran[1] + time.time() - waited))  # its timings went ahead

    def _finish(
        self,
        batch: BatchHeader,
        outputs: dict[Any, torch.Tensor],
        nbytes: list[int],
        timings: list[list[Any]],
        overrun: bool,
        ran: tuple[float, float],
    ) -> None:
        """Hand a last stage's ``outputs`` to the clients with a stream here and report the batch
        done, with the small outputs the scheduler relays to the others; ``ran[1]`` is when the
        outputs were ready to go, which the control path's ``done_worker`` counts from. A client that
        cannot reach this worker gets its outputs through the scheduler, whatever their size: only
        Dask's worker state would hold them here."""
        worker = self.worker
        slot = _SLOTS[worker]
        output = list(outputs.values())
        # storing new keys with ``update_data`` sends the scheduler nothing (the scatter path), so
        # DONE is the one message that puts the batch's keys in memory there
        done: Done = {
            "op": messages.DONE,
            "model": self.model,
            "dispatch": batch["dispatch"],
            "keys": list(outputs),
            "nbytes": nbytes,
            "timings": timings,
            "overrun": overrun,
        }
        wanted: dict[str, list[int]] = batch.get("clients") or {}
        told: list[str] = []
        wired = [wire_output(t) for t in output]  # small ones packed, large ones frames of their own
        keys = done["keys"]
        for client in wanted:  # the clients first: DONE follows in the same loop turn, and a client
            # takes a round trip to ask the scheduler about a key (a ``gather`` that wins that race
            # anyway is told the key is not in memory yet, and Dask's client asks again)
            if client not in slot.clients:
                continue
            try:
                resolved: Resolved = {
                    "op": messages.RESOLVED,
                    "keys": [keys[i] for i in wanted[client]],
                    "outputs": [wired[i] for i in wanted[client]],
                }
                slot.clients[client].send(resolved)
                told.append(client)
            except CommClosedError:  # its stream is gone: the scheduler tells it
                pass
        done["told"] = told
        unreached = any(client in slot.unreached for client in wanted)  # it cannot reach this worker: its outputs go through the scheduler
        if (len(told) < len(wanted) or not wanted) and (sum(nbytes) <= INLINE_OUTPUT_BYTES or unreached):
            done["outputs"] = [pack_output(t) for t in output]  # the scheduler tells the others, with the small outputs
        done["written_s"] = time.time() - ran[1]  # after the clients' writes: the control path's ``done_worker``
        slot.report(worker, done)
        if told and "outputs" not in done:  # every client holds its outputs
            slot.keep(worker, outputs)
            return
        # stored after DONE has left (its write is the next loop turn's first step): nothing can ask
        # this worker for the keys before the scheduler has read DONE and a client has asked it
        stored: dict[Any, object] = dict(outputs)
        asyncio.get_running_loop().call_soon(
            functools.partial(worker.update_data, data=stored, stimulus_id=f"daskpipe-done-{self.model}-{batch['dispatch']}")
        )

    def _compute(self, data: torch.Tensor | Sequence[bytes], split: Sequence[int] | None) -> torch.Tensor | list[torch.Tensor]:
        """Runs in the slot's compute thread: never on the event loop or the actor thread.

        ``data`` is the previous stage's feature map, or the requests' raw bytes for the first one.
        ``split=None``: the fp16 feature map for the next stage; else (last stage) one output per
        request of ``split`` samples each, copied out of the batch so that each frees alone.
        """
        x = data if isinstance(data, torch.Tensor) else decode_inputs(data, self._input_dtype, self._input_shape)
        with torch.inference_mode():
            with TRACING.read_lock():
                y = self._forward(x)
            if split is None:
                return y.to(FEATURE_MAP_DTYPE).cpu()
            return split_output(y, split)

    def _device_forward(self, max_batch: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """On the compute thread: the partition's forward on its device; on a real GPU replayed as
        CUDA graphs of batch sizes 1..``max_batch`` (the Dask config key ``daskpipe.cuda-graphs``),
        as it was profiled (:func:`daskpipe.profiles.graphs.device_runner`)."""
        module, device, dtype = self._module, self.device, self._dtype
        if device.type != "cuda":
            return lambda x: module(x.to(dtype))
        return device_runner(
            module,
            self._input_shape,
            device,
            range(1, max_batch + 1),
            cuda_graphs=setting(CUDA_GRAPHS_CONFIG),
            to_host=False,
            what=f"{self.model} partition {self.partition}",
            dtype=dtype,
            input_dtype=self._input_dtype,
        )

    def _fail(self, batch: BatchHeader, exc: BaseException) -> None:
        logger.warning("%s partition %d failed a batch of %d requests: %r", self.model, self.partition, len(batch["keys"]), exc)
        error = RequestFailed(
            f"stage {self.partition} of model {self.model!r} on worker {self.worker.address} failed: {type(exc).__name__}: {exc}",
            cause=_picklable(exc),
        )
        report_failure(self.worker, batch, error)


def decode_inputs(payloads: Sequence[bytes], dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The batch ``(n, *shape)`` made of requests' raw bytes (``service.encode_input``), in one copy."""
    return torch.frombuffer(bytearray().join(payloads), dtype=dtype).reshape(-1, *shape)


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def install(worker: Any) -> None:
    """Give ``worker`` daskpipe's batch handler and its slot runtime, and its process the scheduler's
    GC policy (``gctune``) and a short GIL switch interval (``environ``); idempotent.

    Runs from the actor's constructor, which may be off the event loop: ``asyncio.Lock`` binds to
    the running loop only on first use.
    """
    if worker in _SLOTS:
        return
    raise_gc_thresholds()
    shorten_switch_interval()
    slot = _SLOTS[worker] = _SlotRuntime(
        ThreadPoolExecutor(
            1, thread_name_prefix=f"daskpipe-slot-{worker.name}", initializer=compute_thread_setup, initargs=(worker.state.nthreads,)
        ),
        to_scheduler=Streams(
            worker.connection_args, {"op": messages.STREAM, "worker": worker.address, "reply": False}, "daskpipe Worker->Scheduler"
        ),
        to_peers=Streams(worker.connection_args, PEER_HANDSHAKE, "daskpipe Worker->Worker"),
    )

    async def reply_stream(comm: Any, client: str) -> Status:  # Dask passes the comm to a handler whose first parameter is ``comm``
        return await _reply_stream(worker, comm, client)

    batches = _BatchHandler(worker)
    slot.fetches = InputFetches(worker.address, slot.clients, batches.start, functools.partial(slot.report, worker))
    worker.handlers[messages.REPLY] = reply_stream
    _store_kept_first(worker, slot)
    worker.stream_handlers[messages.BATCH] = batches
    worker.stream_handlers[messages.INPUTS] = slot.fetches.on_inputs
    worker.stream_handlers[messages.CLIENT_GONE] = slot.fetches.client_left
    worker.stream_handlers[messages.HELLO] = _hello
    worker.stream_handlers[messages.PING] = lambda token: slot.report(worker, {"op": messages.PONG, "token": token})
    worker.stream_handlers[messages.PROBE] = functools.partial(_probe, worker)
    worker.stream_handlers[messages.FORWARD] = functools.partial(_forward, worker)
    worker.stream_handlers[messages.DISCARD] = functools.partial(_discard, worker)


def _store_kept_first(worker: Any, slot: _SlotRuntime) -> None:
    """Dask's handlers that read this worker's data or tasks (a ``gather``, a peer's fetch, a task
    that depends on an output, ``client.run``) store the kept outputs first, and its handlers that
    free keys drop the kept ones, so that through Dask a kept output is as stored
    (:meth:`_SlotRuntime.keep`)."""

    def storing_first(handler: Callable[..., Any]) -> Callable[..., Any]:
        return wrapped(handler, functools.partial(slot.store_kept, worker))

    def dropping_kept(handler: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(handler)
        def handle(*args: Any, keys: Sequence[Any], **kwargs: Any) -> Any:
            stored = slot.drop_kept(keys)
            return handler(*args, keys=stored, **kwargs) if stored else None  # Dask's state never saw the kept ones

        return handle

    wrap_worker_handlers(
        worker, ("get_data", "keys", "run", "run_coroutine"), ("compute-task", "acquire-replicas", "remove-replicas"), storing_first
    )
    wrap_worker_handlers(worker, ("free_keys",), ("free-keys",), dropping_kept)


async def _reply_stream(worker: Any, comm: Any, client: str) -> Status:
    """The worker's ``REPLY`` handler: ``comm`` is ``client``'s stream to this worker from now on,
    until the client closes it. The last stages here finish its futures over it (RESOLVED), and the
    first stages fetch its inputs (FETCH, answered with INPUTS)."""
    slot = _SLOTS[worker]
    fetches = slot.fetches
    assert fetches is not None, "installed with the slot"
    stream = slot.clients[client] = ImmediateSend()
    stream.start(comm)
    fetches.client_opened(client)
    slot.unreached.discard(client)
    for connect in slot.connects.pop(client, ()):
        connect.set_result(None)
    try:
        await worker.handle_stream(comm)  # the client's INPUTS, until it leaves
    finally:
        if slot.clients.get(client) is stream:
            del slot.clients[client]
            fetches.client_left(client)
        stream.abort()
    return Status.dont_reply


def _forward(worker: Any, *, take: list, **batch: Any) -> None:
    """The worker's ``daskpipe-forward`` handler: send the parked data of ``take`` (keys of
    ``batch``) on to ``batch``'s first stage, as one part of its input."""
    slot = _SLOTS[worker]
    header = cast(BatchHeader, batch)  # the scheduler's FORWARD
    model = header["model"]
    missing = [key for key in take if (model, key) not in slot.parked]
    if missing:
        report_failure(
            worker,
            header,
            RequestFailed(
                f"the data of {len(missing)} requests of {model!r} between two stages is not on worker {worker.address} (was it discarded?)"
            ),
        )
        return
    data = torch.cat([slot.parked.pop((model, key)) for key in take])
    part: BatchHeader = {**header, "op": messages.BATCH, "part": take, "sent_at": time.time(), "data": wire_tensor(data)}
    slot.to_peers.send(header["route"][0]["address"], part)


def _on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    """Call ``callback(*args)`` on ``loop`` from another thread; nothing once the loop has closed
    (the worker is gone, and its batches with it)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass


def _discard(worker: Any, *, model: str, keys: list) -> None:
    """The worker's ``daskpipe-discard`` handler: parked data whose requests ended."""
    parked = _SLOTS[worker].parked
    for key in keys:
        parked.pop((model, key), None)


def _probe(worker: Any, *, model: str, token: int, stage: str, hold_s: float) -> None:
    """The worker's ``daskpipe-probe`` stream handler (synchronous, as :class:`_BatchHandler`)."""
    actor = worker.state.actors.get(stage)
    if not isinstance(actor, Stage):
        logger.warning("daskpipe: worker %s was probed for stage %r of %s, which it does not hold", worker.address, stage, model)
        return
    keep_running(worker, actor.probe(token, hold_s))


def keep_running(worker: Any, coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` as a task on ``worker``'s loop, referenced by its slot until it ends."""
    slot = _SLOTS[worker]
    task = asyncio.ensure_future(coro)
    slot.tasks.add(task)
    task.add_done_callback(slot.tasks.discard)


def slow_down(factor: float, seconds: float, dask_worker: Any = None) -> None:
    """Make this worker's emulated stages hold their batches ``factor`` x their profiled latency
    for the next ``seconds``: an emulated GPU that throttles (``client.run(slow_down, 3, 20,
    workers=[address])``; ``daskpipe bench chaos --fault slow``)."""
    if not factor >= 1 or not seconds > 0:
        raise ValueError(f"slow_down needs factor >= 1 and seconds > 0, got {factor!r} and {seconds!r}")
    worker = dask_worker if dask_worker is not None else get_worker()
    install(worker)
    _SLOTS[worker].slowdown = (float(factor), time.time() + seconds)


class _BatchHandler:
    """The worker's ``daskpipe-batch`` stream handler, for batches from the scheduler and from peers.

    Synchronous on purpose: Dask awaits async stream handlers in order, which would hold every
    later message behind this batch's compute.
    """

    def __init__(self, worker: Any):
        self.worker = worker

    def __call__(
        self,
        *,
        route: list[dict[str, Any]],
        data: Any = None,
        inputs: Any = None,
        sent_at: float | None = None,
        part: list | None = None,
        fetch: dict[str, list[int]] | None = None,
        **batch: Any,
    ) -> None:
        received_at = time.time() if sent_at is not None else None
        batch.update(route=route, sent_at=sent_at)
        header = cast(BatchHeader, batch)  # the scheduler's or a peer stage's BATCH: the cluster's own message
        if part is not None:  # one part of a staged batch's input: run once every part is here
            data = self._gather(header, part, from_wire(data))
            if data is None:
                return
        if fetch:  # inputs its clients hold: run once they are here (daskpipe/runtime/worker/fetch.py)
            fetches = _SLOTS[self.worker].fetches
            assert fetches is not None, "installed with the slot"
            fetches.start(header, inputs, fetch)
            return
        self.start(header, from_wire(data) if data is not None else inputs, received_at)

    def start(self, batch: BatchHeader, data: Any, received_at: float | None = None) -> None:
        """Run ``batch`` on its stage here: ``data`` is its feature map, or its requests' raw inputs."""
        worker = self.worker
        route = batch["route"]
        try:
            stage = worker.state.actors.get(route[0]["stage"])
            if not isinstance(stage, Stage):
                raise LookupError(f"stage {route[0]['stage']!r} is not on worker {worker.address} (was it released?)")
            stage.run(batch, data, received_at)
        except Exception as exc:  # never let a bad batch close the worker's stream
            logger.exception("daskpipe: worker %s could not start a batch of %s", worker.address, batch.get("model"))
            report_failure(
                worker,
                batch,
                RequestFailed(f"model {batch.get('model')!r} could not run on worker {worker.address}: {exc}", cause=_picklable(exc)),
            )

    def _gather(self, batch: BatchHeader, part: list, data: torch.Tensor) -> torch.Tensor | None:
        """Keep ``part``'s rows of ``data``; the whole input, in the batch's key order, once the last part came.

        Parts of batches past their late limit are let go first: a part that never comes (the
        worker holding it died) leaves a batch the scheduler has retried or dropped since."""
        gathering = _SLOTS[self.worker].gathering
        now = time.time()
        for stale in [k for k, (expires, _) in gathering.items() if expires is not None and expires < now]:
            del gathering[stale]
        keys, sizes = batch["keys"], dict(zip(batch["keys"], batch["sizes"]))
        _, parts = gathering.setdefault((batch["model"], batch["dispatch"]), (batch.get("expires"), {}))
        parts.update(zip(part, torch.split(data, [sizes[key] for key in part])))
        if len(parts) < len(keys):
            return None
        del gathering[(batch["model"], batch["dispatch"])]
        return torch.cat([parts[key] for key in keys])


def feature_map_peers(worker: Any) -> list[str]:
    """The peer addresses this worker's stages send feature maps to, as the open comms report them."""
    slot = _SLOTS.get(worker)
    return slot.to_peers.peer_addresses() if slot is not None else []


def reply_clients(worker: Any) -> list[str]:
    """The ids of the clients whose futures this worker's last stages resolve themselves (REPLY streams)."""
    slot = _SLOTS.get(worker)
    return [client for client, stream in slot.clients.items() if not stream.please_stop] if slot is not None else []


def _hello(data: Any = None) -> None:
    """A peer opened its stream to this worker (``Stage.connect``); nothing to do."""


def report_failure(worker: Any, batch: BatchHeader, error: RequestFailed) -> None:
    """Every request of ``batch`` errs with ``error``; the scheduler keeps it opaque."""
    failed: Ended = {
        "op": messages.FAILED,
        "model": batch["model"],
        "dispatch": batch["dispatch"],
        "keys": list(batch["keys"]),
        "exception": to_serialize(error),
    }
    _SLOTS[worker].report(worker, failed)
