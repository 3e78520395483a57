"""The scheduler half of daskpipe's runtime: one dispatcher per model on the scheduler's event loop.

:class:`DaskpipeSchedulerPlugin` is installed with ``dask scheduler --preload daskpipe`` (no
pickle needed) or registered from a client (``daskpipe.deploy`` does it when missing). It adds
scheduler handlers and stream handlers (see :mod:`daskpipe.runtime.wire.messages`), learns which
workers are slots from their resources, and routes each of Dask's hooks and handlers to the part
that acts on it; it keeps no state of its own. It never uses the ``transition`` hook.

Its parts each have a module: each served model's requests live in its
:class:`~daskpipe.runtime.scheduler.ledger.Ledger`, which ends every one of them, and the models
in :class:`~daskpipe.runtime.scheduler.models.Models`, which carries out their dispatchers'
decisions and steps them with the real clock (on submissions, on feedback, and on a single timer
re-armed at the earliest ``next_wake``). Submissions come in through
:class:`~daskpipe.runtime.scheduler.intake.Intake`; batches go out to their stages, and their
reports come back, through :class:`~daskpipe.runtime.scheduler.batches.Batches`, over the
:class:`~daskpipe.runtime.scheduler.links.Links`; :class:`~daskpipe.runtime.scheduler.watch.GrayWatch`
watches them for gray failures; :class:`~daskpipe.runtime.scheduler.serving.Serving` starts serving a
model; :class:`~daskpipe.runtime.scheduler.elastic.controller.Elastic` re-plans. Requests are real
Dask keys (:mod:`daskpipe.runtime.scheduler.keys`). Request inputs are raw bytes that the scheduler keeps and
forwards as they are: it never deserializes them.
"""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any

from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin

from daskpipe.config import setting
from daskpipe.runtime.errors import DeployError, guarded
from daskpipe.runtime.gctune import raise_gc_thresholds
from daskpipe.runtime.scheduler.batches import Batches
from daskpipe.runtime.scheduler.elastic.controller import Elastic
from daskpipe.runtime.scheduler.intake import Intake, sliced_releases
from daskpipe.runtime.scheduler.lifecycle import Lifecycle
from daskpipe.runtime.scheduler.links import Links
from daskpipe.runtime.scheduler.models import Models
from daskpipe.runtime.scheduler.serving import Serving
from daskpipe.runtime.scheduler.watch import GrayWatch
from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.messages import worker_slot
from daskpipe.sched.metrics import ServiceMetrics

logger = logging.getLogger(__name__)

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
        self.metrics = ServiceMetrics(unix_offset=time.time() - time.monotonic())  # what the dashboard and /metrics show
        # a dispatcher's batches are sent by the batches, whose reports step the dispatchers again
        self.models = Models(self.metrics, dispatch=lambda ledger, model, action: self.batches.dispatch(ledger, model, action))
        self.links = Links()  # daskpipe's streams to clients and workers
        # stalled and slow slots, late limits, poisoned batches (daskpipe/runtime/scheduler/watch.py)
        self.watch = GrayWatch(
            self.models, self.links, send=lambda ledger, model, dispatch, flight: self.batches.send(ledger, model, dispatch, flight)
        )
        self.batches = Batches(self.models, self.links, self.watch)  # out to the stages and back
        self.intake = Intake(self.models, self.links)  # submissions from clients
        self.serving = Serving(self.models, self.links, self.batches, self.watch)  # models start serving
        self.elastic = Elastic(self.models, self.serving)  # re-plans as workers join and leave (docs/operations.md)
        self.lifecycle = Lifecycle(self.models, self.elastic)  # models added, removed and updated while serving

    # -- SchedulerPlugin hooks -----------------------------------------------------------------
    async def start(self, scheduler: Any) -> None:
        try:
            self.scheduler = scheduler
            self.links.start(scheduler.connection_args)
            self.models.start(scheduler, self.links.to_worker)
            scheduler.handlers.update(
                {
                    messages.STREAM: self.open_stream,
                    messages.INVENTORY: self.models.inventory,
                    messages.SERVE: self.serve,
                    messages.SERVE_POOL: self.serve_pool,
                    messages.JOIN_POOL: self.join_pool,
                    messages.GROW_POOL: self.serving.grow_pool,
                    messages.CLOSE: self.models.close,
                    messages.STATUS: self.models.status,
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
                    messages.PONG: self.links.pings.on_pong,
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
        self.models.slots[worker] = slot
        self.elastic.worker_joined(worker)

    @guarded
    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        """A worker left or died: free its slot at once, retry its batches, then re-plan (elastic)."""
        if self.models.lose_worker(worker):
            self.elastic.worker_left(worker)

    @guarded
    def remove_client(self, scheduler: Any, client: str) -> None:
        """A client left (closed, or vanished mid-stream), and Dask released its keys: the workers
        it was to send inputs to end their fetches from it, and its queued requests end here
        (:meth:`~daskpipe.runtime.scheduler.models.Models.client_left`). A batch whose first stage
        still fetches its inputs ends them there (:meth:`~daskpipe.runtime.scheduler.batches.Batches.on_unfetched`)."""
        self.intake.send_clocks.forget(client)
        self.links.client_left(client, self.models.slots)
        self.models.client_left(client)

    async def close(self) -> None:
        try:
            self.models.close(reason="shutdown")
            self.models.wakeup.close()
            self.watch.close()
            await self.elastic.close()
            await self.links.close()
        except Exception:
            logger.exception("daskpipe: closing the scheduler plugin failed")

    # -- models starting to serve: a closed elastic service of the same names ends first ------------
    async def serve(self, model: str, **serve: Any) -> str:
        """The ``SERVE`` handler (:meth:`~daskpipe.runtime.scheduler.serving.Serving.serve`)."""
        self.elastic.end_forgotten([model])
        return await self.serving.serve(model, **serve)

    async def serve_pool(self, models: list[str], adopt_settings: dict | None = None, **serve: Any) -> str:
        """The ``SERVE_POOL`` handler (:meth:`~daskpipe.runtime.scheduler.serving.Serving.serve_pool`);
        ``adopt_settings``: the pool's service adopts the workers that join, and the elastic controller
        advises scaling for it with these settings (:meth:`~daskpipe.runtime.scheduler.elastic.controller.Elastic.scale_pool`)."""
        self.elastic.end_forgotten(models)
        served = await self.serving.serve_pool(models, **serve)
        if adopt_settings is not None:
            self.elastic.scale_pool(models, adopt_settings)
        return served

    async def join_pool(self, model: str, **join: Any) -> str:
        """The ``JOIN_POOL`` handler (:meth:`~daskpipe.runtime.scheduler.serving.Serving.join_pool`)."""
        self.elastic.end_forgotten([model])
        return await self.serving.join_pool(model, **join)

    async def open_stream(self, comm: Any, client: str | None = None, worker: str | None = None) -> Status:
        """The ``STREAM`` handler (:meth:`~daskpipe.runtime.scheduler.links.Links.open_stream`)."""
        return await self.links.open_stream(self.scheduler, comm, client, worker)


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
