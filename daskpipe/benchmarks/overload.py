"""``daskpipe bench overload``: goodput, drops and scheduler memory from 0.5x to 3x of the plan's capacity.

A small CNN (random weights; nothing is downloaded) is profiled for emulated L4 and T4 GPUs with
the analytic estimator, planned with the MILP and served on an :class:`EmulatedCluster`. Time
dilation k brings the plan's capacity down to ``capacity`` requests per second, so that this
machine's cores carry three times that through client, scheduler and workers. Each load level is
an open-loop Poisson stream at ``load x capacity`` for ``duration`` seconds; every future is then
waited for and counted by how it ended.

Goodput is the requests that finished within their SLO per second of stream. The contract
(issue 6): goodput at 3x >= 90% of goodput at 1x (a flat top, not a collapse), ``lost`` (futures
that never ended) 0 at every level, and what the scheduler holds bounded by the queue bound.

The data plane to serve with when overload is expected is ``deploy(...,
dispatcher="ppipe-two-pass")``: see :func:`daskpipe.sched.registry.ppipe_two_pass` for why.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import click
import numpy as np

MODEL = "small-cnn"
GPUS = {"L4": 1, "T4": 1}
INPUT_SHAPE = (3, 32, 32)
LOADS = (0.5, 1.0, 1.5, 2.0, 3.0)
DISTINCT_FRAMES = 8
DRAIN_S = 10.0  # after the stream and one SLO, a future still pending counts as lost


@dataclass
class Level:
    """How one load level went. ``lost`` counts futures that had not ended after the drain;
    ``keys_left`` the request keys the scheduler still knew once the level's futures were released
    (0: nothing of the level stays behind); ``overruns`` batches whose real CPU compute outlasted
    their emulated latency (the emulation could not keep up: raise the time dilation);
    ``mean_batch`` requests per dispatched batch."""

    load: float
    offered_per_s: float
    submitted: int
    completed: int
    on_time: int
    goodput_per_s: float
    attainment: float
    dropped: dict[str, int]
    failed: int
    lost: int
    queued_peak: int
    queued_bytes_peak: int
    scheduler_rss_peak_mb: float
    keys_left: int
    overruns: int
    mean_batch: float


@dataclass
class Report:
    """What ``daskpipe bench overload`` prints: the setting, then one row per level."""

    model: str
    dispatcher: str
    gpus: dict[str, int]
    time_dilation: float
    capacity_per_s: float
    slo_ms: float
    max_queued: int
    duration_s: float
    levels: list[Level] = field(default_factory=list)
    goodput_3x_over_1x: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class QueueSampler:
    """Samples, on the scheduler's event loop, what the plugin holds for a model: queued requests,
    their input bytes, and the process's resident memory (the scheduler's, with whatever shares
    its process). Started and stopped with ``cluster.sync`` so it runs on that loop."""

    def __init__(self, scheduler: Any, model: str, interval_s: float = 0.05):
        import psutil

        self.process = psutil.Process()
        self.scheduler = scheduler
        self.model = model
        self.interval_s = interval_s
        self.peaks = {"queued": 0, "queued_bytes": 0, "rss": 0}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self.peaks = {"queued": 0, "queued_bytes": 0, "rss": 0}
        self._task = asyncio.ensure_future(self._sample())

    async def stop(self) -> dict[str, int]:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._take()
        return dict(self.peaks)

    def _take(self) -> None:
        from daskpipe.runtime.scheduler.plugin import plugin_of

        ledger = plugin_of(self.scheduler).models.ledgers.get(self.model)
        queued = list(ledger.queued.values()) if ledger is not None else []
        sample = {"queued": len(queued), "queued_bytes": sum(len(payload) for payload, _ in queued), "rss": self.process.memory_info().rss}
        self.peaks = {k: max(v, sample[k]) for k, v in self.peaks.items()}

    async def _sample(self) -> None:
        while True:
            self._take()
            await asyncio.sleep(self.interval_s)


def profile_and_plan(model, example):
    """Estimated tables for the emulated GPU types, and the MILP's plan for ``GPUS``."""
    from daskpipe.plan.milp import make_plan
    from daskpipe.profiles.estimator import estimate_profile

    estimated = estimate_profile(model, example, gpus=sorted(GPUS), name=MODEL, slices=[1], num_blocks=4)
    profile = replace(estimated, latency_us={kind: table for kind, table in estimated.latency_us.items() if kind[1] == 1})
    return profile, make_plan({MODEL: profile}, GPUS, gpus_per_server=dict(GPUS))


