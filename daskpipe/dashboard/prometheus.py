"""daskpipe's Prometheus metrics, on the scheduler's ``/metrics`` and on ``/daskpipe/metrics``.

Registered the way distributed registers its own collectors (``PrometheusHandler``): one collector
instance in ``prometheus_client.REGISTRY`` for the process, pointed at the newest scheduler (tests
start several in sequence). Latencies are *histograms* (they aggregate across schedulers and give
a server-side p99); queue depth is read live from the plugin, not after completions.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import prometheus_client
from distributed.http.prometheus import PrometheusCollector
from distributed.http.utils import RequestHandler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from daskpipe.runtime.scheduler.control import KINDS as CONTROL_DELAYS
from daskpipe.sched.metrics import LATENCY_BOUNDS_S, PHASES

UTILISATION_WINDOW_S = 10.0
"""Utilisation gauges are the busy share over this many recent seconds."""


def _cumulative(counts: list[int]) -> list[tuple[str, int]]:
    """Per-bucket counts over :data:`LATENCY_BOUNDS_S` as Prometheus' cumulative ``(le, count)``."""
    cumulative, buckets = 0, []
    for bound, count in zip((*map(str, LATENCY_BOUNDS_S), "+Inf"), counts):
        cumulative += int(count)
        buckets.append((bound, cumulative))
    return buckets


class DaskpipeCollector(PrometheusCollector):
    """Per model: requests by outcome, drops by reason, SLO attainment, queue depth, histograms of
    latency, of its phases and of batch sizes; per GPU type and NIC direction: recent utilisation."""

    def __init__(self, server: Any) -> None:
        super().__init__(server)
        self.subsystem = "daskpipe"

    def collect(self) -> Iterator[Metric]:
        plugin = self.server.plugins.get("daskpipe") if self.server is not None else None
        metrics = getattr(plugin, "metrics", None)
        if metrics is None:
            return
        name = self.build_name
        outcomes = CounterMetricFamily(
            name("requests"),
            "Requests by outcome: submitted = completed + failed + invalid + dropped (by reason, in requests_dropped) + not ended yet; "
            "on_time = goodput",
            labels=["model", "outcome"],
        )
        dropped = CounterMetricFamily(name("requests_dropped"), "Requests dropped, by reason", labels=["model", "reason"])
        attainment = GaugeMetricFamily(name("slo_attainment"), "Share of ended requests that finished within the SLO", labels=["model"])
        latency = HistogramMetricFamily(name("request_latency_seconds"), "End-to-end latency of completed requests", labels=["model"])
        phases = HistogramMetricFamily(
            name("request_phase_seconds"),
            "Completed requests' latency by phase: queue (waiting for a batch), compute, transfer (NICs), other (messages, waits between "
            "stages)",
            labels=["model", "phase"],
        )
        batches = CounterMetricFamily(
            name("batches"), "Batches dispatched, by pipeline and requests in the batch", labels=["model", "pipeline", "batch_size"]
        )
        for model, recorded in metrics.models.items():
            totals = {
                "submitted": recorded.offered.total,
                "completed": recorded.completed.total,
                "on_time": recorded.on_time.total,
                "failed": recorded.failed.total,
                "invalid": recorded.invalid.total,
            }
            for outcome, total in totals.items():
                outcomes.add_metric([model, outcome], total)
            drops = 0
            for reason, series in recorded.dropped.items():
                dropped.add_metric([model, reason], series.total)
                drops += series.total
            ended = totals["completed"] + totals["failed"] + drops
            attainment.add_metric([model], totals["on_time"] / ended if ended else 1.0)
            latency.add_metric([model], _cumulative(recorded.latency_buckets), recorded.latency_sum)
            for phase in PHASES:
                phases.add_metric([model, phase], _cumulative(recorded.phase_buckets[phase]), recorded.phase_sums[phase])
            for (pipeline, size), count in sorted(recorded.batch_sizes.items()):
                batches.add_metric([model, str(pipeline), str(size)], count)
        queue = GaugeMetricFamily(name("queue_depth"), "Requests waiting for a batch, now", labels=["model"])
        in_flight = GaugeMetricFamily(name("in_flight"), "Requests in dispatched batches, now", labels=["model"])
        margin = GaugeMetricFamily(
            name("control_margin_seconds"),
            "How much earlier than its SLO each request's deadline is planned: the measured control path (docs/runtime.md)",
            labels=["model"],
        )
        control = GaugeMetricFamily(
            name("control_delay_seconds"),
            "Measured control-path delays: send (a request's submit to the scheduler, beyond its client's fastest), and of recent batches "
            "dispatch (to the first stage's start), hop (between stages), done (last stage to the scheduler), total",
            labels=["model", "kind", "quantile"],
        )
        late = GaugeMetricFamily(
            name("late_leg_seconds"),
            "Over the batches whose requests ended after their deadline: how far each leg ran past its plan, mean and max "
            "(docs/runtime.md)",
            labels=["model", "leg", "stat"],
        )
        suspects = GaugeMetricFamily(
            name("suspect_slots"),
            "Slots that get no batches because they stalled or slowed down, until a probe computes in line (docs/operations.md)",
            labels=["model", "slot"],
        )
        for model, status in plugin.models.status().items():
            for slot in status["suspects"]:
                suspects.add_metric([model, slot], 1.0)
            queue.add_metric([model], status["queued"])
            in_flight.add_metric([model], status["in_flight"])
            summary = status["control"]
            margin.add_metric([model], summary["margin_ms"] * 1e-3)
            for kind in (*CONTROL_DELAYS, "total"):
                for q in ("p50", "p99"):
                    if f"{kind}_{q}_ms" in summary:
                        control.add_metric([model, kind, "0.5" if q == "p50" else "0.99"], summary[f"{kind}_{q}_ms"] * 1e-3)
            for stat in ("mean", "max"):
                for leg, ms in status["late"][f"{stat}_ms"].items():
                    late.add_metric([model, leg, stat], ms * 1e-3)
        now = time.monotonic()
        busy = metrics.busy_seconds(now - UTILISATION_WINDOW_S, now)
        gpus = GaugeMetricFamily(
            name("gpu_utilization"), f"Busy share of each GPU type's slots over the last {UTILISATION_WINDOW_S:g} s", labels=["gpu"]
        )
        for gpu, share in metrics.utilisation_by_gpu(busy, UTILISATION_WINDOW_S).items():
            gpus.add_metric([gpu], share)
        slots = GaugeMetricFamily(
            name("slot_utilization"), f"Busy share of each slot over the last {UTILISATION_WINDOW_S:g} s", labels=["slot", "gpu"]
        )
        for slot, gpu in metrics.gpu_of.items():
            slots.add_metric([slot, gpu], min(1.0, busy.get(slot, 0.0) / UTILISATION_WINDOW_S))
        nics = GaugeMetricFamily(
            name("nic_utilization"),
            f"Busy share of each server's NIC direction over the last {UTILISATION_WINDOW_S:g} s",
            labels=["server", "direction"],
        )
        for resource, seconds in busy.items():
            server, _, direction = resource.rpartition("/")
            if direction in ("ul", "dl"):
                nics.add_metric([server, direction], min(1.0, seconds / UTILISATION_WINDOW_S))
        yield from (
            outcomes,
            dropped,
            attainment,
            latency,
            phases,
            batches,
            queue,
            in_flight,
            margin,
            control,
            late,
            suspects,
            gpus,
            slots,
            nics,
        )


