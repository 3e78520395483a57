"""Driving a dispatcher without a simulator: a synthetic 4-block model on P4 and L4 GPUs, Poisson
arrivals, and :func:`drive`, which steps a dispatcher the way a simulator would (arrivals, wakes at
``next_wake``, feedback at the end of every reservation) and executes every dispatch exactly as
reserved. The data planes' tests and ``daskpipe bench scheduler`` run on it.
"""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass, field
from itertools import count
from typing import Callable, Iterable, Iterator

import numpy as np

from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan
from daskpipe.profiles.model import Profile
from daskpipe.sched.api import Dispatch, Dispatcher, Drop, Feedback, Request, Time

# -- a synthetic model and a 100-GPU plan ------------------------------------------------------------
_BLOCK_MS = (1.0, 1.0, 1.5, 1.5)  # L4, whole GPU, batch 1
_SLOWDOWN = {"L4": (1.0, 1.0, 1.0, 1.0), "P4": (1.7, 2.5, 6.0, 8.0)}  # early blocks suit the P4 (paper Fig. 3)
_SLICE_SLOWDOWN = {1: 1.0, 2: 1.7}  # per slice when the GPU is cut in v slices that all run
_BOUNDARY_BYTES = (800e3, 400e3, 200e3)  # fp16 feature map per sample leaving blocks 0..2


def synthetic_profile(name: str = "synthetic", slo_ms: float = 100.0, max_batch: int = 8) -> Profile:
    """A 4-block model whose early blocks run well on a P4 and later ones need an L4."""
    batch = np.arange(1, max_batch + 1)
    tables = {}
    for gpu, slowdown in _SLOWDOWN.items():
        for v, slice_slowdown in _SLICE_SLOWDOWN.items():
            rows = [1e3 * ms * s * slice_slowdown * (0.5 + 0.5 * batch) for ms, s in zip(_BLOCK_MS, slowdown)]
            tables[(gpu, v)] = np.array(rows)
    return Profile(model=name, slo_us=slo_ms * 1e3, num_blocks=len(_BLOCK_MS), latency_us=tables, boundary_bytes=_BOUNDARY_BYTES)


def synthetic_plan(profile: Profile, *, high: int = 25, low: int = 75, gpus_per_server: int = 4, bw_gbps: float = 10.0) -> Plan:
    """Pipeline 0 (batch 4): blocks 0-1 on P4, 2-3 on half-L4 slices, as many as ``high`` L4s feed;
    pipeline 1 (batch 2): the whole model on the P4s left. Pools are sized so stage throughputs match."""
    if high < 1 or low < 1:
        raise ValueError(f"need at least one GPU of each class, got high={high}, low={low}")

    def part(blocks: tuple[int, int], gpu: str, v: int, vgpus: int, bs: int, leaves: bool) -> Partition:
        transfer = bs * profile.cut_bytes(blocks[1]) * 8 / (bw_gbps * 1e9) * 1e6 if leaves else 0.0
        return Partition(blocks, gpu, v, vgpus, profile.latency(gpu, v, bs, *blocks), transfer)

    l4_slices = 2 * high
    l4_rate = l4_slices * 4 / (profile.latency("L4", 2, 4, 2, 4) * 1e-6)
    p4_for_split = min(low, int(np.ceil(l4_rate * profile.latency("P4", 1, 4, 0, 2) * 1e-6 / 4)))
    split_rate = min(l4_rate, p4_for_split * 4 / (profile.latency("P4", 1, 4, 0, 2) * 1e-6))
    pipelines = [Pipeline(4, split_rate, (part((0, 2), "P4", 1, p4_for_split, 4, True), part((2, 4), "L4", 2, l4_slices, 4, False)))]
    if low > p4_for_split:
        whole = low - p4_for_split
        rate = whole * 2 / (profile.latency("P4", 1, 2) * 1e-6)
        pipelines.append(Pipeline(2, rate, (part((0, 4), "P4", 1, whole, 2, False),)))
    total = sum(p.throughput for p in pipelines)
    model = ModelPlan(profile.model, profile.slo_us, 1.0, total, tuple(pipelines))
    cluster = {"gpus": {"L4": high, "P4": low}, "gpus_per_server": {"L4": gpus_per_server, "P4": gpus_per_server}, "bw_gbps": bw_gbps}
    return Plan(objective=total, models=(model,), strategy="synthetic", cluster=cluster)


