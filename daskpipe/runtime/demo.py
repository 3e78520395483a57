"""``daskpipe demo``: the whole path on one machine without GPUs, in about a minute.

A ResNet-18 (random weights; nothing is downloaded) is profiled for emulated L4 and T4 GPUs with
the analytic estimator, planned with the MILP, and deployed on a local cluster of emulated GPU
workers. A Poisson stream of requests then runs through it as Dask futures, and every output is
checked against the unpartitioned model.

The time dilation k is chosen here, not guessed: each planned stage must compute for real on
this machine's CPU within k times its emulated latency (with headroom for the other processes),
and k is raised further when the plan's capacity divided by k would still be more requests per
second than the machine can push through Dask.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

DEMO_GPUS = {"L4": 1, "T4": 2}
MODEL = "resnet18"
INPUT_SHAPE = (3, 64, 64)
DISTINCT_FRAMES = 16  # requests cycle through these, so the reference is computed once per frame
COMPUTE_HEADROOM = 4.0  # dilated stage latency / CPU compute time measured alone: room for contention
MAX_REQUEST_RATE = 30.0  # req/s that 2 cores carry through client, scheduler and workers
DRAIN_S = 30.0  # after the stream and one SLO, requests still unanswered count as failed


@dataclass
class Pool:
    """A planned partition's pool, and what one batch costs there emulated and on this CPU."""

    gpu: str
    slices: int
    workers: int
    blocks: tuple[int, int]
    planned_batch: int
    emulated_latency_ms: float
    cpu_compute_ms: float


@dataclass
class Summary:
    """What the demo prints, and writes with ``--json``."""

    model: str
    duration_s: float
    time_dilation: float
    slo_ms: float
    rate_per_s: float
    submitted: int = 0
    completed: int = 0
    dropped: int = 0
    failed: int = 0
    on_time: int = 0
    attainment: float = 0.0
    throughput_per_s: float = 0.0
    latency_p50_ms: float = 0.0
    latency_p99_ms: float = 0.0
    mean_batch: float = 0.0
    overruns: int = 0
    max_abs_error: float = 0.0
    drop_reasons: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    pools: list[Pool] = field(default_factory=list)
    dashboard: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_demo(
    *,
    duration: float = 30.0,
    dashboard_address: str | None = ":8787",
    protocol: str = "tcp",
    json_path: str | Path | None = None,
    gpus: Mapping[str, int] = DEMO_GPUS,
    load: float = 0.6,
    seed: int = 0,
) -> Summary:
    """Run the demo and return its summary (also printed, and written to ``json_path`` if given).

    ``duration`` is the seconds of request stream; ``load`` the request rate as a fraction of the
    plan's capacity. ``dashboard_address`` and ``protocol`` are the local cluster's.
    """
    import torch
    from distributed import Client
    from rich.console import Console

    from daskpipe.runtime.client.service import deploy
    from daskpipe.runtime.cluster import EmulatedCluster, emulated_slots

    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration!r}")
    if not 0 < load <= 1:
        raise ValueError(f"load must be in (0, 1], got {load!r}")
    console = Console(stderr=True)
    torch.set_num_threads(1)  # the workers share these cores; oversubscribed OpenMP threads spin
    torch.manual_seed(seed)
    model, frames, references = _model_and_frames(seed)

    slots = emulated_slots(gpus)
    kinds = sorted({(slot.gpu_type, slot.slices) for slot in slots})
    with console.status(f"profiling {MODEL} for {', '.join(f'{g}/v{v}' for g, v in kinds)} and planning ..."):
        profile, plan = _profile_and_plan(model, frames[0], kinds, gpus)
    pools, dilation = _pools_and_dilation(model, frames[0], profile, plan, slots)
    capacity = plan.model(MODEL).throughput / dilation
    rate = load * capacity
    _print_plan(console, pools, dilation, profile.slo_us / 1e3, capacity)

    with console.status("starting emulated GPU workers ..."):
        cluster = EmulatedCluster(gpus, protocol=protocol, dashboard_address=dashboard_address)
    with cluster, Client(cluster) as client:
        console.print(f"cluster: {', '.join(slot.name for slot in cluster.slots)}; dashboard: {cluster.dashboard_link}")
        with console.status("deploying stage actors ..."):
            service = deploy(
                client,
                {MODEL: model},
                example_inputs={MODEL: frames[0]},
                profiles={MODEL: profile},
                plan=plan,
                time_dilation=dilation,
            )
        summary = Summary(
            model=MODEL,
            duration_s=duration,
            time_dilation=dilation,
            slo_ms=profile.slo_us * dilation / 1e3,
            rate_per_s=rate,
            pools=pools,
            dashboard=cluster.dashboard_link,
        )
        with service:
            with console.status("warming up every stage ..."):
                _warm_up(service, frames, max(pool.planned_batch for pool in pools))
            _stream(service, frames, references, rate, duration, summary, seed, console)
    _print_summary(console, summary)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(summary.to_dict(), indent=2))
    return summary


