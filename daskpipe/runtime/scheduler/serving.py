"""Starting to serve a model on the scheduler, and switching it to a new plan.

:meth:`Serving.serve` measures the control path to the stages' workers first (:data:`PINGS` round
trips each): it seeds the model's margin, and decides whether its SLO can be served at all (a
tight one on a deploy-time trial's tail, :mod:`daskpipe.runtime.scheduler.trial`). A served
model's :class:`~daskpipe.runtime.scheduler.ledger.Ledger` joins the
:class:`~daskpipe.runtime.scheduler.models.Models`; a re-plan (:mod:`daskpipe.runtime.scheduler.elastic.controller`)
switches it onto new stages with every request in its care (:meth:`Serving.switch`).
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import msgspec

from daskpipe.plan.schema import Plan
from daskpipe.profiles.model import Profile
from daskpipe.runtime.errors import DeployError
from daskpipe.runtime.gctune import freeze_heap
from daskpipe.runtime.scheduler.batches import Batches
from daskpipe.runtime.scheduler.control import ControlPath, control_path, seed_from_round_trips
from daskpipe.runtime.scheduler.intake import (
    as_slot,
    check_dispatcher,
    check_feasible,
    dilated_plan,
    join_pool_dispatcher,
    ledger_for,
    placement_of,
    pool_dispatcher,
)
from daskpipe.runtime.scheduler.ledger import Ledger, queue_bound
from daskpipe.runtime.scheduler.links import Links
from daskpipe.runtime.scheduler.models import Models
from daskpipe.runtime.scheduler.trial import TrialInputs, trial_control_path, trial_margin, trial_summary
from daskpipe.runtime.scheduler.watch import GrayWatch
from daskpipe.runtime.wire.messages import ServeSettings
from daskpipe.sched.api import Dispatcher
from daskpipe.sched.registry import add_shared_slot, remove_shared_model
from daskpipe.sched.symphony import DeferredDispatcher, SharedPoolRoute

logger = logging.getLogger(__name__)

PINGS = 20
"""Round trips to each stage's worker when a model is deployed: they seed its control-path margin
(:mod:`daskpipe.runtime.scheduler.control`) and decide whether its SLO can be served at all."""


def read_settings(serving: dict) -> ServeSettings:
    """``serving`` as deploy sent it (:meth:`ServeSettings.to_wire`); :class:`DeployError` naming what is wrong."""
    try:
        return ServeSettings.from_wire(serving)
    except ValueError as exc:
        raise DeployError(str(exc)) from None


class Serving:
    """Serves models (see the module docstring): their ledgers go to ``models``; their batches
    are sent by ``batches`` and watched by ``watch``, over ``links``."""

    def __init__(self, models: Models, links: Links, batches: Batches, watch: GrayWatch) -> None:
        self.models = models
        self.links = links
        self.batches = batches
        self.watch = watch

    async def serve(
        self,
        model: str,
        plan: dict,
        profile: dict,
        stages: list[list],
        serving: dict,
        sample_nbytes: int = 0,
        trial_client: str | None = None,
        trial_keys: Sequence[str] | None = None,
    ) -> str:
        """Start serving ``model`` as ``serving`` says (:class:`~daskpipe.runtime.wire.messages.ServeSettings`);
        ``stages`` lists [pipeline, partition, worker address, actor key], ``sample_nbytes`` is a
        sample's raw input size; ``trial_client`` holds zero samples under ``trial_keys`` for the
        trial's first stages to fetch (:class:`~daskpipe.runtime.scheduler.trial.TrialInputs`; a client
        without a daskpipe stream here has the trial send its inputs along instead).

        The control path to the stages' workers is measured first (:data:`PINGS` round trips
        each): it seeds the model's margin, and a model whose SLO cannot be met even by a lone
        request on an idle pipeline, with that margin, is refused here with the smallest SLO it
        could serve.
        """
        if trial_keys is not None and not (
            isinstance(trial_keys, (list, tuple)) and all(isinstance(k, str) for k in trial_keys) and trial_keys
        ):
            raise DeployError(f"trial_keys must be a non-empty list of strings, got {type(trial_keys).__name__} {str(trial_keys)[:80]}")
        trial_inputs = TrialInputs(trial_client, tuple(trial_keys)) if trial_keys and trial_client in self.links.client_streams else None
        settings = read_settings(serving)
        check_dispatcher(settings.dispatcher)  # wrong settings fail before any measuring
        addresses = sorted({str(row[2]) for row in stages})
        for address in addresses:
            if address not in self.models.slots:
                raise DeployError(f"a stage of {model!r} is placed on {address}, which is not a worker of this cluster")
        pipelines = Plan.from_dict(plan).model(model).pipelines
        longest = max((len(p.partitions) for p in pipelines), default=1)
        round_trips = [t for address in addresses for t in await self.links.pings.round_trips(self.links.to_worker, address, PINGS)]
        control = control_path(seed_from_round_trips(round_trips, longest + 2), settings.dispatcher)
        self.start_serving(model, plan, profile, stages, control=control, settings=settings, sample_nbytes=sample_nbytes)
        ledger = self.models.ledgers[model]
        delays = await trial_control_path(ledger, model, self.batches, self.watch.own_id, trial_inputs)
        if delays:  # a tight SLO: decided on the trial's tail (daskpipe/runtime/scheduler/trial.py)
            logger.info("daskpipe: %s: the deploy's trial of its control path: %s", model, trial_summary(delays))
            try:
                k = settings.time_dilation
                check_feasible(
                    model,
                    ledger.model,
                    ledger.profile,
                    ledger.budgets,
                    trial_margin(delays, ledger.control.quantile),
                    bw_gbps=ledger.durations.bw_gbps,
                    time_dilation=k,
                )
            except DeployError as exc:
                self.models.close([model], reason="shutdown")
                raise DeployError(f"{exc} (the control path's p99 over a trial of {len(delays)} batches at deploy)") from None
        freeze_heap()
        return "OK"

    async def serve_pool(
        self,
        models: list[str],
        plan: dict,
        profiles: dict[str, dict],
        stages: dict[str, list[list]],
        serving: dict,
        sample_nbytes: dict[str, int] | None = None,
        timeout_s: float | dict[str, float] | None = None,
    ) -> str:
        """Start serving a shared pool (:mod:`daskpipe.runtime.client.pools`): ``models``, each on every
        slot of the pool (``stages[model]``: its rows, as :meth:`serve` takes them), with one
        dispatcher of ``serving``'s kind for all of them, whose dispatches go to the model they are for
        (:meth:`~daskpipe.runtime.scheduler.models.Models.act`). Each model keeps its own requests and
        counts; they share one control path, measured from all their batches, whose margin is
        capped for the tightest of them. All of them are served, or none.
        ``timeout_s``: the timeout data plane's wait, one for all models or one each, before time dilation."""
        settings = read_settings(serving)
        addresses = sorted({str(row[2]) for rows in stages.values() for row in rows})
        unknown = [a for a in addresses if a not in self.models.slots]
        if unknown:
            raise DeployError(f"a shared pool is placed on {unknown}, which are not workers of this cluster")
        shared = pool_dispatcher(
            settings.dispatcher,
            plan,
            {m: profiles[m] for m in models},
            [self.models.slots[a] for a in addresses],
            time_dilation=settings.time_dilation,
            timeout_s=timeout_s,
        )
        round_trips = [t for address in addresses for t in await self.links.pings.round_trips(self.links.to_worker, address, PINGS)]
        # one control path for the pool: its models' batches take the same scheduler, workers and
        # links, and each model alone runs too few of them for a tail (a deferred batch leaves at
        # its last moment: the margin is all it has for the path)
        control = control_path(seed_from_round_trips(round_trips, 3), settings.dispatcher)
        caps: list[float] = []
        started: list[str] = []
        try:
            for model in models:
                self.start_serving(
                    model,
                    plan,
                    profiles[model],
                    stages[model],
                    control=control,
                    settings=settings,
                    shared=shared,
                    sample_nbytes=(sample_nbytes or {}).get(model, 0),
                )
                caps.append(control.cap_s)  # each model's own (start_serving sets it for the model)
                started.append(model)
        except Exception:
            for model in started:
                del self.models.ledgers[model]
            raise
        control.cap_s = min(caps)  # every model's lone request stays servable with the pool's margin
        control.refresh(time.monotonic())
        shared.continue_ids(max(self.batches.next_ids.get(m, 0) for m in models))
        freeze_heap()
        return "OK"

    async def join_pool(
        self,
        model: str,
        pool: list[str],
        plan: dict,
        profile: dict,
        stages: list[list],
        serving: dict,
        sample_nbytes: int = 0,
        timeout_s: float | None = None,
    ) -> str:
        """Serve ``model`` on the shared pool that serves ``pool``'s models, beside them, on its
        ``stages`` (one on each of the pool's slots, rows as :meth:`serve` takes them): it joins the
        pool's dispatcher and control path; the other models serve on undisturbed. ``plan``: the
        pool's plan with ``model`` in it; ``timeout_s``: its wait on the timeout data plane."""
        ledgers, shared, _ = self._pool(pool, f"{model!r} has no shared pool to join", f"{model!r} cannot join them")
        addresses = sorted({str(row[2]) for row in stages})
        unknown = [a for a in addresses if a not in self.models.slots]
        if unknown:
            raise DeployError(f"{model!r}'s stages are on {unknown}, which are not workers of this cluster")
        settings = read_settings(serving)
        slots = [self.models.slots[a] for a in addresses]
        join_pool_dispatcher(shared, model, plan, profile, slots, time_dilation=settings.time_dilation, timeout_s=timeout_s)
        control = ledgers[0].control
        cap = control.cap_s
        try:
            self.start_serving(model, plan, profile, stages, control=control, settings=settings, shared=shared, sample_nbytes=sample_nbytes)
        except Exception:
            control.cap_s = cap
            remove_shared_model(shared, model, time.monotonic())
            raise
        control.cap_s = min(cap, control.cap_s)  # every model's lone request stays servable with the pool's margin
        control.refresh(time.monotonic())
        shared.continue_ids(max(self.batches.next_ids.get(m, 0) for m in [*pool, model]))  # past every id the pool sent
        return "OK"

    def grow_pool(self, pool: list[str], plan: dict, stages: dict[str, list[list]], serving: dict) -> str:
        """Workers join the shared pool that serves ``pool``'s models: ``stages[model]``, that model's
        rows on them (one each, as :meth:`serve` takes rows), for every model of the pool. The
        pool's dispatcher sends batches there at once; ``plan``: the pool's plan with them."""
        ledgers, shared, route = self._pool(pool, "no shared pool to grow", "it cannot grow")
        if set(stages) != set(pool):
            raise DeployError(f"workers join a shared pool with a stage of each of its models {sorted(pool)}, not of {sorted(stages)}")
        joining = sorted({str(row[2]) for rows in stages.values() for row in rows})
        problems = [f"{a} is not a worker of this cluster" for a in joining if a not in self.models.slots]
        problems += [f"{a} is in the pool already" for a in joining if a in route.kinds]
        kinds = set(route.kinds.values())
        problems += [
            f"{a} is a {slot.gpu}/v{slot.slices}, a kind the pool has no slot of"
            for a in joining
            if (slot := self.models.slots.get(a)) is not None and (slot.gpu, slot.slices) not in kinds
        ]
        problems += [f"{m} has no stage on {a}" for m, rows in stages.items() for a in joining if a not in {str(r[2]) for r in rows}]
        if problems:
            raise DeployError(f"the shared pool of {sorted(pool)} cannot grow: {'; '.join(problems)}")
        k = read_settings(serving).time_dilation
        whole = Plan.from_dict(plan)
        now = time.monotonic()
        actions = [action for address in joining for action in add_shared_slot(shared, as_slot(self.models.slots[address]), now)]
        for model, ledger in zip(pool, ledgers):
            rows = {(int(p), int(q), str(a)): str(key) for p, q, a, key in stages[model]}
            ledger.add_stages(dilated_plan(whole.model(model), k), rows, (a for a in joining if self.models.slots[a].emulated))
            self.models.metrics.place(model, placement_of(model, ledger.stages, self.models.slots))
        owner = ledgers[0]
        self.models.act(owner, pool[0], owner.step(lambda: actions))
        self.models.arm()
        return "OK"

    def _pool(self, pool: list[str], unserved: str, unshared: str) -> tuple[list[Ledger], DeferredDispatcher, SharedPoolRoute]:
        """The ledgers of ``pool``'s models, the one dispatcher they share and its route; a :class:`DeployError`
        that ends with ``unserved`` or ``unshared`` where they are not all served, or not by one pool."""
        ledgers = [ledger for m in pool if (ledger := self.models.ledgers.get(m)) is not None and not ledger.closing]
        if not pool or len(ledgers) < len(pool):
            raise DeployError(f"models {sorted(pool)} are not all served here: {unserved}")
        shared = ledgers[0].dispatcher
        if not isinstance(shared, DeferredDispatcher) or not isinstance(shared.route, SharedPoolRoute):
            raise DeployError(f"models {sorted(pool)} are not served by a shared pool: {unshared}")
        if any(ledger.dispatcher is not shared for ledger in ledgers):
            raise DeployError(f"models {sorted(pool)} do not share one pool's dispatcher: {unshared}")
        return ledgers, shared, shared.route

    def start_serving(
        self,
        model: str,
        plan: dict,
        profile: dict,
        stages: list[list],
        *,
        control: ControlPath,
        settings: ServeSettings = ServeSettings(),
        shared: Dispatcher | None = None,
        sample_nbytes: int = 0,
    ) -> None:
        """Serve ``model`` at once as ``settings`` say, with the control-path estimate ``control`` (a
        re-plan keeps the model's own), on a dispatcher of its own, or ``shared``, a shared pool's
        (:meth:`serve_pool`); ``sample_nbytes`` is a sample's raw input size, against which
        submissions are checked.
        A model closed earlier whose batches have all ended (its owner vanished) is replaced.
        """
        old = self.models.ledgers.get(model)
        if old is not None and not (old.closing and not old.flights):
            raise DeployError(f"model {model!r} is already served; close the service that serves it first")
        assert self.models.endings is not None, "the plugin has started"
        ledger, placement = ledger_for(
            model,
            plan,
            profile,
            stages,
            self.models.endings,
            control=control,
            settings=settings,
            shared=shared,
            sample_nbytes=sample_nbytes,
        )
        # a closed deployment of the same model may still have batches reporting (a stalled
        # worker's backlog): the new one numbers its batches past every id sent before
        ledger.dispatcher.continue_ids(self.batches.next_ids.get(model, 0))
        self.models.ledgers[model] = ledger
        self.models.metrics.serve(
            model,
            ledger.model,
            placement,
            control=control.summary,
            suspects=ledger.suspect_summaries,
            plan_quality=Plan.from_dict(plan).quality(),
        )
        logger.info(
            "daskpipe: serving %s on %d stages (%d pipelines), time dilation %g, control-path margin %.2f ms",
            model,
            len(ledger.stages),
            len(ledger.model.pipelines),
            settings.time_dilation,
            control.margin_s * 1e3,
        )

    def switch(
        self,
        model: str,
        held: Ledger,
        plan: Plan,
        profile: Profile,
        stages: list[list],
        *,
        settings: ServeSettings,
        first_id: int,
    ) -> None:
        """Serve ``model`` on ``plan``'s ``stages`` instead of ``held``, which keeps its control
        path, queue bound and every request in its care; dispatch ids start at ``first_id``. If the
        new plan cannot be served, this raises and ``held`` stays in place."""
        del self.models.ledgers[model]
        explicit_bound = held.max_queued != queue_bound(held.model, None)
        try:
            self.start_serving(
                model,
                plan.to_dict(),
                profile.to_dict(),
                stages,
                control=held.control,
                settings=msgspec.structs.replace(settings, max_queued=held.max_queued if explicit_bound else None),
                sample_nbytes=held.sample_nbytes,
            )
        except Exception:
            self.models.ledgers[model] = held
            raise
        fresh = self.models.ledgers[model]
        fresh.carry_over(held)
        fresh.dispatcher.continue_ids(max(first_id, self.batches.next_ids.get(model, 0)))
