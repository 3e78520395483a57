"""The scheduler half of daskpipe's runtime: one dispatcher per model on the scheduler's event loop.

:class:`DaskpipeSchedulerPlugin` is installed with ``dask scheduler --preload daskpipe`` (no
pickle needed) or registered from a client (``daskpipe.deploy`` does it when missing). It adds
scheduler handlers and stream handlers (see :mod:`daskpipe.runtime.wire.messages`), learns which
workers are slots from their resources, and steps each model's :class:`Dispatcher` with the
real clock: on submissions, on feedback, and on a single timer re-armed at the earliest
``next_wake``. It never uses the ``transition`` hook.

Its parts each have a module: submissions come in through :class:`~daskpipe.runtime.scheduler.intake.Intake`;
batches go out to their stages, and their reports come back, through
:class:`~daskpipe.runtime.scheduler.batches.Batches`; :class:`~daskpipe.runtime.scheduler.watch.GrayWatch` watches
them for gray failures; :class:`~daskpipe.runtime.scheduler.elastic.controller.Elastic` re-plans. Requests are real
Dask keys (:mod:`daskpipe.runtime.scheduler.keys`). Request inputs are raw bytes that the scheduler keeps and
forwards as they are: it never deserializes them.
"""

from __future__ import annotations

import functools
import importlib
import logging
import time
from dataclasses import replace
from typing import Any, Callable, Iterable

from distributed.comm import CommClosedError
from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin

from daskpipe.config import setting
from daskpipe.plan.schema import Plan
from daskpipe.profiles.model import Profile
from daskpipe.runtime.errors import DeployError, RequestFailed, guarded
from daskpipe.runtime.gctune import freeze_heap, raise_gc_thresholds
from daskpipe.runtime.scheduler.batches import Batches
from daskpipe.runtime.scheduler.control import ControlPath, seed_from_round_trips
from daskpipe.runtime.scheduler.elastic.controller import Elastic
from daskpipe.runtime.scheduler.intake import Intake, check_dispatcher, check_feasible, ledger_for, pool_dispatcher, sliced_releases
from daskpipe.runtime.scheduler.ledger import Dropped, Endings, Failed, Flight, Ledger, client_gone, queue_bound, worker_lost
from daskpipe.runtime.scheduler.lifecycle import Lifecycle
from daskpipe.runtime.scheduler.timer import Wakeup
from daskpipe.runtime.scheduler.trial import trial_control_path, trial_margin, trial_summary
from daskpipe.runtime.scheduler.watch import GrayWatch
from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.messages import WorkerSlot, worker_slot
from daskpipe.runtime.wire.streams import PEER_HANDSHAKE, ImmediateSend, Pings, Streams
from daskpipe.sched.api import Dispatch, Dispatcher, Drop, DropReason, Request
from daskpipe.sched.metrics import ServiceMetrics
from daskpipe.sched.symphony import DeferredDispatcher

logger = logging.getLogger(__name__)

PINGS = 20
"""Round trips to each stage's worker when a model is deployed: they seed its control-path margin
(:mod:`daskpipe.runtime.scheduler.control`) and decide whether its SLO can be served at all."""
EXTENSIONS_CONFIG = "daskpipe.scheduler-extensions"
"""Dask config key: the ``module:function`` names the plugin runs on its scheduler as it starts.
Layers above the runtime add themselves here (``daskpipe/__init__.py`` sets the dashboard's pages
as the default), so the runtime imports none of them."""


