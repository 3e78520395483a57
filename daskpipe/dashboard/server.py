"""daskpipe's pages in the scheduler's own dashboard, and its Prometheus metrics.

:func:`attach` runs when daskpipe's scheduler plugin starts, so it works both for ``dask scheduler
--preload daskpipe`` and for a plugin registered from a client after the scheduler started:
instead of adding to ``distributed.dashboard.scheduler.applications`` (read once, when the
scheduler connects its dashboard, before a client-registered plugin exists) it builds its own
Bokeh server application with distributed's ``BokehApplication`` and adds it to the scheduler's
``http_application``, on the same port. A ``daskpipe`` entry is added to the navigation bar, and
the Prometheus collector is registered (see :mod:`daskpipe.dashboard.prometheus`).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from bokeh.document import Document
from dask.utils import parse_timedelta
from distributed.dashboard.components import add_periodic_callback
from distributed.dashboard.components.scheduler import BOKEH_THEME, env
from distributed.dashboard.core import BokehApplication, DaskBokehTornado
from tornado.ioloop import IOLoop

from daskpipe.config import setting
from daskpipe.dashboard.components import VIEWS, Reader
from daskpipe.sched.metrics import ServiceMetrics

logger = logging.getLogger(__name__)

UPDATE_CONFIG = "daskpipe.dashboard.update-interval"
"""Dask config key of how often an open page refreshes (``DASK_DASKPIPE__DASHBOARD__UPDATE_INTERVAL``
in the environment): a duration such as ``"1s"`` or ``"500ms"``, or seconds (at least 0.1 s: the schema's)."""


def update_interval_ms() -> int:
    """The configured refresh period of the pages."""
    return round(parse_timedelta(setting(UPDATE_CONFIG), default="seconds") * 1000)


NAV_PAGE = "daskpipe-plan"
"""The page the navigation bar's ``Daskpipe`` entry opens."""

TEMPLATE = env.from_string(
    """{% extends "base.html" %}
{% block content %}
<div style="padding: 6px 12px; font-size: 14px">daskpipe:
{% for url, title in daskpipe_pages %}<a href="{{ url }}" style="margin-right: 14px">{{ title }}</a>{% endfor %}
</div>
{{ plot_div }}
{{ plot_script }}
{% endblock %}"""
)
PAGES = [(f"daskpipe-{slug}", title) for slug, (title, _) in VIEWS.items()]
"""(url, title) of every page: flat paths, since the navigation bar's links are relative to ``/``."""


def live_reader(scheduler: Any) -> Reader:
    """Read the running plugin's recorder against the scheduler's monotonic clock."""

    def read() -> tuple[ServiceMetrics | None, float]:
        plugin = scheduler.plugins.get("daskpipe")
        return getattr(plugin, "metrics", None), time.monotonic()

    return read


def destroy_without_full_collection(document: Document) -> None:
    """Make ``document``'s ``destroy`` leave its garbage to the collector's next pass.

    Bokeh discards the session of a closed page (15 s later) with ``Document.destroy``, which ends
    with a full ``gc.collect()`` to break the document's reference cycles at once. On the
    scheduler's event loop that walks the whole heap, every key's task state included: 0.7 s of
    stalled scheduler per closed page in ``daskpipe bench dashboard``. With the heap frozen
    (``gc.freeze``) the collection walks nothing; unfrozen, the document's cycles are collected
    with everything else by the next automatic full collection.
    """
    destroy = document.destroy

    def destroy_frozen(session: Any) -> None:
        gc.freeze()
        try:
            destroy(session)
        finally:
            gc.unfreeze()

    document.destroy = destroy_frozen


def page_doc(slug: str):
    """The ``*_doc`` function of page ``slug``: one view, refreshed every :func:`update_interval_ms`."""
    title, view_class = VIEWS[slug]

    def doc(scheduler: Any, extra: dict, document: Document) -> None:
        view = view_class(live_reader(scheduler))
        view.update()
        add_periodic_callback(document, view, update_interval_ms())
        document.add_root(view.root)
        document.title = f"daskpipe: {title}"
        document.theme = BOKEH_THEME
        document.template = TEMPLATE
        document.template_variables.update(extra)
        document.template_variables["daskpipe_pages"] = PAGES
        destroy_without_full_collection(document)

    doc.__name__ = f"{slug}_doc"
    return doc


applications = {f"/daskpipe-{slug}": page_doc(slug) for slug in VIEWS}
"""Path -> ``*_doc``: the one table of daskpipe's pages."""


def _dask_dashboard(scheduler: Any) -> DaskBokehTornado | None:
    """The Bokeh application of distributed's own pages, if the scheduler serves a dashboard."""
    return next((app for app in scheduler.http_application.applications if isinstance(app, DaskBokehTornado)), None)


def attach(scheduler: Any) -> None:
    """Serve daskpipe's pages and metrics from ``scheduler``'s HTTP server (once per scheduler)."""
    try:
        from daskpipe.dashboard.prometheus import register_collector, route
    except ModuleNotFoundError:  # no prometheus_client: pages only, as distributed does
        register_collector = route = None
    if register_collector is not None:
        register_collector(scheduler)
    if getattr(scheduler, "http_application", None) is None or getattr(scheduler, "_daskpipe_dashboard", None) is not None:
        return
    update_interval_ms()  # a bad setting is reported now, in the scheduler's log, not when a page opens
    dask_pages = _dask_dashboard(scheduler)
    prefix = dask_pages.prefix if dask_pages is not None else ""
    if route is not None:
        scheduler.http_application.add_handlers(r".*", [route(scheduler, prefix)])
    scheduler._daskpipe_dashboard = dask_pages is not None
    if dask_pages is None:
        return
    from distributed.dashboard.scheduler import template_variables

    nav = template_variables(scheduler)  # the navigation bar's variables, shared by every page
    bokeh_app = BokehApplication(applications, scheduler, prefix=prefix, template_variables=nav)
    scheduler.http_application.add_application(bokeh_app)
    bokeh_app.initialize(IOLoop.current())
    bokeh_app.start()
    if NAV_PAGE not in nav["pages"]:
        nav["pages"].append(NAV_PAGE)
    logger.info("daskpipe: dashboard pages at %s", ", ".join(applications))
