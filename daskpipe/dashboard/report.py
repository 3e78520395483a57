"""The dashboard's pages as one standalone HTML file, for a simulated (or any finished) run.

``save_report`` draws the same views as the live pages (:data:`~daskpipe.dashboard.components.VIEWS`),
one tab each, from a :class:`ServiceMetrics` as it stood at the run's last event. A simulated run
fills one with :func:`record_trace`, which replays an engine ``Trace`` into the recorder's events.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from bokeh.io import save
from bokeh.models import TabPanel, Tabs
from bokeh.resources import INLINE

from daskpipe.dashboard.components import build_roots
from daskpipe.sched.metrics import BUCKET_S, ServiceMetrics

if TYPE_CHECKING:
    from daskpipe.plan.schema import ModelPlan
    from daskpipe.sched.api import Placement
    from daskpipe.sim.engine import Trace


def record_trace(metrics: ServiceMetrics, plan: ModelPlan, placement: Placement, trace: Trace) -> ServiceMetrics:
    """Replay the simulator's ``trace`` of model ``plan.name`` into ``metrics``, in time order.

    The trace has no NIC timings and no drop times: drops are counted at the request's
    deadline (or at the run's end, if earlier), and the NIC chart stays empty.
    """
    model = plan.name
    metrics.serve(model, plan, placement)
    records = {key: r for key, r in trace.requests.items() if r.model == model}
    first_dispatch: dict[Any, float] = {}
    events: list[tuple[float, int, str, Any]] = []  # (time, order at equal times, kind, payload)
    for decided, dispatch in trace.dispatches:
        if dispatch.model == model:
            events.append((decided, 1, "dispatch", dispatch))
            if dispatch.hops[0].partition == 0:
                for request in dispatch.requests:
                    first_dispatch.setdefault(request.id, decided)
    for key, record in records.items():
        events.append((record.arrival, 0, "submit", key))
        if record.finish is not None and record.dropped is None:
            events.append((record.finish, 2, "complete", record))
        elif record.dropped is not None:
            events.append((min(record.deadline, trace.end_time), 2, "drop", record))
            if key not in first_dispatch:
                first_dispatch[key] = min(record.deadline, trace.end_time)
    events.extend((when, 1, "leave", key) for key, when in first_dispatch.items() if key in records)
    events.sort(key=lambda event: (event[0], event[1]))
    queued = 0
    for when, _, kind, payload in events:
        if kind == "submit":
            queued += 1
            metrics.submit(model, 1, when, queued)
        elif kind == "leave":
            queued -= 1
        elif kind == "dispatch":
            metrics.dispatch(model, payload, when, queued)
        elif kind == "complete":
            metrics.complete(model, [payload.finish - payload.arrival], when)
        else:
            metrics.drop(model, payload.dropped, 1, when)
    for trace_model, slot, _, _, start, end in trace.computes:
        if trace_model == model:
            metrics.busy_interval(slot, start, end)
    return metrics


def save_report(run: ServiceMetrics | Any, path: str | Path, *, title: str = "daskpipe report") -> Path:
    """Write the dashboard's pages for ``run`` to ``path`` as one self-contained HTML file.

    ``run`` is a :class:`ServiceMetrics` (the live plugin's ``metrics``, or one filled by
    :func:`record_trace`) or an object carrying one as ``.metrics`` (a simulation result).
    """
    metrics = run if isinstance(run, ServiceMetrics) else getattr(run, "metrics", None)
    if not isinstance(metrics, ServiceMetrics):
        raise TypeError(f"save_report needs a ServiceMetrics or a result with a .metrics one, got {type(run).__name__}")
    end = (metrics.last_time // BUCKET_S + 1) * BUCKET_S  # the end of the last event's second: its bucket is complete
    tabs = Tabs(
        tabs=[TabPanel(child=root, title=page_title) for page_title, root in build_roots(lambda: (metrics, end))],
        sizing_mode="stretch_width",
    )
    path = Path(path)
    save(tabs, filename=path, resources=INLINE, title=title)
    return path
