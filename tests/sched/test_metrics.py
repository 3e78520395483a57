"""The recorder on hand-made events: series, percentiles, busy intervals, a replayed trace, a report."""

from __future__ import annotations

import math

import dask.config
import numpy as np
import pytest

from daskpipe.dashboard.components import SERIES_BUCKETS, GPUView, SLOView
from daskpipe.dashboard.report import record_trace, save_report
from daskpipe.plan.schema import ModelPlan, Partition, Pipeline
from daskpipe.sched.api import Dispatch, Feedback, Hop, Placement, Request, Reservation, Slot
from daskpipe.sched.metrics import BUCKET_S, LATENCY_BOUNDS_S, LatencySeries, RateSeries, ServiceMetrics
from daskpipe.sim.engine import RequestRecord, Trace

PLAN = ModelPlan(
    name="m",
    slo_us=100_000.0,
    weight=1.0,
    throughput=100.0,
    pipelines=(
        Pipeline(
            batch_size=2,
            throughput=100.0,
            partitions=(
                Partition(blocks=(0, 1), gpu="L4", slices=1, vgpus=1, latency_us=10_000.0),
                Partition(blocks=(1, 2), gpu="T4", slices=2, vgpus=1, latency_us=20_000.0),
            ),
        ),
    ),
)
PLACEMENT = Placement(
    model="m", pools={(0, 0): ("a",), (0, 1): ("b",)}, slots={"a": Slot("a", "L4", 1, "s0"), "b": Slot("b", "T4", 2, "s1")}
)


def batch(dispatch_id: int, arrivals: list[float], at: float) -> Dispatch:
    requests = [Request(id=f"r{dispatch_id}-{i}", model="m", arrival=t, deadline=t + 0.1) for i, t in enumerate(arrivals)]
    hops = (
        Hop(0, "a", Reservation("a", at, at + 0.01)),
        Hop(
            1,
            "b",
            Reservation("b", at + 0.015, at + 0.035),
            (Reservation("s0/ul", at + 0.01, at + 0.015), Reservation("s1/dl", at + 0.01, at + 0.015)),
        ),
    )
    return Dispatch(id=dispatch_id, model="m", pipeline=0, batch_size=2, requests=requests, hops=hops)


def test_rate_series_counts_per_bucket_and_in_all():
    series = RateSeries()
    for t in (10.1, 10.9, 12.5):
        series.add(t)
    series.add(12.7, 3)
    assert series.counts(9, 13) == [0, 2, 0, 4, 0]
    assert series.total == 6


def test_latency_percentiles_are_read_from_fine_bins():
    series = LatencySeries()
    series.add(5.5, np.arange(1, 51) / 1e3)  # two batches in one bucket
    series.add(5.9, np.arange(51, 101) / 1e3)
    by_q = series.percentiles(4, 5, (50, 99))
    (gap, p50), (_, p99) = by_q[50], by_q[99]
    assert 0.050 <= p50 <= 0.050 * 1.13 and 0.099 <= p99 <= 0.099 * 1.13
    assert math.isnan(gap)


def test_dispatch_feedback_and_done_give_busy_intervals_batches_and_latencies():
    metrics = ServiceMetrics()
    metrics.serve("m", PLAN, PLACEMENT)
    metrics.submit("m", 2, 1.0, queued=2)
    metrics.dispatch("m", batch(7, [1.0, 1.0], 1.02), 1.02, queued=0)
    metrics.feedback("m", Feedback(7, 0, "compute", 1.02, 1.03))
    metrics.feedback("m", Feedback(7, 1, "transfer", 1.03, 1.04))
    metrics.feedback("m", Feedback(7, 1, "compute", 1.04, 1.2))
    metrics.done("m", 7, 1.2)  # 200 ms: late against the 100 ms SLO
    metrics.drop("m", "deadline", 1, 1.3)
    model = metrics.models["m"]
    assert model.batch_sizes == {(0, 2): 1} and not model.pending
    means = model.phases.means(1, 1)  # each request: 20 ms queued, 170 ms computing, 10 ms crossing NICs
    assert {phase: round(seconds, 6) for phase, seconds in means.items()} == {
        "queue": 0.02,
        "compute": 0.17,
        "transfer": 0.01,
        "other": 0.0,
    }
    assert math.isclose(model.phase_sums["compute"], 0.34) and sum(model.phase_buckets["queue"]) == 2
    assert (model.completed.total, model.on_time.total, model.dropped["deadline"].total) == (2, 0, 1)
    assert model.latency_buckets[LATENCY_BOUNDS_S.index(0.2)] == 2  # both in (0.1, 0.2]
    busy = metrics.busy_seconds(1.0, 2.0)
    assert busy.keys() == {"a", "b", "s0/ul", "s1/dl"} and math.isclose(busy["b"], 0.16)
    assert metrics.utilisation_by_gpu(busy, 1.0) == {"L4": busy["a"], "T4": busy["b"]}
    view = GPUView(lambda: (metrics, 2.0))
    view.update()
    assert sorted(view.timeline_source.data["kind"]) == ["busy", "busy", "planned", "planned"]
    assert view.nic_source.data["link"] == ["s0/ul", "s1/dl"]
    sent = view.timeline_source.data
    view.update()  # nothing new at the same time: nothing sent
    assert view.timeline_source.data is sent
    metrics.feedback("m", Feedback(7, 0, "compute", 1.9, 1.95))  # ignored: dispatch 7 is done
    metrics.busy_interval("a", 1.9, 1.95)
    view.update()
    assert sorted(view.timeline_source.data["kind"]) == ["busy", "busy", "busy", "planned", "planned"]
    assert max(view.timeline_source.data["right"]) == -50.0  # ms before now (2.0 s): the newest busy interval ended at 1.95 s


