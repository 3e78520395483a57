"""Elastic serving: re-plan and migrate when the cluster or the load mix changes; advice for Adaptive.

``deploy`` hands the scheduler plugin what it needs to serve its models on *any* inventory
(:meth:`Elastic.register`): each model's profile, its torch.fx blocks pickled one by one (bytes the
scheduler never unpickles), the input spec, the planner's options. From then on:

* **Workers join or leave** (any GPU type, any number): after ``debounce_s`` without further
  changes, the tables of GPU kinds the profiles lack are measured on a worker of that kind (as
  ``deploy`` does, :mod:`daskpipe.runtime.profiling`; emulated kinds estimated), and
  the MILP re-plans for the inventory in a thread (never on the event loop); when the plan
  or its slots changed, the new stage actors are started and connected on their workers while the
  old ones keep serving (preload), then every model of the deployment switches at once as PPipe
  does: queued requests are held, in-flight batches finish (the flush, bounded by
  ``flush_timeout_s``), the dispatchers are rebuilt on the new placement, the held requests
  re-enter them with their original deadlines, and the old stages are released. No request is
  lost: each one ends as a result, a drop with a reason, or a failure with its cause.
* **The load mix shifts**: a deployment of several models is re-planned with the observed rates
  as weights when a model's share of the load moved by ``load_shift`` (relative), at most once per
  ``load_interval_s``.
* **Autoscaling** (Symphony's load-proportional rule): :meth:`Elastic.scaling` says how many GPUs
  of which type are wanted (bad rate r above ``scale_up_bad_rate`` on N slots: N·r/(1-r) more) and
  which workers can go (no stage on them). Over-provisioned GPU types (busy share under
  ``target_utilisation``) are drained first: their surplus slots are marked *leaving*, the
  deployment is re-planned without them (kept only if the new plan still carries the observed load
  at ``target_utilisation``), and once no stage is left on them they are offered for closing.
  :mod:`daskpipe.runtime.adaptive` turns this into Dask's ``Adaptive``.

Worker loss itself (re-dispatching a dead worker's batches) is handled at once by the plugin;
the re-plan here then adapts the plan to the smaller inventory.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import math
import time
import uuid
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import numpy as np

from daskpipe.plan.options import PlannerOptions
from daskpipe.plan.schema import Plan
from daskpipe.profiles.model import ESTIMATED, MEASURED, Profile, kind_label
from daskpipe.runtime import messages
from daskpipe.runtime.errors import DeployError
from daskpipe.runtime.messages import WorkerSlot
from daskpipe.runtime.deployment import hand_over, ppipe_launches, retire_stages, start_stages
from daskpipe.runtime.placement import gpus_per_server, physical_gpus
from daskpipe.runtime.served import Served
from daskpipe.sched.api import Action, Dispatcher, Drop, DropReason, Request, Time

if TYPE_CHECKING:
    from distributed import Client, Future

    from daskpipe.sched.metrics import ServiceMetrics


logger = logging.getLogger(__name__)

DISPATCH_ID_STRIDE = 10**9
"""Each migration numbers the new dispatchers' batches from ``epoch * DISPATCH_ID_STRIDE``: a late
report of a batch of the previous dispatcher (one re-dispatched after a worker loss) never matches
a batch of the new one."""


@dataclass(frozen=True)
class ElasticSettings:
    """How eagerly a deployment follows its cluster and its load (docs/operations.md).

    debounce_s
        A re-plan starts this long after the last worker joined or left (bursts make one re-plan).
    load_shift
        Re-plan when a model's share of the offered load moved by this much, relative to the share
        the plan was made for (0.25: from 40% to under 30% or over 50%).
    load_interval_s
        At most one load-mix re-plan per this many seconds.
    load_window_s
        Rates (offered, bad, busy) are measured over this window.
    plan_time_limit_s
        The MILP's time limit for a re-plan.
    flush_timeout_s
        The longest the switch waits for in-flight batches before it goes on without them.
    scale_up_bad_rate
        Ask for more GPUs when more than this share of a model's requests miss (drop, fail, late).
    target_utilisation
        Busy share per GPU type to scale down to, and the headroom a scaled-down plan must keep.
    scale_cooldown_s
        No scaling advice this long after the inventory or the plan changed.
    idle_grace_s
        A worker that joined is offered for closing only after this long without a stage.
    profile_band
        Re-plan when a stage's measured compute time (the median of its recent batches against
        the profile) leaves [1/band, band]; the profile is scaled to what was measured first. At
        most one such re-plan per ``load_interval_s``.
    """

    debounce_s: float = 1.0
    load_shift: float = 0.25
    load_interval_s: float = 60.0
    load_window_s: float = 10.0
    plan_time_limit_s: float = 30.0
    flush_timeout_s: float = 10.0
    scale_up_bad_rate: float = 0.01
    target_utilisation: float = 0.8
    scale_cooldown_s: float = 30.0
    idle_grace_s: float = 10.0
    profile_band: float = 1.3

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == math.inf:
                raise ValueError(f"ElasticSettings.{f.name} must be a finite number >= 0, got {value!r}")
        if not 0 < self.target_utilisation <= 1:
            raise ValueError(f"ElasticSettings.target_utilisation must be in (0, 1], got {self.target_utilisation!r}")
        if self.load_window_s <= 0:
            raise ValueError(f"ElasticSettings.load_window_s must be > 0, got {self.load_window_s!r}")
        if not self.profile_band > 1:
            raise ValueError(f"ElasticSettings.profile_band must be > 1, got {self.profile_band!r}")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ElasticSettings:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown elastic settings {sorted(unknown)}; known: {sorted(f.name for f in fields(cls))}")
        return cls(**data)


@dataclass
class ModelSpec:
    """What starting a stage of one model for any cut takes; the blocks stay opaque bytes here."""

    blocks: list[bytes]  # block i: ``pickle.dumps([torch.fx block i])``, unpickled by ``Stage`` on a worker
    input_shapes: list[tuple[int, ...]]  # the per-sample shape block i takes
    output_shape: tuple[int, ...]  # the per-sample shape the last block gives
    input_dtype: str  # the requests' torch dtype name
    profile: Profile  # undilated; tables of GPU kinds that join later are measured or estimated into it


@dataclass
class Deployment:
    """The models of one ``deploy`` call: planned together, switched together."""

    models: dict[str, ModelSpec]
    plan: Plan  # undilated: the plan in force
    rows: dict[str, list[list]]  # model -> [[pipeline, partition, address, stage key], ...]
    planner: PlannerOptions  # deploy's, with the plan's bandwidth
    slo_us: dict[str, float]  # deploy's SLOs, where it gave them
    weights: dict[str, float]
    time_dilation: float
    dispatcher: str
    profile_store: str | None = None  # deploy's store folder: used where this scheduler sees it
    epoch: int = 0
    replanned_at: float = field(default_factory=time.monotonic)

    def addresses(self) -> set[str]:
        return {row[2] for rows in self.rows.values() for row in rows}


class Holding(Dispatcher):
    """Stands in for a model's dispatcher during a switch: requests wait here, nothing is dispatched."""

    def __init__(self, model: str):
        self.model = model
        self.requests: list[Request] = []

    def submit(self, request: Request, now: Time) -> list[Action]:
        self.requests.append(request)
        return []

    def wake(self, now: Time) -> list[Action]:
        return []

    def next_wake(self) -> Time | None:
        return None

    def drain(self, now: Time, reason: DropReason = "shutdown") -> list[Action]:
        held, self.requests = self.requests, []
        return [Drop(request, reason, "the service closed while it switched to a new plan") for request in held]

    @property
    def queued(self) -> int:
        return len(self.requests)