class DaskpipeSchedulerPlugin(SchedulerPlugin):
    """Serves daskpipe models from the scheduler (see the module docstring)."""

    name = "daskpipe"
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Any = None
        self.ledgers: dict[str, Ledger] = {}  # model -> its ledger: its requests, until each ends
        self.endings: Endings | None = None  # what ending a request touches on this scheduler, from start
        self.slots: dict[str, WorkerSlot] = {}
        self.wakeup = Wakeup(self._on_timer)  # the earliest next_wake of all dispatchers
        self.client_streams: dict[str, ImmediateSend] = {}  # client id -> its daskpipe stream (RESOLVED goes there)
        self.reached: dict[str, set[str]] = {}  # client id -> the workers it was asked to open streams to (REACH)
        self.to_workers: Streams | None = None  # batches and pings, opened at start
        self.pings = Pings()  # round trips to stage workers, measured when a model is served
        self.metrics = ServiceMetrics(unix_offset=time.time() - time.monotonic())  # what the dashboard and /metrics show
        self.elastic = Elastic(self)  # re-plans as workers join and leave (docs/operations.md)
        self.lifecycle = Lifecycle(self, self.elastic)  # models added, removed and updated while serving
        self.intake = Intake(self)  # submissions from clients
        self.watch = GrayWatch(self)  # stalled and slow slots, late limits, poisoned batches (daskpipe/runtime/scheduler/watch.py)
        self.batches = Batches(self, self.watch)  # out to the stages and back

    # -- SchedulerPlugin hooks -----------------------------------------------------------------
    async def start(self, scheduler: Any) -> None:
        try:
            self.scheduler = scheduler
            self.endings = Endings(scheduler, self.slots, self.to_worker, self.metrics)
            self.to_workers = Streams(scheduler.connection_args, PEER_HANDSHAKE, "daskpipe Scheduler->Worker")
            scheduler.handlers.update(
                {
                    messages.STREAM: self.open_stream,
                    messages.INVENTORY: self.inventory,
                    messages.SERVE: self.serve,
                    messages.SERVE_POOL: self.serve_pool,
                    messages.CLOSE: self.close_models,
                    messages.STATUS: self.status,
                    **self.elastic.handlers(),
                    **self.lifecycle.handlers(),
                }
            )
            scheduler.stream_handlers.update(
                {
                    messages.SUBMIT: self.intake.on_submit,
                    messages.FEEDBACK: self.batches.on_feedback,
                    messages.DONE: self.batches.on_done,
                    messages.FAILED: self.batches.on_failed,
                    messages.UNFETCHED: self.batches.on_unfetched,
                    messages.EXPIRED: self.watch.on_expired,
                    messages.PROBED: self.watch.on_probed,
                    messages.PONG: self.pings.on_pong,
                    "client-releases-keys": sliced_releases(scheduler.stream_handlers["client-releases-keys"]),
                }
            )
            for address in scheduler.workers:
                self.add_worker(scheduler, address)
            start_extensions(scheduler)
            raise_gc_thresholds()
        except Exception:
            logger.exception("daskpipe: the scheduler plugin could not start; daskpipe requests will not be served")

    @guarded
    def add_worker(self, scheduler: Any, worker: str) -> None:
        ws = scheduler.workers[worker]
        slot = worker_slot(worker, ws.name, ws.resources, ws.host)
        if slot is None:
            logger.warning(
                "daskpipe: worker %s (%s) has incomplete daskpipe resources %s; not used as a slot", worker, ws.name, dict(ws.resources)
            )
            return
        self.slots[worker] = slot
        self.elastic.worker_joined(worker)

    @guarded
    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        """A worker left or died: free its slot at once, retry its batches, then re-plan (elastic)."""
        if self.slots.pop(worker, None) is None:
            return
        now = time.monotonic()
        for model, ledger in list(self.ledgers.items()):
            self._lose_worker(ledger, model, worker, now)
        self.arm()
        self.elastic.worker_left(worker)

    def _lose_worker(self, ledger: Ledger, model: str, worker: str, now: float) -> None:
        """Take ``worker``'s slot out of the dispatcher's pools (its reservations are released) and
        re-dispatch the requests of the batches that ran through it while their deadlines allow;
        a request the retry cannot serve is dropped as "worker-lost", saying why."""
        lost = [flight for _, flight in ledger.take_flights(worker)]
        if ledger.suspects.pop(worker, None) is None:  # a suspect is out of the pools already
            self.remove_slot(ledger, model, worker, now, "worker-lost")
        for key in [key for key, address in ledger.parked.items() if address == worker]:
            ledger.end([key], worker_lost(f"worker {worker} died holding its data between two stages"))
        self.retry(ledger, model, lost, now, "worker-lost", f"worker {worker} died while its batch ran")

    def remove_slot(self, ledger: Ledger, model: str, address: str, now: float, reason: DropReason) -> None:
        """Take ``address`` out of the dispatcher's pools; a dispatcher whose pools are fixed
        (``supports_pools`` false) keeps it, and what it still sends there is dropped as
        "worker-lost" (:meth:`~daskpipe.runtime.scheduler.batches.Batches.dispatch`) until a re-plan."""
        dispatcher = ledger.dispatcher
        if dispatcher.supports_pools and any(a == address for _, _, a in ledger.stages):
            self.act(ledger, model, self.step(ledger, model, lambda: dispatcher.remove_slot(address, now, reason)))

    def retry(self, ledger: Ledger, model: str, flights: list[Flight], now: float, reason: DropReason, why: str) -> None:
        """Queue the requests of ``flights`` again, with their original deadlines; one the retry
        cannot serve is dropped for ``reason``, with ``why`` and the dispatcher's own reason."""
        for flight in flights:
            for request, payload, size in flight.retries:
                key = request.id
                if not ledger.requeue(key, payload, size):  # ended meanwhile, or already queued again
                    continue
                ledger.counts["retried"] = ledger.counts.get("retried", 0) + 1
                retry = replace(request)  # its original deadline
                actions = self.step(ledger, model, lambda: ledger.dispatcher.submit(retry, now), failing=[key])
                for action in actions:
                    if isinstance(action, Drop) and action.request.id == key:
                        action.reason, action.detail = reason, f"{why}; the retry was dropped ({action.reason}): {action.detail}"
                self.act(ledger, model, actions)

    @guarded
    def remove_client(self, scheduler: Any, client: str) -> None:
        """A client left (closed, or vanished mid-stream), and Dask released its keys: its queued
        requests end here, dropped as "client-gone", rather than computed for nobody or kept (their
        keys are gone: nothing is left of them on the scheduler), and a model whose stage actors it
        held (their keys are gone with it) is closed. A batch whose first stage still fetches
        its inputs ends them there (:meth:`~daskpipe.runtime.scheduler.batches.Batches.on_unfetched`)."""
        self.intake.send_clocks.forget(client)
        for address in sorted(self.reached.pop(client, ())):  # their fetches from it end there at once
            if address in self.slots:
                self.to_worker(address, {"op": messages.CLIENT_GONE, "client": client})
        tasks = scheduler.tasks
        for model, ledger in list(self.ledgers.items()):
            ledger.end([k for k in ledger.queued if k not in tasks], client_gone(f"client {client} left"))
            if not ledger.closing and any(key not in tasks for key in ledger.stages.values()):
                logger.warning("daskpipe: the stage actors of %s were released (client %s left); closing it", model, client)
                self.close_models([model], reason="shutdown")

    async def close(self) -> None:
        try:
            self.close_models(reason="shutdown")
            self.wakeup.close()
            self.watch.close()
            await self.elastic.close()
            if self.to_workers is not None:
                await self.to_workers.close()
        except Exception:
            logger.exception("daskpipe: closing the scheduler plugin failed")

    # -- daskpipe's streams (daskpipe/runtime/wire/streams.py) --------------------------------------
    async def open_stream(self, comm: Any, client: str | None = None, worker: str | None = None) -> Status:
        """The ``STREAM`` handler: read ``comm`` as a stream from ``client`` or ``worker`` (Dask's
        ``handle_stream`` with the sender in every message); a client's stream also carries the
        resolutions of its requests back."""
        if client is None and worker is None:
            raise ValueError("a daskpipe stream names its client or its worker")
        reply = None
        if client is not None:
            reply = self.client_streams[client] = ImmediateSend()
            reply.start(comm)
            self.reached.pop(client, None)  # a new stream opens its own streams to the workers
        try:
            await self.scheduler.handle_stream(comm, extra={"client": client} if client is not None else {"worker": worker})
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

    def to_worker(self, address: str, message: dict) -> None:
        """``message`` to ``address``'s worker on the scheduler's streams (opened at start)."""
        assert self.to_workers is not None, "the plugin has started"
        self.to_workers.send(address, message)

    # -- rpc handlers (client -> scheduler) ----------------------------------------------------
    def inventory(self) -> list[dict]:
        """The slots a plan may use: the daskpipe workers if any, else every worker as a CPU slot."""
        gpu_slots = [s for s in self.slots.values() if s.gpu != messages.CPU or s.emulated]
        slots = gpu_slots or list(self.slots.values())
        return [s.to_msg() for s in sorted(slots, key=lambda s: s.address)]

    async def serve(self, model: str, plan: dict, profile: dict, stages: list[list], **options: Any) -> str:
        """Start serving ``model``: ``stages`` lists [pipeline, partition, worker address, actor key].

        The control path to the stages' workers is measured first (:data:`PINGS` round trips
        each): it seeds the model's margin, and a model whose SLO cannot be met even by a lone
        request on an idle pipeline, with that margin, is refused here with the smallest SLO it
        could serve. ``options`` are :meth:`start_serving`'s.
        """
        check_dispatcher(options.get("dispatcher", "ppipe"))  # wrong options fail before any measuring
        addresses = sorted({str(row[2]) for row in stages})
        for address in addresses:
            if address not in self.slots:
                raise DeployError(f"a stage of {model!r} is placed on {address}, which is not a worker of this cluster")
        pipelines = Plan.from_dict(plan).model(model).pipelines
        longest = max((len(p.partitions) for p in pipelines), default=1)
        round_trips = [t for address in addresses for t in await self.pings.round_trips(self.to_worker, address, PINGS)]
        self.start_serving(model, plan, profile, stages, control=ControlPath(seed_from_round_trips(round_trips, longest + 2)), **options)
        ledger = self.ledgers[model]
        delays = await trial_control_path(ledger, model, self.batches, self.watch.own_id)
        if delays:  # a tight SLO: decided on the trial's tail (daskpipe/runtime/scheduler/trial.py)
            logger.info("daskpipe: %s: the deploy's trial of its control path: %s", model, trial_summary(delays))
            try:
                k = float(options.get("time_dilation", 1.0))
                check_feasible(
                    model,
                    ledger.model,
                    ledger.profile,
                    ledger.budgets,
                    trial_margin(delays),
                    bw_gbps=ledger.durations.bw_gbps,
                    time_dilation=k,
                )
            except DeployError as exc:
                self.close_models([model], reason="shutdown")
                raise DeployError(f"{exc} (the control path's p99 over a trial of {len(delays)} batches at deploy)") from None
        freeze_heap()
        return "OK"

    async def serve_pool(
        self,
        models: list[str],
        plan: dict,
        profiles: dict[str, dict],
        stages: dict[str, list[list]],
        *,
        dispatcher: str,
        time_dilation: float = 1.0,
        bw_gbps: float = 10.0,
        max_queued: int | None = None,
        sample_nbytes: dict[str, int] | None = None,
        timeout_s: float | None = None,
    ) -> str:
        """Start serving a shared pool (:mod:`daskpipe.runtime.client.pools`): ``models``, each on every
        slot of the pool (``stages[model]``: its rows, as :meth:`serve` takes them), with one
        ``dispatcher`` for all of them, whose dispatches go to the model they are for
        (:meth:`act`). Each model keeps its own requests, counts and control-path margin, all
        seeded from one measurement of the pool's workers. All of them are served, or none.
        ``timeout_s``: the timeout data plane's wait, before time dilation."""
        addresses = sorted({str(row[2]) for rows in stages.values() for row in rows})
        unknown = [a for a in addresses if a not in self.slots]
        if unknown:
            raise DeployError(f"a shared pool is placed on {unknown}, which are not workers of this cluster")
        shared = pool_dispatcher(
            dispatcher,
            plan,
            {m: profiles[m] for m in models},
            [self.slots[a] for a in addresses],
            time_dilation=time_dilation,
            timeout_s=timeout_s,
        )
        round_trips = [t for address in addresses for t in await self.pings.round_trips(self.to_worker, address, PINGS)]
        started: list[str] = []
        try:
            for model in models:
                control = ControlPath(seed_from_round_trips(round_trips, 3))
                self.start_serving(
                    model,
                    plan,
                    profiles[model],
                    stages[model],
                    control=control,
                    time_dilation=time_dilation,
                    bw_gbps=bw_gbps,
                    dispatcher=shared,
                    max_queued=max_queued,
                    sample_nbytes=(sample_nbytes or {}).get(model, 0),
                )
                started.append(model)
        except Exception:
            for model in started:
                del self.ledgers[model]
            raise
        shared.continue_ids(max(self.batches.next_ids.get(m, 0) for m in models))
        freeze_heap()
        return "OK"

    def start_serving(
        self,
        model: str,
        plan: dict,
        profile: dict,
        stages: list[list],
        *,
        control: ControlPath,
        time_dilation: float = 1.0,
        bw_gbps: float = 10.0,
        dispatcher: str | Dispatcher = "ppipe",
        max_queued: int | None = None,
        sample_nbytes: int = 0,
    ) -> None:
        """Serve ``model`` at once with the control-path estimate ``control`` (a re-plan keeps the
        model's own), on ``dispatcher``: a data plane's name, or a shared pool's dispatcher
        (:meth:`serve_pool`). ``max_queued`` bounds the requests queued here (default :func:`queue_bound`);
        ``sample_nbytes`` is a sample's raw input size, against which submissions are checked.
        A model closed earlier whose batches have all ended (its owner vanished) is replaced.
        """
        old = self.ledgers.get(model)
        if old is not None and not (old.closing and not old.flights):
            raise DeployError(f"model {model!r} is already served; close the service that serves it first")
        assert self.endings is not None, "the plugin has started"
        ledger, placement = ledger_for(
            model,
            plan,
            profile,
            stages,
            self.endings,
            control=control,
            time_dilation=time_dilation,
            bw_gbps=bw_gbps,
            dispatcher=dispatcher,
            max_queued=max_queued,
            sample_nbytes=sample_nbytes,
        )
        # a closed deployment of the same model may still have batches reporting (a stalled
        # worker's backlog): the new one numbers its batches past every id sent before
        ledger.dispatcher.continue_ids(self.batches.next_ids.get(model, 0))
        self.ledgers[model] = ledger
        self.metrics.serve(
            model,
            ledger.model,
            placement,
            control=control.summary,
            suspects=functools.partial(self.watch.suspects, model),
            plan_quality=Plan.from_dict(plan).quality(),
        )
        logger.info(
            "daskpipe: serving %s on %d stages (%d pipelines), time dilation %g, control-path margin %.2f ms",
            model,
            len(ledger.stages),
            len(ledger.model.pipelines),
            float(time_dilation),
            control.margin_s * 1e3,
        )

    def close_models(self, models: Iterable[str] | None = None, reason: DropReason = "shutdown") -> dict[str, int]:
        """Stop taking requests for ``models`` (default: all); queued ones err with ``reason``.

        Batches already dispatched run to the end; ``status`` shows them in ``in_flight``.
        """
        now = time.monotonic()
        drained = {}
        for model in list(self.ledgers if models is None else models):
            ledger = self.ledgers.get(model)
            if ledger is None:
                continue
            ledger.closing = True
            actions = self.step(ledger, model, lambda: self._drain(ledger, model, now, reason))
            self.act(ledger, model, actions)
            leftover = ledger.end(list(ledger.queued), Dropped(reason))  # anything the dispatcher did not hand back
            drained[model] = len(actions) + len(leftover)
        return drained

    def _drain(self, ledger: Ledger, model: str, now: float, reason: DropReason) -> list:
        """``model``'s queued requests out of its dispatcher; of a shared pool's, only its own
        while other models of the pool are still served."""
        dispatcher = ledger.dispatcher
        staying = any(s.dispatcher is dispatcher and not s.closing for s in self.ledgers.values())
        if staying and isinstance(dispatcher, DeferredDispatcher):
            return dispatcher.drain(now, reason, models=[model])
        return dispatcher.drain(now, reason)

    def status(self, models: Iterable[str] | None = None, forget: bool = False) -> dict[str, dict]:
        """Counters per model; ``forget`` removes closed models whose batches have all ended."""
        out = {}
        for model in list(self.ledgers if models is None else models):
            ledger = self.ledgers.get(model)
            if ledger is None:
                continue
            out[model] = {
                **ledger.counts,
                "dropped": dict(ledger.dropped),
                "queued": len(ledger.queued),
                "max_queued": ledger.max_queued,
                "in_flight": sum(len(f.keys) for f in ledger.flights.values()),
                "closing": ledger.closing,
                "control": ledger.control.summary(),
                "late": ledger.late.summary(),
                "measured_ratios": {f"{p}/{q}": ratio for (p, q), ratio in sorted(ledger.dispatcher.measured_ratios().items())},
                "suspects": self.watch.suspects(model),
            }
            if forget and ledger.closing and not ledger.flights:
                del self.ledgers[model]
        return out

    # -- the control surface of a re-plan (daskpipe.runtime.scheduler.elastic.controller) -----------------------------
    def hold(self, model: str, holding: Dispatcher) -> tuple[Dispatcher, list[Request]]:
        """Put ``holding`` in charge of ``model`` and drain the dispatcher it replaces: returns that
        dispatcher and the queued requests it gave up (they are still in the plugin's care)."""
        ledger = self.ledgers[model]
        old, ledger.dispatcher = ledger.dispatcher, holding
        drained = self.step(ledger, model, lambda: old.drain(time.monotonic(), "shutdown"))
        return old, [action.request for action in drained if isinstance(action, Drop)]

    def switch(
        self,
        model: str,
        held: Ledger,
        plan: Plan,
        profile: Profile,
        stages: list[list],
        *,
        dispatcher: str,
        time_dilation: float,
        bw_gbps: float,
        first_id: int,
    ) -> None:
        """Serve ``model`` on ``plan``'s ``stages`` instead of ``held``, which keeps its control
        path, queue bound and every request in its care; dispatch ids start at ``first_id``. If the
        new plan cannot be served, this raises and ``held`` stays in place."""
        del self.ledgers[model]
        explicit_bound = held.max_queued != queue_bound(held.model, None)
        try:
            self.start_serving(
                model,
                plan.to_dict(),
                profile.to_dict(),
                stages,
                control=held.control,
                time_dilation=time_dilation,
                bw_gbps=bw_gbps,
                dispatcher=dispatcher,
                max_queued=held.max_queued if explicit_bound else None,
                sample_nbytes=held.sample_nbytes,
            )
        except Exception:
            self.ledgers[model] = held
            raise
        fresh = self.ledgers[model]
        fresh.carry_over(held)
        fresh.dispatcher.continue_ids(max(first_id, self.batches.next_ids.get(model, 0)))

    def resume(self, model: str, requests: list[Request], dispatcher: Dispatcher | None = None) -> None:
        """Submit the ``requests`` still queued to ``model``'s dispatcher (``dispatcher``, when
        given, first takes charge again: the one :meth:`hold` returned)."""
        ledger = self.ledgers[model]
        if dispatcher is not None:
            ledger.dispatcher = dispatcher
        now = time.monotonic()
        for request in requests:
            if request.id in ledger.queued:  # else it ended meanwhile
                self.act(ledger, model, self.step(ledger, model, lambda: ledger.dispatcher.submit(request, now), failing=[request.id]))

    # -- stepping the dispatcher ---------------------------------------------------------------
    def step(self, ledger: Ledger, model: str, call: Callable[[], list], failing: list | None = None) -> list:
        """Run one dispatcher call; a dispatcher bug fails the requests at stake, with the cause."""
        try:
            return call()
        except Exception as exc:
            logger.exception("daskpipe: the dispatcher of %s raised", model)
            stake = list(ledger.queued) if failing is None else failing
            failure = RequestFailed(f"the dispatcher of {model!r} raised {type(exc).__name__}: {exc}", cause=exc)
            ledger.end(stake, Failed(failure))
            return []

    def act(self, ledger: Ledger, model: str, actions: list) -> None:
        """Carry out what a dispatcher call returned: send its batches, end what it dropped. A
        shared pool's dispatcher decides for all of its models at once: each action goes to the
        model it is for."""
        for action in actions:
            owner = action.model if isinstance(action, Dispatch) else action.request.model
            target = ledger if owner == model else self.ledgers[owner]
            if isinstance(action, Dispatch):
                self.batches.dispatch(target, owner, action)
            elif isinstance(action, Drop) and action.request.id in target.queued:  # else it ended already (released)
                target.end([action.request.id], Dropped(action.reason, action.detail))

    # -- the timer -----------------------------------------------------------------------------
    def arm(self) -> None:
        """Keep one wake-up (:class:`~daskpipe.runtime.scheduler.timer.Wakeup`), at the earliest ``next_wake`` of all dispatchers."""
        wakes = [w for s in self.ledgers.values() if (w := s.dispatcher.next_wake()) is not None]
        wake = min(wakes, default=float("inf"))
        if wake < self.wakeup.at:
            self.wakeup.arm(wake)
        elif wake == float("inf"):
            self.wakeup.cancel()

    @guarded
    def _on_timer(self) -> None:
        now = time.monotonic()
        margins: dict[int, float] = {}  # a shared pool's dispatcher: the least margin of its models
        for ledger in self.ledgers.values():
            key = id(ledger.dispatcher)
            margins[key] = min(margins.get(key, ledger.control.margin_s), ledger.control.margin_s)
        for model, ledger in list(self.ledgers.items()):
            if id(ledger.dispatcher) not in margins:  # a shared pool's, woken already
                continue
            wake = ledger.dispatcher.next_wake()
            if wake is not None and wake <= now:
                # a wake that fires late by up to the margin is given the time it asked for: the margin
                # pays for it (a late timer is part of the measured dispatch delay); else a dispatcher
                # waiting for a batch's last moment would find it just past, and drop the batch
                at = max(wake, now - margins.pop(id(ledger.dispatcher)))
                self.act(ledger, model, self.step(ledger, model, lambda: ledger.dispatcher.wake(at)))
            else:
                margins.pop(id(ledger.dispatcher))
        self.arm()


