"""The dashboard's views, one class per page, each reading a :class:`ServiceMetrics`.

Every view builds its ``ColumnDataSource``\\ s and figures once and refreshes them in ``update()``,
which sends the browser as little as possible, since every source sent is a message and a redraw
in each open page: a source is replaced only when what it shows changed (a time-series chart once
per completed second at most, the GPU timeline once per update under load), and the x axes count
back from now so that no range moves. A view gets its data from a ``Reader``: a function returning
the recorder and the ``now`` to draw against, so the same view draws the live service (the
scheduler plugin's recorder and the monotonic clock) or a finished simulated run (its recorder
and end time). The recent drops carry times of day: the recorder's clock plus its
``unix_offset``, UTC for the live service and time since the start for a simulated run.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from itertools import cycle

import numpy as np
from bokeh.core.properties import without_property_validation
from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, DataTable, Div, FactorRange, HoverTool, LayoutDOM, NumberFormatter, Range1d, TableColumn
from bokeh.palettes import Category10_10
from bokeh.plotting import figure
from distributed.dashboard.components import DashboardComponent
from distributed.utils import log_errors

from daskpipe.sched.metrics import BUCKET_S, PHASES, DropEvent, ServiceMetrics

Reader = Callable[[], tuple["ServiceMetrics | None", float]]
"""Returns the recorder to draw (``None`` while there is none) and the time to draw up to."""
Columns = Callable[[ServiceMetrics, int, int], dict[str, list[float]]]
"""Given the recorder and buckets ``first`` to ``last``, one list of values per line label (labels
only ever added, in a stable order: models and drop reasons are never forgotten)."""

SERIES_BUCKETS = 120
"""Completed buckets the time series show: the last two minutes."""
TIMELINE_S = 5.0
"""Seconds of reservations and busy intervals the GPU timeline shows."""
TIMELINE_BARS = 400
"""At most this many planned and this many busy bars are drawn: under heavy load the timeline
shows less than :data:`TIMELINE_S` rather than thousands of bars."""
PERCENTILES = (50, 99)
BREAKDOWN_BUCKETS = 10
"""The latency breakdown averages the requests completed in this many last seconds."""
LINE = "line/"
"""Prefix of the source column of each time-series line."""
SLO_SUFFIX = " SLO"
"""Label suffix of the (dashed) SLO lines in the latency chart."""
PHASE_COLORS = ("#fdae6b", "#3182bd", "#756bb1", "#bdbdbd")


def _colors(labels: list[str]) -> list[str]:
    """A stable colour per distinct label, in order of first appearance."""
    palette = cycle(Category10_10)
    assigned: dict[str, str] = {}
    for label in labels:
        if label not in assigned:
            assigned[label] = next(palette)
    return [assigned[label] for label in labels]


def last_completed(now: float) -> int:
    """The newest bucket that has ended by ``now``: what the charts show last."""
    return int(now // BUCKET_S) - 1


def push(source: ColumnDataSource, data: dict[str, list | np.ndarray]) -> None:
    """Replace ``source``'s data unless it holds ``data`` already: an unchanged source sends the
    browser nothing and redraws nothing. Columns are plain lists (no NaN) or float arrays (NaN
    marks a gap and equals NaN here)."""
    current = source.data
    same = current.keys() == data.keys() and all(
        np.array_equal(current[key], column, equal_nan=True) if isinstance(column, np.ndarray) else current[key] == column
        for key, column in data.items()
    )
    if not same:
        source.data = data


def clock_text(metrics: ServiceMetrics, t: float) -> str:
    """A recorder time as ``HH:MM:SS.mmm`` UTC (time since the start, for a virtual clock)."""
    return datetime.fromtimestamp(t + metrics.unix_offset, timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten above ``value`` plus 5% headroom (1 at least):
    an axis end that stays put while the data moves within it."""
    target = max(float(value), 0.0) * 1.05
    if not target > 0 or not np.isfinite(target):
        return 1.0
    power = 10.0 ** np.floor(np.log10(target))
    return float(next(step * power for step in (1, 2, 5, 10) if step * power >= target))


