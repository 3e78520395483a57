"""The dashboard's views, one class per page, each reading a :class:`ServiceMetrics`.

Every view builds its ``ColumnDataSource``\\ s and figures once and refreshes them in ``update()``,
which reads the recorder into columns and pushes them with distributed's ``update`` (it skips
pushes that change nothing). A view gets its data from a ``Reader``: a function returning the
recorder and the ``now`` to draw against, so the same view draws the live service (the scheduler
plugin's recorder and the monotonic clock) or a finished simulated run (its recorder and end time).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import cycle

import numpy as np
from bokeh.core.properties import without_property_validation
from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, DataTable, FactorRange, HoverTool, LayoutDOM, NumberFormatter, TableColumn
from bokeh.palettes import Category10_10
from bokeh.plotting import figure
from distributed.dashboard.components import DashboardComponent
from distributed.dashboard.utils import update
from distributed.utils import log_errors

from daskpipe.dashboard.metrics import BUCKET_S, ModelMetrics, ServiceMetrics

Reader = Callable[[], tuple["ServiceMetrics | None", float]]
"""Returns the recorder to draw (``None`` while there is none) and the time to draw up to."""

SERIES_BUCKETS = 120
"""Buckets the time series show: the last two minutes."""
TIMELINE_S = 5.0
"""Seconds of reservations and busy intervals the GPU timeline shows."""
TIMELINE_BARS = 400
"""At most this many planned and this many busy bars, the newest: under heavy load the timeline
shows less than :data:`TIMELINE_S` rather than thousands of bars per refresh."""
PERCENTILES = (50, 99)


def _colors(labels: list[str]) -> list[str]:
    """A stable colour per distinct label, in order of first appearance."""
    palette = cycle(Category10_10)
    assigned: dict[str, str] = {}
    for label in labels:
        if label not in assigned:
            assigned[label] = next(palette)
    return [assigned[label] for label in labels]


class LineSet:
    """Several labelled lines in one figure, held in one ``multi_line`` source, with a marker on
    each point (so a series with a single point, or with gaps, still shows)."""

    def __init__(self, fig: figure, dashed: bool = False, markers: bool = True) -> None:
        self.label = "reference" if dashed else "label"  # Bokeh groups legend items by field name
        self.source = ColumnDataSource({"xs": [], "ys": [], self.label: [], "color": []})
        self.points = ColumnDataSource({"x": [], "y": [], "color": []}) if markers else None
        fig.multi_line("xs", "ys", color="color", legend_field=self.label, line_width=2, line_dash="dashed" if dashed else "solid", source=self.source)
        if self.points is not None:
            fig.scatter("x", "y", color="color", size=4, source=self.points)
        fig.legend.location = "top_left"

    def push(self, lines: list[tuple[str, list[float], list[float]]]) -> None:
        labels = [label for label, _, _ in lines]
        colors = _colors(labels)
        update(self.source, {"xs": [xs for _, xs, _ in lines], "ys": [ys for _, _, ys in lines], self.label: labels, "color": colors})
        if self.points is not None:
            points: dict[str, list] = {"x": [], "y": [], "color": []}
            for (_, xs, ys), color in zip(lines, colors):
                for x, y in zip(xs, ys):
                    if y == y:  # not NaN: a bucket with data
                        points["x"].append(x)
                        points["y"].append(y)
                        points["color"].append(color)
            update(self.points, points)


def _time_figure(title: str, y_label: str, **kwargs) -> figure:
    fig = figure(title=title, height=230, sizing_mode="stretch_width", tools="pan,wheel_zoom,box_zoom,reset", x_range=(-SERIES_BUCKETS * BUCKET_S, 0), **kwargs)
    fig.xaxis.axis_label = "seconds before now"
    fig.yaxis.axis_label = y_label
    return fig


def _buckets(now: float) -> tuple[int, int, list[float]]:
    """The bucket range the series show and each bucket's end, in seconds relative to ``now``."""
    last = int(now // BUCKET_S)
    first = last - SERIES_BUCKETS + 1
    return first, last, [(index + 1) * BUCKET_S - now for index in range(first, last + 1)]


class PlanView(DashboardComponent):
    """Each model's pipelines as a flow of pools, first partition to last, and the same as a table."""

    @log_errors
    def __init__(self, read: Reader) -> None:
        self.read = read
        self.source = ColumnDataSource({k: [] for k in ("model", "pipeline", "partition", "gpu", "slices", "vgpus", "blocks", "batch", "throughput", "x", "y", "label")})
        self.flow = ColumnDataSource({"x0": [], "x1": [], "y": []})
        self.figure = figure(
            title="Plan: pools of each pipeline, first partition to last", height=210, sizing_mode="stretch_width",
            y_range=FactorRange(), tools="", x_axis_label="partition",
        )
        self.figure.segment("x0", "y", "x1", "y", source=self.flow, line_width=3, color="#888888")
        self.figure.rect("x", "y", width=0.8, height=0.8, source=self.source, fill_color="#9ecae1", line_color="#3182bd")
        self.figure.text("x", "y", text="label", source=self.source, text_align="center", text_baseline="middle", text_font_size="9pt")
        self.figure.add_tools(HoverTool(tooltips=[("pool", "@gpu 1/@slices x @vgpus slices"), ("blocks", "@blocks"), ("batch", "@batch"), ("planned req/s", "@throughput{0.0}")]))
        self.figure.xaxis.ticker = list(range(8))
        columns = [("model", "model"), ("pipeline", "pipeline"), ("partition", "partition"), ("gpu", "GPU"), ("slices", "slices/GPU"), ("vgpus", "slices in pool"), ("blocks", "blocks"), ("batch", "batch"), ("throughput", "planned req/s")]
        formats = {"throughput": NumberFormatter(format="0.0")}
        self.table = DataTable(source=self.source, columns=[TableColumn(field=f, title=t, **({"formatter": formats[f]} if f in formats else {})) for f, t in columns], height=240, sizing_mode="stretch_width", index_position=None)
        self.root = column(self.figure, self.table, sizing_mode="stretch_width")

    @without_property_validation
    @log_errors
    def update(self) -> None:
        metrics, _ = self.read()
        rows: dict[str, list] = {k: [] for k in self.source.data}
        flow: dict[str, list] = {"x0": [], "x1": [], "y": []}
        factors = []
        for name, model in (metrics.models.items() if metrics else ()):
            if model.plan is None:
                continue
            for p, pipeline in enumerate(model.plan.pipelines):
                y = f"{name} p{p}: b={pipeline.batch_size}, {pipeline.throughput:.0f} req/s"
                factors.append(y)
                for q, part in enumerate(pipeline.partitions):
                    for key, value in (
                        ("model", name), ("pipeline", p), ("partition", q), ("gpu", part.gpu), ("slices", part.slices), ("vgpus", part.vgpus),
                        ("blocks", f"{part.blocks[0]}-{part.blocks[1]}"), ("batch", pipeline.batch_size), ("throughput", pipeline.throughput), ("x", q), ("y", y),
                        ("label", f"{part.gpu} 1/{part.slices} x{part.vgpus} [{part.blocks[0]},{part.blocks[1]})"),
                    ):
                        rows[key].append(value)
                if len(pipeline.partitions) > 1:
                    flow["x0"].append(0)
                    flow["x1"].append(len(pipeline.partitions) - 1)
                    flow["y"].append(y)
        if list(self.figure.y_range.factors) != factors:
            self.figure.y_range.factors = factors
            self.figure.height = 120 + 90 * len(factors)
        update(self.flow, flow)
        update(self.source, rows)


class SLOView(DashboardComponent):
    """Per model over time: offered rate and goodput, SLO attainment, drops by reason, latency percentiles."""

    @log_errors
    def __init__(self, read: Reader) -> None:
        self.read = read
        self.rates_figure = _time_figure("Offered rate and goodput (on-time completions)", "requests/s")
        self.attainment_figure = _time_figure("SLO attainment (on time / ended)", "fraction", y_range=(0, 1.05))
        self.drops_figure = _time_figure("Drops by reason", "requests/s")
        self.latency_figure = _time_figure("Latency percentiles against the SLO (dashed)", "ms")
        self.rates = LineSet(self.rates_figure)
        self.attainment = LineSet(self.attainment_figure)
        self.drops = LineSet(self.drops_figure)
        self.latency = LineSet(self.latency_figure)
        self.slo = LineSet(self.latency_figure, dashed=True, markers=False)
        self.root = column(row(self.rates_figure, self.attainment_figure, sizing_mode="stretch_width"), row(self.drops_figure, self.latency_figure, sizing_mode="stretch_width"), sizing_mode="stretch_width")

    @without_property_validation
    @log_errors
    def update(self) -> None:
        metrics, now = self.read()
        first, last, xs = _buckets(now)
        rates, attainment, drops, latency, slo = [], [], [], [], []
        for name, model in (metrics.models.items() if metrics else ()):
            offered = model.offered.counts(first, last)
            on_time = model.on_time.counts(first, last)
            rates += [(f"{name} offered", xs, [c / BUCKET_S for c in offered]), (f"{name} goodput", xs, [c / BUCKET_S for c in on_time])]
            ended = np.array(model.completed.counts(first, last)) + np.array(model.failed.counts(first, last))
            for reason, series in model.dropped.items():
                counts = series.counts(first, last)
                ended += counts
                drops.append((f"{name} {reason}", xs, [c / BUCKET_S for c in counts]))
            with np.errstate(invalid="ignore", divide="ignore"):
                attainment.append((name, xs, (np.array(on_time) / ended).tolist()))
            latency += self._percentiles(name, model, first, xs)
            slo.append((f"{name} SLO", [xs[0], xs[-1]], [model.slo_s * 1e3] * 2))
        self.rates.push(rates)
        self.attainment.push(attainment)
        self.drops.push(drops)
        self.latency.push(latency)
        self.slo.push(slo)

    @staticmethod
    def _percentiles(name: str, model: ModelMetrics, first: int, xs: list[float]) -> list[tuple[str, list[float], list[float]]]:
        """Latency percentiles per bucket, in ms (NaN, drawn as a gap, where nothing completed)."""
        by_q = model.latencies.percentiles(first, first + len(xs) - 1, PERCENTILES)
        return [(f"{name} p{q}", xs, [v * 1e3 for v in values]) for q, values in by_q.items()]


class GPUView(DashboardComponent):
    """Per slot, planned reservations against actual busy intervals; utilisation per GPU type and NIC."""

    @log_errors
    def __init__(self, read: Reader) -> None:
        self.read = read
        self.timeline_source = ColumnDataSource({"y": [], "left": [], "right": [], "kind": [], "color": []})
        self.timeline = figure(
            title=f"Planned reservations vs actual busy intervals (last {TIMELINE_S:g} s)", height=360, sizing_mode="stretch_width",
            y_range=FactorRange(), tools="xpan,xwheel_zoom,reset", x_axis_label="seconds before now",
        )
        self.timeline.hbar(y="y", left="left", right="right", height=0.8, color="color", legend_field="kind", source=self.timeline_source)
        self.utilisation_source = ColumnDataSource({"gpu": [], "utilisation": []})
        self.utilisation = figure(title="Utilisation per GPU type (busy share of its slots)", height=260, sizing_mode="stretch_width", x_range=FactorRange(), y_range=(0, 1.05), tools="")
        self.utilisation.vbar(x="gpu", top="utilisation", width=0.7, source=self.utilisation_source, color="#31a354")
        self.nic_source = ColumnDataSource({"link": [], "utilisation": []})
        self.nic = figure(title="NIC use per server (uplink / downlink busy share)", height=260, sizing_mode="stretch_width", x_range=FactorRange(), y_range=(0, 1.05), tools="")
        self.nic.vbar(x="link", top="utilisation", width=0.7, source=self.nic_source, color="#756bb1")
        self.root = column(self.timeline, row(self.utilisation, self.nic, sizing_mode="stretch_width"), sizing_mode="stretch_width")

    @without_property_validation
    @log_errors
    def update(self) -> None:
        metrics, now = self.read()
        start = now - TIMELINE_S
        bars: dict[str, list] = {"y": [], "left": [], "right": [], "kind": [], "color": []}

        def bar(resource: str, kind: str, begin: float, end: float, color: str) -> None:
            bars["y"].append((resource, kind))
            bars["left"].append(max(begin, start) - now)
            bars["right"].append(min(end, now) - now)
            bars["kind"].append(kind)
            bars["color"].append(color)

        resources: set[str] = set()
        planned = 0
        for model in (metrics.models.values() if metrics else ()):
            for _, dispatch in reversed(model.dispatches):
                if dispatch.hops[0].compute.start < start - TIMELINE_S or planned >= TIMELINE_BARS:  # older ones cannot reach the window, or enough bars
                    break
                for hop in dispatch.hops:
                    if hop.compute.end > start and hop.compute.start < now:
                        bar(hop.slot, "planned", hop.compute.start, hop.compute.end, "#9ecae1")
                        resources.add(hop.slot)
                        planned += 1
        busy = 0
        for resource, begin, end in (metrics.recent_busy(start) if metrics else ()):
            if busy >= TIMELINE_BARS:
                break
            if end > start and begin < now and resource in metrics.gpu_of:
                bar(resource, "busy", begin, end, "#e6550d")
                resources.add(resource)
                busy += 1
        factors = [(r, kind) for r in sorted(resources) for kind in ("planned", "busy")]
        if list(self.timeline.y_range.factors) != factors:
            self.timeline.y_range.factors = factors
        update(self.timeline_source, bars)
        busy_s = metrics.busy_seconds(start, now) if metrics else {}
        by_gpu = metrics.utilisation_by_gpu(busy_s, TIMELINE_S) if metrics else {}
        gpus = list(by_gpu)
        if list(self.utilisation.x_range.factors) != gpus:
            self.utilisation.x_range.factors = gpus
        update(self.utilisation_source, {"gpu": gpus, "utilisation": list(by_gpu.values())})
        links = sorted(r for r in busy_s if r.endswith(("/ul", "/dl")))
        if list(self.nic.x_range.factors) != links:
            self.nic.x_range.factors = links
        update(self.nic_source, {"link": links, "utilisation": [min(1.0, busy_s[link] / TIMELINE_S) for link in links]})


class BatchView(DashboardComponent):
    """Batch-size histogram per pipeline, and queue length per model over time."""

    @log_errors
    def __init__(self, read: Reader) -> None:
        self.read = read
        self.histogram_source = ColumnDataSource({"x": [], "batches": [], "color": []})
        self.histogram = figure(title="Batch sizes per pipeline (requests per batch)", height=300, sizing_mode="stretch_width", x_range=FactorRange(), tools="")
        self.histogram.vbar(x="x", top="batches", width=0.8, color="color", source=self.histogram_source)
        self.histogram.add_tools(HoverTool(tooltips=[("pipeline, batch", "@x"), ("batches", "@batches")]))
        self.queue_figure = _time_figure("Queue length per model (requests waiting for a batch)", "requests")
        self.queue = LineSet(self.queue_figure)
        self.root = column(self.histogram, self.queue_figure, sizing_mode="stretch_width")

    @without_property_validation
    @log_errors
    def update(self) -> None:
        metrics, now = self.read()
        histogram: dict[str, list] = {"x": [], "batches": []}
        queues = []
        first, last, xs = _buckets(now)
        for name, model in (metrics.models.items() if metrics else ()):
            for (pipeline, size), count in sorted(model.batch_sizes.items()):
                histogram["x"].append((f"{name} p{pipeline}", str(size)))
                histogram["batches"].append(count)
            queues.append((f"{name} (longest in each second)", xs, model.queue.values(first, last, 0)))
        histogram["color"] = _colors([pipeline for pipeline, _ in histogram["x"]])
        factors = list(histogram["x"])
        if list(self.histogram.x_range.factors) != factors:
            self.histogram.x_range.factors = factors
        update(self.histogram_source, histogram)
        self.queue.push(queues)


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