def kind_tables(
    name: str,
    blocks: list[bytes],
    input_shapes: list[tuple[int, ...]],
    output_shape: tuple[int, ...],
    profile: Profile,
    kinds: list[tuple[str, int]],
    measure: bool,
) -> dict[tuple[str, int], Any]:
    """On a worker: the latency tables of ``kinds`` for the model whose blocks (pickled one by one)
    ``profile`` describes: timed here (``measure``: the one kind of this worker, as ``deploy`` does),
    or estimated, calibrated on the profile's measured tables."""
    import pickle

    from daskpipe.profiles.estimator import estimate_kinds
    from daskpipe.profiles.fx import BlockedModel
    from daskpipe.runtime.profiling import measure_kind
    from daskpipe.runtime.stage import LOADING

    with LOADING:  # unpickling re-traces: no stage of this process may compute meanwhile
        modules = [block for chunk in blocks for block in pickle.loads(chunk)]
    blocked = BlockedModel(
        modules,
        tuple(input_shapes[0]),
        tuple(output_shape),
        [tuple(s) for s in input_shapes[1:]],
        [int(b) for b in profile.boundary_bytes],
        list(profile.meta.get("segment_boundaries", [])),
    )
    top = max(profile.max_batch(*kind) for kind in profile.latency_us)
    if measure:
        ((gpu, slices),) = kinds
        sizes = profile.meta.get("batch_sizes") or list(range(1, top + 1))
        return {
            (gpu, slices): measure_kind(blocked, name=name, batch_sizes=sizes, gpu=gpu, slices=slices, slo_us=profile.slo_us).table(
                gpu, slices
            )
        }
    measured = {kind: table for kind, table in profile.latency_us.items() if profile.origin(*kind) == MEASURED}
    return estimate_kinds(blocked, kinds, name=name, batch_sizes=top, slo_us=profile.slo_us, measured=measured)[0]


