"""``daskpipe bench goodput``: the highest request rate a real model is served at within its SLO,
beside the plan's promise and the machine's limit.

A torchvision model (random weights, fp32, one ``3 x S x S`` image per request) is deployed with
``daskpipe.deploy`` on a ``LocalCluster`` of plain CPU workers (``COUNTxTHREADS``), started without
the allocator setting that halves torch (:mod:`daskpipe.runtime.worker.environ`). For each SLO, open-loop
Poisson trials from the client search the highest rate at which at least ``GOAL`` of the requests
are in the client's hands within the SLO, timed from each request's *scheduled* send time, so a
client that falls behind its schedule counts against the runtime, as a real caller would see it.
Each trial runs on a freshly deployed, warmed-up service with the SLO's plan, so that what an
overloaded trial leaves behind (queues, dispatch state) cannot spoil the next one.

The machine's limit is measured in the same run, before the cluster starts and after it closes:
``COUNT`` bare torch processes of ``THREADS`` threads each run the same model back to back at batch
1, at the same time; the better of the two counts (other work on the machine only slows a run). The model is
profiled once, by the first deploy on the cluster's worker, and each SLO is planned from that profile.

Beside them, the simulator's highest rate on the same plan, found by the same search, with each
compute drawn from the measured/profiled ratios of the batches the met trials ran: what the plan
reaches with this machine's compute noise and no control path, so that a run tells what the
runtime loses from what the machine's noise does. And the same search with every compute exactly
as profiled: what Poisson arrivals at 99% attainment allow the plan at all. A plan's throughput is
a capacity; no runtime serves more than this share of it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, TypeVar

import click
import numpy as np

if TYPE_CHECKING:
    from daskpipe.plan.schema import Plan
    from daskpipe.profiles.model import Profile

logger = logging.getLogger(__name__)

GOAL = 0.99  # share of requests in the client's hands within the SLO
GROWTH = 1.25  # next rate after a met trial while no rate has failed yet
SHRINK = 0.7  # next rate after a missed trial while no rate has been met yet
PRECISION = 0.05  # the search stops once the failing rate is within this of the met one
DRAIN_S = 10.0  # after the stream and one SLO, requests still not in hand count as missed
DISTINCT_IMAGES = 8
WARMUP_FORWARDS = 3
SIM_SEEDS = 5  # the simulator's attainment at a rate: the mean over this many Poisson streams
SIM_TRIALS = 12  # simulated trials cost milliseconds: the simulator's search may close in further


@dataclass
class Trial:
    """One open-loop stream at ``rate`` req/s on a fresh service, and how its requests ended."""

    rate: float
    submitted: int
    in_hand: int
    on_time: int
    dropped: int
    failed: int
    pending: int
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    mean_batch: float | None
    drop_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def attainment(self) -> float:
        return self.on_time / max(self.submitted, 1)

    @property
    def met(self) -> bool:
        return self.attainment >= GOAL

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "attainment": self.attainment, "met": self.met}


@dataclass
class SloResult:
    """The search at one SLO, beside the plan it served and the machine's limit."""

    slo_ms: float
    plan_throughput: float
    planned_batches: list[int]
    profile_threads: int | None
    machine_limit: float = 0.0  # known once the run's last bare torch measurement is done
    trials: list[Trial] = field(default_factory=list)
    compute_ratios: list[float] = field(default_factory=list)  # measured/profiled, of the met trials' recent batches
    sim_max_rate: float | None = None  # the simulator's, on the same plan with those ratios as its latency noise
    sim_exact_max_rate: float | None = None  # the simulator's with computes exactly as profiled: what the arrivals alone allow

    @property
    def best(self) -> Trial | None:
        return max((t for t in self.trials if t.met), key=lambda t: t.rate, default=None)

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        max_rate = best.rate if best else 0.0
        return {
            "max_rate": max_rate,
            "plan_throughput": self.plan_throughput,
            "machine_limit": self.machine_limit,
            "of_plan": max_rate / self.plan_throughput if self.plan_throughput else None,
            "of_machine_limit": max_rate / self.machine_limit if self.machine_limit else None,
            "sim_max_rate": self.sim_max_rate,
            "of_sim": max_rate / self.sim_max_rate if self.sim_max_rate else None,
            "sim_exact_max_rate": self.sim_exact_max_rate,
            "sim_exact_of_plan": self.sim_exact_max_rate / self.plan_throughput
            if self.sim_exact_max_rate and self.plan_throughput
            else None,
            "compute_ratios": {
                "samples": len(self.compute_ratios),
                **(
                    {f"p{q}": float(v) for q, v in zip((50, 90, 99), np.percentile(self.compute_ratios, [50, 90, 99]))}
                    if self.compute_ratios
                    else {}
                ),
            },
            "mean_batch": best.mean_batch if best else None,
            "planned_batches": self.planned_batches,
            "attainment": best.attainment if best else None,
            "latency_p99_ms": best.latency_p99_ms if best else None,
            "profile_threads": self.profile_threads,
            "trials": [t.to_dict() for t in self.trials],
        }


