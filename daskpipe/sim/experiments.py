"""Reproducible experiments: Symphony's Table 2 and PPipe's Figs. 6, 8 and 10, each writing JSON.

``symphony_table2`` simulates staggered (deferred, one scheduler over N GPUs) against uncoordinated
(one deferred batcher per GPU, requests spread round-robin, as Nexus' distributed frontends do)
batching with constant arrivals, and finds by bisection on the rate the highest throughput each
sustains at >= 99% attainment; the analytic values of Symphony §5.3 sit beside them.

``ppipe_experiment`` plans groups G1-G4 on clusters HC1-HC4 with each strategy's MILP and finds
each model's max load factor (LF 1.0 = PPipe's plan throughput for that model; baselines are fed
the same absolute rates, as in the paper) with each strategy's data plane.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import click

from daskpipe.sched.api import Request, Slot
from daskpipe.sched.symphony import DeferredDispatcher
from daskpipe.sim.engine import Engine, ReservedDurations, on_time


@dataclass(frozen=True)
class LinearModel:
    """l(b) = alpha * b + beta (ms), with an SLO (ms): Symphony's Table 2 models."""

    name: str
    alpha_ms: float
    beta_ms: float
    slo_ms: float

    def latency_s(self, batch: int) -> float:
        return (self.alpha_ms * batch + self.beta_ms) / 1e3

    def analytic(self, gpus: int, staggered: bool) -> tuple[int, float]:
        """Symphony §5.3: b = floor((SLO/(1+1/N) - beta)/alpha) staggered, floor((SLO/2 - beta)/alpha)
        uncoordinated; throughput N b / l(b)."""
        budget = self.slo_ms / (1 + 1 / gpus) if staggered else self.slo_ms / 2
        batch = math.floor((budget - self.beta_ms) / self.alpha_ms)
        return batch, gpus * batch / self.latency_s(batch)

    def gpu_rate_bound(self) -> float:
        """Upper bound on one GPU's rate: batches as large as the SLO allows, back to back."""
        batch = max(1, math.floor((self.slo_ms - self.beta_ms) / self.alpha_ms))
        return batch / self.latency_s(batch)


TABLE2_MODELS = (LinearModel("ResNet50", 1.053, 5.072, 25.0), LinearModel("InceptionResNetV2", 5.090, 18.368, 70.0))


def constant_load(model: LinearModel, gpus: int, rate: float, duration: float, *, staggered: bool, max_batch: int = 64) -> tuple[float, float]:
    """(attainment, mean batch) of ``gpus`` GPUs under constant arrivals at ``rate``."""
    slots = [Slot(f"gpu{i}", "X") for i in range(gpus)]
    slo = model.slo_ms / 1e3
    latency = lambda _m, b: model.latency_s(b)  # noqa: E731 - the dispatcher's latency hook
    if staggered:
        shared = DeferredDispatcher({"m": slo}, slots, latency, max_batch=max_batch)
        dispatchers = {"m": shared}
        lane = lambda i: "m"  # noqa: E731
    else:
        dispatchers = {f"m{i}": DeferredDispatcher({f"m{i}": slo}, [s], latency, max_batch=max_batch) for i, s in enumerate(slots)}
        lane = lambda i: f"m{i % gpus}"  # noqa: E731
    engine = Engine(dispatchers, {s.id: s for s in slots}, ReservedDurations())
    count = int(rate * duration)
    engine.add_arrivals(Request(i, lane(i), i / rate, i / rate + slo) for i in range(count))
    trace = engine.run()
    good = sum(on_time(r) for r in trace.requests.values())
    sizes = [d.batch_size for _, d in trace.dispatches]
    return good / count, sum(sizes) / len(sizes)


def max_rate(model: LinearModel, gpus: int, *, staggered: bool, duration: float = 1.0, target: float = 0.99, precision: float = 0.002) -> tuple[float, float]:
    """Highest constant rate with ``target`` attainment, by bisection (attainment assumed to fall
    with the rate), to a relative ``precision``; returns (rate, mean batch there)."""
    upper = gpus * model.gpu_rate_bound()
    lo, hi = 0.0, upper
    batch = math.nan
    while hi - lo > precision * upper:
        mid = (lo + hi) / 2
        attained, mean_batch = constant_load(model, gpus, mid, duration, staggered=staggered)
        if attained >= target:
            lo, batch = mid, mean_batch
        else:
            hi = mid
    return lo, batch


def symphony_table2(gpus: int = 8, duration: float = 1.0, precision: float = 0.002) -> list[dict[str, Any]]:
    """Symphony's Table 2 by formula and by simulation."""
    rows = []
    for model in TABLE2_MODELS:
        for staggered in (True, False):
            batch, throughput = model.analytic(gpus, staggered)
            rate, mean_batch = max_rate(model, gpus, staggered=staggered, duration=duration, precision=precision)
            rows.append({
                "model": model.name,
                "scheme": "staggered (deferred)" if staggered else "uncoordinated (per-GPU)",
                "analytic_batch": batch,
                "analytic_throughput": round(throughput, 1),
                "simulated_throughput": round(rate, 1),
                "simulated_mean_batch": round(mean_batch, 2),
            })
    return rows