def fit_end(axis_range: Range1d, values: list[float] | np.ndarray) -> None:
    """Set ``axis_range`` to [0, nice end] over ``values``, only when the end moves: the server sets
    every range, so the browser never computes one and sends it back (as it does for a
    ``DataRange1d``), and a steady chart costs no message."""
    finite = np.asarray(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    end = nice_ceiling(finite.max() if finite.size else 0.0)
    if axis_range.end != end:
        axis_range.end = end


def set_factors(axis_range: FactorRange, factors: list) -> bool:
    """Set a categorical axis's factors only when they change (a steady chart costs no message);
    returns whether they did."""
    if list(axis_range.factors) == factors:
        return False
    axis_range.factors = factors
    return True


class Chart:
    """One time-series figure of a :class:`TimeSeriesCharts`: its lines, one per label that its
    ``columns`` function returns, each a column ``line/<label>`` of the chart's own source (a
    label may be any model name, ``x`` too)."""

    def __init__(self, fig: figure, columns: Columns, markers: bool, fixed_y: bool) -> None:
        self.figure, self.columns = fig, columns
        self.source = ColumnDataSource({"x": []})
        self.markers = markers  # a marker per point, so a point between gaps (NaN) still shows
        self.fixed_y = fixed_y
        self.labels: list[str] = []
        self.palette = cycle(Category10_10)

    def column(self, label: str) -> list[float]:
        """The values the line ``label`` shows, oldest first."""
        return list(self.source.data[LINE + label])

    def add_line(self, label: str) -> None:
        color = next(self.palette)
        dash = "dashed" if label.endswith(SLO_SUFFIX) else "solid"
        self.figure.line("x", LINE + label, source=self.source, color=color, line_width=2, line_dash=dash, legend_label=label)
        if self.markers and dash == "solid":
            self.figure.scatter("x", LINE + label, source=self.source, color=color, size=4, legend_label=label)
        self.figure.legend.location = "top_left"


class TimeSeriesCharts:
    """The time-series figures of one page: one point per completed :data:`BUCKET_S` bucket over
    the last :data:`SERIES_BUCKETS`, at x = seconds before the end of the last completed one.
    Each figure has its own source, replaced (as binary arrays) once per completed bucket if its
    lines changed: a figure whose window looks the same is not sent or redrawn. The x range is
    fixed and the y ranges are set here (see :func:`fit_end`), so the browser sends nothing back."""

    def __init__(self) -> None:
        self.x_range = Range1d(-SERIES_BUCKETS * BUCKET_S, 0)
        self.charts: list[Chart] = []
        self.last: int | None = None  # the last bucket sent

    def add(self, title: str, y_label: str, columns: Columns, *, markers: bool = False, y_end: float | None = None) -> Chart:
        """A figure whose lines ``columns`` gives; its y axis from 0 to ``y_end``, or fitted to the lines."""
        fig = figure(
            title=title,
            height=230,
            sizing_mode="stretch_width",
            tools="pan,wheel_zoom,box_zoom,reset",
            x_range=self.x_range,
            y_range=Range1d(0, y_end or 1.0),
        )
        fig.xaxis.axis_label = "seconds before now"
        fig.yaxis.axis_label = y_label
        chart = Chart(fig, columns, markers, fixed_y=y_end is not None)
        self.charts.append(chart)
        return chart

    def advance(self, metrics: ServiceMetrics, now: float) -> None:
        """Send the buckets completed by ``now``, if one completed since the last update."""
        last = last_completed(now)
        if last == self.last:
            return
        first = last - SERIES_BUCKETS + 1
        x = (np.arange(first, last + 1) - last) * BUCKET_S
        for chart in self.charts:
            lines = {label: np.asarray(column, dtype=float) for label, column in chart.columns(metrics, first, last).items()}
            for label in lines:
                if label not in chart.labels:
                    chart.add_line(label)
            chart.labels = list(lines)
            if not chart.fixed_y:
                fit_end(chart.figure.y_range, np.concatenate(list(lines.values())) if lines else [])
            push(
                chart.source, {"x": x, **{LINE + label: values for label, values in lines.items()}}
            )  # a chart that looks the same is not sent
        self.last = last


class PlanView(DashboardComponent):
    """Each model's pipelines as a flow of pools, first partition to last, and the same as a table."""

    @log_errors
    def __init__(self, read: Reader) -> None:
        self.read = read
        self.source = ColumnDataSource(
            {
                k: []
                for k in (
                    "model",
                    "pipeline",
                    "partition",
                    "gpu",
                    "slices",
                    "vgpus",
                    "blocks",
                    "batch",
                    "throughput",
                    "table",
                    "x",
                    "y",
                    "label",
                )
            }
        )
        self.flow = ColumnDataSource({"x0": [], "x1": [], "y": []})
        self.figure = figure(
            title="Plan: pools of each pipeline, first partition to last",
            height=210,
            sizing_mode="stretch_width",
            y_range=FactorRange(),
            tools="",
            x_axis_label="partition",
        )
        self.figure.segment("x0", "y", "x1", "y", source=self.flow, line_width=3, color="#888888")
        self.figure.rect("x", "y", width=0.8, height=0.8, source=self.source, fill_color="#9ecae1", line_color="#3182bd")
        self.figure.text("x", "y", text="label", source=self.source, text_align="center", text_baseline="middle", text_font_size="9pt")
        self.figure.add_tools(
            HoverTool(
                tooltips=[
                    ("pool", "@gpu 1/@slices x @vgpus slices"),
                    ("blocks", "@blocks"),
                    ("batch", "@batch"),
                    ("planned req/s", "@throughput{0.0}"),
                    ("latency table", "@table"),
                ]
            )
        )
        self.figure.xaxis.ticker = list(range(8))
        columns = [
            ("model", "model"),
            ("pipeline", "pipeline"),
            ("partition", "partition"),
            ("gpu", "GPU"),
            ("slices", "slices/GPU"),
            ("vgpus", "slices in pool"),
            ("blocks", "blocks"),
            ("batch", "batch"),
            ("throughput", "planned req/s"),
            ("table", "latency table"),
        ]
        formats = {"throughput": NumberFormatter(format="0.0")}
        self.table = DataTable(
            source=self.source,
            columns=[TableColumn(field=f, title=t, **({"formatter": formats[f]} if f in formats else {})) for f, t in columns],
            height=240,
            sizing_mode="stretch_width",
            index_position=None,
        )
        self.quality = Div(text="")
        self.root = column(self.quality, self.figure, self.table, sizing_mode="stretch_width")

    @without_property_validation
    @log_errors
    def update(self) -> None:
        metrics, _ = self.read()
        qualities = sorted({model.plan_quality for model in metrics.models.values() if model.plan_quality} if metrics else ())
        text = "; ".join(f"plan {q}" for q in qualities)
        if self.quality.text != text:
            self.quality.text = text
        rows: dict[str, list] = {k: [] for k in self.source.data}
        flow: dict[str, list] = {"x0": [], "x1": [], "y": []}
        factors = []
        for name, model in metrics.models.items() if metrics else ():
            if model.plan is None:
                continue
            for p, pipeline in enumerate(model.plan.pipelines):
                y = f"{name} p{p}: b={pipeline.batch_size}, {pipeline.throughput:.0f} req/s"
                factors.append(y)
                for q, part in enumerate(pipeline.partitions):
                    for key, value in (
                        ("model", name),
                        ("pipeline", p),
                        ("partition", q),
                        ("gpu", part.gpu),
                        ("slices", part.slices),
                        ("vgpus", part.vgpus),
                        ("blocks", f"{part.blocks[0]}-{part.blocks[1]}"),
                        ("batch", pipeline.batch_size),
                        ("throughput", pipeline.throughput),
                        ("table", part.table or "not recorded"),
                        ("x", q),
                        ("y", y),
                        ("label", f"{part.gpu} 1/{part.slices} x{part.vgpus} [{part.blocks[0]},{part.blocks[1]})"),
                    ):
                        rows[key].append(value)
                if len(pipeline.partitions) > 1:
                    flow["x0"].append(0)
                    flow["x1"].append(len(pipeline.partitions) - 1)
                    flow["y"].append(y)
        if set_factors(self.figure.y_range, factors):
            self.figure.height = 120 + 90 * len(factors)
        push(self.flow, flow)
        push(self.source, rows)


CONTROL_COLUMNS = (
    ("model", "control path (ms)"),
    ("margin_ms", "margin"),
    ("send_p99_ms", "send p99"),
    ("dispatch_p50_ms", "dispatch p50"),
    ("dispatch_p99_ms", "dispatch p99"),
    ("hop_p50_ms", "hop p50"),
    ("hop_p99_ms", "hop p99"),
    ("done_p50_ms", "done p50"),
    ("done_p99_ms", "done p99"),
    ("done_worker_p50_ms", "done p50: worker"),
    ("done_wire_p50_ms", "done p50: wire"),
    ("total_p99_ms", "batch total p99"),
)
"""The control-path table of the SLO page: ``ControlPath.summary`` keys and their titles."""
SUSPECT_COLUMNS = (
    ("model", "suspect slot's model"),
    ("slot", "slot"),
    ("since_s", "suspect for (s)"),
    ("probes", "probes"),
    ("last_ratio", "last probe / profile"),
    ("detail", "why"),
)
"""The suspect-slot table of the SLO page (``daskpipe.runtime.scheduler.gray``)."""


class SLOView(DashboardComponent):
    """Per model over time: offered rate and goodput, SLO attainment, drops by reason, latency
    percentiles; the latency breakdown of recent requests; the recent drops."""

    @log_errors
    def __init__(self, read: Reader) -> None:
        self.read = read
        self.series = TimeSeriesCharts()
        self.rates = self.series.add("Offered rate and goodput (on-time completions)", "requests/s", _rates)
        self.attainment = self.series.add("SLO attainment (on time / ended)", "fraction", _attainment, markers=True, y_end=1.05)
        self.drops = self.series.add("Drops by reason", "requests/s", _drop_rates)
        self.latency = self.series.add("Latency percentiles against the SLO (dashed)", "ms", _latency_lines, markers=True)
        self.breakdown_source = ColumnDataSource({"model": [], **{phase: [] for phase in PHASES}})
        self.breakdown = figure(
            title=f"Where a request's time goes: mean ms per request completed in the last {BREAKDOWN_BUCKETS * BUCKET_S:g} s",
            height=230,
            sizing_mode="stretch_width",
            y_range=FactorRange(),
            x_range=Range1d(0, 1),
            tools="",
            x_axis_label="ms",
        )
        self.breakdown.hbar_stack(
            list(PHASES), y="model", height=0.6, color=list(PHASE_COLORS), source=self.breakdown_source, legend_label=list(PHASES)
        )
        self.breakdown.legend.location = "bottom_right"
        self.breakdown.legend.orientation = "horizontal"
        self.drop_source = ColumnDataSource({"time": [], "model": [], "reason": [], "requests": [], "detail": []})
        self.drop_table = DataTable(
            source=self.drop_source,
            height=230,
            sizing_mode="stretch_width",
            index_position=None,
            columns=[
                TableColumn(field="time", title="time (UTC)", width=100),
                TableColumn(field="model", title="model", width=90),
                TableColumn(field="reason", title="reason", width=90),
                TableColumn(field="requests", title="requests", width=60),
                TableColumn(field="detail", title="detail", width=400),
            ],
        )
        self.newest_drop: tuple[DropEvent, int] | None = None  # the newest drop event the table shows, and its count then
        self.control_source = ColumnDataSource({field: [] for field, _ in CONTROL_COLUMNS})
        self.control_table = DataTable(
            source=self.control_source,
            height=120,
            sizing_mode="stretch_width",
            index_position=None,
            columns=[
                TableColumn(field=f, title=t, **({} if f == "model" else {"formatter": NumberFormatter(format="0.00")}))
                for f, t in CONTROL_COLUMNS
            ],
        )
        self.suspect_source = ColumnDataSource({field: [] for field, _ in SUSPECT_COLUMNS})
        self.suspect_table = DataTable(
            source=self.suspect_source,
            height=100,
            sizing_mode="stretch_width",
            index_position=None,
            columns=[TableColumn(field=f, title=t, **({"width": 400} if f == "detail" else {})) for f, t in SUSPECT_COLUMNS],
        )
        self.root = column(
            row(self.rates.figure, self.attainment.figure, sizing_mode="stretch_width"),
            row(self.drops.figure, self.latency.figure, sizing_mode="stretch_width"),
            row(self.breakdown, column(self.drop_table, sizing_mode="stretch_width"), sizing_mode="stretch_width"),
            self.control_table,
            self.suspect_table,
            sizing_mode="stretch_width",
        )

    @without_property_validation
    @log_errors
    def update(self) -> None:
        metrics, now = self.read()
        if metrics is None:
            return
        self.series.advance(metrics, now)
        self._update_breakdown(metrics, now)
        self._update_drops(metrics)
        self._update_control(metrics)

    def _update_control(self, metrics: ServiceMetrics) -> None:
        """The runtime's measured control path and the margin it plans deadlines with (ms)."""
        summaries = [(name, m.control()) for name, m in metrics.models.items() if m.control is not None]
        push(
            self.control_source,
            {
                field: [
                    name if field == "model" else (round(summary[field], 3) if field in summary else None) for name, summary in summaries
                ]
                for field, _ in CONTROL_COLUMNS
            },
        )
        rows = [
            {"model": name, "slot": slot, **summary}
            for name, m in metrics.models.items()
            if m.suspects is not None
            for slot, summary in m.suspects().items()
        ]
        push(self.suspect_source, {field: [r[field] for r in rows] for field, _ in SUSPECT_COLUMNS})

    def _update_breakdown(self, metrics: ServiceMetrics, now: float) -> None:
        last = last_completed(now)
        names = list(metrics.models)
        means = [metrics.models[name].phases.means(last - BREAKDOWN_BUCKETS + 1, last) for name in names]
        set_factors(self.breakdown.y_range, names)
        columns = {phase: [round(m.get(phase, 0.0) * 1e3, 2) for m in means] for phase in PHASES}
        push(self.breakdown_source, {"model": names, **columns})
        fit_end(self.breakdown.x_range, [sum(stack) for stack in zip(*columns.values())])

    def _update_drops(self, metrics: ServiceMetrics) -> None:
        """Newest first; replaced only when a drop happened since the last update."""
        newest = (metrics.drops[-1], metrics.drops[-1].count) if metrics.drops else None
        if newest == self.newest_drop:  # the same event with the same count (events compare by identity)
            return
        self.newest_drop = newest
        events = list(reversed(metrics.drops))
        push(
            self.drop_source,
            {
                "time": [clock_text(metrics, e.time) for e in events],
                "model": [e.model for e in events],
                "reason": [e.reason for e in events],
                "requests": [e.count for e in events],
                "detail": [e.detail for e in events],
            },
        )


def _rates(metrics: ServiceMetrics, first: int, last: int) -> dict[str, list[float]]:
    """Offered requests and on-time completions per second, per model."""
    return {
        f"{name} {kind}": [c / BUCKET_S for c in series.counts(first, last)]
        for name, model in metrics.models.items()
        for kind, series in (("offered", model.offered), ("goodput", model.on_time))
    }


def _attainment(metrics: ServiceMetrics, first: int, last: int) -> dict[str, list[float]]:
    """Per model, on-time completions over ended requests per bucket (NaN, a gap, where nothing ended)."""
    lines = {}
    for name, model in metrics.models.items():
        ended = np.array(model.completed.counts(first, last)) + np.array(model.failed.counts(first, last))
        for series in model.dropped.values():
            ended += series.counts(first, last)
        with np.errstate(invalid="ignore", divide="ignore"):
            lines[name] = (np.array(model.on_time.counts(first, last)) / ended).tolist()
    return lines


def _drop_rates(metrics: ServiceMetrics, first: int, last: int) -> dict[str, list[float]]:
    """Drops per second, per model and reason."""
    return {
        f"{name} {reason}": [c / BUCKET_S for c in series.counts(first, last)]
        for name, model in metrics.models.items()
        for reason, series in model.dropped.items()
    }


def _latency_lines(metrics: ServiceMetrics, first: int, last: int) -> dict[str, list[float]]:
    """Per model, latency percentiles per bucket in ms (NaN, a gap, where nothing completed), and the SLO."""
    lines = {}
    for name, model in metrics.models.items():
        for q, values in model.latencies.percentiles(first, last, PERCENTILES).items():
            lines[f"{name} p{q}"] = [v * 1e3 for v in values]
        lines[f"{name}{SLO_SUFFIX}"] = [model.slo_s * 1e3] * (last - first + 1)
    return lines


def _queues(metrics: ServiceMetrics, first: int, last: int) -> dict[str, list[float]]:
    """The longest queue of each second, per model."""
    return {f"{name} (longest in each second)": model.queue.values(first, last, 0) for name, model in metrics.models.items()}


class GPUView(DashboardComponent):
    """Per slot, planned reservations against actual busy intervals; utilisation per GPU type and NIC."""

    @log_errors
    def __init__(self, read: Reader) -> None:
        self.read = read
        self.timeline_source = ColumnDataSource({"y": [], "left": [], "right": [], "kind": [], "color": []})
        self.timeline = figure(
            title=f"Planned reservations vs actual busy intervals (last {TIMELINE_S:g} s)",
            height=360,
            sizing_mode="stretch_width",
            y_range=FactorRange(),
            x_range=Range1d(-TIMELINE_S * 1e3, 0),
            tools="xpan,xwheel_zoom,reset",
            x_axis_label="ms before now",
        )
        self.timeline.hbar(y="y", left="left", right="right", height=0.8, color="color", legend_field="kind", source=self.timeline_source)
        self.utilisation_source = ColumnDataSource({"gpu": [], "utilisation": []})
        self.utilisation = figure(
            title="Utilisation per GPU type (busy share of its slots)",
            height=260,
            sizing_mode="stretch_width",
            x_range=FactorRange(),
            y_range=(0, 1.05),
            tools="",
        )
        self.utilisation.vbar(x="gpu", top="utilisation", width=0.7, source=self.utilisation_source, color="#31a354")
        self.nic_source = ColumnDataSource({"link": [], "utilisation": []})
        self.nic = figure(
            title="NIC use per server (uplink / downlink busy share)",
            height=260,
            sizing_mode="stretch_width",
            x_range=FactorRange(),
            y_range=(0, 1.05),
            tools="",
        )
        self.nic.vbar(x="link", top="utilisation", width=0.7, source=self.nic_source, color="#756bb1")
        self.root = column(self.timeline, row(self.utilisation, self.nic, sizing_mode="stretch_width"), sizing_mode="stretch_width")

    @without_property_validation
    @log_errors
    def update(self) -> None:
        metrics, now = self.read()
        if metrics is None:
            return
        self._update_timeline(metrics, now)
        busy_s = metrics.busy_seconds(now - TIMELINE_S, now)
        by_gpu = metrics.utilisation_by_gpu(busy_s, TIMELINE_S)
        gpus = list(by_gpu)
        set_factors(self.utilisation.x_range, gpus)
        push(self.utilisation_source, {"gpu": gpus, "utilisation": [round(u, 3) for u in by_gpu.values()]})
        links = sorted(r for r in busy_s if r.endswith(("/ul", "/dl")))
        set_factors(self.nic.x_range, links)
        push(self.nic_source, {"link": links, "utilisation": [round(min(1.0, busy_s[link] / TIMELINE_S), 3) for link in links]})

    def _update_timeline(self, metrics: ServiceMetrics, now: float) -> None:
        """The reservations and busy intervals of the last :data:`TIMELINE_S` (the newest
        :data:`TIMELINE_BARS` of each), at x = ms before ``now``: one replaced source is one
        message and one redraw, and the fixed x range needs none."""
        bars: dict[str, list] = {"y": [], "left": [], "right": [], "kind": [], "color": []}
        since = now - TIMELINE_S

        def bar(resource: str, kind: str, begin: float, end: float, color: str) -> None:
            bars["y"].append((resource, kind))
            bars["left"].append(round((begin - now) * 1e3, 3))
            bars["right"].append(round((end - now) * 1e3, 3))
            bars["kind"].append(kind)
            bars["color"].append(color)

        planned = 0
        for model in metrics.models.values():
            for _, hops in reversed(model.dispatches):
                if planned >= TIMELINE_BARS or hops[-1].compute.end < since:
                    break
                for hop in hops:
                    bar(hop.slot, "planned", hop.compute.start, hop.compute.end, "#9ecae1")
                    planned += 1
        busy = 0
        for resource, begin, end in reversed(metrics.busy):
            if busy >= TIMELINE_BARS or end < since - 1.0:  # recorded about in the order they end
                break
            if resource in metrics.gpu_of and end >= since:
                bar(resource, "busy", begin, end, "#e6550d")
                busy += 1
        set_factors(self.timeline.y_range, [(slot, kind) for slot in sorted(metrics.gpu_of) for kind in ("planned", "busy")])
        push(self.timeline_source, bars)


class BatchView(DashboardComponent):
    """Batch-size histogram per pipeline, and queue length per model over time."""

    @log_errors
    def __init__(self, read: Reader) -> None:
        self.read = read
        self.histogram_source = ColumnDataSource({"x": [], "batches": [], "color": []})
        self.histogram = figure(
            title="Batch sizes per pipeline (requests per batch)",
            height=300,
            sizing_mode="stretch_width",
            x_range=FactorRange(),
            y_range=Range1d(0, 1),
            tools="",
        )
        self.histogram.vbar(x="x", top="batches", width=0.8, color="color", source=self.histogram_source)
        self.series = TimeSeriesCharts()
        self.queue = self.series.add("Queue length per model (requests waiting for a batch)", "requests", _queues)
        self.root = column(self.histogram, self.queue.figure, sizing_mode="stretch_width")

    @without_property_validation
    @log_errors
    def update(self) -> None:
        metrics, now = self.read()
        if metrics is None:
            return
        histogram: dict[str, list] = {"x": [], "batches": []}
        for name, model in metrics.models.items():
            for (pipeline, size), count in sorted(model.batch_sizes.items()):
                histogram["x"].append((f"{name} p{pipeline}", str(size)))
                histogram["batches"].append(count)
        histogram["color"] = _colors([pipeline for pipeline, _ in histogram["x"]])
        factors = list(histogram["x"])
        set_factors(self.histogram.x_range, factors)
        push(self.histogram_source, histogram)
        fit_end(self.histogram.y_range, histogram["batches"])
        self.series.advance(metrics, now)


VIEWS: dict[str, tuple[str, type[DashboardComponent]]] = {
    "plan": ("Plan", PlanView),
    "slos": ("SLOs", SLOView),
    "gpus": ("GPUs", GPUView),
    "batches": ("Batches and queues", BatchView),
}
"""Page slug -> (title, view): the one table both the live pages and the report are made from."""


def build_roots(read: Reader) -> list[tuple[str, LayoutDOM]]:
    """Every view, updated once: (title, root layout)."""
    roots = []
    for title, view_class in VIEWS.values():
        view = view_class(read)
        view.update()
        roots.append((title, view.root))
    return roots