def run_overload(
    loads: tuple[float, ...] = LOADS,
    *,
    duration: float = 10.0,
    capacity: float = 30.0,
    max_queued: int | None = None,
    dispatcher: str = "ppipe",
    processes: bool = True,
    seed: int = 0,
    advance: Callable[..., None] = lambda *a, **k: None,
) -> Report:
    """Serve the small CNN at each of ``loads`` x ``capacity`` req/s for ``duration`` s; one cluster for all.

    ``max_queued`` is the service's queue bound (``None``: the runtime's default); ``dispatcher``
    the runtime's dispatcher name (``"ppipe"`` or ``"ppipe-two-pass"``).
    """
    import torch
    from distributed import Client, wait

    from daskpipe.profiles.small_model import small_cnn
    from daskpipe.runtime.client.service import deploy
    from daskpipe.runtime.cluster import EmulatedCluster

    if not duration > 0 or not capacity > 0 or not loads or min(loads) <= 0:
        raise ValueError(
            f"duration, capacity and every load must be > 0; got duration={duration!r}, capacity={capacity!r}, loads={loads!r}"
        )
    torch.set_num_threads(1)  # the workers share these cores; oversubscribed OpenMP threads spin
    model = small_cnn()
    frames = torch.randn(DISTINCT_FRAMES, *INPUT_SHAPE, generator=torch.Generator().manual_seed(seed)).unsqueeze(1)
    profile, plan = profile_and_plan(model, frames[0])
    dilation = plan.model(MODEL).throughput / capacity
    with EmulatedCluster(GPUS, processes=processes, dashboard_address=None) as cluster, Client(cluster) as client:
        svc = deploy(
            client,
            {MODEL: model},
            example_inputs={MODEL: frames[0]},
            plan=plan,
            profiles={MODEL: profile},
            time_dilation=dilation,
            max_queued=max_queued,
            dispatcher=dispatcher,
        )
        with svc:
            batch = plan.model(MODEL).max_batch
            wait(svc.map(MODEL, [frames[i % DISTINCT_FRAMES] for i in range(3 * batch)]))  # one-time costs of fresh workers
            status = svc.status()[MODEL]
            slo_s = plan.model(MODEL).slo_us * dilation * 1e-6
            report = Report(MODEL, dispatcher, dict(GPUS), dilation, capacity, slo_s * 1e3, status["max_queued"], duration)
            sampler = QueueSampler(cluster.scheduler, MODEL)
            rng = np.random.default_rng(seed)
            for load in loads:
                report.levels.append(_level(svc, cluster, sampler, frames, load, capacity, duration, slo_s, rng))
                advance(note=f"{load:g}x done")
    by_load = {level.load: level.goodput_per_s for level in report.levels}
    if by_load.get(1.0) and 3.0 in by_load:
        report.goodput_3x_over_1x = by_load[3.0] / by_load[1.0]
    return report


