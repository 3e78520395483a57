"""daskpipe's dashboard: pages in Dask's scheduler dashboard, Prometheus metrics, HTML reports.

:class:`~daskpipe.sched.metrics.ServiceMetrics` records the service's events (the scheduler
plugin owns one); :mod:`~daskpipe.dashboard.server` serves the pages and ``/daskpipe/metrics``;
:mod:`~daskpipe.dashboard.report` writes the same figures for a simulated run.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def attach_dashboard(scheduler: Any) -> None:
    """Add daskpipe's pages and metrics to ``scheduler``'s HTTP server; a scheduler without Bokeh
    or prometheus_client still serves requests (the failure is logged)."""
    try:
        from daskpipe.dashboard.server import attach

        attach(scheduler)
    except Exception:
        logger.exception("daskpipe: the dashboard pages could not be added; serving goes on without them")
