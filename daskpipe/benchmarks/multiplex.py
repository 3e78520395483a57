"""``daskpipe bench multiplex``: many models on one shared pool, on the runtime and in the simulator.

Twelve models of Symphony's 1080Ti zoo (Table 3: l(b) = alpha b + beta, SLO = max(20 ms, 2 l(4)))
share four emulated GPUs (``deploy(..., pools=SharedPools())``): every GPU holds every model, and
one dispatcher decides batch by batch which model a free GPU runs. The stages are hold-only (one
block that keeps every 64th value, held to the profiled latency), so two cores can drive them;
every latency and SLO is time-dilated by ``--time-dilation`` (the runtime's path, about a
millisecond or more a request on this machine, is then a smaller share of each SLO).

For each data plane, deferred (Symphony), eager and timeout (each of ``--timeouts``, the best
one reported), the same workload runs in the simulator (:func:`daskpipe.sim.simulate_pool`) and
on the runtime: Poisson arrivals at an equal rate per model, the same arrival times in both.

Goodput is Symphony's: the highest offered rate at which at least 99% of all requests end within
their SLO (the runtime: their output in the client's hands). It is found by bisection over the
offered rate, in the simulator and on the runtime alike, each trial on the same arrivals in both.
The runtime/simulator ratio is of those rates.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import click
import numpy as np
import torch
from torch import nn

from daskpipe.benchmarks.experiments import LinearModel, highest_rate

GPU = "T4"
GPUS = 4
SERVER = "node-0"
INPUT = (1, 64, 64)
MAX_BATCH = 32
TARGET = 0.99
WARM_UP_S = 1.0
RUNTIME_STEPS = (1.1, 1.0, 0.9, 0.8, 0.7, 0.5)
"""The runtime's trial rates, as shares of the simulator's goodput: from the top down to the first
that passes, so that a runtime at >= 0.9x the simulator's takes at most three trials."""
ZOO = (
    LinearModel("DenseNet121", 0.054, 10.546, 21.0),
    LinearModel("DenseNet201", 0.304, 14.345, 31.0),
    LinearModel("ResNet50V2", 0.135, 5.560, 20.0),
    LinearModel("EfficientNetB0", 0.115, 4.326, 20.0),
    LinearModel("ResNet152", 0.390, 10.449, 24.0),
    LinearModel("MobileNetV3Large", 0.196, 4.072, 20.0),
    LinearModel("ResNet50", 0.268, 5.172, 20.0),
    LinearModel("InceptionResNetV2", 1.112, 15.270, 39.0),
    LinearModel("InceptionV3", 0.913, 6.732, 20.0),
    LinearModel("VGG16", 0.660, 2.252, 20.0),
    LinearModel("NASNetLarge", 3.464, 7.154, 42.0),
    LinearModel("EfficientNetV2M", 4.479, 6.861, 49.0),
)
"""Twelve rows of Symphony's Table 4 (A100), from ``../shared/notes/001_symphony.md`` §6.10: beta/alpha
from 1.5 to 195, both batching regimes, SLOs of 20 to 49 ms."""


