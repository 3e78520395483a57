"""A small discrete-event simulation of a ``ServingPlan``: does it meet the fragments' deadlines?

Each device is a Poisson :class:`~daskpipe.sim.workload.Stream` at its fragment's rate, entering
at its start block (checked against its route); a request reaches the server with ``budget_ms``
left and follows its route (private stage, then shared stage). Every stage has one
FIFO queue pulled by ``instances`` identical instances: an idle instance takes up to ``batch``
waiting requests at once, whatever private stage they came from, and holds them for the
profile's latency at that batch size on its MPS share. As Graft's load balancer does, a request
that could not finish the stage before its deadline even alone is dropped when it is dequeued.
A request meets its SLO when its last stage ends by its deadline.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from daskpipe.graft.costs import StageConfig, StageCosts
from daskpipe.graft.fragments import Fragment
from daskpipe.graft.planner import ServingPlan
from daskpipe.sim.workload import Stream, stream_requests


@dataclass
class _Request:
    device: str
    arrival_s: float
    deadline_s: float
    route: tuple[int, ...]
    hop: int = 0


@dataclass
class _Stage:
    config: StageConfig
    idle: int
    queue: deque[_Request] = field(default_factory=deque)


@dataclass(frozen=True)
class SimResult:
    """Outcome of one run: counts, and server-side latency percentiles of completed requests."""

    arrivals: int
    met: int
    late: int
    dropped: int
    p50_ms: float
    p99_ms: float
    max_batch_seen: int  # the largest batch any stage ran
    mixed_batches: int  # batches holding requests of more than one device

    @property
    def slo_attainment(self) -> float:
        return self.met / self.arrivals if self.arrivals else 1.0

    def to_dict(self) -> dict[str, float]:
        return {
            "arrivals": self.arrivals,
            "met": self.met,
            "late": self.late,
            "dropped": self.dropped,
            "slo_attainment": round(self.slo_attainment, 5),
            "p50_ms": round(self.p50_ms, 3),
            "p99_ms": round(self.p99_ms, 3),
            "max_batch_seen": self.max_batch_seen,
            "mixed_batches": self.mixed_batches,
        }


def simulate(plan: ServingPlan, costs: StageCosts, fragments: Sequence[Fragment], *, duration_s: float = 10.0, seed: int = 0) -> SimResult:
    """Run ``fragments`` (unmerged: one per device) through ``plan`` for ``duration_s`` seconds."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    missing = sorted({member for f in fragments for member in f.members} - set(plan.routes))
    if missing:
        raise ValueError(f"plan for {plan.model!r} has no route for device(s) {missing[:5]}")
    streams = [
        Stream(member, f.model, f.rate_rps / len(f.members), f.budget_ms / 1e3, f.start_block) for f in fragments for member in f.members
    ]
    stages = [_Stage(config, config.instances) for config in plan.stages]
    events: list[tuple[float, int, str, object]] = []
    order = itertools.count()
    for arrival in stream_requests(streams, duration_s, np.random.default_rng(seed)):
        device = arrival.id[0]
        route = plan.routes[device]
        if plan.stages[route[0]].start != arrival.start_block:
            raise ValueError(
                f"device {device!r} enters at block {arrival.start_block} but its route starts at block {plan.stages[route[0]].start}"
            )
        request = _Request(device, arrival.arrival, arrival.deadline, route)
        heapq.heappush(events, (arrival.arrival, next(order), "arrive", request))

    arrivals = met = late = dropped = largest = mixed = 0
    latencies: list[float] = []

    def start_batches(stage: _Stage, now: float) -> None:
        nonlocal dropped, largest, mixed
        config = stage.config
        while stage.idle and stage.queue:
            batch: list[_Request] = []
            while stage.queue and len(batch) < config.batch:
                request = stage.queue.popleft()
                if now + costs.latency_ms(config.start, config.end, 1, config.share) / 1e3 > request.deadline_s:
                    dropped += 1
                else:
                    batch.append(request)
            if batch:
                stage.idle -= 1
                largest = max(largest, len(batch))
                mixed += len({r.device for r in batch}) > 1
                done = now + costs.latency_ms(config.start, config.end, len(batch), config.share) / 1e3
                heapq.heappush(events, (done, next(order), "finish", (stage, batch)))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            arrivals += 1
            ready = [payload]
        else:
            stage, batch = payload
            stage.idle += 1
            ready = []
            for request in batch:
                request.hop += 1
                if request.hop < len(request.route):
                    ready.append(request)
                elif now <= request.deadline_s + 1e-12:
                    met += 1
                    latencies.append((now - request.arrival_s) * 1e3)
                else:
                    late += 1
            start_batches(stage, now)
        touched: dict[int, _Stage] = {}
        for request in ready:  # enqueue all first, so one finished batch can feed one next batch
            index = request.route[request.hop]
            stages[index].queue.append(request)
            touched[index] = stages[index]
        for target in touched.values():
            start_batches(target, now)

    p50, p99 = np.percentile(latencies, [50, 99]) if latencies else (np.nan, np.nan)
    return SimResult(arrivals, met, late, dropped, float(p50), float(p99), largest, mixed)