def test_time_series_stream_only_the_completed_seconds_and_the_drops_table_shows_the_newest_first():
    metrics = ServiceMetrics(unix_offset=3600.0)
    metrics.serve("m", PLAN, PLACEMENT)
    now = [100.5]
    view = SLOView(lambda: (metrics, now[0]))
    metrics.submit("m", 3, 100.2, queued=3)
    view.update()
    x = list(view.rates.source.data["x"])
    assert len(x) == SERIES_BUCKETS and (x[0], x[-1]) == (-(SERIES_BUCKETS - 1) * BUCKET_S, 0)
    assert sum(view.rates.column("m offered")) == 0  # the second in progress (100) is not shown yet
    sent = view.rates.source.data
    now[0] = 100.9
    view.update()
    assert view.rates.source.data is sent  # no second completed: nothing sent
    drops_sent = view.drops.source.data
    now[0] = 101.2
    view.update()
    assert len(view.rates.source.data["x"]) == SERIES_BUCKETS and view.rates.column("m offered")[-1] == 3 / BUCKET_S
    assert view.drops.source.data is drops_sent  # a second completed, but the drops chart looks the same: not sent
    assert view.rates.figure.y_range.end == 5  # 3 req/s plus headroom, rounded up to 1, 2 or 5 times a power of ten
    metrics.drop("m", "overload", 2, 101.25, "3 requests queued")
    metrics.drop("m", "overload", 1, 101.3, "4 requests queued")  # the same second and reason: the same row
    metrics.drop("m", "deadline", 1, 101.5)
    now[0] = 102.0
    view.update()
    assert view.drops.labels == ["m overload", "m deadline"] and view.drops.column("m overload")[-1] == 3 / BUCKET_S
    assert view.drop_source.data == {
        "time": ["01:01:41.500", "01:01:41.250"],
        "model": ["m", "m"],
        "reason": ["deadline", "overload"],
        "requests": [1, 3],
        "detail": ["", "4 requests queued"],
    }
    metrics.drop("m", "deadline", 2, 101.9)
    view.update()
    assert view.drop_source.data["requests"] == [3, 3]


def test_the_update_interval_is_configurable_and_checked():
    from daskpipe.dashboard.server import UPDATE_CONFIG, update_interval_ms

    assert update_interval_ms() == 1000
    with dask.config.set({UPDATE_CONFIG: "250ms"}):
        assert update_interval_ms() == 250
    for bad in ("soon", "10ms"):
        with dask.config.set({UPDATE_CONFIG: bad}), pytest.raises(ValueError, match="update-interval"):
            update_interval_ms()


def test_a_replayed_simulator_trace_makes_a_report(tmp_path):
    trace = Trace(end_time=3.0)
    dispatch = batch(1, [1.0, 1.01], 1.02)
    for request, finish in zip(dispatch.requests, (1.06, 1.07)):
        trace.requests[request.id] = RequestRecord("m", request.arrival, request.deadline, finish=finish)
    trace.requests["late"] = RequestRecord("m", 2.0, 2.1, dropped="deadline")
    trace.dispatches.append((1.02, dispatch))
    trace.computes += [("m", "a", 2, 0, 1.02, 1.03), ("m", "b", 2, 1, 1.04, 1.06)]
    metrics = record_trace(ServiceMetrics(), PLAN, PLACEMENT, trace)
    model = metrics.models["m"]
    assert (model.offered.total, model.on_time.total, model.dropped["deadline"].total) == (3, 2, 1)
    assert model.queue.values(1, 2, 0) == [2, 1]  # two waited before the batch; one until its drop
    slos = SLOView(lambda: (metrics, metrics.last_time + BUCKET_S))
    slos.update()
    assert {label: sum(slos.rates.column(label)) for label in slos.rates.labels} == {"m offered": 3, "m goodput": 2}
    path = save_report(metrics, tmp_path / "sim.html")
    assert "Batches and queues" in path.read_text()