class Outcome(Protocol):
    """A trial at ``rate`` of either search, the runtime's (:class:`Trial`) or the simulator's (:class:`SimTrial`)."""

    rate: float

    @property
    def met(self) -> bool: ...


T = TypeVar("T", bound=Outcome)


def search_max_rate(run_trial: Callable[[float], T], start: float, *, trials: int, ceiling: float = math.inf) -> list[T]:
    """Trials from ``start`` req/s: up by ``GROWTH`` until one misses, down by ``SHRINK`` until one is
    met, then bisection until the missed rate is within ``PRECISION`` of the met one; at most
    ``trials`` trials, none above ``ceiling``."""
    met, missed = 0.0, math.inf
    rate = min(start, ceiling)
    done: list[T] = []
    for _ in range(trials):
        trial = run_trial(rate)
        done.append(trial)
        if trial.met:
            met = max(met, rate)
        else:
            missed = min(missed, rate)
        if missed <= met * (1 + PRECISION) or met >= ceiling:
            break
        rate = min(met * GROWTH, ceiling) if missed == math.inf else missed * SHRINK if met == 0 else (met + missed) / 2
    return done


@dataclass
class SimTrial:
    """The simulator's attainment at ``rate``: the mean over :data:`SIM_SEEDS` Poisson streams."""

    rate: float
    attainment: float

    @property
    def met(self) -> bool:
        return self.attainment >= GOAL


def sim_max_rate(
    plan: Plan, profile: Profile, ratios: Sequence[float], start: float, *, duration: float, seed: int, ceiling: float = math.inf
) -> float:
    """The highest rate the simulator serves ``plan``'s one model at (the same search as the
    runtime's), its computes drawn from ``ratios`` x the profile: what this plan reaches with the
    compute noise the runtime measured at the rates it served, and no control path."""
    from daskpipe.sim import SimulationConfig, simulate

    (model_plan,) = plan.models
    profiles = {model_plan.name: profile}
    configs = [SimulationConfig(duration=duration, seed=seed + k, latency_ratios=list(ratios) or None) for k in range(SIM_SEEDS)]

    def trial(rate: float) -> SimTrial:
        load = rate / model_plan.throughput
        return SimTrial(
            rate, float(np.mean([simulate(plan, profiles, c, load_factor=load).models[model_plan.name].attainment for c in configs]))
        )

    return max((t.rate for t in search_max_rate(trial, start, trials=SIM_TRIALS, ceiling=ceiling) if t.met), default=0.0)


def compute_ratios(dask_scheduler: Any, model: str) -> list[float]:
    """On the scheduler: the measured/profiled compute ratios of ``model``'s recent batches, its stages pooled."""
    from daskpipe.runtime.scheduler.plugin import plugin_of

    ledger = plugin_of(dask_scheduler).models.ledgers.get(model)
    return [] if ledger is None else [r for ratios in ledger.dispatcher.ratio_samples().values() for r in ratios]


