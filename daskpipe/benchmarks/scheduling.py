"""``daskpipe bench scheduler``: the cost of PPipe's data plane per request, on a 100-GPU plan.

There is no simulator here: :func:`daskpipe.sched.drive.drive` steps a dispatcher the way a
simulator would (arrivals, wakes at ``next_wake``, feedback at the end of every reservation) and
executes every dispatch exactly as reserved. The cost is reported against a heapq push+pop pair on a heap of the same
size as the queue of pending feedback events, measured in the same run, so figures from
different machines compare.
"""

from __future__ import annotations

import cProfile
import heapq
import json
import pstats
import random
import sys
import time
from typing import Callable

import click

from daskpipe.sched.drive import drive, poisson_arrivals, synthetic_plan, synthetic_profile
from daskpipe.sched.placement import place
from daskpipe.sched.ppipe import PPipeDispatcher, PPipeSettings

_REFERENCE_HEAP = 1024  # entries: about the pending events of a simulator of this cluster


def heap_pair_us(size: int, pairs: int = 200_000, seed: int = 0) -> float:
    """Microseconds of one heappush + heappop on a heap of ``size`` (time, seq, object) entries."""
    rng = random.Random(seed)
    heap = [(rng.random(), i, None) for i in range(max(size, 1))]
    heapq.heapify(heap)
    push, pop = heapq.heappush, heapq.heappop
    keys = [rng.random() + 1.0 for _ in range(pairs)]
    start = time.perf_counter()
    for i, key in enumerate(keys):
        push(heap, (key, i, None))
        pop(heap)
    return (time.perf_counter() - start) / pairs * 1e6


def run_bench(
    requests: int, *, load: float = 1.0, settings: PPipeSettings | None = None, seed: int = 0, advance: Callable[..., None] | None = None
) -> dict:
    """Push ``requests`` through a PPipe dispatcher on the synthetic 100-GPU plan; return the figures.

    ``advance(steps)`` hears of each twentieth of the requests, outside the timed sections."""
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    if not load > 0:
        raise ValueError(f"load must be > 0, got {load}")
    profile = synthetic_profile()
    plan = synthetic_plan(profile)
    model = plan.models[0]
    placement = place(plan)[model.name]
    dispatcher = PPipeDispatcher(model, placement, profile, bw_gbps=plan.cluster["bw_gbps"], settings=settings)
    rate = model.throughput * load
    pairs: list[float] = []

    every = max(requests // 20, 1)

    def sample() -> None:  # the reference cost, under the same load as the run around it
        pairs.append(heap_pair_us(_REFERENCE_HEAP, pairs=20_000, seed=len(pairs)))
        if advance is not None and len(pairs) > 1:
            advance(every)

    wall = time.perf_counter()
    sample()
    outcome = drive(dispatcher, poisson_arrivals(model.name, rate, model.slo_us * 1e-6, requests, seed), every=every, tick=sample)
    sample()
    wall = time.perf_counter() - wall
    pair = sum(pairs) / len(pairs)
    us_per_request = outcome.dispatcher_seconds / requests * 1e6
    return {
        "requests": requests,
        "gpus": sum(plan.cluster["gpus"].values()),
        "pipelines": len(model.pipelines),
        "plan_throughput": model.throughput,
        "load": load,
        "settings": vars(dispatcher.settings),
        "requests_per_second": requests / outcome.dispatcher_seconds,
        "us_per_request": us_per_request,
        "heap_pair_us": pair,
        "heap_pair_samples": len(pairs),
        "heap_size": _REFERENCE_HEAP,
        "max_pending_events": outcome.max_pending_events,
        "ratio": us_per_request / pair,
        "wall_seconds": wall,
        "probes_per_batch": dispatcher.stats.probes / max(outcome.batches, 1),
        "mean_batch": outcome.dispatched / max(outcome.batches, 1),
        "dispatched": outcome.dispatched,
        "batches": outcome.batches,
        "dropped": outcome.dropped,
        "late": outcome.late,
    }


@click.command("scheduler")
@click.option(
    "--requests",
    "requests",
    type=click.IntRange(min=1),
    default=1_000_000,
    show_default=True,
    help="Requests to push through the dispatcher.",
)
@click.option(
    "--load",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Arrival rate as a fraction of the plan's throughput.",
)
@click.option(
    "--timeline",
    type=click.Choice(["gaps", "append"]),
    default="gaps",
    show_default=True,
    help="Reservation tables: the paper's (gaps) or the artifact's (append).",
)
@click.option("--artifact", is_flag=True, help="Use all of the published simulator's choices (PPipeSettings.artifact()).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the Poisson arrivals.")
@click.option("--profile", "profile_top", type=int, default=0, help="Also print the top N functions by cProfile (slower run).")
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None, help="Also write the figures to this file."
)
def bench_scheduler(requests: int, load: float, timeline: str, artifact: bool, seed: int, profile_top: int, json_path: str | None) -> None:
    """Cost per request of PPipe's dispatcher on a synthetic 100-GPU plan (25 L4 + 75 P4)."""
    settings = PPipeSettings.artifact(timeline=timeline) if artifact else PPipeSettings(timeline=timeline)
    if profile_top:
        profiler = cProfile.Profile()
        profiler.enable()
    from daskpipe.progress import progress_bar

    with progress_bar("requests through the dispatcher", total=requests) as advance:
        figures = run_bench(requests, load=load, settings=settings, seed=seed, advance=advance)
    if profile_top:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(profile_top)
    text = json.dumps(figures, indent=1)
    click.echo(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