class KeepEvery64th(nn.Module):
    """A stage that computes next to nothing (every 64th value): the emulated GPU holds each batch to its profile."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., ::8, ::8].flatten(1)


def zoo_profiles(models: Sequence[LinearModel] = ZOO):
    """One-block profiles of ``models`` on a whole T4 (l(b) for b = 1..MAX_BATCH), each with its
    zoo SLO, and the stand-in module and example that serve them."""
    from daskpipe.profiles.fx import segment_model
    from daskpipe.profiles.model import Profile

    module, example = KeepEvery64th().eval(), torch.zeros(1, *INPUT)
    segmented = segment_model(module, example)
    bounds = [0, segmented.num_segments]
    blocked = segmented.cut(bounds)
    profiles = {
        m.name: Profile(
            model=m.name,
            slo_us=m.slo_ms * 1e3,
            num_blocks=1,
            latency_us={(GPU, 1): np.array([[m.latency_s(b) * 1e6 for b in range(1, MAX_BATCH + 1)]])},
            boundary_bytes=tuple(float(b) for b in blocked.boundary_bytes),
            input_shape=blocked.input_shape,
            boundary_shapes=tuple(blocked.boundary_shapes),
            meta={"segment_boundaries": bounds},
        )
        for m in models
    }
    return profiles, module, example


def pool_plan(profiles: dict) -> Any:
    """Every model on every one of the :data:`GPUS` GPUs."""
    from daskpipe.plan.shared import SharedGroup, shared_plan

    return shared_plan(profiles, [SharedGroup(tuple(profiles), {(GPU, 1): GPUS})])


def workload(names: Sequence[str], rate: float, duration: float, seed: int, *, min_requests: int = 0) -> list[tuple[float, str]]:
    """Poisson arrivals of ``rate`` req/s in all, an equal share per model: (time, model), sorted;
    over ``duration`` seconds, or longer at a low rate, so that about ``min_requests`` arrive (one
    late request then stays a small share of the 1% that the goodput's target lets miss)."""
    rng = np.random.default_rng(seed)
    duration = max(duration, min_requests / rate) if rate > 0 else duration
    arrivals = [(float(t), name) for name in names for t in np.cumsum(rng.exponential(len(names) / rate, int(2 * rate * duration)))]
    return sorted(a for a in arrivals if a[0] < duration)


@dataclass(frozen=True)
class Trials:
    """How every goodput is measured: trials of ``duration`` seconds of arrivals (profile time) at
    least, and of about ``min_requests`` requests at least; bisection to ``precision`` x the bound."""

    duration: float = 1.0
    seed: int = 1
    min_requests: int = 600
    precision: float = 0.002

    def arrivals(self, names: Sequence[str], rate: float) -> list[tuple[float, str]]:
        return workload(names, rate, self.duration, self.seed, min_requests=self.min_requests)


@dataclass(frozen=True)
class Policy:
    dataplane: str
    timeout_ms: float = 0.0

    @property
    def label(self) -> str:
        return f"timeout {self.timeout_ms:g} ms" if self.dataplane == "timeout" else self.dataplane


def sim_trial(plan: Any, profiles: dict, policy: Policy, arrivals: list[tuple[float, str]]) -> dict[str, Any]:
    """The simulator on ``arrivals``, in the profiles' time (the runtime runs them ``k`` times slower)."""
    from daskpipe.sched.api import Request, Slot
    from daskpipe.sim import simulate_pool
    from daskpipe.sim.engine import on_time

    slos = {m.name: m.slo_us * 1e-6 for m in plan.models}
    slots = [Slot(f"gpu{i}", GPU, 1, SERVER) for i in range(GPUS)]
    requests = (Request(i, name, t, t + slos[name]) for i, (t, name) in enumerate(arrivals))
    trace = simulate_pool(plan, profiles, policy.dataplane, slots, requests, timeout_s=policy.timeout_ms * 1e-3)
    good = sum(on_time(r) for r in trace.requests.values())
    sizes = [d.batch_size for _, d in trace.dispatches]
    return {
        "attainment": good / len(arrivals) if arrivals else 1.0,
        "mean_batch": float(np.mean(sizes)) if sizes else None,
        "dropped": sum(r.dropped is not None for r in trace.requests.values()),
    }


def pool_bound(plan: Any) -> float:
    """The pool's rate bound with equal shares (req/s): every model at its largest batch on every
    GPU, each taking the share of the pool that its share of the requests needs, i.e. the harmonic
    mean of the models' own whole-pool throughputs (their arithmetic mean is no bound: the slow
    models' shares cost more GPU time than the fast ones')."""
    return len(plan.models) / sum(1 / m.throughput for m in plan.models)


def sim_goodput(plan: Any, profiles: dict, policy: Policy, trials: Trials) -> float:
    """The highest offered rate (req/s, profile time) with >= 99% of requests on time, by bisection
    (:func:`~daskpipe.benchmarks.experiments.highest_rate`) to ``trials.precision`` x :func:`pool_bound`."""
    names = [m.name for m in plan.models]

    def meets(rate: float) -> bool:
        return sim_trial(plan, profiles, policy, trials.arrivals(names, rate))["attainment"] >= TARGET

    return highest_rate(meets, pool_bound(plan), trials.precision)


def runtime_trial(
    service: Any, slos_s: dict[str, float], example: torch.Tensor, arrivals: list[tuple[float, str]], k: float
) -> dict[str, Any]:
    """``arrivals`` (profile time) sent open-loop ``k`` times slower; a request is on time when its
    output is in a client thread's hands (``Service.as_completed``) within its model's SLO (dilated)
    of its scheduled send. Every request is accounted for: on time, late, dropped by reason,
    failed, or lost (not ended by the drain)."""
    from daskpipe.runtime.errors import RequestDropped

    due = np.array([at * k for at, _ in arrivals]) + time.perf_counter() + 0.2
    in_hand = np.full(len(arrivals), np.nan)
    completed = service.as_completed(timeout=float(due.max(initial=0.0)) - time.perf_counter() + max(slos_s.values()) + 10.0)
    index: dict[Any, int] = {}
    sending = threading.Event()
    sending.set()

    def collect() -> None:
        while True:
            still_sending = sending.is_set()
            try:
                future = next(completed)
            except StopIteration:
                if not still_sending:
                    return
                time.sleep(0.001)
                continue
            except TimeoutError:
                return
            in_hand[index[future.key]] = time.perf_counter()

    collector = threading.Thread(target=collect, name="multiplex-collector", daemon=True)
    collector.start()
    futures: list[Any] = []
    for (_, name), at in zip(arrivals, due):
        delay = at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        future = service.submit(name, example)
        index[future.key] = len(futures)
        futures.append(future)
        completed.add(future)
    sending.clear()
    collector.join()
    on_time = late = failed = lost = 0
    dropped: dict[str, int] = {}
    for (_, name), at, done, future in zip(arrivals, due, in_hand, futures):
        if np.isnan(done):
            lost += 1
        elif future.status == "finished":
            on_time += int(done - at <= slos_s[name])
            late += int(done - at > slos_s[name])
        elif isinstance(exc := future.exception(), RequestDropped):
            dropped[exc.reason] = dropped.get(exc.reason, 0) + 1
        else:
            failed += 1
    count = len(arrivals)
    return {
        "attainment": on_time / count if count else 1.0,
        "on_time": on_time,
        "late": late,
        "dropped": dropped,
        "failed": failed,
        "lost": lost,
    }


def measure_policy(
    client: Any,
    plan: Any,
    profiles: dict,
    module: nn.Module,
    example: torch.Tensor,
    policy: Policy,
    sim_rate: float,
    *,
    trials: Trials,
    k: float,
    advance: Callable[..., None],
) -> dict[str, Any]:
    """The runtime's goodput for ``policy``: its highest passing rate among ``sim_rate`` x
    :data:`RUNTIME_STEPS` (tried from the top down, stopping at the first pass), each trial on
    the simulator's arrivals at that rate, on one deployment."""
    import daskpipe
    from daskpipe.runtime.client.pools import SharedPools

    names = [m.name for m in plan.models]
    slos_s = {m.name: m.slo_us * 1e-6 * k for m in plan.models}
    rows = []
    service = daskpipe.deploy(
        client,
        {name: module for name in names},
        example_inputs={name: example for name in names},
        profiles=profiles,
        time_dilation=k,
        dispatcher=policy.dataplane,
        pools=SharedPools(timeout_ms=policy.timeout_ms),
    )
    best = 0.0
    with service:
        runtime_trial(service, slos_s, example, workload(names, 0.5 * sim_rate, WARM_UP_S, trials.seed + 1), k)
        for step in RUNTIME_STEPS:
            rate = step * sim_rate
            arrivals = trials.arrivals(names, rate)
            advance(0, note=f"{policy.label}: {rate:.0f} req/s on the runtime")
            gc.collect()
            runtime = runtime_trial(service, slos_s, example, arrivals, k)
            sim = sim_trial(plan, profiles, policy, arrivals)
            rows.append({"rate_per_s": rate, "requests": len(arrivals), "runtime": runtime, "sim": sim})
            if runtime["attainment"] >= TARGET:
                best = rate
                break
    return {"runtime_goodput_per_s": best, "trials": rows}


def run_multiplex(*, trials: Trials, time_dilation: float, timeouts_ms: Sequence[float], advance: Callable[..., None]) -> dict[str, Any]:
    """Every policy's goodput in the simulator; deferred's, eager's and the best timeout's on the runtime too."""
    import os

    from distributed import Client

    from daskpipe.runtime.cluster import EmulatedCluster

    load_before = os.getloadavg()
    profiles, module, example = zoo_profiles()
    plan = pool_plan(profiles)
    policies = [Policy("deferred"), Policy("eager"), *(Policy("timeout", t) for t in timeouts_ms)]
    advance(0, note="goodput in the simulator")
    sim = {policy: sim_goodput(plan, profiles, policy, trials) for policy in policies}
    timeouts = [p for p in policies if p.dataplane == "timeout"]
    best_timeout = max(timeouts, key=lambda p: sim[p])
    rows: dict[str, dict[str, Any]] = {
        p.label: {"sim_goodput_per_s": round(sim[p], 1), "on_runtime": p in (policies[0], policies[1], best_timeout)} for p in policies
    }
    advance(1, note=f"starting {GPUS} emulated {GPU}s")
    with EmulatedCluster({GPU: GPUS}, dashboard_address=None) as cluster, Client(cluster) as client:
        for policy in (policies[0], policies[1], best_timeout):
            measured = measure_policy(
                client, plan, profiles, module, example, policy, sim[policy], trials=trials, k=time_dilation, advance=advance
            )
            row = rows[policy.label]
            row.update(measured)
            row["ratio"] = measured["runtime_goodput_per_s"] / sim[policy] if sim[policy] else None
            advance(1)
    runtime = {label: row.get("runtime_goodput_per_s") for label, row in rows.items()}

    def over(figures: dict[str, Any], other: str) -> float | None:
        return figures["deferred"] / figures[other] if figures.get(other) else None

    sim_by_label = {p.label: sim[p] for p in policies}
    return {
        "models": [{"name": m.name, "alpha_ms": m.alpha_ms, "beta_ms": m.beta_ms, "slo_ms": m.slo_ms} for m in ZOO],
        "gpus": f"{GPUS} x {GPU} (emulated, hold-only)",
        "time_dilation": time_dilation,
        "duration_s": trials.duration,
        "min_requests": trials.min_requests,
        "seed": trials.seed,
        "pool_bound_per_s": round(pool_bound(plan), 1),
        "goodput": "the highest offered rate (req/s, before time dilation; equal per model, Poisson) with >= 99% of all requests on time",
        "best_timeout": best_timeout.label,
        "policies": rows,
        "deferred_over_eager": {"sim": over(sim_by_label, "eager"), "runtime": over(runtime, "eager")},
        "deferred_over_best_timeout": {"sim": over(sim_by_label, best_timeout.label), "runtime": over(runtime, best_timeout.label)},
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
    }


@click.command("multiplex")
@click.option("--duration", default=1.0, show_default=True, help="Seconds of arrivals per trial, before time dilation.")
@click.option("--min-requests", default=600, show_default=True, help="Requests per trial at the least (a low rate's trial runs longer).")
@click.option("--seed", default=1, show_default=True, help="Seeds the Poisson arrivals.")
@click.option("--time-dilation", default=20.0, show_default=True, help="Every latency and SLO is this many times longer on the runtime.")
@click.option(
    "--timeouts",
    default="1,2,5,10",
    show_default=True,
    help="The timeout policy's waits (ms, before time dilation); the best runs on the runtime.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Also write the figures to this file.")
def bench_multiplex(duration: float, min_requests: int, seed: int, time_dilation: float, timeouts: str, json_path: str | None) -> None:
    """Twelve zoo models sharing four emulated GPUs: goodput of deferred, eager and timeout batching, simulated and on the runtime."""
    from daskpipe.progress import progress_bar

    try:
        waits = [float(t) for t in timeouts.split(",") if t.strip()]
    except ValueError:
        raise click.BadParameter(f"a comma-separated list of milliseconds, got {timeouts!r}", param_hint="--timeouts") from None
    if not waits or any(not 0 <= t < float("inf") for t in waits):
        raise click.BadParameter(f"at least one wait, each >= 0 ms, got {timeouts!r}", param_hint="--timeouts")
    if not (duration > 0 and time_dilation > 0 and min_requests >= 0):
        raise click.BadParameter("--duration and --time-dilation must be > 0, --min-requests >= 0")
    with progress_bar("multiplex", total=4) as advance:
        figures = run_multiplex(
            trials=Trials(duration, seed, min_requests), time_dilation=time_dilation, timeouts_ms=waits, advance=advance
        )
    text = json.dumps(figures, indent=1)
    click.echo(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