def start_extensions(scheduler: Any) -> None:
    """Run each ``module:function`` that the Dask config key :data:`EXTENSIONS_CONFIG` names on
    ``scheduler`` (the top-level ``daskpipe`` package names the dashboard's pages). A failing one
    is logged: the scheduler still serves requests."""
    for name in setting(EXTENSIONS_CONFIG):
        try:
            module, _, function = name.partition(":")
            getattr(importlib.import_module(module), function)(scheduler)
        except Exception:
            logger.exception("daskpipe: the scheduler extension %r could not start; serving goes on without it", name)


def install(scheduler: Any) -> DaskpipeSchedulerPlugin:
    """Add the plugin to ``scheduler`` (before it starts: its ``start`` hook installs the handlers)."""
    existing = scheduler.plugins.get(DaskpipeSchedulerPlugin.name)
    if isinstance(existing, DaskpipeSchedulerPlugin):
        return existing
    plugin = DaskpipeSchedulerPlugin()
    scheduler.add_plugin(plugin)
    return plugin


def plugin_of(scheduler: Any) -> DaskpipeSchedulerPlugin:
    """The running plugin of ``scheduler`` (for tests and in-process tools)."""
    plugin = scheduler.plugins.get(DaskpipeSchedulerPlugin.name)
    if not isinstance(plugin, DaskpipeSchedulerPlugin):
        raise DeployError("daskpipe's scheduler plugin is not installed on this scheduler")
    return plugin
