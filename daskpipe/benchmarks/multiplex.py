"""``daskpipe bench multiplex``: many models on one shared pool, on the runtime and in the simulator.

Twelve models of Symphony's zoo (l(b) = alpha b + beta, SLO = max(20 ms, 2 l(4))) share four
emulated GPUs (``deploy(..., pools=SharedPools())``): every GPU holds every model, and one
dispatcher decides batch by batch which model a free GPU runs. The stages are hold-only (one
block that keeps every 64th value, held to the profiled latency), so two cores can drive them;
every latency and SLO is time-dilated by ``--time-dilation`` (the runtime's path, about a
millisecond or more a request on this machine, is then a smaller share of each SLO).

Their profiles are by default the twelve rows of Table 3 (1080Ti): the table of Symphony's
mixed-model comparison with eager (Fig. 7), and of its two GPUs the nearer to the emulated T4s;
``--zoo a100`` takes Table 4's rows, whose batches cost far more than their requests (beta/alpha
up to 195): there deferred and eager tie within the search's resolution (docs/batching.md).

The workload is Symphony's (§3.4, §5): Poisson arrivals, every model equally popular. The
policies are its Fig. 6 baselines: deferred (Symphony), eager, and timeout with each model's wait a
share of its SLO (Fig. 6b; one run per share of ``--timeouts``, the best reported). The same
arrivals run in the simulator (:func:`daskpipe.sim.simulate_pool`) and on the runtime.

Goodput is Symphony's: the highest offered rate at which every model has at least 99% of its
requests done within its SLO (the runtime: their output in the client's hands), found by
bisection over the offered rate in the simulator, and on the runtime at steps of the simulator's.
``--sweep-gpus`` also finds the simulator's goodputs with the same twelve models on other GPU
counts: Symphony evaluated one GPU a model or more (docs/batching.md, "Shared pools").
``--fig6-beta`` serves ``--fig6-models`` copies of Fig. 6a's synthetic profile instead of the zoo,
where batching pays (beta/alpha up to 15) and the simulator finds deferred ahead of eager.
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
from daskpipe.benchmarks.symphony import ZOOS, load_zoo

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
TWELVE = (
    "DenseNet121",
    "DenseNet201",
    "ResNet50V2",
    "EfficientNetB0",
    "ResNet152",
    "MobileNetV3Large",
    "ResNet50",
    "InceptionResNetV2",
    "InceptionV3",
    "VGG16",
    "NASNetLarge",
    "EfficientNetV2M",
)
"""The zoo's models the pool serves: both batching regimes (beta/alpha from 0.7 to 9.7 on the
1080Ti, 1.5 to 195 on the A100), SLOs of 20 to 210 ms (1080Ti) or 20 to 49 ms (A100)."""


def zoo_models(zoo: str = ZOOS[0]) -> list[LinearModel]:
    """The :data:`TWELVE` models' rows of Symphony's ``zoo`` table (``../shared/notes/001_symphony.md`` §6.10)."""
    rows = {m.name: m for m in load_zoo(zoo)}
    return [rows[name] for name in TWELVE]


TIMEOUT_SHARES = (0.02, 0.05, 0.1, 0.2, 0.3)
"""The timeout policy's waits, as shares of each model's SLO (Fig. 6b's axis)."""


class KeepEvery64th(nn.Module):
    """A stage that computes next to nothing (every 64th value): the emulated GPU holds each batch to its profile."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., ::8, ::8].flatten(1)


def zoo_profiles(models: Sequence[LinearModel] | None = None):
    """One-block profiles of ``models`` (default: :func:`zoo_models`) on a whole T4 (l(b) for
    b = 1..MAX_BATCH), each with its zoo SLO, and the stand-in module and example that serve them."""
    from daskpipe.profiles.fx import segment_model
    from daskpipe.profiles.model import Profile

    models = zoo_models() if models is None else models
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


def pool_plan(profiles: dict, gpus: int = GPUS) -> Any:
    """Every model on every one of ``gpus`` GPUs."""
    from daskpipe.plan.shared import SharedGroup, shared_plan

    return shared_plan(profiles, [SharedGroup(tuple(profiles), {(GPU, 1): gpus})])


def gpus_of(plan: Any) -> int:
    """The GPUs of a one-sub-cluster pool's plan (each model has a pipeline on every one)."""
    return sum(pipeline.partitions[0].vgpus for pipeline in plan.models[0].pipelines)


def workload(names: Sequence[str], rate: float, duration: float, seed: int, *, min_requests: int = 0) -> list[tuple[float, str]]:
    """Poisson arrivals of ``rate`` req/s in all, an equal share per model: (time, model), sorted;
    over ``duration`` seconds, or longer at a low rate, so that about ``min_requests`` arrive for
    each model (one late request is then at most a share of the 1% that the goodput lets a model miss)."""
    rng = np.random.default_rng(seed)
    duration = max(duration, min_requests * len(names) / rate) if rate > 0 else duration
    arrivals = [(float(t), name) for name in names for t in np.cumsum(rng.exponential(len(names) / rate, int(2 * rate * duration)))]
    return sorted(a for a in arrivals if a[0] < duration)


@dataclass(frozen=True)
class Trials:
    """How every goodput is measured: trials of ``duration`` seconds of arrivals (profile time) at
    least, and of about ``min_requests`` requests per model at least; bisection to ``precision`` x
    the search's upper bound."""

    duration: float = 1.0
    seed: int = 1
    min_requests: int = 200
    precision: float = 0.002

    def arrivals(self, names: Sequence[str], rate: float) -> list[tuple[float, str]]:
        return workload(names, rate, self.duration, self.seed, min_requests=self.min_requests)


@dataclass(frozen=True)
class Policy:
    """A data plane; ``timeout_share``: the timeout plane's wait as a share of each model's SLO."""

    dataplane: str
    timeout_share: float = 0.0

    @property
    def label(self) -> str:
        return f"timeout {self.timeout_share:g} SLO" if self.dataplane == "timeout" else self.dataplane

    def waits_ms(self, plan: Any) -> dict[str, float] | None:
        """Each model's wait (ms, before time dilation), for the timeout plane."""
        return {m.name: self.timeout_share * m.slo_us / 1e3 for m in plan.models} if self.dataplane == "timeout" else None


def attainments(outcomes: Sequence[tuple[str, bool]]) -> dict[str, Any]:
    """Of (model, on time) pairs: the least model's share on time (what the goodput's target is
    read against), all requests' share, and the model that had the least."""
    good: dict[str, int] = {}
    total: dict[str, int] = {}
    for name, on_time in outcomes:
        total[name] = total.get(name, 0) + 1
        good[name] = good.get(name, 0) + int(on_time)
    shares = {name: good[name] / total[name] for name in total}
    worst = min(shares, key=lambda name: shares[name]) if shares else None
    return {
        "attainment": shares[worst] if worst is not None else 1.0,
        "worst_model": worst,
        "overall": sum(good.values()) / len(outcomes) if outcomes else 1.0,
    }


def sim_trial(plan: Any, profiles: dict, policy: Policy, arrivals: list[tuple[float, str]]) -> dict[str, Any]:
    """The simulator on ``arrivals``, in the profiles' time (the runtime runs them ``k`` times
    slower); ``busy``: the GPUs' busy share until the last batch ends."""
    from daskpipe.sched.api import Request, Slot
    from daskpipe.sim import simulate_pool
    from daskpipe.sim.engine import on_time

    slos = {m.name: m.slo_us * 1e-6 for m in plan.models}
    slots = [Slot(f"gpu{i}", GPU, 1, SERVER) for i in range(gpus_of(plan))]
    requests = (Request(i, name, t, t + slos[name]) for i, (t, name) in enumerate(arrivals))
    waits = policy.waits_ms(plan)
    timeout_s = {name: ms * 1e-3 for name, ms in waits.items()} if waits is not None else 0.0
    trace = simulate_pool(plan, profiles, policy.dataplane, slots, requests, timeout_s=timeout_s)
    computes = [d.hops[0].compute for _, d in trace.dispatches]
    sizes = [d.batch_size for _, d in trace.dispatches]
    end = max((c.end for c in computes), default=0.0)
    return {
        **attainments([(r.model, on_time(r)) for r in trace.requests.values()]),
        "mean_batch": round(float(np.mean(sizes)), 2) if sizes else None,
        "busy": round(sum(c.end - c.start for c in computes) / (len(slots) * end), 3) if end > 0 else 0.0,
        "dropped": sum(r.dropped is not None for r in trace.requests.values()),
    }


def pool_bound(plan: Any) -> float:
    """The bisection's upper bound (req/s, equal shares): every model at its largest batch on
    every GPU, each taking the share of the pool that its share of the requests needs, i.e. the
    harmonic mean of the models' own whole-pool throughputs. No pool reaches it: a batch of b
    forms only where a model gets b requests within its SLO less l(b), and with three models a GPU
    at the zoo's SLOs (2 l(4)) it gets one to two (docs/batching.md, "Shared pools")."""
    return len(plan.models) / sum(1 / m.throughput for m in plan.models)


def sim_goodput(plan: Any, profiles: dict, policy: Policy, trials: Trials) -> float:
    """The highest offered rate (req/s, profile time) at which every model has >= 99% of its
    requests on time, by bisection (:func:`~daskpipe.benchmarks.experiments.highest_rate`) to
    ``trials.precision`` x :func:`pool_bound`."""
    names = [m.name for m in plan.models]

    def meets(rate: float) -> bool:
        return sim_trial(plan, profiles, policy, trials.arrivals(names, rate))["attainment"] >= TARGET

    return highest_rate(meets, pool_bound(plan), trials.precision)


@dataclass(frozen=True)
class SimGoodputs:
    """Every policy's simulated goodput on one pool, with its mean batch and the GPUs' busy share there."""

    gpus: int
    found: dict[Policy, float]
    at_goodput: dict[Policy, dict[str, Any]]

    @property
    def best_timeout(self) -> Policy:
        return max((p for p in self.found if p.dataplane == "timeout"), key=lambda p: self.found[p])

    def of(self, dataplane: str) -> float:
        return next(found for p, found in self.found.items() if p.dataplane == dataplane)

    def summary(self) -> dict[str, Any]:
        """Goodputs (req/s), the best timeout, and deferred's ratios to eager and to it."""
        deferred = self.of("deferred")
        return {
            "gpus": self.gpus,
            "policies": {p.label: {"goodput_per_s": round(found, 1), **self.at_goodput[p]} for p, found in self.found.items()},
            "best_timeout": self.best_timeout.label,
            **{
                f"deferred_over_{name}": round(deferred / other, 3) if other else None
                for name, other in (("eager", self.of("eager")), ("best_timeout", self.found[self.best_timeout]))
            },
        }


def sim_goodputs(plan: Any, profiles: dict, policies: Sequence[Policy], trials: Trials) -> SimGoodputs:
    """Every policy's goodput in the simulator (``policies``: deferred, eager and timeouts)."""
    names = [m.name for m in plan.models]
    found = {p: sim_goodput(plan, profiles, p, trials) for p in policies}
    at_goodput = {}
    for p in policies:
        trial = sim_trial(plan, profiles, p, trials.arrivals(names, found[p])) if found[p] > 0 else {}
        at_goodput[p] = {"mean_batch": trial.get("mean_batch"), "busy": trial.get("busy")}
    return SimGoodputs(gpus_of(plan), found, at_goodput)


def runtime_trial(
    service: Any, slos_s: dict[str, float], example: torch.Tensor, arrivals: list[tuple[float, str]], k: float
) -> dict[str, Any]:
    """``arrivals`` (profile time) sent open-loop ``k`` times slower; a request is on time when its
    output is in a client thread's hands (``Service.as_completed``) within its model's SLO (dilated)
    of its scheduled send. Every request is accounted for: on time, late (and by how much, real
    time), dropped by reason, failed, or lost (not ended by the drain)."""
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
    failed = lost = 0
    late_by: list[float] = []
    dropped: dict[str, int] = {}
    outcomes = []
    for (_, name), at, done, future in zip(arrivals, due, in_hand, futures):
        on_time = False
        if np.isnan(done):
            lost += 1
        elif future.status == "finished":
            on_time = bool(done - at <= slos_s[name])
            if not on_time:
                late_by.append(done - at - slos_s[name])
        elif isinstance(exc := future.exception(), RequestDropped):
            dropped[exc.reason] = dropped.get(exc.reason, 0) + 1
        else:
            failed += 1
        outcomes.append((name, on_time))
    return {
        **attainments(outcomes),
        "late": len(late_by),
        "late_by_ms": {"p50": round(float(np.median(late_by)) * 1e3, 1), "max": round(max(late_by) * 1e3, 1)} if late_by else None,
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
    the simulator's arrivals at that rate, on one deployment; and after them the pool's control
    path, and where its late requests lost their time (each model's, warm-up included: the
    scheduler's ``late`` legs)."""
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
        pools=SharedPools(timeout_ms=policy.waits_ms(plan)),
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
            rows.append({"rate_per_s": round(rate, 1), "requests": len(arrivals), "runtime": runtime, "sim": sim})
            if runtime["attainment"] >= TARGET:
                best = rate
                break
        status = service.status()
    control = status[names[0]]["control"]  # the pool's: its models share one control path
    path = {key: round(value, 2) for key, value in control.items() if key.endswith("_ms") or key == "batches"}
    late = {name: status[name]["late"] for name in names if status[name]["late"]["requests"]}
    return {"runtime_goodput_per_s": round(best, 1), "trials": rows, "control_path": path, "late_legs": late}


def run_multiplex(
    *,
    trials: Trials,
    time_dilation: float,
    timeout_shares: Sequence[float],
    sweep_gpus: Sequence[int],
    sim_only: bool,
    advance: Callable[..., None],
    models: Sequence[LinearModel],
    zoo: str,
    gpus: int = GPUS,
) -> dict[str, Any]:
    """Every policy's goodput in the simulator for ``models`` (from ``zoo``, named in the figures) on ``gpus`` GPUs; unless
    ``sim_only``, deferred's, eager's and the best timeout's on the runtime too; with
    ``sweep_gpus``, the simulator's on those GPU counts."""
    import os

    load_before = os.getloadavg()
    profiles, module, example = zoo_profiles(models)
    plan = pool_plan(profiles, gpus)
    policies = [Policy("deferred"), Policy("eager"), *(Policy("timeout", share) for share in timeout_shares)]
    advance(0, note="goodput in the simulator")
    sim = sim_goodputs(plan, profiles, policies, trials)
    figures: dict[str, Any] = {
        "zoo": zoo,
        "models": [{"name": m.name, "alpha_ms": m.alpha_ms, "beta_ms": m.beta_ms, "slo_ms": m.slo_ms} for m in models],
        "gpus": f"{gpus} x {GPU} (emulated, hold-only)",
        "time_dilation": time_dilation,
        "duration_s": trials.duration,
        "min_requests_per_model": trials.min_requests,
        "seed": trials.seed,
        "bisection_bound_per_s": round(pool_bound(plan), 1),
        "goodput": "the highest offered rate (req/s, before time dilation; equal per model, Poisson) at which every model "
        "has >= 99% of its requests on time",
        "sim": sim.summary(),
    }
    if not sim_only:
        figures["runtime"] = on_runtime(plan, profiles, module, example, sim, trials=trials, k=time_dilation, advance=advance)
    sweep = []
    for gpus in sweep_gpus:
        advance(0, note=f"the simulator on {gpus} GPUs")
        sweep.append(sim_goodputs(pool_plan(profiles, gpus), profiles, policies, trials).summary())
    figures["sim_sweep_gpus"] = sweep
    figures["load_average"] = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
    return figures


def on_runtime(
    plan: Any,
    profiles: dict,
    module: nn.Module,
    example: torch.Tensor,
    sim: SimGoodputs,
    *,
    trials: Trials,
    k: float,
    advance: Callable[..., None],
) -> dict[str, Any]:
    """Deferred's, eager's and the best timeout's goodput on the runtime, each against the simulator's."""
    from distributed import Client

    from daskpipe.runtime.cluster import EmulatedCluster

    policies = [p for p in sim.found if p.dataplane != "timeout"] + [sim.best_timeout]
    rows: dict[str, dict[str, Any]] = {}
    gpus = gpus_of(plan)
    advance(1, note=f"starting {gpus} emulated {GPU}s")
    with EmulatedCluster({GPU: gpus}, dashboard_address=None) as cluster, Client(cluster) as client:
        for policy in policies:
            found = sim.found[policy]
            measured = measure_policy(client, plan, profiles, module, example, policy, found, trials=trials, k=k, advance=advance)
            rows[policy.label] = {"ratio": round(measured["runtime_goodput_per_s"] / found, 3) if found else None, **measured}
            advance(1)
    goodput = {label: row["runtime_goodput_per_s"] for label, row in rows.items()}
    best = sim.best_timeout.label
    return {
        "policies": rows,
        **{
            f"deferred_over_{name}": round(goodput["deferred"] / goodput[other], 3) if goodput[other] else None
            for name, other in (("eager", "eager"), ("best_timeout", best))
        },
    }


def numbers(text: str, kind: Callable[[str], Any], option: str) -> list[Any]:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"a comma-separated list, got {text!r}", param_hint=option) from None


@click.command("multiplex")
@click.option("--duration", default=1.0, show_default=True, help="Seconds of arrivals per trial, before time dilation.")
@click.option(
    "--min-requests", default=200, show_default=True, help="Requests per model and trial at the least (a low rate's trial runs longer)."
)
@click.option("--seed", default=1, show_default=True, help="Seeds the Poisson arrivals.")
@click.option("--time-dilation", default=20.0, show_default=True, help="Every latency and SLO is this many times longer on the runtime.")
@click.option(
    "--timeouts",
    default=",".join(f"{s:g}" for s in TIMEOUT_SHARES),
    show_default=True,
    help="The timeout policy's waits, as shares of each model's SLO; the best runs on the runtime.",
)
@click.option(
    "--zoo",
    type=click.Choice(ZOOS),
    default=ZOOS[0],
    show_default=True,
    help="The Symphony table the twelve models' profiles come from: 1080ti (Table 3) or a100 (Table 4).",
)
@click.option("--gpus", default=GPUS, show_default=True, type=click.IntRange(min=1), help="Emulated GPUs the models share.")
@click.option("--sweep-gpus", default="", help="Also the simulator's goodputs of the same models on these GPU counts (comma-separated).")
@click.option("--sim-only", is_flag=True, help="The simulator's goodputs only (no runtime).")
@click.option(
    "--fig6-beta",
    type=click.FloatRange(min=0, min_open=True),
    help="Instead of the zoo: copies of Symphony's Fig. 6a profile (alpha 1 ms, this beta in ms, SLO 2 l(8)).",
)
@click.option("--fig6-models", default=10, show_default=True, type=click.IntRange(min=1), help="How many copies --fig6-beta serves.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Also write the figures to this file.")
def bench_multiplex(
    duration: float,
    min_requests: int,
    seed: int,
    time_dilation: float,
    timeouts: str,
    zoo: str,
    gpus: int,
    sweep_gpus: str,
    sim_only: bool,
    fig6_beta: float | None,
    fig6_models: int,
    json_path: str | None,
) -> None:
    """Twelve zoo models (or Fig. 6a's) sharing emulated GPUs: the goodput of deferred, eager and timeout batching, simulated and run."""
    from daskpipe.benchmarks.symphony import fig6_models as fig6
    from daskpipe.progress import progress_bar

    shares = numbers(timeouts, float, "--timeouts")
    if not shares or any(not 0 < s < 1 for s in shares):
        raise click.BadParameter(f"at least one share of the SLO, each in (0, 1), got {timeouts!r}", param_hint="--timeouts")
    counts = numbers(sweep_gpus, int, "--sweep-gpus")
    if any(c < 1 for c in counts):
        raise click.BadParameter(f"GPU counts >= 1, got {sweep_gpus!r}", param_hint="--sweep-gpus")
    if not (duration > 0 and time_dilation > 0 and min_requests >= 0):
        raise click.BadParameter("--duration and --time-dilation must be > 0, --min-requests >= 0")
    with progress_bar("multiplex", total=4) as advance:
        trials = Trials(duration, seed, min_requests)
        figures = run_multiplex(
            trials=trials,
            time_dilation=time_dilation,
            timeout_shares=shares,
            sweep_gpus=counts,
            sim_only=sim_only,
            advance=advance,
            models=zoo_models(zoo) if fig6_beta is None else fig6(fig6_models, fig6_beta),
            zoo=zoo if fig6_beta is None else f"fig. 6a, beta {fig6_beta:g} ms",
            gpus=gpus,
        )
    text = json.dumps(figures, indent=1)
    click.echo(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