def _client_security(security: Any) -> Any:
    """The scheduler's credentials for its own client: a scheduler started with ``--tls-cert`` has
    no client certificate, and a TLS scheduler requires one from every client."""
    if security is None or getattr(security, "tls_client_cert", None) or not getattr(security, "tls_scheduler_cert", None):
        return security
    own = copy.copy(security)
    own.tls_client_cert, own.tls_client_key = security.tls_scheduler_cert, security.tls_scheduler_key
    return own


class ServingControl(Protocol):
    """What a re-plan needs of the scheduler plugin (:class:`~daskpipe.runtime.plugin.DaskpipeSchedulerPlugin`,
    which creates the :class:`Elastic`): what it serves on which slots, and the calls that hand a
    model from one plan to the next."""

    scheduler: Any
    served: dict[str, Served]
    slots: dict[str, WorkerSlot]
    metrics: ServiceMetrics  # the busy time of each slot, for scaling down

    def hold(self, model: str, holding: Dispatcher) -> tuple[Dispatcher, list[Request]]: ...

    def switch(
        self,
        model: str,
        held: Served,
        plan: Plan,
        profile: Profile,
        stages: list[list],
        *,
        dispatcher: str,
        time_dilation: float,
        bw_gbps: float,
        first_id: int,
    ) -> None: ...

    def resume(self, model: str, requests: list[Request], dispatcher: Dispatcher | None = None) -> None: ...

    def arm(self) -> None: ...