def _model_and_frames(seed: int):
    import torch
    import torchvision

    model = torchvision.models.resnet18(weights=None).eval()
    frames = torch.randn(DISTINCT_FRAMES, *INPUT_SHAPE, generator=torch.Generator().manual_seed(seed)).unsqueeze(1)
    with torch.inference_mode():
        references = model(frames.squeeze(1))
    return model, frames, references


def _profile_and_plan(model, example, kinds: list[tuple[str, int]], gpus: Mapping[str, int]):
    """Estimated tables for exactly the (GPU type, slices) kinds the cluster has, and the MILP's plan."""
    from daskpipe.plan.milp import make_plan
    from daskpipe.profiles.estimator import estimate_profile

    estimated = estimate_profile(
        model, example, gpus=sorted({g for g, _ in kinds}), name=MODEL, slices=sorted({v for _, v in kinds}), num_blocks=8
    )
    profile = replace(estimated, latency_us={kind: t for kind, t in estimated.latency_us.items() if kind in kinds})
    plan = make_plan({MODEL: profile}, gpus, gpus_per_server=dict(gpus))
    return profile, plan


def _pools_and_dilation(model, example, profile, plan, slots) -> tuple[list[Pool], float]:
    """Time every planned stage on this CPU at its batch size; k makes each fit its dilated latency."""
    import torch

    from daskpipe.profiles.fx import cut_model
    from daskpipe.profiles.profiler import time_module

    blocked = cut_model(model, example, profile.meta["segment_boundaries"])
    pools = []
    with torch.inference_mode():
        for pipeline in plan.model(MODEL).pipelines:
            for part in pipeline.partitions:
                start, end = part.blocks
                shape = blocked.input_shape if start == 0 else blocked.boundary_shapes[start - 1]
                stage = torch.nn.Sequential(*blocked.blocks[start:end])
                cpu_us = time_module(stage, torch.randn(pipeline.batch_size, *shape), repeats=3)
                workers = sum(1 for s in slots if (s.gpu_type, s.slices) == (part.gpu, part.slices))
                pools.append(Pool(part.gpu, part.slices, workers, (start, end), pipeline.batch_size, part.latency_us / 1e3, cpu_us / 1e3))
    for_compute = max(COMPUTE_HEADROOM * pool.cpu_compute_ms / pool.emulated_latency_ms for pool in pools)
    for_rate = plan.model(MODEL).throughput / MAX_REQUEST_RATE
    return pools, float(np.ceil(max(for_compute, for_rate, 1.0)))


def _warm_up(service, frames, batch: int) -> None:
    """A few full batches first: the first ones through fresh worker processes pay one-time costs
    (imports, allocator growth, Dask connections) that would otherwise count as SLO misses."""
    from distributed import wait

    wait(service.map(MODEL, [frames[i % len(frames)] for i in range(3 * batch)]))


def _stream(service, frames, references, rate: float, duration: float, summary: Summary, seed: int, console) -> None:
    """Open-loop Poisson arrivals at ``rate`` for ``duration`` s, then the tally of how each ended."""
    before = service.status()[MODEL]
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, size=int(rate * duration * 1.5) + 10))
    requests = _submit(service, frames, arrivals[arrivals < duration], duration + DRAIN_S + summary.slo_ms / 1e3, console)
    _tally(summary, requests, references, before, service.status()[MODEL])


@dataclass
class _Requests:
    futures: list
    submitted_at: list[float]
    finished_at: dict  # key -> perf_counter() when its future ended (set from Dask's callback thread)
    start: float


