"""The client half of daskpipe's runtime: ``deploy`` a set of models, then submit requests as futures.

``deploy`` asks the scheduler plugin which slots the cluster has, profiles each model (every
(GPU type, slices) kind measured on a worker of that kind, all at once, or read from the profile
store; emulated kinds estimated, see :mod:`daskpipe.runtime.deploying.profiling`), plans with the MILP,
places one stage actor per (pool, slot) and tells the plugin to start serving. A
:class:`Service` then turns ``submit``/``map`` into real ``distributed.Future`` objects: it
validates the input on the client (the profile knows its shape), creates the futures, and sends
the requests to the scheduler over the service's own stream (:class:`~daskpipe.runtime.client.futures.ClientStream`,
which sends without Dask's 10 ms batching interval), a message per ``SUBMIT_CHUNK`` requests. Each
input is its raw bytes (:func:`encode_input`), which the client keeps until the first stage of its
batch fetches them; a small one rides the submission instead (:mod:`daskpipe.runtime.wire.inputs`).
Nothing is unpickled on the way.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import os
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence, TypeVar

import msgspec
import numpy as np
import torch
from distributed import Client, Future
from torch import nn

from daskpipe.config import ConfigError, check_settings
from daskpipe.plan.options import PlannerOptions
from daskpipe.plan.schema import Plan, PlanError
from daskpipe.plan.subclusters import ModelDemand, imbalance, partition
from daskpipe.profiles.fx import BlockedModel, InputLayout, SegmentationError
from daskpipe.profiles.memory import measure_memory
from daskpipe.profiles.model import Profile, ProfileError
from daskpipe.profiles.store import ProfileStore, configured_store
from daskpipe.runtime.client.arguments import check_deploy_arguments, check_model_change
from daskpipe.runtime.client.futures import ClientStream, LandedFutures, ServedFuture
from daskpipe.runtime.client.pools import Pool, PoolMember, SharedDeployment, SharedPools, plan_pools, pool_placement, resolve
from daskpipe.runtime.deploying.deployment import pickle_blocks, plan_launches, release, start_stages
from daskpipe.runtime.deploying.placement import gpus_per_server, physical_gpus, place
from daskpipe.runtime.deploying.profiling import ProfilingOptions, profile_on_cluster
from daskpipe.runtime.errors import DeployError, InvalidRequest, check_positive
from daskpipe.runtime.gctune import freeze_heap, raise_gc_thresholds
from daskpipe.runtime.scheduler.elastic.state import ElasticSettings
from daskpipe.runtime.scheduler.ledger import queue_bound
from daskpipe.runtime.scheduler.plugin import DaskpipeSchedulerPlugin
from daskpipe.runtime.wire.messages import ServeSettings, WorkerSlot

SUBMIT_CHUNK = 256
"""Most requests in one submit message: the scheduler registers a message's keys in one go on its
event loop (tens of microseconds each), so this bounds how long one message holds the loop."""

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class InputSpec:
    """What a request of one model must look like: ``(n, *shape)`` of ``dtype``, 1 <= n <= max_samples,
    finite unless ``allow_nonfinite`` (a NaN would only come back as a NaN output, or fail its batch)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    max_samples: int
    allow_nonfinite: bool = False

    @property
    def sample_nbytes(self) -> int:
        """Raw bytes of one sample, as ``encode_input`` sends it."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def admit(self, model: str, x: Any) -> tuple[int, bytes]:
        """``x``'s sample count and raw bytes (:func:`encode_input`), or :class:`InvalidRequest` naming what is wrong.

        Whatever ``x`` is, the answer is one of the two: a tensor torch cannot read as values (a
        subclass's own failure, say) is refused with torch's words, never raised as they are."""
        if not isinstance(x, torch.Tensor):
            raise InvalidRequest(
                f"input of model {model!r} must be a torch.Tensor of shape (n, {', '.join(map(str, self.shape))}), got {type(x).__name__}"
            )
        try:
            return self._admit_tensor(model, x)
        except InvalidRequest:
            raise
        except Exception as exc:
            raise InvalidRequest(
                f"input of model {model!r} cannot be read as a dense tensor of values: {type(exc).__name__}: {exc}"
            ) from exc

    def _admit_tensor(self, model: str, x: torch.Tensor) -> tuple[int, bytes]:
        if x.is_nested:
            raise InvalidRequest(f"input of model {model!r} is a nested tensor; send each of its tensors as a request of its own")
        if x.layout is not torch.strided:
            raise InvalidRequest(f"input of model {model!r} must be a dense tensor, got layout {x.layout}; send x.to_dense()")
        if x.device.type == "meta":
            raise InvalidRequest(f"input of model {model!r} is on the meta device and holds no values; send a tensor with data")
        if x.dim() != len(self.shape) + 1 or tuple(x.shape[1:]) != self.shape or x.shape[0] < 1:
            raise InvalidRequest(
                f"input of model {model!r} must have shape (n, {', '.join(map(str, self.shape))}) with n >= 1, got {tuple(x.shape)}"
            )
        if x.dtype != self.dtype:
            raise InvalidRequest(f"input of model {model!r} must be {self.dtype}, got {x.dtype}")
        if x.shape[0] > self.max_samples:
            raise InvalidRequest(
                f"a request of model {model!r} may hold at most {self.max_samples} samples (the largest planned batch), got {x.shape[0]}"
            )
        values = host_array(x)
        if not self.allow_nonfinite and not _finite(x, values):
            raise InvalidRequest(f"input of model {model!r} holds NaN or Inf values; deploy with allow_nonfinite=True to serve such inputs")
        return int(x.shape[0]), values.tobytes() if values is not None else encode_input(x)


@dataclass(frozen=True)
class PackedInputSpec(InputSpec):
    """What a request of a model with several arguments, or integer ones, must look like: the
    example's form (:func:`~daskpipe.profiles.fx.call_arguments`), each argument as the example's;
    it travels as one row of bytes per sample, which the model's first block unpacks."""

    layout: InputLayout = field(kw_only=True)

    def admit(self, model: str, x: Any) -> tuple[int, bytes]:
        try:
            leaves = self.layout.leaves(x)
        except SegmentationError as exc:
            raise InvalidRequest(f"input of model {model!r}: {exc}") from exc
        rows = []
        for index, (leaf, shape, dtype) in enumerate(zip(leaves, self.layout.shapes, self.layout.dtypes)):
            try:
                samples, raw = InputSpec(shape, dtype, self.max_samples, self.allow_nonfinite).admit(model, leaf)
            except InvalidRequest as exc:
                raise InvalidRequest(f"argument {index} of the request: {exc}") from exc
            rows.append(np.frombuffer(raw, dtype=np.uint8).reshape(samples, -1))
        if len({len(row) for row in rows}) != 1:
            raise InvalidRequest(
                f"the arguments of a request of model {model!r} must hold the same number of samples, got {[len(r) for r in rows]}"
            )
        return len(rows[0]), np.concatenate(rows, axis=1).tobytes()


def request_spec(blocked: BlockedModel, profile: Profile, example: Any, max_samples: int, allow_nonfinite: bool) -> InputSpec:
    """What the requests of the model ``blocked`` serves must look like (its ``example``'s form)."""
    layout = blocked.inputs or InputLayout.of(example)
    if layout.packed:
        return PackedInputSpec(layout.wire_shape, layout.wire_dtype, max_samples, allow_nonfinite, layout=layout)
    return InputSpec(tuple(profile.input_shape or layout.shapes[0]), layout.dtypes[0], max_samples, allow_nonfinite)


def host_array(x: torch.Tensor) -> np.ndarray | None:
    """``x`` as a numpy array sharing its memory, when it lives on the host in a dtype numpy has.

    The client's per-request path goes through numpy rather than torch ops on purpose: every torch
    op releases the GIL, and taking it back waits for the client's event-loop thread (in-process
    clusters: the scheduler and workers too) to reach its switch interval, up to 5 ms per op.
    """
    if x.device.type != "cpu" or x.dtype in _NOT_IN_NUMPY:
        return None
    try:
        return (x.detach() if x.requires_grad else x).numpy()
    except (RuntimeError, TypeError):  # a lazy conjugate or negative view: the torch path resolves it
        return None


_NOT_IN_NUMPY = frozenset(
    {
        torch.bfloat16,
        torch.complex32,
        *(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64") if hasattr(torch, name)),
    }
)


def _finite(x: torch.Tensor, values: np.ndarray | None) -> bool:
    if values is not None:
        return values.dtype.kind not in "fc" or bool(np.isfinite(values).all())
    return not (x.is_floating_point() or x.is_complex()) or bool(torch.isfinite(x).all())


def encode_input(x: torch.Tensor) -> bytes:
    """A request's tensor as its raw bytes; the first stage rebuilds the batch from them with the
    model's input dtype and shape (which the client checked), see ``Stage``."""
    values = host_array(x)
    if values is not None:
        return values.tobytes()
    return x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class Service:
    """Models served by daskpipe on a Dask cluster; made by :func:`deploy`.

    ``submit`` and ``map`` return ``distributed.Future`` objects that work with ``wait``,
    ``as_completed`` and ``client.gather``. A future ends with the model's output, or raises
    :class:`~daskpipe.runtime.errors.InvalidRequest` (at once, for a bad input),
    :class:`~daskpipe.runtime.errors.RequestDropped` (with the reason) or
    :class:`~daskpipe.runtime.errors.RequestFailed` (with the cause).

    ``add_model``, ``remove_model`` and ``update_model`` change the models it serves while it
    serves (docs/operations.md, "Model life cycle").
    """

    def __init__(
        self,
        client: Client,
        plan: Plan,
        profiles: Mapping[str, Profile],
        specs: Mapping[str, InputSpec],
        stages: Sequence[Future],
        time_dilation: float,
        entries: Mapping[tuple[str, int], InputSpec] | None = None,
        changeable: bool = False,
        shared: SharedDeployment | None = None,
        stream: ClientStream | None = None,
    ):
        self.client = client
        self._stream = stream if stream is not None else open_stream(client)
        self._plan = plan
        self.profiles = dict(profiles)
        self.time_dilation = time_dilation
        self._specs = dict(specs)
        self._entries = dict(entries or {})  # (model, start block > 0) -> what a mid-model request must look like
        self._stages = list(stages)
        self._token = uuid.uuid4().hex[:12]
        self._counter = itertools.count()
        self.closed = False
        # its deployment is elastic, or of shared pools: models can be added, removed and updated
        self._changeable = changeable or shared is not None
        self._shared = shared
        self._routing = threading.Lock()  # a model's name -> the served model its requests go to, and the count sent there
        self._served_as: dict[str, str] = {}  # an updated model -> its version served now (``name@v2``)
        self._sent: Counter[str] = Counter()  # served model -> requests sent to it, awaited before it is retired
        self._removed: set[str] = set()
        self._requested: Counter[str] = Counter()  # model -> requests sent to it, whatever version: the epochs' rates
        self._changing = threading.Lock()  # one change of the model set at a time
        self._stopping = threading.Event()
        self._unadoptable: set[str] = set()  # workers that joined and could not join a sub-cluster: tried once
        for every, change, what in (
            (shared.settings.resplit_s if shared else None, functools.partial(self._resplit, 2, 10.0, 30.0), "re-split"),
            (shared.settings.adopt_s if shared else None, self._adopt_joined, "adopt"),
        ):
            if every is not None:
                threading.Thread(target=self._every, args=(every, change, what), name=f"daskpipe-{what}", daemon=True).start()

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys([*self._specs, *(model for model, _ in self._entries)]))

    @property
    def plan(self) -> Plan | Awaitable[Plan]:
        """The plan in force; the scheduler re-plans as workers join and leave (docs/operations.md).

        With an asynchronous client, an awaitable: ``plan = await svc.plan``."""
        if self.client.asynchronous:
            return self._current_plan()
        return self.client.sync(self._current_plan)

    async def _current_plan(self) -> Plan:
        if not self.closed:
            current = await self.client.scheduler.daskpipe_plan(models=self._served_names())
            if current is not None:
                self._plan = self._public_plan(current)
        return self._plan

    def _served_names(self) -> list[str]:
        """The names the scheduler serves this service's models under (an updated one's version)."""
        return [self._served_as.get(model, model) for model in self.models]

    def _public_plan(self, plan: dict) -> Plan:
        """The scheduler's ``plan`` with this service's models under their own names."""
        public = {served: model for model, served in self._served_as.items()}
        planned = Plan.from_dict(plan)
        return replace(planned, models=tuple(replace(m, name=public.get(m.name, m.name)) for m in planned.models))

    def submit(self, model: str, x: torch.Tensor, start_block: int = 0) -> ServedFuture:
        """One request; its future resolves to ``model``'s output for ``x`` (shape ``(n, ...)``).

        ``start_block=k > 0`` (hybrid inference, docs/hybrid.md): ``x`` is the float16 feature map a
        device computed with blocks ``[0, k)``, and the server runs the rest within the budget the
        plan gives that entry.
        """
        return self.map(model, [x], start_block=start_block)[0]

    def as_completed(self, futures: Iterable[ServedFuture] = (), timeout: float | None = None) -> LandedFutures:
        """The service's ``futures`` as each ends, in the caller's thread: Dask's ``as_completed``
        (without results) for served futures, without its trips through the client's event loop
        (:class:`~daskpipe.runtime.client.futures.LandedFutures`). ``result()`` on a yielded future hands
        an output that came with the completion over at once. A synchronous client's only: an
        asynchronous one awaits its futures, or uses ``distributed.as_completed``."""
        if self.client.asynchronous:
            raise RuntimeError(
                "Service.as_completed blocks its caller's thread; with an asynchronous client await the futures or use "
                "distributed.as_completed"
            )
        return LandedFutures(futures, timeout)

    def map(self, model: str, xs: Iterable[torch.Tensor], start_block: int = 0) -> list[ServedFuture]:
        """Many requests in few messages to the scheduler (``SUBMIT_CHUNK`` each); one future each, in order.

        All or nothing: every input is checked before any is sent. If one is refused, none is sent,
        and every future is already done: a refused input's raises its own :class:`InvalidRequest`,
        each other's an ``InvalidRequest`` saying it was not sent and which input was refused."""
        sent_at = time.time()  # the requests' deadlines count from here
        admitted: list[tuple[int, bytes]] = []
        refused: dict[int, InvalidRequest] = {}
        for i, x in enumerate(xs):
            try:
                admitted.append(self._admit(model, x, start_block))
            except InvalidRequest as exc:
                refused[i] = exc
        keys = [f"daskpipe-{model}-{self._token}-{next(self._counter)}" for _ in range(len(admitted) + len(refused))]
        if refused:
            first, problem = next(iter(refused.items()))
            unsent = InvalidRequest(
                f"not sent: map() sends all of its inputs or none, and {len(refused)} of its {len(keys)} inputs of model {model!r} "
                f"were refused, the first (input {first}) as: {problem}"
            )
            futures = [ServedFuture(key, self.client) for key in keys]
            for i, key in enumerate(keys):
                self.client.futures[key].set_error(refused.get(i, unsent), None)
            return futures
        futures = []
        for key in keys:
            future = self._stream.pending[key] = ServedFuture(key, self.client)
            futures.append(future)
        for first in range(0, len(keys), SUBMIT_CHUNK):
            chunk = admitted[first : first + SUBMIT_CHUNK]
            self._send(
                model,
                keys[first : first + SUBMIT_CHUNK],
                [payload for _, payload in chunk],
                [size for size, _ in chunk],
                start_block,
                sent_at,
            )
        return futures

    def _send(
        self, model: str, keys: list[str], inputs: list[bytes], sizes: list[int], start_block: int = 0, sent_at: float | None = None
    ) -> None:
        with self._routing:
            served = self._served_as.get(model, model)
            self._sent[served] += len(keys)
            self._requested[model] += len(keys)
            self._stream.send_requests(served, keys, inputs, sizes, start_block, sent_at)

    def _admit(self, model: str, x: Any, start_block: int = 0) -> tuple[int, bytes]:
        if self.closed:
            raise InvalidRequest(f"the service is closed; model {model!r} takes no more requests")
        spec = self._specs.get(model) if start_block == 0 else self._entries.get((model, start_block))
        if spec is None:
            if model in self._removed:
                raise InvalidRequest(f"model {model!r} was removed from this service; it serves {self.models}")
            if model not in self.models:
                raise InvalidRequest(f"unknown model {model!r}; this service serves {self.models}")
            entries = [0] * (model in self._specs) + sorted(k for m, k in self._entries if m == model)
            raise InvalidRequest(
                f"model {model!r} takes no requests entering at block {start_block!r}; its plan has entries at blocks {entries}"
            )
        return spec.admit(model, x)

    def status(self) -> dict[str, dict]:
        """Per model: submitted, completed, on_time, failed, dropped by reason, queued, in_flight,
        the control path (``control``, docs/runtime.md). Awaitable with an asynchronous client."""
        return self.client.sync(self._status)

    async def _status(self) -> dict[str, dict]:
        public = {served: model for model, served in self._served_as.items()}
        counts = await self.client.scheduler.daskpipe_status(models=self._served_names())
        return {public.get(model, model): status for model, status in counts.items()}

    def close(self, timeout: float = 30.0) -> None | Awaitable[None]:
        """Stop serving: queued requests err with reason "shutdown", dispatched batches finish.
        Awaitable with an asynchronous client."""
        return self.client.sync(self._close, timeout)

    async def _close(self, timeout: float) -> None:
        if self.closed:
            return
        self.closed = True
        self._stopping.set()
        scheduler = self.client.scheduler
        served = self._served_names()
        await scheduler.daskpipe_close(models=served, reason="shutdown")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = await scheduler.daskpipe_status(models=served, forget=True)
            if not any(s["in_flight"] for s in left.values()):
                break
            await asyncio.sleep(0.05)
        await scheduler.daskpipe_status(models=served, forget=True)
        await self._stream.close()
        self._stages.clear()

    # -- the model life cycle (docs/operations.md, daskpipe/runtime/scheduler/lifecycle.py) ---------------------
    def add_model(
        self,
        name: str,
        module: nn.Module,
        example_input: Any,
        *,
        slo_ms: float | None = None,
        profile: Profile | None = None,
        weight: float = 1.0,
        max_queued: int | None = None,
        allow_nonfinite: bool = False,
        profiling: ProfilingOptions = ProfilingOptions(),
    ) -> None | Awaitable[None]:
        """Serve one more model while the others serve: profile it as ``deploy`` does (or cut it
        as ``profile`` says), re-plan the cluster for the new model set, start the new plan's
        stages, serve the new model, then switch the others to the new plan (their queued
        requests wait through the switch, as on a re-plan). Returns once ``name`` takes requests.

        The arguments are ``deploy``'s for one model; ``weight`` is its workload share against
        the others' (deploy's ``weights``, default 1). Awaitable with an asynchronous client. On a
        shared-pool service it joins one sub-cluster instead, with no re-plan (docs/operations.md,
        "Model life cycle").

        Raises
        ------
        DeployError
            On a closed service or one whose plan is fixed, a bad argument, a name already served,
            or a model the cluster cannot fit beside the others (the plan in force stays).
        """
        return self._change(self._add_model, name, module, example_input, slo_ms, profile, weight, max_queued, allow_nonfinite, profiling)

    def remove_model(self, name: str, timeout: float = 30.0) -> None | Awaitable[None]:
        """Stop serving ``name``: new requests for it are refused at once (an ``InvalidRequest``
        naming it); those already sent are served to their end (queued ones dispatched, batches
        in flight finished), then its stages are released and the others re-planned onto the
        freed slots. What has not ended ``timeout`` seconds on is dropped ("shutdown"), or, a
        batch still running after the flush, failed. Awaitable with an asynchronous client.

        Raises
        ------
        DeployError
            On a closed or non-elastic service, an unknown model, or the service's last model
            (``close`` the service instead).
        """
        return self._change(self._remove_model, name, timeout)

    def update_model(
        self,
        name: str,
        module: nn.Module,
        example_input: Any = None,
        *,
        slo_ms: float | None = None,
        profile: Profile | None = None,
        max_queued: int | None = None,
        profiling: ProfilingOptions = ProfilingOptions(),
        timeout: float = 30.0,
    ) -> None | Awaitable[None]:
        """Roll out a new version of ``name``: ``module`` is profiled and planned in the old
        version's place and started on stages of its own; once they are up, new requests go to
        it, while those already sent finish on the old version, whose stages are then released
        (as ``remove_model`` ends a model, ``timeout`` included). The scheduler serves it as
        ``name@v2`` (``@v3``, ...): its log lines and dashboard say which version.

        Requests keep their form: ``example_input`` (default: zeros of the served input's shape)
        must have the shape and dtype the service takes for ``name``, or the update is refused,
        naming both; a model that takes another input is a new model (``add_model``).
        ``slo_ms`` defaults to the old version's. Awaitable with an asynchronous client.

        Raises
        ------
        DeployError
            On a closed or non-elastic service, an unknown model, a bad argument, another input
            form, or a version the cluster cannot fit (the old version keeps serving).
        """
        return self._change(self._update_model, name, module, example_input, slo_ms, profile, max_queued, profiling, timeout)

    def _change(self, change: Callable[..., T], *args: Any) -> T | Awaitable[T]:
        """Run ``change``, one change at a time; with an asynchronous client, in a thread,
        awaitable: profiling and planning block for seconds, and the loop must keep serving meanwhile."""
        if self.client.asynchronous:
            return asyncio.get_running_loop().run_in_executor(None, functools.partial(self._one_at_a_time, change, *args))
        return self._one_at_a_time(change, *args)

    def _one_at_a_time(self, change: Callable[..., T], *args: Any) -> T:
        with self._changing:
            return change(*args)

    def resplit(
        self, *, max_moves: int = 2, time_limit_s: float = 10.0, timeout: float = 30.0
    ) -> dict[str, tuple[int, int]] | Awaitable[dict[str, tuple[int, int]]]:
        """Symphony's epoch (section 4.4, Appendix A) on a service of several shared sub-clusters:
        split its models over them again by the rates this service sent each since the last
        re-split (or the deploy), balancing rate and memory (``daskpipe.plan.subclusters.partition``
        within ``time_limit_s``), moving at most ``max_moves`` models. A model moves as
        ``update_model`` rolls out a version: its stages start in its new sub-cluster, new requests go
        there, and those already sent end in the old one (``timeout`` as there). Returns the moves
        made, model -> (from, to) sub-cluster; none when the split in force is as balanced.
        ``SharedPools(resplit_s=)`` runs it on a schedule. Awaitable with an asynchronous client.
        """
        return self._change(self._resplit, max_moves, time_limit_s, timeout)

    def _resplit(self, max_moves: int, time_limit_s: float, timeout: float) -> dict[str, tuple[int, int]]:
        shared = self._shared
        if self.closed:
            raise DeployError("resplit: the service is closed")
        if shared is None or len(shared.pools) < 2:
            raise DeployError("resplit: only a service of two or more shared sub-clusters is re-split (pools=SharedPools(subclusters=...))")
        if isinstance(max_moves, bool) or not isinstance(max_moves, int) or max_moves < 1:
            raise DeployError(f"resplit: max_moves must be an integer >= 1, got {max_moves!r}")
        check_positive("time_limit_s", time_limit_s, " s")
        check_positive("timeout", timeout, " s")
        now = time.monotonic()
        with self._routing:
            sent, served = dict(self._requested), {name: self._served_as.get(name, name) for name in self._specs}
        seconds = max(now - shared.epoch_at, 1e-3)
        rates = {name: (sent.get(name, 0) - shared.epoch_sent.get(name, 0)) / seconds for name in served}
        shared.epoch_sent, shared.epoch_at = sent, now
        if not any(rates.values()):  # nothing sent this epoch: nothing to balance
            return {}
        members = {name: shared.members[s] for name, s in served.items()}
        demands = [
            ModelDemand(name, rates[name], m.memory.weights_bytes, m.memory.activations(self._plan.model(name).max_batch))
            for name, m in members.items()
        ]
        previous = {name: shared.index_of(s) for name, s in served.items()}
        before = imbalance([sum(r for name, r in rates.items() if previous[name] == j) for j in range(len(shared.pools))])
        try:
            split = partition(demands, len(shared.pools), previous=previous, max_moves=max_moves, time_limit_s=time_limit_s)
        except PlanError as exc:
            raise DeployError(f"resplit: {exc}") from None
        if split.rate_imbalance >= before:
            return {}
        moves = {}
        for name, to in split.assignment.items():
            home = previous[name]
            if to == home:
                continue
            if shared.pools[home].models == (served[name],):  # its slots would serve nothing
                logger.info("daskpipe: re-split: %s stays in sub-cluster %d, its only model", name, home)
                continue
            version = next_version(name, served[name])
            member = replace(members[name], profile=replace(members[name].profile, model=version))
            try:
                self._replace_in_pool(shared, name, version, member, self._specs[name], to, timeout)
            except DeployError as exc:
                logger.warning("daskpipe: re-split: %s stays in sub-cluster %d: %s", name, home, exc)
                continue
            moves[name] = (home, to)
        logger.info("daskpipe: re-split at rates %s: moved %s (rate imbalance %.2f -> %.2f)", rates, moves, before, split.rate_imbalance)
        return moves

    def add_workers(self, workers: Sequence[str] | None = None, *, subcluster: int | None = None) -> list[str] | Awaitable[list[str]]:
        """Grow a shared pool by workers that joined the cluster: ``workers`` (addresses; default:
        every slot of the cluster that no sub-cluster of this service has) join ``subcluster``
        (default: of those with slots of their kinds, the one with the most models a slot). Every
        model of it gets a stage on each, memory checked as at deploy, and the pool's dispatcher
        sends batches there as soon as they are up: no re-plan, no switch, the models serve on
        meanwhile. Returns the addresses that joined. Awaitable with an asynchronous client.

        A deployment planned by the MILP re-plans onto workers that join by itself when it is
        elastic (``deploy(..., elastic=ElasticSettings())``); this call is for shared pools.

        Raises
        ------
        DeployError
            On a closed service or one without shared pools, an address that is no worker or serves
            a sub-cluster already, a kind the sub-cluster has no slot of (a new kind needs a plan
            of its own: deploy again), or models that do not fit the new slots' memory.
        """
        return self._change(self._add_workers, workers, subcluster)

    def _add_workers(self, workers: Sequence[str] | None, into: int | None) -> list[str]:
        shared = self._shared
        if self.closed:
            raise DeployError("add_workers: the service is closed")
        if shared is None:
            raise DeployError(
                "add_workers: this service has no shared pools (pools=SharedPools()); a deployment planned by the MILP re-plans onto "
                "workers that join by itself when deployed with elastic=ElasticSettings()"
            )
        if isinstance(workers, str) or not (workers is None or all(isinstance(w, str) for w in workers)):
            raise DeployError(f"add_workers: workers must be a sequence of worker addresses, got {workers!r}")
        slots = {s.address: s for s in cluster_slots(self.client)}
        if workers is None:
            workers = [a for a in sorted(slots) if a not in shared.addresses()]
        unknown = [a for a in workers if a not in slots]
        if unknown:
            raise DeployError(f"add_workers: {unknown} are not workers of this cluster (its workers: {sorted(slots)})")
        joining = [slots[a] for a in workers]
        try:
            index, plan = shared.plan_grow(joining, into)
        except DeployError as exc:
            raise DeployError(f"add_workers: {exc}") from None
        members = {name: shared.members[name] for name in shared.pools[index].models}
        rows = self._start_in_pool(
            plan,
            pool_placement(plan, [Pool(tuple(members), tuple(joining))]),
            {name: m.blocked for name, m in members.items()},
            {name: self._specs[name.partition("@v")[0]].dtype for name in members},
            lambda rows: self.client.sync(
                self.client.scheduler.daskpipe_grow_pool,
                pool=list(members),
                plan=plan.to_dict(),
                stages={name: rows[name] for name in members},
                serving=shared.serving.to_wire(),
            ),
        )
        shared.grown(index, joining, {name: {str(row[3]) for row in rows[name]} for name in members})
        self._plan = self._public_plan(plan.to_dict())
        logger.info("daskpipe: %s joined sub-cluster %d (%s)", [s.address for s in joining], index, ", ".join(members))
        return [s.address for s in joining]

    def _every(self, seconds: float, change: Callable[[], Any], what: str) -> None:
        """``change`` every ``seconds`` until the service closes (a thread): a re-split's epochs, or
        the look for workers to adopt. A failure is logged; the models serve on and the next round tries again."""
        while not self._stopping.wait(seconds):
            try:
                self._one_at_a_time(change)
            except Exception as exc:
                logger.warning("daskpipe: this round's %s failed: %s", what, exc)

    def _adopt_joined(self) -> None:
        """``SharedPools(adopt_s=)``: add the workers that joined the cluster since the last look, each
        to the sub-cluster :meth:`add_workers` picks; one that none can take is logged once."""
        shared = self._shared
        if self.closed or shared is None:
            return
        taken = shared.addresses() | self._unadoptable
        for slot in cluster_slots(self.client):
            if slot.address in taken:
                continue
            try:
                self._add_workers([slot.address], None)
            except DeployError as exc:
                self._unadoptable.add(slot.address)
                logger.warning("daskpipe: worker %s joined the cluster and stays out of the service's pools: %s", slot.address, exc)

    def _check_changeable(self, what: str) -> None:
        if self.closed:
            raise DeployError(f"{what}: the service is closed")
        if not self._changeable:
            raise DeployError(
                f"{what}: this service keeps its plan (deployed with elastic=None, or a hybrid deployment); deploy with "
                f"elastic=ElasticSettings(), or with pools=SharedPools(), to add, remove or update models"
            )

    def _add_model(
        self,
        name: str,
        module: nn.Module,
        example: Any,
        slo_ms: float | None,
        profile: Profile | None,
        weight: float,
        max_queued: int | None,
        allow_nonfinite: bool,
        profiling: ProfilingOptions,
    ) -> None:
        self._check_changeable(f"add_model({name!r})")
        check_model_change(name, module, example, slo_ms=slo_ms, profile=profile, weight=weight, max_queued=max_queued, profiling=profiling)
        if not isinstance(allow_nonfinite, bool):
            raise DeployError(f"allow_nonfinite must be True or False, got {allow_nonfinite!r}")
        if name in self.models:
            raise DeployError(f"model {name!r} is already served by this service; update_model rolls out a new version of it")
        slo_us = slo_ms * 1e3 if slo_ms is not None else None
        profile, blocked, spec = self._prepare(name, module, example, profile, slo_us, profiling, allow_nonfinite)
        if self._shared is not None:
            memory = self._shared.settings.memory.get(name) or measure_memory(module, example)
            plan = self._join_pool(self._shared, name, PoolMember(profile, memory, slo_us, max_queued, blocked, set()), spec)
        else:
            plan = self.client.sync(
                self.client.scheduler.daskpipe_add_model,
                models=self._served_names(),
                model=name,
                spec=scheduler_spec(blocked, spec, profile, pickle_blocks(blocked.blocks)),
                slo_us=slo_us,
                weight=float(weight),
                max_queued=max_queued,
                sample_nbytes=spec.sample_nbytes,
            )
        with self._routing:
            self._removed.discard(name)
            self._specs[name] = replace(spec, max_samples=Plan.from_dict(plan).model(name).max_batch)
            self.profiles[name] = profile
            self._plan = self._public_plan(plan)

    def _remove_model(self, name: str, timeout: float) -> None:
        self._check_changeable(f"remove_model({name!r})")
        check_positive("timeout", timeout, " s")
        if name not in self._specs:
            raise DeployError(f"unknown model {name!r}; this service serves {self.models}")
        if len(self.models) == 1:
            raise DeployError(f"model {name!r} is the service's last model; close the service instead")
        served_names = self._served_names()
        with self._routing:  # no request of it is sent from here on
            served, spec = self._served_as.pop(name, name), self._specs.pop(name)
            self._removed.add(name)
            sent = self._sent.pop(served, 0)
        try:
            if self._shared is not None:
                self.client.sync(self.client.scheduler.daskpipe_leave_pool, model=served, sent=sent, timeout_s=float(timeout))
                plan = self._left_pool(self._shared, served)
            else:
                plan = self.client.sync(
                    self.client.scheduler.daskpipe_remove_model, models=served_names, model=served, sent=sent, timeout_s=float(timeout)
                )
        except Exception:  # refused before anything changed there: it serves on
            with self._routing:
                self._removed.discard(name)
                self._specs[name], self._sent[served] = spec, self._sent[served] + sent
                if served != name:
                    self._served_as[name] = served
            raise
        self.profiles.pop(name, None)
        self._plan = self._public_plan(plan)

    def _update_model(
        self,
        name: str,
        module: nn.Module,
        example: Any,
        slo_ms: float | None,
        profile: Profile | None,
        max_queued: int | None,
        profiling: ProfilingOptions,
        timeout: float,
    ) -> None:
        self._check_changeable(f"update_model({name!r})")
        check_model_change(name, module, example, slo_ms=slo_ms, profile=profile, weight=1.0, max_queued=max_queued, profiling=profiling)
        check_positive("timeout", timeout, " s")
        old_spec = self._specs.get(name)
        if old_spec is None:
            raise DeployError(f"unknown model {name!r}; this service serves {self.models}")
        if example is None:
            if isinstance(old_spec, PackedInputSpec):
                raise DeployError(f"model {name!r} takes several arguments; give update_model its example_input")
            example = torch.zeros(1, *old_spec.shape, dtype=old_spec.dtype)
        old = self._served_as.get(name, name)
        version = next_version(name, old)
        slo_us = slo_ms * 1e3 if slo_ms is not None else None
        given = replace(profile, model=version) if profile is not None else None
        new_profile, blocked, spec = self._prepare(version, module, example, given, slo_us, profiling, old_spec.allow_nonfinite)
        if replace(spec, max_samples=old_spec.max_samples) != old_spec:
            raise DeployError(
                f"update_model keeps the requests of model {name!r} as they are: (n, {', '.join(map(str, old_spec.shape))}) of "
                f"{old_spec.dtype}; the new version takes (n, {', '.join(map(str, spec.shape))}) of {spec.dtype}; serve it as a new "
                f"model with add_model"
            )
        if self._shared is not None:  # both versions in the old one's pool until the old one ends
            shared = self._shared
            memory = shared.settings.memory.get(name) or measure_memory(module, example)
            slo = slo_us if slo_us is not None else shared.members[old].slo_us
            member = PoolMember(new_profile, memory, slo, max_queued, blocked, set())
            self._replace_in_pool(shared, name, version, member, spec, shared.index_of(old), timeout)
            return
        plan = self.client.sync(
            self.client.scheduler.daskpipe_update_model,
            models=self._served_names(),
            model=old,
            version=version,
            spec=scheduler_spec(blocked, spec, new_profile, pickle_blocks(blocked.blocks)),
            slo_us=slo_us,
            max_queued=max_queued,
            sample_nbytes=spec.sample_nbytes,
        )
        sent = self._route_to(name, version, spec, plan)
        self.profiles[name] = new_profile
        self.client.sync(self.client.scheduler.daskpipe_retire_model, model=old, sent=sent, timeout_s=float(timeout))

    def _route_to(self, name: str, version: str, spec: InputSpec, plan: dict) -> int:
        """New requests for ``name`` go to ``version`` (served on ``plan``) from here on; the
        count sent to the version before it, which the scheduler awaits before ending it."""
        with self._routing:
            old = self._served_as.get(name, name)
            self._served_as[name] = version
            self._specs[name] = replace(spec, max_samples=Plan.from_dict(plan).model(version).max_batch)
            sent = self._sent.pop(old, 0)
        self._plan = self._public_plan(plan)
        return sent

    def _replace_in_pool(
        self, shared: SharedDeployment, name: str, version: str, member: PoolMember, spec: InputSpec, into: int, timeout: float
    ) -> None:
        """Serve ``name`` as ``version`` in sub-cluster ``into``, then end the version serving it now
        (an update, or a move of a re-split): both are held until the old one has ended what it was sent."""
        old = self._served_as.get(name, name)
        plan = self._join_pool(shared, version, member, spec, into)
        sent = self._route_to(name, version, spec, plan)
        self.profiles[name] = member.profile
        self.client.sync(self.client.scheduler.daskpipe_leave_pool, model=old, sent=sent, timeout_s=float(timeout))
        self._plan = self._public_plan(self._left_pool(shared, old))

    def _prepare(
        self,
        name: str,
        module: nn.Module,
        example: Any,
        profile: Profile | None,
        slo_us: float | None,
        profiling: ProfilingOptions,
        allow_nonfinite: bool,
    ) -> tuple[Profile, BlockedModel, InputSpec]:
        """A new model's profile, blocks and request spec (batch 1 for now: the plan decides), as ``deploy`` makes them."""
        slots = inventory(self.client)
        measured, blocked, excluded = prepare_model(
            self.client, slots, name, module, example, profile, slo_us, profiling, configured_store(profiling.store)
        )
        if profile is None:
            measured = on_kinds(measured, [s for s in slots if (s.gpu, s.slices) not in excluded])
        return measured, blocked, request_spec(blocked, measured, example, 1, allow_nonfinite)

    def _join_pool(self, shared: SharedDeployment, served: str, member: PoolMember, spec: InputSpec, into: int | None = None) -> dict:
        """Serve ``served`` in a sub-cluster of ``shared`` (``into``, else the one
        :meth:`SharedDeployment.plan_join` picks): its stages start on every slot there, then the
        scheduler adds it to the pool's dispatcher. The deployment's plan with it."""
        index, plan = shared.plan_join(served, member, into)
        wait_s = shared.timeout_s(served.partition("@v")[0])  # refused before any stage starts
        grown = Pool((*shared.pools[index].models, served), shared.pools[index].slots)
        alive = {s.address for s in cluster_slots(self.client)}  # a worker that left never comes back under its address
        rows = self._start_in_pool(
            plan,
            {served: [row for row in pool_placement(plan, [grown])[served] if row[2].address in alive]},
            {served: member.blocked},
            {served: spec.dtype},
            lambda rows: self.client.sync(
                self.client.scheduler.daskpipe_join_pool,
                model=served,
                pool=list(shared.pools[index].models),
                plan=plan.to_dict(),
                profile=member.profile.to_dict(),
                stages=rows[served],
                serving=msgspec.structs.replace(shared.serving, max_queued=member.max_queued).to_wire(),
                sample_nbytes=spec.sample_nbytes,
                timeout_s=wait_s,
            ),
        )
        shared.joined(index, served, replace(member, stages={str(row[3]) for row in rows[served]}))
        return plan.to_dict()

    def _start_in_pool(
        self,
        plan: Plan,
        placed: Mapping[str, list],
        blocked: Mapping[str, BlockedModel],
        dtypes: Mapping[str, torch.dtype],
        serve: Callable[[dict[str, list[list]]], Any],
    ) -> dict[str, list[list]]:
        """Start the stages ``placed`` (model -> :func:`pool_placement` rows) of a shared pool, then
        hand their rows to the scheduler with ``serve``; a refusal there releases them. The rows, by model."""
        launches = plan_launches(
            plan,
            placed,
            {name: [b.input_shape, *b.boundary_shapes] for name, b in blocked.items()},
            {name: str(dtype).removeprefix("torch.") for name, dtype in dtypes.items()},
        )
        started = self.client.sync(start_stages, self.client, launches, {name: pickle_blocks(b.blocks) for name, b in blocked.items()})
        try:
            serve(started.rows)
        except Exception:
            release(started.futures)
            raise
        self._stages.extend(started.futures)
        return started.rows

    def _left_pool(self, shared: SharedDeployment, served: str) -> dict:
        """``served`` left its pool on the scheduler: release its stages; the deployment's plan without it."""
        stages = shared.left(served)
        release(future for future in self._stages if future.key in stages)
        self._stages = [future for future in self._stages if future.key not in stages]
        return shared.plan().to_dict()

    def __enter__(self) -> Service:
        return self

    async def __aenter__(self) -> Service:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._close(30.0)

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<daskpipe.Service models={self.models} {'closed' if self.closed else 'serving'}>"


def next_version(name: str, served: str) -> str:
    """The name the scheduler serves ``name``'s next version as, ``served`` its version now: ``name@v2``, ``@v3``, ..."""
    return f"{name}@v{int(served.rpartition('@v')[2]) + 1 if served != name else 2}"


def awaitable_with_asynchronous_client(function: Callable[..., Service]) -> Callable[..., Any]:
    """``function(client, ...)`` as it is, or, called on an asynchronous client's event loop, an
    awaitable of it run in a thread: profiling and planning block for seconds, and the loop must
    keep serving the client meanwhile (Dask's blocking API works from another thread)."""

    @functools.wraps(function)
    def wrapper(client: Client, *args: Any, **kwargs: Any) -> Any:
        if client.asynchronous:
            return asyncio.get_running_loop().run_in_executor(None, functools.partial(function, client, *args, **kwargs))
        return function(client, *args, **kwargs)

    return wrapper


@awaitable_with_asynchronous_client
def deploy(
    client: Client,
    models: Mapping[str, nn.Module],
    *,
    example_inputs: Mapping[str, torch.Tensor],
    slo_ms: Mapping[str, float] | None = None,
    plan: Plan | str | os.PathLike | None = None,
    profiles: Mapping[str, Profile] | None = None,
    weights: Mapping[str, float] | None = None,
    planner: PlannerOptions = PlannerOptions(),
    profiling: ProfilingOptions = ProfilingOptions(),
    time_dilation: float = 1.0,
    dispatcher: str = "ppipe",
    max_queued: int | None = None,
    allow_nonfinite: bool = False,
    elastic: ElasticSettings | None = ElasticSettings(),
    pools: SharedPools | None = None,
) -> Service:
    """Profile, plan, place and serve ``models`` (name -> ``nn.Module``) on ``client``'s cluster.

    Parameters
    ----------
    example_inputs
        A batched example per model, e.g. ``torch.randn(1, 3, 224, 224)``: it fixes the input
        shape and dtype that requests must have.
    slo_ms
        The latency SLO per model, in milliseconds (default: 5x the model's batch-1 latency on its slowest measured whole-GPU kind).
    plan, profiles
        A plan (``Plan`` or a plan.json path) and the profiles it was made from, instead of
        profiling and planning here. ``profiles`` alone skips profiling only.
    weights
        The models' workload shares, which the plan balances (default: equal).
    planner
        How to plan (:class:`~daskpipe.plan.options.PlannerOptions`: strategy, bandwidth, margin,
        partitions, solver); the elastic re-planner plans with them too.
    profiling
        How to profile the models not given profiles of
        (:class:`~daskpipe.runtime.deploying.profiling.ProfilingOptions`: blocks, batch sizes, the profile
        store, a timeout per model).
    time_dilation
        k: every latency and SLO is scaled by k, so emulated GPUs on a slow machine keep up.
    dispatcher
        The data plane that batches and routes the requests, by name: ``ppipe`` (default),
        ``ppipe-two-pass``, ``deferred`` (Symphony), ``eager``, ``timeout``, ``reactive`` or
        ``hybrid`` (:mod:`daskpipe.sched.registry`; the same names as ``daskpipe simulate
        --dataplane``). An unknown name fails the deploy, listing the known ones.
    max_queued
        Most requests a model queues on the scheduler; one more is dropped with reason
        "overload" (default: two SLOs' worth at the plan's capacity, see ``daskpipe.runtime.scheduler.ledger.queue_bound``).
    allow_nonfinite
        Serve inputs holding NaN or Inf; by default they err with ``InvalidRequest`` at once.
    elastic
        How the scheduler re-plans as workers join and leave or the load mix shifts, and advises
        ``Adaptive`` (:class:`~daskpipe.runtime.scheduler.elastic.state.ElasticSettings`); ``None``: the plan stays.
        Shared pools are not re-planned.
    pools
        ``None`` (default): PPipe's planned pools, each GPU serving one model. A
        :class:`~daskpipe.runtime.client.pools.SharedPools`: Symphony's shared pools, every model of a
        sub-cluster whole on every slot of it (within each GPU's memory: a deploy whose models do
        not fit is refused, naming them), with one ``deferred``, ``eager`` or ``timeout``
        dispatcher per sub-cluster choosing which model a free slot runs next (docs/batching.md,
        "Shared pools"). It needs no ``plan=``; a PPipe plan that gives a model no pipeline says so.

    Returns
    -------
    Service
        Serving until closed. With an asynchronous client, an awaitable of it:
        ``svc = await deploy(client, ...)`` (and ``await svc.plan``, ``await svc.status()``,
        ``await svc.close()`` or ``async with svc``).

    Raises
    ------
    DeployError
        When the cluster cannot serve the models as asked; the message says what to change.
    """
    check_deploy_arguments(
        models,
        example_inputs,
        slo_ms=slo_ms,
        weights=weights,
        time_dilation=time_dilation,
        planner=planner,
        profiling=profiling,
        dispatcher=dispatcher,
        allow_nonfinite=allow_nonfinite,
        plan=plan,
        profiles=profiles,
        max_queued=max_queued,
        elastic=elastic,
        pools=pools,
    )
    try:  # this process's keys: its own (the store, its GC), and those of an in-process scheduler and workers
        check_settings()
    except ConfigError as exc:
        raise DeployError(f"the Dask config: {exc}") from None
    names = list(models)
    slots = inventory(client)
    from daskpipe.runtime.worker.environ import warn_slow_workers

    warn_slow_workers(client, [slot.address for slot in slots])  # e.g. Dask's MALLOC_TRIM_THRESHOLD_ halves torch
    if not slots:
        raise DeployError("the cluster has no workers to serve on")
    plan_source = "the plan"  # for errors: a plan file is named
    if isinstance(plan, (str, os.PathLike)):
        plan_source = f"plan {plan}"
        plan = Plan.load(Path(plan))
    profiles = dict(profiles or {})
    if plan is not None and set(names) - set(profiles):
        raise DeployError(f"plan= needs the profiles= it was made from; missing for {sorted(set(names) - set(profiles))}")
    store = configured_store(profiling.store)
    given = set(profiles)
    blocked = {}
    for name in names:
        slo_us = slo_ms[name] * 1e3 if slo_ms and name in slo_ms else None
        profiles[name], blocked[name], excluded = prepare_model(
            client, slots, name, models[name], example_inputs[name], profiles.get(name), slo_us, profiling, store
        )
        slots = [s for s in slots if (s.gpu, s.slices) not in excluded]  # an excluded kind serves no model
    for name in set(names) - given:  # and is planned for none, whichever model's profiling excluded it
        profiles[name] = on_kinds(profiles[name], slots)
    slos_us = {m: s * 1e3 for m, s in (slo_ms or {}).items()}
    shared = resolve(pools, names, slots) if pools is not None else []
    if pools is not None and pools.resplit_s is not None and len(shared) < 2:
        raise DeployError(f"SharedPools.resplit_s re-splits models over two or more sub-clusters; this deploy has {len(shared)}")
    if shared and pools is not None:
        memory = {name: pools.memory.get(name) or measure_memory(models[name], example_inputs[name]) for name in names}
        plan = plan_pools(shared, profiles, slos_us, memory, pools.context_bytes)
    elif plan is None:
        from daskpipe.plan.milp import make_plan

        plan = make_plan(
            profiles,
            physical_gpus(slots),
            weights=weights,
            gpus_per_server=gpus_per_server(slots),
            slo_us=slos_us,
            options=planner,
        )
    unplanned = sorted(set(names) - {m.name for m in plan.models})
    if unplanned:
        raise DeployError(f"{plan_source} has no model {unplanned}; it plans {[m.name for m in plan.models]}")
    specs = {}
    for name in names:
        model_plan = plan.model(name)
        if not model_plan.pipelines:
            raise DeployError(
                f"the plan gives model {name!r} no pipeline on this cluster; to share GPUs between models, deploy with "
                f"pools=SharedPools() and dispatcher='deferred' (docs/batching.md, \"Shared pools\")"
            )
        deepest = max(part.blocks[1] for pipeline in model_plan.pipelines for part in pipeline.partitions)
        if deepest > profiles[name].num_blocks:
            raise DeployError(
                f"{plan_source} cuts {name!r} up to block {deepest}, its profile has {profiles[name].num_blocks} blocks; give the "
                f"profiles the plan was made from"
            )
        specs[name] = request_spec(blocked[name], profiles[name], example_inputs[name], model_plan.max_batch, allow_nonfinite)
        queue_bound(model_plan, max_queued)  # a bad bound fails here, before any stage starts
    launches = plan_launches(
        plan,
        pool_placement(plan, shared) if shared else place(plan, names, slots),
        {name: [blocked[name].input_shape, *blocked[name].boundary_shapes] for name in names},
        {name: str(specs[name].dtype).removeprefix("torch.") for name in names},
    )
    # each block pickled once: every stage of its pools and the scheduler's re-planning take these bytes
    pickled = {name: pickle_blocks(blocked[name].blocks) for name in names}
    started = client.sync(start_stages, client, launches, pickled)
    stage_futures, stage_rows = started.futures, started.rows
    served: list[str] = []
    bw_gbps = float(plan.cluster.get("bw_gbps", planner.bw_gbps))
    serving = ServeSettings(dispatcher=dispatcher, time_dilation=float(time_dilation), bw_gbps=bw_gbps, max_queued=max_queued).to_wire()
    stream = open_stream(client)  # before the serve calls: a trial's first stages fetch its inputs from this client
    try:
        for pool in shared:
            client.sync(
                client.scheduler.daskpipe_serve_pool,
                models=list(pool.models),
                plan=plan.to_dict(),
                profiles={name: profiles[name].to_dict() for name in pool.models},
                stages={name: stage_rows[name] for name in pool.models},
                serving=serving,
                sample_nbytes={name: specs[name].sample_nbytes for name in pool.models},
                timeout_s=pools.timeouts_s(pool.models) if pools is not None else None,
                adopt_settings=elastic.to_dict() if pools is not None and pools.adopt_s is not None and elastic is not None else None,
            )
            served.extend(pool.models)
        for name in names if not shared else ():
            with stream.trial_inputs(specs[name].sample_nbytes) as trial:
                client.sync(
                    client.scheduler.daskpipe_serve,
                    model=name,
                    plan=plan.to_dict(),
                    profile=profiles[name].to_dict(),
                    stages=stage_rows[name],
                    serving=serving,
                    sample_nbytes=specs[name].sample_nbytes,
                    **trial,
                )
            served.append(name)
        if elastic is not None and not shared:  # the scheduler keeps what re-planning takes; the blocks stay opaque bytes there
            client.sync(
                client.scheduler.daskpipe_elastic,
                group=uuid.uuid4().hex,
                models={name: scheduler_spec(blocked[name], specs[name], profiles[name], pickled[name]) for name in names},
                plan=plan.to_dict(),
                stages=stage_rows,
                options=replace(planner, bw_gbps=bw_gbps).to_dict(),
                slo_us=slos_us,
                weights=dict(weights) if weights else None,
                serving=serving,
                settings=elastic.to_dict(),
                profile_store=str(store.root) if store is not None else None,
            )
    except Exception:  # e.g. an SLO the measured control path cannot meet: serve none of them, and keep no stage
        if served:
            client.sync(client.scheduler.daskpipe_close, models=served, reason="shutdown")
            client.sync(client.scheduler.daskpipe_status, models=served, forget=True)
        release(stage_futures)
        client.sync(stream.close)
        raise
    deployment = None
    if shared and pools is not None:
        deployment = SharedDeployment(
            pools=list(shared),
            settings=pools,
            serving=ServeSettings.from_wire(serving),
            members={
                name: PoolMember(
                    profiles[name], memory[name], slos_us.get(name), max_queued, blocked[name], {str(r[3]) for r in stage_rows[name]}
                )
                for name in names
            },
        )
    return Service(
        client, plan, profiles, specs, stage_futures, float(time_dilation), changeable=elastic is not None, shared=deployment, stream=stream
    )


# -- steps of deploy ---------------------------------------------------------------------------
def open_stream(client: Client) -> ClientStream:
    """The client's own stream to the scheduler, for a service's requests and their resolutions.

    The client's process then collects garbage as a scheduler does (:mod:`daskpipe.runtime.gctune`):
    on higher thresholds, as it holds a few dozen objects per request in flight, and with the heap
    it holds by now frozen out of full collections."""
    raise_gc_thresholds()
    stream = ClientStream(client)
    client.sync(stream.open)
    freeze_heap()
    return stream


def inventory(client: Client) -> list[WorkerSlot]:
    """The cluster's slots, installing the scheduler plugin first unless a preload did."""
    try:  # idempotent: a no-op where ``--preload daskpipe`` installed it
        client.register_plugin(DaskpipeSchedulerPlugin())
    except Exception as exc:  # e.g. a scheduler that refuses pickled plugins; the preload may be there
        logger.info("daskpipe: could not register the scheduler plugin from the client (%s); expecting a preload", exc)
    return cluster_slots(client)


def cluster_slots(client: Client) -> list[WorkerSlot]:
    """The cluster's slots, as the scheduler plugin lists them."""
    listed = client.sync(client.scheduler.daskpipe_inventory)
    if listed is None:  # the scheduler has no such handler
        raise DeployError("the scheduler has no daskpipe plugin: start it with `dask scheduler --preload daskpipe`")
    return [WorkerSlot.from_msg(s) for s in listed]


def prepare_model(
    client: Client,
    slots: list[WorkerSlot],
    name: str,
    module: nn.Module,
    example: Any,
    profile: Profile | None,
    slo_us: float | None,
    profiling: ProfilingOptions,
    store: ProfileStore | None,
) -> tuple[Profile, BlockedModel, set[tuple[str, int]]]:
    """``name``'s profile, its blocks, and the slot kinds its profiling excluded: ``module`` cut
    as ``profile`` says where one is given, else profiled on ``slots``."""
    try:
        if profile is not None:
            return profile, cut_blocks(name, module, example, profile, profiling.leaf_modules), set()
        measured = profile_on_cluster(
            client,
            slots,
            name,
            module,
            example,
            slo_us=slo_us,
            num_blocks=profiling.num_blocks,
            batch_sizes=profiling.batch_sizes,
            store=store,
            timeout_s=profiling.timeout_s,
            leaf_modules=profiling.leaf_modules,
        )
        return measured.profile, measured.blocked, set(measured.excluded)
    except (SegmentationError, ProfileError) as exc:  # tracing or estimating the model: its own code is the cause
        raise DeployError(f"model {name!r} cannot be profiled: {exc}") from exc


def on_kinds(profile: Profile, slots: Sequence[WorkerSlot]) -> Profile:
    """``profile`` with the tables of the slot kinds of ``slots`` only: it is planned for no other."""
    kinds = {(s.gpu, s.slices) for s in slots}
    return replace(profile, latency_us={k: t for k, t in profile.latency_us.items() if k in kinds})


def scheduler_spec(blocked: BlockedModel, spec: InputSpec, profile: Profile, pickled: list[bytes]) -> dict[str, Any]:
    """What the scheduler keeps of a model to start its stages on any plan
    (:meth:`~daskpipe.runtime.scheduler.elastic.state.ModelSpec.from_msg`); the blocks stay opaque bytes there."""
    return {
        "blocks": pickled,
        "input_shapes": [list(blocked.input_shape), *(list(s) for s in blocked.boundary_shapes)],
        "output_shape": list(blocked.output_shape),
        "input_dtype": str(spec.dtype).removeprefix("torch."),
        "profile": profile.to_dict(),
    }


def cut_blocks(name: str, module: nn.Module, example: Any, profile: Profile, leaf_modules: Sequence[str] = ()) -> BlockedModel:
    """``module`` cut into the blocks its profile was measured on (the boundaries and leaf modules it records)."""
    from daskpipe.profiles.fx import cut_model

    bounds = profile.meta.get("segment_boundaries")
    if not bounds:
        raise DeployError(f"profile of {name!r} has no meta.segment_boundaries, so its blocks cannot be rebuilt; profile it with daskpipe")
    return cut_model(module, example, bounds, [*leaf_modules, *profile.meta.get("leaf_modules", [])])