class Elastic:
    """The scheduler plugin's elasticity (see the module docstring); runs on the scheduler's loop."""

    def __init__(self, plugin: ServingControl, settings: ElasticSettings | None = None):
        self.plugin = plugin
        self.settings = settings or ElasticSettings()
        self.deployments: dict[str, Deployment] = {}
        self.leaving: set[str] = set()  # addresses drained for a scale-down
        self.joined: dict[str, float] = {}  # address -> when it joined
        self.history: list[dict[str, Any]] = []  # re-plans, newest last
        self.wanted: dict[str, int] = {}  # GPU type -> more slots wanted (the last scaling decision)
        self.changed_at = -math.inf  # when the inventory or a plan last changed
        self._advised_at = -math.inf  # when Adaptive last asked: surplus GPUs are drained only for it
        self._stage_futures: dict[str, Future] = {}  # stages started here, by key
        self._client: Client | None = None
        self._reasons: list[str] = []
        self._due = 0.0
        self._replanning: asyncio.Task | None = None
        self._ticker: asyncio.Task | None = None
        self._samples: deque[tuple[float, dict[str, tuple[int, int]]]] = deque()  # (time, model -> (submitted, bad))

    def handlers(self) -> dict[str, Any]:
        return {messages.ELASTIC: self.register, messages.PLAN: self.plan_in_force, messages.SCALING: self.scaling}

    # -- rpc handlers ----------------------------------------------------------------------------
    def register(
        self,
        group: str,
        models: dict,
        plan: dict,
        stages: dict,
        options: dict,
        slo_us: dict | None = None,
        weights: dict | None = None,
        time_dilation: float = 1.0,
        dispatcher: str = "ppipe",
        settings: dict | None = None,
        profile_store: str | None = None,
    ) -> str:
        """Take over ``group``'s models (already served) for re-planning; ``models`` maps each name
        to its ``blocks`` (pickled one by one), ``input_shapes``, ``input_dtype`` and ``profile``;
        ``options`` are the planner's (:meth:`PlannerOptions.to_dict`)."""
        missing = [m for m in models if m not in self.plugin.served]
        if missing:
            raise DeployError(f"models {missing} are not served; serve them before making them elastic")
        specs = {}
        for name, spec in models.items():
            profile = Profile.from_dict(spec["profile"])
            blocks, shapes = list(spec["blocks"]), [tuple(int(x) for x in s) for s in spec["input_shapes"]]
            if len(blocks) != profile.num_blocks or len(shapes) != profile.num_blocks:
                raise DeployError(
                    f"model {name!r} has {profile.num_blocks} blocks but {len(blocks)} pickled blocks and {len(shapes)} input shapes were given"
                )
            specs[name] = ModelSpec(blocks, shapes, tuple(int(x) for x in spec["output_shape"]), str(spec["input_dtype"]), profile)
        if settings is not None:
            self.settings = ElasticSettings.from_dict(settings)
        for stale in [g for g, dep in self.deployments.items() if set(dep.models) & set(specs)]:
            del self.deployments[stale]  # a closed service whose model names are deployed again
        self.deployments[group] = Deployment(
            models=specs,
            plan=Plan.from_dict(plan),
            rows={m: [list(r) for r in rows] for m, rows in stages.items()},
            planner=PlannerOptions.from_dict(options),
            slo_us={m: float(slo) for m, slo in (slo_us or {}).items()},
            weights=dict(weights or {m: 1.0 for m in specs}),
            time_dilation=float(time_dilation),
            dispatcher=dispatcher,
            profile_store=profile_store,
        )
        if self._ticker is None:
            self._ticker = asyncio.ensure_future(self._tick_forever())
        return "OK"

    def plan_in_force(self, models: Sequence[str]) -> dict | None:
        """The plan of the deployment serving ``models`` now (``None``: not elastic, or unknown)."""
        for dep in self.deployments.values():
            if set(models) <= set(dep.models):
                return dep.plan.to_dict()
        return None

    def scaling(self) -> dict[str, Any]:
        """What Adaptive should do: GPUs ``wanted`` by type; ``closable`` worker names (no stage,
        none wanted, past their grace); ``leaving`` workers still being drained; the re-plans made."""
        scheduler = self.plugin.scheduler
        now = time.monotonic()
        self._advised_at = now
        serving = self._serving_addresses()
        busy = self._replanning is not None or now - self.changed_at < self.settings.debounce_s
        closable = []
        if not busy and not self.wanted:
            for address, ws in scheduler.workers.items():
                if address not in serving and now - self.joined.get(address, -math.inf) >= self.settings.idle_grace_s:
                    closable.append(ws.name)
        names = {a: ws.name for a, ws in scheduler.workers.items()}
        return {
            "wanted": dict(self.wanted),
            "closable": sorted(closable, key=str),
            "leaving": sorted((names[a] for a in self.leaving if a in names), key=str),
            "replans": len(self.history),
        }

    # -- hooks -----------------------------------------------------------------------------------
    def worker_joined(self, address: str) -> None:
        self.joined[address] = time.monotonic()
        self._schedule(f"worker {address} joined")

    def worker_left(self, address: str) -> None:
        self.joined.pop(address, None)
        self.leaving.discard(address)
        self._schedule(f"worker {address} left")

    async def close(self) -> None:
        for task in (self._ticker, self._replanning):
            if task is not None:
                task.cancel()
        if self._client is not None:
            await self._client.close()

    # -- re-planning -----------------------------------------------------------------------------
    def _serving_addresses(self) -> set[str]:
        return {a for served in self.plugin.served.values() for _, _, a in served.stages}

    def _schedule(self, reason: str) -> None:
        """Re-plan ``debounce_s`` after the last change (a burst of joins makes one re-plan)."""
        self.changed_at = time.monotonic()
        if not self.deployments:
            return
        self._reasons.append(reason)
        self._due = self.changed_at + self.settings.debounce_s
        if self._replanning is None:
            self._replanning = asyncio.ensure_future(self._replan_when_settled())

    async def _replan_when_settled(self) -> None:
        try:
            while self._reasons:
                while (left := self._due - time.monotonic()) > 0:
                    await asyncio.sleep(left)
                reasons, self._reasons = self._reasons, []
                for group in list(self.deployments):
                    try:
                        await self._replan(group, reasons)
                    except Exception:
                        logger.exception("daskpipe: re-planning %s failed; the plan in force stays", group)
        finally:
            self._replanning = None

    def _inventory(self, dep: Deployment) -> list[WorkerSlot]:
        """The live slots ``dep`` may plan on: not leaving, not serving another deployment."""
        plugin = self.plugin
        others = {a for m, s in plugin.served.items() if m not in dep.models for _, _, a in s.stages}
        slots = [s for a, s in plugin.slots.items() if a in plugin.scheduler.workers and a not in self.leaving and a not in others]
        gpu_slots = [s for s in slots if s.gpu != messages.CPU or s.emulated]
        return gpu_slots or slots

    async def _replan(self, group: str, reasons: list[str]) -> None:
        from daskpipe.plan.milp import make_plan

        dep = self.deployments[group]
        if any(self.plugin.served.get(m) is None or self.plugin.served[m].closing for m in dep.models):
            return  # closing: the ticker forgets it once its batches have ended
        slots = self._inventory(dep)
        if not slots:
            logger.warning("daskpipe: no slot left to plan %s on (%s)", sorted(dep.models), "; ".join(reasons))
            return
        started = time.perf_counter()
        await self._profile_missing(dep, slots)
        profiles = {m: spec.profile for m, spec in dep.models.items()}
        plan_call = functools.partial(
            make_plan,
            profiles,
            physical_gpus(slots),
            weights=dep.weights,
            gpus_per_server=gpus_per_server(slots),
            slo_us=dep.slo_us,
            options=replace(dep.planner, allow_missing_gpus=True, time_limit=self.settings.plan_time_limit_s),
        )
        try:
            plan = await asyncio.get_running_loop().run_in_executor(None, plan_call)
        except Exception as exc:
            logger.warning(
                "daskpipe: re-plan of %s for %s failed (%s); the plan in force stays", sorted(dep.models), "; ".join(reasons), exc
            )
            self.leaving.clear()  # they cannot be drained: keep them
            return
        alive = {s.address for s in self._inventory(dep)}
        if plan.models == dep.plan.models and dep.addresses() <= alive:
            return  # same plan, every stage alive: nothing to migrate
        unserved = [m for m in dep.models if not plan.model(m).pipelines]
        if unserved:
            logger.warning("daskpipe: the re-plan gives %s no pipeline on %s; the plan in force stays", unserved, sorted(alive))
            self.leaving.clear()
            return
        if self.leaving and not self._carries_load(dep, plan):
            logger.info("daskpipe: a plan without %s would not carry the load; they stay", sorted(self.leaving))
            self.leaving.clear()
            self.changed_at = time.monotonic()  # the cooldown holds off the next attempt
            return
        launches = ppipe_launches(
            plan,
            [s for s in slots if s.address in alive],
            {m: spec.input_shapes for m, spec in dep.models.items()},
            {m: spec.input_dtype for m, spec in dep.models.items()},
        )
        try:  # PPipe's preload: the new plan's stages start while the old ones serve
            stages = await start_stages(
                await self._get_client(),
                launches,
                {m: spec.blocks for m, spec in dep.models.items()},
                timeout=max(60.0, self.settings.plan_time_limit_s),
            )
        except Exception as exc:
            logger.warning("daskpipe: the new plan's stages could not start (%r); the plan in force stays", exc)
            return
        self._stage_futures.update((str(future.key), future) for future in stages.futures)
        await self._switch(dep, plan, stages.rows)
        self.history.append(
            {"deployment": group, "epoch": dep.epoch, "reasons": reasons, "seconds": time.perf_counter() - started, "plan": plan.to_dict()}
        )
        logger.info(
            "daskpipe: %s now served by a new plan (%s) after %.2fs", sorted(dep.models), "; ".join(reasons), time.perf_counter() - started
        )

    async def _profile_missing(self, dep: Deployment, slots: list[WorkerSlot]) -> None:
        """Tables of the (GPU type, slices) kinds that joined and a model's profile lacks, so that
        the MILP can use them: a real kind measured on a worker of it (it serves nothing yet; kinds
        of different GPUs at once, of one GPU one after another), or read from the deployment's
        profile store where this scheduler sees that folder; an emulated kind estimated."""
        from daskpipe.profiles.catalog import load_catalog
        from daskpipe.runtime.profiling import device_of  # torch stays out of the scheduler until a kind joins

        catalog = load_catalog()
        real = {(s.gpu, s.slices) for s in slots if not s.emulated}
        names = {a: str(ws.name) for a, ws in self.plugin.scheduler.workers.items()}
        for name, spec in dep.models.items():
            profile = spec.profile
            missing = sorted({(s.gpu, s.slices) for s in slots if s.gpu in catalog or (s.gpu, s.slices) in real} - set(profile.latency_us))
            if not missing:
                continue
            client = await self._get_client()
            chains: dict[str, list[tuple[tuple[str, int], str]]] = {}
            for kind in (k for k in missing if k in real):
                address = next(s.address for s in slots if (s.gpu, s.slices) == kind and not s.emulated)
                chains.setdefault(device_of(address, names), []).append((kind, address))
            results = await asyncio.gather(*(self._measure_chain(client, dep, name, spec, chain) for chain in chains.values()))
            tables = {kind: table for measured in results for kind, table in measured.items()}
            origins = {kind_label(*k): MEASURED for k in tables}
            estimate = [k for k in missing if k not in real]
            if estimate:
                host = next(s.address for s in slots if (s.gpu, s.slices) in estimate)
                try:
                    estimated = await client.submit(
                        kind_tables,
                        name,
                        spec.blocks,
                        spec.input_shapes,
                        spec.output_shape,
                        profile,
                        estimate,
                        False,
                        workers=[host],
                        pure=False,
                    )
                    tables.update(estimated)
                    origins.update({kind_label(*k): ESTIMATED for k in estimated})
                except Exception as exc:
                    logger.warning(
                        "daskpipe: could not estimate %s for %s on %s (%r); the re-plan leaves them out", estimate, name, host, exc
                    )
            meta = {**profile.meta, "tables": {**profile.meta.get("tables", {}), **origins}}
            spec.profile = replace(profile, latency_us={**profile.latency_us, **tables}, meta=meta)
            logger.info("daskpipe: profiled %s for %s", origins, name)

    async def _measure_chain(
        self, client: Client, dep: Deployment, name: str, spec: ModelSpec, chain: list[tuple[tuple[str, int], str]]
    ) -> dict:
        """Measure the kinds of one physical GPU one after another; a kind that fails is left out (logged)."""
        from daskpipe.profiles.store import ProfileStore
        from daskpipe.runtime.profiling import PROFILE_KEY_PREFIX, describe_device, measurement_key

        profile = spec.profile
        store = (
            ProfileStore(dep.profile_store)
            if dep.profile_store and Path(dep.profile_store).expanduser().is_dir() and profile.meta.get("fingerprint")
            else None
        )
        tables = {}
        for kind, address in chain:
            try:
                key = None
                if store is not None:
                    described = (await client.run(describe_device, kind[0], workers=[address]))[address]
                    key = measurement_key(
                        profile.meta["fingerprint"], profile.meta["segment_boundaries"], profile.meta["batch_sizes"], kind, described
                    )
                    found = store.get(key)
                    if found is not None:
                        tables[kind] = found
                        continue
                measured = await client.submit(
                    kind_tables,
                    name,
                    spec.blocks,
                    spec.input_shapes,
                    spec.output_shape,
                    profile,
                    [kind],
                    True,
                    workers=[address],
                    allow_other_workers=False,
                    pure=False,
                    key=f"{PROFILE_KEY_PREFIX}{name}-{kind[0]}-v{kind[1]}-{uuid.uuid4().hex[:8]}",
                )
                tables.update(measured)
                if store is not None and key is not None:
                    store.put(key, measured[kind], {"model": name, "measured_at": time.time()})
            except Exception as exc:
                logger.warning(
                    "daskpipe: could not profile %s on %s for %s (%r); the re-plan leaves it out", kind_label(*kind), address, name, exc
                )
        return tables

    def _carries_load(self, dep: Deployment, plan: Plan) -> bool:
        """Whether ``plan`` serves every model's observed rate at the target utilisation."""
        rates = self._rates(self.settings.load_window_s)
        return all(
            plan.model(m).throughput / dep.time_dilation * self.settings.target_utilisation >= rates.get(m, (0.0, 0.0))[0]
            for m in dep.models
        )

    async def _get_client(self) -> Client:
        if self._client is None:
            from distributed import Client

            scheduler = self.plugin.scheduler
            self._client = await Client(
                scheduler.address, asynchronous=True, security=_client_security(scheduler.security), name="daskpipe-elastic"
            )
        return self._client

    async def _switch(self, dep: Deployment, plan: Plan, rows: dict[str, list[list]]) -> None:
        """Hold, flush, switch every model of ``dep`` at once, resume (PPipe's migration)."""
        plugin = self.plugin
        held: dict[str, tuple[Served, Dispatcher, Holding]] = {}
        for model in dep.models:
            holding = Holding(model)
            old, drained = plugin.hold(model, holding)
            holding.requests.extend(drained)
            held[model] = (plugin.served[model], old, holding)
        flush_until = time.monotonic() + self.settings.flush_timeout_s
        while any(served.flights for served, _, _ in held.values()) and time.monotonic() < flush_until:
            await asyncio.sleep(0.002)
        dep.epoch += 1
        old_keys = [row[3] for model_rows in dep.rows.values() for row in model_rows]
        for model, (served, old, holding) in held.items():
            if plugin.served.get(model) is not served or served.closing:
                continue  # closed during the flush: ``Holding.drain`` dropped what it held
            try:
                plugin.switch(
                    model,
                    served,
                    plan,
                    dep.models[model].profile,
                    rows[model],
                    dispatcher=dep.dispatcher,
                    time_dilation=dep.time_dilation,
                    bw_gbps=float(plan.cluster.get("bw_gbps", dep.planner.bw_gbps)),
                    first_id=dep.epoch * DISPATCH_ID_STRIDE,
                )
            except Exception:
                logger.exception("daskpipe: %s could not switch to the new plan; it stays on the old one", model)
                plugin.resume(model, holding.requests, dispatcher=old)
                continue
            plugin.resume(model, holding.requests)
        dep.plan, dep.rows, dep.replanned_at = plan, rows, time.monotonic()
        self.changed_at = dep.replanned_at
        scheduler = plugin.scheduler
        new_keys = [row[3] for model_rows in rows.values() for row in model_rows]
        hand_over(scheduler, old_keys, new_keys, self._stage_futures, self._client.id if self._client is not None else None)
        retire_stages(scheduler, old_keys, self._stage_futures)
        plugin.arm()

    # -- the periodic look at the load -----------------------------------------------------------
    async def _tick_forever(self, every_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                self._tick(time.monotonic())
            except Exception:
                logger.exception("daskpipe: the elastic controller's periodic check failed")

    def _tick(self, now: float) -> None:
        for group, dep in list(self.deployments.items()):
            if not any(m in self.plugin.served for m in dep.models):  # its service closed and was forgotten
                retire_stages(self.plugin.scheduler, (row[3] for rows in dep.rows.values() for row in rows), self._stage_futures)
                del self.deployments[group]
        self._samples.append(
            (
                now,
                {
                    m: (s.counts["submitted"], sum(s.dropped.values()) + s.counts["failed"] + s.counts["completed"] - s.counts["on_time"])
                    for m, s in self.plugin.served.items()
                },
            )
        )
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.settings.load_window_s:
            self._samples.popleft()
        self._check_load_mix(now)
        self._check_profiles(now)
        self._decide_scaling(now)

    def _rates(self, window_s: float) -> dict[str, tuple[float, float]]:
        """model -> (offered requests/s, share of them that ended badly) over the last samples."""
        if len(self._samples) < 2:
            return {}
        (t0, first), (t1, last) = self._samples[0], self._samples[-1]
        span = max(t1 - t0, 1e-9)
        rates = {}
        for model, (submitted, bad) in last.items():
            before = first.get(model, (0, 0))
            offered = submitted - before[0]
            rates[model] = (offered / span, (bad - before[1]) / offered if offered > 0 else 0.0)
        return rates

    def _check_load_mix(self, now: float) -> None:
        rates = self._rates(self.settings.load_window_s)
        for dep in self.deployments.values():
            if len(dep.models) < 2 or now - dep.replanned_at < self.settings.load_interval_s:
                continue
            offered = {m: rates.get(m, (0.0, 0.0))[0] for m in dep.models}
            total_offered, total_weight = sum(offered.values()), sum(dep.weights.values())
            if total_offered <= 0:
                continue
            shifted = max(
                abs(offered[m] / total_offered - dep.weights[m] / total_weight) / (dep.weights[m] / total_weight) for m in dep.models
            )
            if shifted > self.settings.load_shift:
                dep.weights = {m: max(offered[m] / total_offered, 1e-3) for m in dep.models}
                dep.replanned_at = now
                self._schedule(f"load mix shifted by {shifted:.0%}")

    def _check_profiles(self, now: float) -> None:
        """Re-plan a deployment whose stages run outside the profile's band, on its profiles
        scaled to what the stages measure (the plan is only as good as its latency tables)."""
        band = self.settings.profile_band
        for dep in self.deployments.values():
            if now - dep.replanned_at < self.settings.load_interval_s:
                continue
            drifted = []
            for model, spec in dep.models.items():
                served = self.plugin.served.get(model)
                if served is None or served.closing:
                    continue
                factors: dict[tuple[str, int], np.ndarray] = {}
                for (p, q), ratio in sorted(served.dispatcher.measured_ratios().items()):
                    if 1 / band <= ratio <= band:
                        continue
                    part = served.model.pipelines[p].partitions[q]
                    factors.setdefault((part.gpu, part.slices), np.ones(spec.profile.num_blocks))[part.blocks[0] : part.blocks[1]] = ratio
                    drifted.append(f"{model} blocks [{part.blocks[0]}, {part.blocks[1]}) on {part.gpu} run at {ratio:.2f}x their profile")
                if factors:
                    tables = dict(spec.profile.latency_us)
                    for kind, scale in factors.items():
                        tables[kind] = tables[kind] * scale[:, None]
                    spec.profile = replace(spec.profile, latency_us=tables)
            if drifted:
                dep.replanned_at = now
                logger.warning("daskpipe: %s; re-planning on the measured latencies", "; ".join(drifted))
                self._schedule("; ".join(drifted))

    def _decide_scaling(self, now: float) -> None:
        """Symphony's rules: N·r/(1-r) more GPUs for a bad rate r; drain the surplus of idle types."""
        settings = self.settings
        if self._replanning is not None or now - self.changed_at < settings.scale_cooldown_s or not self.deployments:
            self.wanted = {}
            return
        rates = self._rates(settings.load_window_s)
        wanted: Counter[str] = Counter()
        for model, served in self.plugin.served.items():
            offered, bad = rates.get(model, (0.0, 0.0))
            if offered > 0 and bad > settings.scale_up_bad_rate and served.stages:
                types = Counter(self.plugin.slots[a].gpu for _, _, a in served.stages if a in self.plugin.slots)
                if types:
                    wanted[types.most_common(1)[0][0]] += math.ceil(len(served.stages) * min(bad, 0.9) / (1 - min(bad, 0.9)))
        self.wanted = dict(wanted)
        if wanted or self.leaving or len(self._samples) < 2 or now - self._advised_at > 3 * settings.debounce_s + 5.0:
            return  # draining is for an Adaptive that asks; without one, serving stays as planned
        window = self._samples[-1][0] - self._samples[0][0]
        busy = self.plugin.metrics.busy_seconds(now - window, now)
        by_type: dict[str, list[str]] = {}
        for address in sorted(self._serving_addresses()):
            slot = self.plugin.slots.get(address)
            if slot is not None:
                by_type.setdefault(slot.gpu, []).append(address)
        for gpu, addresses in by_type.items():
            utilisation = sum(busy.get(a, 0.0) for a in addresses) / (window * len(addresses))
            surplus = len(addresses) - max(1, math.ceil(len(addresses) * utilisation / settings.target_utilisation))
            if surplus > 0:
                self.leaving.update(addresses[-surplus:])
        if self.leaving:
            self._schedule(f"scale down: {sorted(self.leaving)} are surplus")