def machine_limit(model: str, image_size: int, processes: int, threads: int, seconds: float) -> float:
    """Images/s of ``processes`` bare torch processes with ``threads`` threads each, at batch 1, all at once."""
    from distributed.utils import get_mp_context  # as Dask starts its workers: spawn unless configured

    from daskpipe.runtime.worker.environ import drop_allocator_settings

    drop_allocator_settings()  # they run as the stage workers do
    context = get_mp_context()
    ready = context.Barrier(processes)
    rates = context.Queue()
    runners = [
        context.Process(target=_bare_torch, args=(model, image_size, threads, seconds, ready, rates), daemon=True) for _ in range(processes)
    ]
    for runner in runners:
        runner.start()
    try:
        outcomes = [rates.get(timeout=seconds + 300) for _ in runners]
    finally:
        for runner in runners:
            runner.join(timeout=30)
    failures = [outcome for outcome in outcomes if isinstance(outcome, str)]
    if failures:
        raise RuntimeError(f"the bare torch run of {model} failed: {failures[0]}")
    return sum(outcomes)


def _bare_torch(model: str, image_size: int, threads: int, seconds: float, ready: Any, rates: Any) -> None:
    """One process of :func:`machine_limit`: its img/s, or why it failed (the others then stop too)."""
    import torch

    try:
        torch.set_num_threads(threads)
        module, image = build_model(model), torch.randn(1, 3, image_size, image_size)
        with torch.inference_mode():
            for _ in range(WARMUP_FORWARDS):
                module(image)
            ready.wait()
            forwards, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                module(image)
                forwards += 1
        rates.put(forwards / (time.perf_counter() - start))
    except Exception as exc:  # reported to the parent, which raises it
        ready.abort()
        rates.put(f"{type(exc).__name__}: {exc}")


def build_model(name: str):
    """The torchvision classifier ``name`` with random weights (nothing is downloaded), in eval mode."""
    import torch
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None).eval()


def run_trial(service: Any, model: str, images: Sequence[Any], rate: float, duration: float, slo_s: float, seed: int) -> Trial:
    """Open-loop Poisson arrivals at ``rate`` for ``duration`` s; each request's latency runs from its
    scheduled send time until its output is in this process (fetched if it did not ride the completion)."""
    from distributed import wait

    from daskpipe.benchmarks.remote_client import mark_in_hand
    from daskpipe.runtime.errors import RequestDropped

    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, size=int(rate * duration * 1.5) + 10))
    arrivals = arrivals[arrivals < duration]
    ended_at: dict[int, float] = {}
    before = service.status()[model]
    futures = []
    start = time.perf_counter()
    while len(futures) < len(arrivals):
        now = time.perf_counter() - start
        due = int(np.searchsorted(arrivals, now, side="right"))
        if due == len(futures):
            time.sleep(arrivals[due] - now)
            continue
        for index, future in enumerate(service.map(model, [images[i % len(images)] for i in range(len(futures), due)]), start=len(futures)):
            future.add_done_callback(partial(mark_in_hand, ended_at, index))
            futures.append(future)
    give_up = start + duration + slo_s + DRAIN_S
    while len(ended_at) < len(futures) and time.perf_counter() < give_up:
        time.sleep(0.05)
    try:  # the next trial starts on a drained service
        wait(futures, timeout=max(give_up - time.perf_counter(), 0) + DRAIN_S)
    except TimeoutError:
        logger.warning("goodput: %d requests at %.1f req/s still pending after the drain", sum(not f.done() for f in futures), rate)
    after = service.status()[model]
    latencies = np.array([ended_at[i] - start - arrivals[i] for i in sorted(ended_at)])
    p50, p99 = (float(q) * 1e3 for q in np.percentile(latencies, [50, 99])) if latencies.size else (None, None)
    errors = [future.exception() for future in futures if future.status == "error"]
    dropped = sum(isinstance(error, RequestDropped) for error in errors)
    batches = after["batches"] - before["batches"]
    return Trial(
        rate=rate,
        submitted=len(futures),
        in_hand=len(latencies),
        on_time=int((latencies <= slo_s).sum()),
        dropped=dropped,
        failed=len(errors) - dropped,
        pending=sum(not future.done() for future in futures),
        latency_p50_ms=p50,
        latency_p99_ms=p99,
        mean_batch=(after["completed"] - before["completed"]) / batches if batches else None,
        drop_reasons={
            reason: n - before["dropped"].get(reason, 0) for reason, n in after["dropped"].items() if n > before["dropped"].get(reason, 0)
        },
    )


