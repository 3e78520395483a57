"""Elastic serving: re-plan and migrate when the cluster or the load mix changes; advice for Adaptive.

``deploy`` hands the scheduler plugin what it needs to serve its models on *any* inventory
(:meth:`Elastic.register`): each model's profile, its torch.fx blocks pickled one by one (bytes the
scheduler never unpickles), the input spec, the planner's options. From then on:

* **Workers join or leave** (any GPU type, any number): after ``debounce_s`` without further
  changes, the tables of GPU kinds the profiles lack are measured on a worker of that kind (as
  ``deploy`` does; emulated kinds estimated: :mod:`daskpipe.runtime.deploying.reprofiling`), and
  the MILP re-plans for the inventory in a thread (never on the event loop); when the plan
  or its slots changed, the new stage actors are started and connected on their workers while the
  old ones keep serving (preload), then every model of the deployment switches at once as PPipe
  does: queued requests are held, in-flight batches finish (the flush, bounded by
  ``flush_timeout_s``), the dispatchers are rebuilt on the new placement, the held requests
  re-enter them with their original deadlines, and the old stages are released. No request is
  lost: each one ends as a result, a drop with a reason, or a failure with its cause.
* **The load mix shifts**: a deployment of several models is re-planned with the observed rates
  as weights when a model's share of the load moved by ``load_shift`` (relative), at most once per
  ``load_interval_s``; so is a deployment whose stages run outside ``profile_band`` of their
  profile. :mod:`daskpipe.runtime.scheduler.elastic.load_watch` watches the load once a second.
* **Autoscaling** (Symphony's load-proportional rule): :meth:`Elastic.scaling` says how many GPUs
  of which type are wanted (bad rate r above ``scale_up_bad_rate`` on N slots: N·r/(1-r) more) and
  which workers can go (no stage on them). Over-provisioned GPU types (busy share under
  ``target_utilisation``) are drained first: their surplus slots are marked *leaving*, the
  deployment is re-planned without them (kept only if the new plan still carries the observed load
  at ``target_utilisation``), and once no stage is left on them they are offered for closing.
  :mod:`daskpipe.runtime.adaptive` turns this into Dask's ``Adaptive``.

Worker loss itself (re-dispatching a dead worker's batches) is handled at once by the plugin;
the re-plan here then adapts the plan to the smaller inventory. The settings, the deployments and
the served models it drives are :class:`~daskpipe.runtime.scheduler.models.Models`, and new ones
start serving through :class:`~daskpipe.runtime.scheduler.serving.Serving`.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import msgspec

from daskpipe.plan.options import PlannerOptions
from daskpipe.plan.schema import Plan
from daskpipe.runtime.deploying.deployment import hand_over, ppipe_launches, retire_stages, start_stages
from daskpipe.runtime.deploying.placement import gpus_per_server, physical_gpus
from daskpipe.runtime.deploying.reprofiling import profile_missing
from daskpipe.runtime.errors import DeployError
from daskpipe.runtime.scheduler.elastic.load_watch import LoadWatch
from daskpipe.runtime.scheduler.elastic.state import Deployment, ElasticSettings, ModelSpec, NewModel
from daskpipe.runtime.scheduler.ledger import Ledger
from daskpipe.runtime.scheduler.models import Models
from daskpipe.runtime.scheduler.serving import Serving
from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.messages import ServeSettings, WorkerSlot
from daskpipe.sched.api import Action, Dispatcher, Drop, DropReason, Request, Time

if TYPE_CHECKING:
    from distributed import Client, Future


logger = logging.getLogger(__name__)

DISPATCH_ID_STRIDE = 10**9
"""Each migration numbers the new dispatchers' batches from ``epoch * DISPATCH_ID_STRIDE``: a late
report of a batch of the previous dispatcher (one re-dispatched after a worker loss) never matches
a batch of the new one."""


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


def client_security(security: Any) -> Any:
    """The scheduler's credentials for its own client: a scheduler started with ``--tls-cert`` has
    no client certificate, and a TLS scheduler requires one from every client."""
    if security is None or getattr(security, "tls_client_cert", None) or not getattr(security, "tls_scheduler_cert", None):
        return security
    own = copy.copy(security)
    own.tls_client_cert, own.tls_client_key = security.tls_scheduler_cert, security.tls_scheduler_key
    return own


class Elastic:
    """The scheduler plugin's elasticity (see the module docstring); runs on the scheduler's loop."""

    def __init__(self, models: Models, serving: Serving, settings: ElasticSettings | None = None):
        self.models = models
        self.serving = serving
        self.settings = settings or ElasticSettings()
        self.deployments: dict[str, Deployment] = {}
        self.pools: list[Dispatcher] = []  # shared pools whose service adopts the workers that join: scaled, not re-planned
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
        self.lock = asyncio.Lock()  # one change of a deployment at a time: a re-plan, or a model added, removed or updated
        self._ticker: asyncio.Task | None = None
        self.load = LoadWatch(models, self.settings, self._schedule)

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
        serving: dict,
        slo_us: dict | None = None,
        weights: dict | None = None,
        settings: dict | None = None,
        profile_store: str | None = None,
    ) -> str:
        """Take over ``group``'s models (already served, as ``serving`` says:
        :meth:`ServeSettings.to_wire`) for re-planning; ``models`` maps each name to its ``blocks``
        (pickled one by one), ``input_shapes``, ``input_dtype`` and ``profile``; ``options`` are the
        planner's (:meth:`PlannerOptions.to_dict`), ``settings`` the controller's (:class:`ElasticSettings`)."""
        missing = [m for m in models if m not in self.models.ledgers]
        if missing:
            raise DeployError(f"models {missing} are not served; serve them before making them elastic")
        specs = {name: ModelSpec.from_msg(name, spec) for name, spec in models.items()}
        if settings is not None:
            self.settings = self.load.settings = ElasticSettings.from_dict(settings)  # one set for the controller and its load watch
        for stale in [g for g, dep in self.deployments.items() if set(dep.models) & set(specs)]:
            self._end(stale)  # a closed service whose model names are deployed again, before a tick ended it
        self.deployments[group] = Deployment(
            models=specs,
            plan=Plan.from_dict(plan),
            rows={m: [list(r) for r in rows] for m, rows in stages.items()},
            planner=PlannerOptions.from_dict(options),
            slo_us={m: float(slo) for m, slo in (slo_us or {}).items()},
            weights=dict(weights or {m: 1.0 for m in specs}),
            serving=ServeSettings.from_wire(serving),
            profile_store=profile_store,
        )
        if self._ticker is None:
            self._ticker = asyncio.ensure_future(self._tick_forever())
        return "OK"

    def scale_pool(self, models: Sequence[str], settings: dict) -> None:
        """Advise scaling for the shared pool that serves ``models`` (its service adopts the workers
        that join, ``SharedPools(adopt_s=)``): GPUs of its kind are wanted when its requests end
        badly, as for a deployment; it is never drained (its slots all hold every model). ``settings``:
        the controller's (:class:`ElasticSettings`)."""
        self.settings = self.load.settings = ElasticSettings.from_dict(settings)
        self.pools.append(self.models.ledgers[models[0]].dispatcher)
        if self._ticker is None:
            self._ticker = asyncio.ensure_future(self._tick_forever())

    def plan_in_force(self, models: Sequence[str]) -> dict | None:
        """The plan of the deployment serving ``models`` now (``None``: not elastic, or unknown)."""
        for dep in self.deployments.values():
            if set(models) <= set(dep.models):
                return dep.plan.to_dict()
        return None

    def scaling(self) -> dict[str, Any]:
        """What Adaptive should do: GPUs ``wanted`` by type; ``closable`` worker names (no stage,
        none wanted, past their grace); ``leaving`` workers still being drained; the re-plans made."""
        scheduler = self.models.scheduler
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
        return {a for ledger in self.models.ledgers.values() for _, _, a in ledger.stages}

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
                        async with self.lock:
                            if group in self.deployments:
                                await self._replan(group, reasons)
                    except Exception:
                        logger.exception("daskpipe: re-planning %s failed; the plan in force stays", group)
        finally:
            self._replanning = None

    def inventory_of(self, dep: Deployment) -> list[WorkerSlot]:
        """The live slots ``dep`` may plan on: not leaving, not serving another deployment (a model
        ``dep`` is retiring serves on its own slots)."""
        models = self.models
        others = {a for m, s in models.ledgers.items() if m not in dep.models and m not in dep.retiring for _, _, a in s.stages}
        slots = [s for a, s in models.slots.items() if a in models.scheduler.workers and a not in self.leaving and a not in others]
        gpu_slots = [s for s in slots if s.gpu != messages.CPU or s.emulated]
        return gpu_slots or slots

    async def _replan(self, group: str, reasons: list[str]) -> None:
        dep = self.deployments[group]
        if any(self.models.ledgers.get(m) is None or self.models.ledgers[m].closing for m in dep.models):
            return  # closing: the ticker forgets it once its batches have ended
        slots = self.inventory_of(dep)
        if not slots:
            logger.warning("daskpipe: no slot left to plan %s on (%s)", sorted(dep.models), "; ".join(reasons))
            return
        started = time.perf_counter()
        try:
            plan = await self.plan_for(dep, slots)
        except Exception as exc:
            logger.warning(
                "daskpipe: re-plan of %s for %s failed (%s); the plan in force stays", sorted(dep.models), "; ".join(reasons), exc
            )
            self.leaving.clear()  # they cannot be drained: keep them
            return
        alive = {s.address for s in self.inventory_of(dep)}
        if plan.models == dep.plan.models and dep.addresses() <= alive:
            return  # same plan, every stage alive: nothing to migrate
        unserved = [m for m in dep.models if not plan.model(m).pipelines]
        if unserved:
            logger.warning("daskpipe: the re-plan gives %s no pipeline on %s; the plan in force stays", unserved, sorted(alive))
            self.leaving.clear()
            return
        if self.leaving and not self.load.carries_load(dep, plan):
            logger.info("daskpipe: a plan without %s would not carry the load; they stay", sorted(self.leaving))
            self.leaving.clear()
            self.changed_at = time.monotonic()  # the cooldown holds off the next attempt
            return
        try:
            await self.migrate(group, plan, [s for s in slots if s.address in alive], reasons, started)
        except DeployError as exc:
            logger.warning("daskpipe: %s; the plan in force stays", exc)

    async def plan_for(self, dep: Deployment, slots: list[WorkerSlot]) -> Plan:
        """The MILP's plan of ``dep``'s models on ``slots`` (in a thread, never on the event loop),
        the tables of GPU kinds their profiles lack measured or estimated first."""
        from daskpipe.plan.milp import make_plan

        await profile_missing(dep, slots, {a: str(ws.name) for a, ws in self.models.scheduler.workers.items()}, self._get_client)
        plan_call = functools.partial(
            make_plan,
            {m: spec.profile for m, spec in dep.models.items()},
            physical_gpus(slots),
            weights=dep.weights,
            gpus_per_server=gpus_per_server(slots),
            slo_us=dep.slo_us,
            options=replace(dep.planner, allow_missing_gpus=True, time_limit=self.settings.plan_time_limit_s),
        )
        return await asyncio.get_running_loop().run_in_executor(None, plan_call)

    async def migrate(
        self,
        group: str,
        plan: Plan,
        slots: list[WorkerSlot],
        reasons: list[str],
        started: float,
        serve: dict[str, NewModel] | None = None,
    ) -> None:
        """Serve ``dep`` on ``plan``: its stages start on ``slots`` while the old ones serve (PPipe's
        preload), the models of ``serve`` (new to the plugin, :mod:`daskpipe.runtime.scheduler.lifecycle`)
        start serving, then the
        others switch at once. A stage or a new model that cannot start raises :class:`DeployError`
        and leaves the plan in force as it was, every new stage released."""
        dep = self.deployments[group]
        launches = ppipe_launches(
            plan,
            slots,
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
            raise DeployError(f"the new plan's stages could not start ({exc!r})") from exc
        self._stage_futures.update((str(future.key), future) for future in stages.futures)
        settings = msgspec.structs.replace(dep.serving, bw_gbps=float(plan.cluster.get("bw_gbps", dep.planner.bw_gbps)))
        try:
            for model, new in (serve or {}).items():
                await self.serving.serve(
                    model,
                    plan.to_dict(),
                    dep.models[model].profile.to_dict(),
                    stages.rows[model],
                    msgspec.structs.replace(settings, max_queued=new.max_queued).to_wire(),
                    new.sample_nbytes,
                )
        except Exception:
            self.models.close([m for m in serve or {} if m in self.models.ledgers], reason="shutdown")
            self.models.status(list(serve or {}), forget=True)
            self.retire(str(future.key) for future in stages.futures)
            raise
        switch_s = await self._switch(dep, plan, stages.rows, fresh=set(serve or ()))
        self.history.append(
            {
                "deployment": group,
                "epoch": dep.epoch,
                "reasons": reasons,
                "seconds": time.perf_counter() - started,
                "switch_s": switch_s,
                "plan": plan.to_dict(),
            }
        )
        logger.info(
            "daskpipe: %s now served by a new plan (%s) after %.2fs", sorted(dep.models), "; ".join(reasons), time.perf_counter() - started
        )

    def retire(self, keys: Iterable[str]) -> None:
        """Release the stage actors of ``keys``, whichever client holds them."""
        retire_stages(self.models.scheduler, keys, self._stage_futures)

    def _end(self, group: str) -> None:
        """Forget ``group``'s deployment and release every stage it started, re-plans' included
        (the service that closed it knew only those of its deploy)."""
        dep = self.deployments.pop(group)
        self.retire(row[3] for rows in [*dep.rows.values(), *dep.retiring.values()] for row in rows)

    async def _get_client(self) -> Client:
        """The scheduler's own client, for the stages of a re-plan; never the process's default,
        which in-process clusters share with the user's code (its ``wait`` and ``get_client``)."""
        if self._client is None:
            from distributed import Client

            scheduler = self.models.scheduler
            self._client = await Client(
                scheduler.address,
                asynchronous=True,
                security=client_security(scheduler.security),
                name="daskpipe-elastic",
                set_as_default=False,
            )
        return self._client

    async def _switch(self, dep: Deployment, plan: Plan, rows: dict[str, list[list]], fresh: set[str]) -> float:
        """Hold, flush, switch every model of ``dep`` at once, resume (PPipe's migration); the
        ``fresh`` models already serve on ``plan``. Returns how long the requests were held."""
        models = self.models
        held_at = time.perf_counter()
        held: dict[str, tuple[Ledger, Dispatcher, Holding]] = {}
        for model in set(dep.models) - fresh:
            holding = Holding(model)
            old, drained = models.hold(model, holding)
            holding.requests.extend(drained)
            held[model] = (models.ledgers[model], old, holding)
        flush_until = time.monotonic() + self.settings.flush_timeout_s
        while any(ledger.flights for ledger, _, _ in held.values()) and time.monotonic() < flush_until:
            await asyncio.sleep(0.002)
        dep.epoch += 1
        old_keys = [row[3] for model_rows in dep.rows.values() for row in model_rows]
        for model, (ledger, old, holding) in held.items():
            if models.ledgers.get(model) is not ledger or ledger.closing:
                continue  # closed during the flush: ``Holding.drain`` dropped what it held
            try:
                self.serving.switch(
                    model,
                    ledger,
                    plan,
                    dep.models[model].profile,
                    rows[model],
                    settings=msgspec.structs.replace(dep.serving, bw_gbps=float(plan.cluster.get("bw_gbps", dep.planner.bw_gbps))),
                    first_id=dep.epoch * DISPATCH_ID_STRIDE,
                )
            except Exception:
                logger.exception("daskpipe: %s could not switch to the new plan; it stays on the old one", model)
                models.resume(model, holding.requests, dispatcher=old)
                continue
            models.resume(model, holding.requests)
        switch_s = time.perf_counter() - held_at
        dep.plan, dep.rows, dep.replanned_at = plan, rows, time.monotonic()
        self.changed_at = dep.replanned_at
        scheduler = models.scheduler
        new_keys = [row[3] for model_rows in rows.values() for row in model_rows]
        held_by = [*old_keys, *(row[3] for model_rows in dep.retiring.values() for row in model_rows)]  # whose client holds them
        hand_over(scheduler, held_by, new_keys, self._stage_futures, self._client.id if self._client is not None else None)
        retire_stages(scheduler, old_keys, self._stage_futures)
        models.arm()
        return switch_s

    # -- the periodic look at the load -----------------------------------------------------------
    async def _tick_forever(self, every_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                self._tick(time.monotonic())
            except Exception:
                logger.exception("daskpipe: the elastic controller's periodic check failed")

    def end_forgotten(self, names: Iterable[str] | None = None) -> None:
        """End the deployments whose service closed and whose models were all forgotten (of those
        with a model of ``names``: about to be served again, by a deploy that may not be elastic;
        default: all). Each tick ends them too; a deploy under the same names can come first."""
        wanted = None if names is None else set(names)
        for group, dep in list(self.deployments.items()):
            if (wanted is None or wanted & set(dep.models)) and not any(m in self.models.ledgers for m in dep.models):
                self._end(group)

    def _tick(self, now: float) -> None:
        self.end_forgotten()
        self.load.sample(now)
        self.load.check_load_mix(self.deployments.values(), now)
        self.load.check_profiles(self.deployments.values(), now)
        self._decide_scaling(now)

    def _decide_scaling(self, now: float) -> None:
        """Symphony's rules: N·r/(1-r) more GPUs for a bad rate r; drain the surplus of idle types."""
        settings = self.settings
        served = {id(ledger.dispatcher) for ledger in self.models.ledgers.values() if not ledger.closing}
        self.pools = [pool for pool in self.pools if id(pool) in served]
        if self._replanning is not None or now - self.changed_at < settings.scale_cooldown_s or not (self.deployments or self.pools):
            self.wanted = {}
            return
        self.wanted = self.load.wanted_gpus(self.pools)
        if self.wanted or self.leaving or now - self._advised_at > 3 * settings.debounce_s + 5.0:
            return  # draining is for an Adaptive that asks; without one, serving stays as planned
        self.leaving.update(self.load.surplus(now, {a for dep in self.deployments.values() for a in dep.addresses()}))
        if self.leaving:
            self._schedule(f"scale down: {sorted(self.leaving)} are surplus")