_COLLECTOR: DaskpipeCollector | None = None
_OWN_REGISTRY = prometheus_client.CollectorRegistry(auto_describe=False)
"""Only daskpipe's collector: what ``/daskpipe/metrics`` serves."""


def register_collector(scheduler: Any) -> DaskpipeCollector:
    """Register the process's collector once (in the global registry, which ``/metrics`` serves),
    and point it at ``scheduler``."""
    global _COLLECTOR
    if _COLLECTOR is None:
        _COLLECTOR = DaskpipeCollector(scheduler)
        prometheus_client.REGISTRY.register(_COLLECTOR)
        _OWN_REGISTRY.register(_COLLECTOR)
    _COLLECTOR.server = scheduler
    return _COLLECTOR


class DaskpipeMetricsHandler(RequestHandler):
    """``/daskpipe/metrics``: daskpipe's metrics alone, in Prometheus' text format."""

    def get(self) -> None:
        self.write(prometheus_client.generate_latest(_OWN_REGISTRY))
        self.set_header("Content-Type", prometheus_client.CONTENT_TYPE_LATEST)


def route(scheduler: Any, prefix: str = "") -> tuple[str, type, dict]:
    """The tornado route of ``/daskpipe/metrics`` under the dashboard's ``prefix``."""
    return (f"{prefix.rstrip('/')}/daskpipe/metrics", DaskpipeMetricsHandler, {"dask_server": scheduler})