def _submit(service, frames, arrivals: np.ndarray, give_up_after: float, console) -> _Requests:
    """Submit at ``arrivals`` (s from now) with a progress bar; wait until all end or ``give_up_after`` s."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    requests = _Requests([], [], {}, time.perf_counter())
    lock = threading.Lock()

    def finished(future) -> None:
        with lock:
            requests.finished_at[future.key] = time.perf_counter()

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        sent = progress.add_task("submitted", total=len(arrivals))
        done = progress.add_task("finished ", total=len(arrivals))
        for i, at in enumerate(arrivals):
            delay = requests.start + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            future = service.submit(MODEL, frames[i % len(frames)])
            requests.submitted_at.append(time.perf_counter())
            future.add_done_callback(finished)
            requests.futures.append(future)
            progress.update(sent, completed=i + 1)
            progress.update(done, completed=len(requests.finished_at))
        give_up = requests.start + give_up_after
        while len(requests.finished_at) < len(requests.futures) and time.perf_counter() < give_up:
            progress.update(done, completed=len(requests.finished_at))
            time.sleep(0.1)
        progress.update(done, completed=len(requests.finished_at))
    return requests


def _tally(summary: Summary, requests: _Requests, references, before: dict, after: dict) -> None:
    """Classify every future, compare outputs with the unpartitioned model, and take the plugin's
    counters (on time, batches, overruns, drop reasons) for the stream alone: ``after - before``."""
    from daskpipe.runtime.errors import RequestDropped

    latencies, errors = [], [0.0]
    for i, future in enumerate(requests.futures):
        if future.status == "finished":
            output = future.result()
            errors.append(float((output.float() - references[i % len(references)]).abs().max()))
            ended = requests.finished_at.get(future.key, requests.submitted_at[i])
            latencies.append((ended - requests.submitted_at[i]) * 1e3)
        elif future.status == "error" and isinstance(future.exception(), RequestDropped):
            summary.dropped += 1
        else:
            summary.failed += 1
            if len(summary.failures) < 5:
                cause = future.exception() if future.status == "error" else f"still {future.status} after the stream"
                summary.failures.append(repr(cause))
    summary.submitted = len(requests.futures)
    summary.completed = len(latencies)
    summary.on_time = after["on_time"] - before["on_time"]
    summary.attainment = summary.on_time / max(summary.submitted, 1)
    summary.drop_reasons = {
        reason: count - before["dropped"].get(reason, 0)
        for reason, count in after["dropped"].items()
        if count > before["dropped"].get(reason, 0)
    }
    summary.overruns = after["overruns"] - before["overruns"]
    summary.mean_batch = summary.completed / max(after["batches"] - before["batches"], 1)
    ended = max(requests.finished_at.values(), default=requests.start)
    summary.throughput_per_s = summary.completed / max(ended - requests.start, 1e-9)
    if latencies:
        summary.latency_p50_ms, summary.latency_p99_ms = (float(q) for q in np.percentile(latencies, [50, 99]))
    summary.max_abs_error = max(errors)


def _print_plan(console, pools: list[Pool], dilation: float, slo_ms: float, capacity: float) -> None:
    from rich.table import Table

    table = Table(title=f"plan for {MODEL} {INPUT_SHAPE}, SLO {slo_ms:.2f} ms, k={dilation:g}")
    for column in ("pool", "workers", "blocks", "batch", "emulated ms", "x k ms", "CPU ms"):
        table.add_column(column, justify="right")
    for pool in pools:
        table.add_row(
            f"{pool.gpu}/v{pool.slices}",
            str(pool.workers),
            f"{pool.blocks[0]}-{pool.blocks[1]}",
            str(pool.planned_batch),
            f"{pool.emulated_latency_ms:.3f}",
            f"{pool.emulated_latency_ms * dilation:.1f}",
            f"{pool.cpu_compute_ms:.1f}",
        )
    console.print(table)
    console.print(f"capacity at k={dilation:g}: {capacity:.1f} req/s")


def _print_summary(console, summary: Summary) -> None:
    from rich.table import Table

    table = Table(title=f"daskpipe demo: {summary.model}, {summary.duration_s:g} s of Poisson load at {summary.rate_per_s:.1f} req/s")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("submitted / completed", f"{summary.submitted} / {summary.completed}"),
        ("dropped / failed", f"{summary.dropped} / {summary.failed}"),
        ("SLO attainment", f"{summary.attainment:.1%} (SLO {summary.slo_ms:.0f} ms = emulated x {summary.time_dilation:g})"),
        ("throughput", f"{summary.throughput_per_s:.1f} req/s"),
        ("latency p50 / p99", f"{summary.latency_p50_ms:.0f} / {summary.latency_p99_ms:.0f} ms"),
        ("mean batch (planned per pool)", f"{summary.mean_batch:.2f} ({', '.join(f'{p.gpu}: {p.planned_batch}' for p in summary.pools)})"),
        ("emulation overruns", str(summary.overruns)),
        ("max |output - unpartitioned|", f"{summary.max_abs_error:.2e}"),
    ]
    if summary.drop_reasons:
        rows.append(("drops by reason", ", ".join(f"{k}: {v}" for k, v in summary.drop_reasons.items())))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for failure in summary.failures:
        console.print(f"[red]failed:[/red] {failure}")
    if summary.dashboard:
        pages = summary.dashboard.removesuffix("/status")
        console.print(
            f"dashboard (while the demo ran): {summary.dashboard}; daskpipe's pages: {pages}/daskpipe-slos, {pages}/daskpipe-plan"
        )