def poisson_arrivals(model: str, rate: float, slo: Time, n: int, seed: int = 0) -> Iterator[Request]:
    """``n`` requests arriving as a Poisson process of ``rate`` per second, deadline = arrival + SLO."""
    rng = random.Random(seed)
    expovariate = rng.expovariate
    t = 0.0
    for i in range(n):
        t += expovariate(rate)
        yield Request(i, model, t, t + slo)


# -- driving a dispatcher without a simulator ------------------------------------------------------
@dataclass
class Outcome:
    """What happened to the requests :func:`drive` pushed through."""

    dispatched: int = 0
    batches: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    late: int = 0  # requests dispatched to finish after their deadline (as reserved; whole-pipeline dispatches)
    dispatcher_seconds: float = 0.0  # time spent inside the dispatcher's methods
    max_pending_events: int = 0
    dispatches: list[Dispatch] = field(default_factory=list)  # only with record=True
    drops: list[Drop] = field(default_factory=list)


def drive(
    dispatcher: Dispatcher,
    requests: Iterable[Request],
    *,
    feedback: bool = True,
    record: bool = False,
    execute: Callable[[Dispatch], list[Feedback]] | None = None,
    every: int = 0,
    tick: Callable[[], None] | None = None,
) -> Outcome:
    """Feed ``requests`` (in arrival order) to ``dispatcher`` and run what it decides.

    Every dispatch is executed by ``execute`` (default: exactly as reserved), whose feedback is
    delivered at each reported end when ``feedback`` is on. ``tick`` is called after every
    ``every`` submissions, outside the timed sections (the bench samples its reference cost
    there, so that both see the same machine load). Ends with a drain, so every request is
    accounted for.
    """
    execute = execute or exact_feedback
    outcome = Outcome()
    events: list[tuple[Time, int, Feedback]] = []
    seq = count()
    clock = time.perf_counter
    inf = float("inf")
    arrivals = iter(requests)
    request = next(arrivals, None)
    spent = 0.0
    submitted = 0
    if tick is not None and every < 1:
        raise ValueError(f"every must be >= 1 when a tick is given, got {every}")

    def handle(actions: list) -> None:
        for action in actions:
            if type(action) is Dispatch:
                outcome.batches += 1
                outcome.dispatched += len(action.requests)
                finish = action.finish
                for r in action.requests:
                    if finish > r.deadline:
                        outcome.late += 1
                if feedback:
                    for fb in execute(action):
                        heapq.heappush(events, (fb.end, next(seq), fb))
                if record:
                    outcome.dispatches.append(action)
            else:
                outcome.dropped[action.reason] = outcome.dropped.get(action.reason, 0) + 1
                if record:
                    outcome.drops.append(action)

    while True:
        t_arrival = request.arrival if request is not None else inf
        wake = dispatcher.next_wake()
        t_wake = inf if wake is None else wake
        t_event = events[0][0] if events else inf
        if t_event <= t_wake and t_event <= t_arrival:
            if t_event == inf:
                break
            fb = heapq.heappop(events)[2]
            start = clock()
            actions = dispatcher.feedback(fb, t_event)
        elif t_wake <= t_arrival:
            start = clock()
            actions = dispatcher.wake(t_wake)
        else:
            assert request is not None  # t_arrival is finite
            start = clock()
            actions = dispatcher.submit(request, t_arrival)
            submitted += 1
            if tick is not None and submitted % every == 0:
                spent += clock() - start
                tick()
                start = clock()
            request = next(arrivals, None)
        spent += clock() - start
        if actions:
            handle(actions)
        if len(events) > outcome.max_pending_events:
            outcome.max_pending_events = len(events)
    handle(dispatcher.drain(t_event if t_event != inf else 0.0))
    outcome.dispatcher_seconds = spent
    return outcome


def exact_feedback(dispatch: Dispatch) -> list[Feedback]:
    """Every reservation of ``dispatch`` ran exactly as reserved."""
    out = []
    for hop in dispatch.hops:
        if hop.transfer_in is not None:
            out.append(Feedback(dispatch.id, hop.partition, "transfer", hop.transfer_in[0].start, hop.transfer_in[0].end))
        out.append(Feedback(dispatch.id, hop.partition, "compute", hop.compute.start, hop.compute.end))
    return out