def run_goodput(
    *,
    model: str = "resnet18",
    workers: tuple[int, int] = (2, 1),
    slos_ms: Sequence[float] = (500.0, 200.0),
    duration: float = 20.0,
    trials: int = 6,
    limit_seconds: float = 10.0,
    image_size: int = 224,
    max_rate: float = math.inf,
    seed: int = 0,
    advance: Callable[..., None] = lambda *a, **k: None,
) -> dict[str, Any]:
    """The figures of ``daskpipe bench goodput`` (see the module's docstring)."""
    import torch
    from distributed import Client, LocalCluster

    import daskpipe
    from daskpipe.runtime.worker.environ import environments, probe_worker, stage_worker_environ

    count, threads = workers
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    advance(0, note="the machine's limit, bare torch")
    limits = [machine_limit(model, image_size, count, threads, limit_seconds)]
    advance(note=f"machine limit {limits[0]:.1f} img/s; starting {count}x{threads} workers")
    module = build_model(model)
    images = list(torch.randn(DISTINCT_IMAGES, 1, 3, image_size, image_size, generator=torch.Generator().manual_seed(seed)))
    results: dict[str, SloResult] = {}
    with (
        stage_worker_environ(),
        LocalCluster(n_workers=count, threads_per_worker=threads, processes=True, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        worker_warnings = [w for report in environments(client.run(probe_worker)) for w in report.warnings()]
        profile = None
        for slo_ms in slos_ms:
            advance(0, note=f"SLO {slo_ms:g} ms: profiling and planning" if profile is None else f"SLO {slo_ms:g} ms: planning")
            with daskpipe.deploy(
                client,
                {model: module},
                example_inputs={model: images[0]},
                slo_ms={model: slo_ms},
                profiles={model: replace(profile, slo_us=slo_ms * 1e3)} if profile else None,
            ) as planned:
                profile, plan = planned.profiles[model], planned.plan
            model_plan = plan.model(model)
            result = results[f"{slo_ms:g}"] = SloResult(
                slo_ms, model_plan.throughput, [p.batch_size for p in model_plan.pipelines], profile.meta.get("cpu_threads")
            )

            def trial(rate: float) -> Trial:
                with daskpipe.deploy(
                    client, {model: module}, example_inputs={model: images[0]}, plan=plan, profiles={model: profile}
                ) as service:
                    _warm_up(service, model, images, model_plan.max_batch)
                    done = run_trial(service, model, images, rate, duration, slo_ms / 1e3, seed + len(result.trials))
                    if done.met:  # an overloaded trial's contention is not the noise of a rate that is served
                        result.compute_ratios += client.run_on_scheduler(compute_ratios, model=model)
                result.trials.append(done)
                advance(note=f"SLO {slo_ms:g} ms: {rate:.1f} req/s, {done.attainment:.1%} on time")
                return done

            start = min(model_plan.throughput, limits[0])
            search_max_rate(trial, start, trials=trials, ceiling=max_rate)
            result.sim_max_rate = sim_max_rate(plan, profile, result.compute_ratios, start, duration=duration, seed=seed, ceiling=max_rate)
            result.sim_exact_max_rate = sim_max_rate(plan, profile, [], start, duration=duration, seed=seed, ceiling=max_rate)
            advance(trials - len(result.trials))
    advance(0, note="the machine's limit again")
    limits.append(machine_limit(model, image_size, count, threads, limit_seconds))
    advance()
    for result in results.values():
        result.machine_limit = max(limits)
    return {
        "model": model,
        "input_shape": [3, image_size, image_size],
        "workers": f"{count}x{threads}",
        "cluster": f"LocalCluster, {count} worker process(es) x {threads} thread(s), plain CPU",
        "goal": GOAL,
        "trial_duration_s": duration,
        "machine_limit": {
            "img_per_s": max(limits),
            "runs": limits,
            "processes": count,
            "threads": threads,
            "batch": 1,
            "seconds": limit_seconds,
        },
        "worker_warnings": worker_warnings,
        "slos": {name: result.to_dict() for name, result in results.items()},
        "wall_s": time.perf_counter() - began,
        "load_average": {"start": load_before, "end": os.getloadavg()[0]},  # others' work on the machine skews every figure
    }


def _warm_up(service: Any, model: str, images: Sequence[Any], batch: int) -> None:
    """Full batches first: fresh stages pay one-time costs (allocator growth, connections) that
    would count as misses in the first trial."""
    from distributed import wait

    wait(service.map(model, [images[i % len(images)] for i in range(3 * batch)]))


# -- the command ----------------------------------------------------------------------------------


def parse_workers(text: str) -> tuple[int, int]:
    """``"2x1"`` -> ``(2, 1)``: worker processes x threads each."""
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text)
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise click.BadParameter(f"takes COUNTxTHREADS with both >= 1, like 2x1 or 1x2; got {text!r}", param_hint="--workers")
    return int(match[1]), int(match[2])


def parse_slos(text: str) -> list[float]:
    """``"500,200"`` -> ``[500.0, 200.0]``: positive milliseconds, each once."""
    try:
        slos = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        slos = []
    if not slos or min(slos) <= 0 or not all(math.isfinite(s) for s in slos) or len(set(slos)) < len(slos):
        raise click.BadParameter(f"takes distinct positive milliseconds, like 500,200; got {text!r}", param_hint="--slo-ms")
    return slos


def check_model(name: str) -> str:
    """``name`` if torchvision has a classifier of that name."""
    import torchvision

    known = torchvision.models.list_models(module=torchvision.models)
    if name not in known:
        raise click.BadParameter(
            f"torchvision has no classifier {name!r}; try resnet18, resnet50 or mobilenet_v3_small", param_hint="--model"
        )
    return name


@click.command("goodput")
@click.option("--model", default="resnet18", show_default=True, help="A torchvision classifier, random weights, fp32.")
@click.option(
    "--workers", "workers_text", default="2x1", show_default=True, help="COUNTxTHREADS: CPU worker processes x threads each (2x1, 1x2)."
)
@click.option("--slo-ms", "slo_text", default="500,200", show_default=True, help="SLOs to search at, in milliseconds.")
@click.option(
    "--duration", type=click.FloatRange(min=0, min_open=True), default=20.0, show_default=True, help="Seconds of Poisson stream per trial."
)
@click.option("--trials", type=click.IntRange(min=1), default=6, show_default=True, help="Most trials per SLO.")
@click.option(
    "--limit-seconds",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds of bare torch for the machine's limit.",
)
@click.option("--image-size", type=click.IntRange(min=16), default=224, show_default=True, help="Requests are 1 x 3 x SIZE x SIZE images.")
@click.option("--max-rate", type=click.FloatRange(min=0, min_open=True), default=None, help="Try no rate above this (req/s).")
@click.option("--seed", default=0, show_default=True, help="Seed of the images and the arrivals.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Also write the figures to this file.")
def bench_goodput(
    model: str,
    workers_text: str,
    slo_text: str,
    duration: float,
    trials: int,
    limit_seconds: float,
    image_size: int,
    max_rate: float | None,
    seed: int,
    json_path: str | None,
) -> None:
    """Highest req/s of a torchvision model within each SLO (>= 99% in hand, open-loop Poisson), beside the plan's
    throughput and the machine's limit measured with bare torch in the same run."""
    workers, slos_ms = parse_workers(workers_text), parse_slos(slo_text)
    check_model(model)
    from daskpipe.progress import progress_bar

    with progress_bar("goodput", total=2 + len(slos_ms) * trials) as advance:
        figures = run_goodput(
            model=model,
            workers=workers,
            slos_ms=slos_ms,
            duration=duration,
            trials=trials,
            limit_seconds=limit_seconds,
            image_size=image_size,
            max_rate=max_rate or math.inf,
            seed=seed,
            advance=advance,
        )
    for slo, row in figures["slos"].items():
        click.echo(
            f"SLO {slo} ms: max {row['max_rate']:.1f} req/s | plan {row['plan_throughput']:.1f} req/s | machine limit "
            f"{row['machine_limit']:.1f} img/s | simulator {row['sim_max_rate'] or 0:.1f} req/s "
            f"({row['sim_exact_max_rate'] or 0:.1f} with exact computes) | mean batch {row['mean_batch'] or 0:.2f}",
            err=True,
        )
    text = json.dumps(figures, indent=1)
    click.echo(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