def _level(svc, cluster, sampler: QueueSampler, frames, load: float, capacity: float, duration: float, slo_s: float, rng) -> Level:
    """One open-loop Poisson stream, then the tally: futures by end state, the plugin's counters
    for this stream alone (``after - before``), and the sampler's peaks."""
    from distributed import wait

    from daskpipe.benchmarks.runtime_overhead import settle

    rate = load * capacity
    arrivals = np.cumsum(rng.exponential(1 / rate, size=int(rate * duration * 1.5) + 10))
    arrivals = arrivals[arrivals < duration]
    before = svc.status()[MODEL]
    cluster.sync(sampler.start)
    futures = []
    start = time.perf_counter()
    for i, at in enumerate(arrivals):
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        futures.append(svc.submit(MODEL, frames[i % len(frames)]))
    wait(futures, timeout=slo_s + DRAIN_S)
    peaks = cluster.sync(sampler.stop)
    after = svc.status()[MODEL]
    ended = Counter(future.status for future in futures)
    submitted = len(futures)
    del futures
    settle(svc.client)
    on_time = after["on_time"] - before["on_time"]
    return Level(
        load=load,
        offered_per_s=submitted / duration,
        submitted=submitted,
        completed=ended["finished"],
        on_time=on_time,
        goodput_per_s=on_time / duration,
        attainment=on_time / max(submitted, 1),
        dropped={
            reason: n - before["dropped"].get(reason, 0) for reason, n in after["dropped"].items() if n > before["dropped"].get(reason, 0)
        },
        failed=after["failed"] - before["failed"],
        lost=submitted - ended["finished"] - ended["error"],
        queued_peak=peaks["queued"],
        queued_bytes_peak=peaks["queued_bytes"],
        scheduler_rss_peak_mb=peaks["rss"] / 2**20,
        keys_left=sum(not ts.actor for ts in list(cluster.scheduler.tasks.values())),
        overruns=after["overruns"] - before["overruns"],
        mean_batch=ended["finished"] / max(after["batches"] - before["batches"], 1),
    )


@click.command("overload")
@click.option(
    "--loads", default=",".join(f"{x:g}" for x in LOADS), show_default=True, help="Offered loads, as multiples of the plan's capacity."
)
@click.option("--duration", default=10.0, show_default=True, help="Seconds of Poisson stream per load.")
@click.option("--capacity", default=30.0, show_default=True, help="The plan's capacity after time dilation, in req/s (sets k).")
@click.option("--max-queued", type=int, default=None, help="The service's queue bound (default: the runtime's, two SLOs at capacity).")
@click.option(
    "--dispatcher",
    type=click.Choice(["ppipe", "ppipe-two-pass"]),
    default="ppipe",
    show_default=True,
    help="The runtime's dispatcher (ppipe-two-pass: PPipe with two-pass admission).",
)
@click.option("--processes/--in-process", default=True, show_default=True, help="Workers as processes, or threads of this process.")
@click.option("--seed", default=0, show_default=True, help="Seed of the Poisson arrivals and the input frames.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Also write the figures to this file.")
def bench_overload(
    loads: str, duration: float, capacity: float, max_queued: int | None, dispatcher: str, processes: bool, seed: int, json_path: str | None
) -> None:
    """Goodput, drops by reason, lost requests and scheduler memory from 0.5x to 3x of the plan's capacity."""
    try:
        levels = tuple(float(x) for x in loads.split(","))
    except ValueError:
        raise click.BadParameter(f"must be comma-separated numbers, got {loads!r}", param_hint="--loads") from None
    for value, hint in ((duration, "--duration"), (capacity, "--capacity"), (min(levels), "--loads")):
        if not value > 0:
            raise click.BadParameter(f"must be > 0, got {value:g}", param_hint=hint)
    if max_queued is not None and max_queued < 1:
        raise click.BadParameter("must be >= 1", param_hint="--max-queued")
    from daskpipe.progress import progress_bar

    with progress_bar("load levels", total=len(levels)) as advance:
        report = run_overload(
            levels,
            duration=duration,
            capacity=capacity,
            max_queued=max_queued,
            dispatcher=dispatcher,
            processes=processes,
            seed=seed,
            advance=advance,
        )
    text = json.dumps(report.to_dict(), indent=1)
    click.echo(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
