"""``daskpipe bench symphony``: Symphony's many-model results in the simulator (Fig. 6's β/α sweep
and Fig. 9's model zoo), every policy a dispatcher of :mod:`daskpipe.sched` over one set of GPUs
that each hold every model (a Symphony sub-cluster).

Policies:

* ``deferred``: :class:`~daskpipe.sched.symphony.DeferredDispatcher` (Symphony);
* ``eager``: :class:`~daskpipe.sched.batching.EagerDispatcher` (timeout 0; a freed GPU takes the
  most urgent batch: Clockwork's rule, and Nexus'/Shepherd's default batching);
* ``timeout``: :class:`~daskpipe.sched.batching.TimeoutDispatcher` with each model's timeout a share
  of its SLO (Fig. 6b), one run per share of a grid; the best share is reported, eager counted
  as share 0;
* ``shepherd``: :class:`~daskpipe.sched.batching.ShepherdDispatcher` (eager, a freed GPU takes the
  largest batch; no preemption).

Nexus is not among them: its scheduler places models on GPUs every 10 s (squishy bin packing),
each backend round-robins its own models, and frontends split each model's requests over the GPUs
that hold it, a placement algorithm of its own rather than a dispatcher over shared GPUs (Table 2's
"uncoordinated" row in ``daskpipe experiments`` is its one-model form).

Goodput (Symphony §5): the highest total request rate, split equally over the models (Poisson
arrivals each), at which every model has >= 99% of its requests finished by their deadlines,
found by :func:`~daskpipe.benchmarks.experiments.highest_rate`; one search per seed, and at each
rate every policy sees the same arrivals. Latency is exactly ``alpha*b + beta`` (emulated GPUs, as
the paper's large runs), with no network or control delay.
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import click
import numpy as np

from daskpipe.benchmarks.experiments import LinearModel, highest_rate
from daskpipe.sched.api import Dispatcher, Slot
from daskpipe.sched.batching import EagerDispatcher, ShepherdDispatcher, TimeoutDispatcher
from daskpipe.sched.symphony import DeferredDispatcher
from daskpipe.sim.engine import Engine, ReservedDurations, on_time
from daskpipe.sim.workload import Stream, stream_requests

ZOO_FILE = Path(__file__).resolve().parents[1] / "data" / "symphony_zoo.json"
TARGET = 0.99  # every model's share of requests on time
STRONG = 2.0  # beta/alpha above: a strong batching effect (Symphony §5.1)
SETTINGS = ("mixed", "strong", "weak")

# What Symphony's text states (its plots were lost in the text; no per-point numbers exist).
PAPER = {
    "fig6a": "alpha 1 ms, beta 1-15 ms, SLO 2 l(8), 32 GPUs, 10 models, Poisson: eager ~= deferred at beta/alpha 1, "
    "deferred's advantage grows with beta/alpha",
    "fig6b": "timeout = a share of each model's SLO: one ResNet50 (SLO 50 ms, 8 GPUs): the best timeout matches deferred; "
    "37 A100 models on 64 GPUs: timeout 'much lower' than deferred; too long a timeout loses goodput",
    "fig7_mixed_deferred_over_eager": [1.35, 2.02],
    "fig9_symphony_over_baseline_systems": {
        "1080ti": {"mixed": [2.0, 2.4], "strong": 3.5, "weak": 1.23},
        "a100": {"mixed": [2.0, 2.4], "strong": 5.7, "weak": 1.10},
    },
}


ZOOS = ("1080ti", "a100")
"""The zoo tables of ``ZOO_FILE``: Symphony's Table 3 (1080Ti) and Table 4 (A100)."""


def load_zoo(name: str) -> list[LinearModel]:
    """Symphony's Table 3 (``1080ti``, 35 models) or Table 4 (``a100``, 37 models)."""
    zoos = json.loads(ZOO_FILE.read_text())["zoos"]
    if name not in zoos:
        raise ValueError(f"unknown zoo {name!r}; have {sorted(zoos)}")
    return [LinearModel(row["name"], row["alpha_ms"], row["beta_ms"], row["slo_ms"]) for row in zoos[name]]


def zoo_setting(models: Sequence[LinearModel], setting: str) -> list[LinearModel]:
    """Fig. 9's settings: ``mixed`` all models, ``strong`` beta/alpha > 2, ``weak`` beta/alpha < 2."""
    if setting == "mixed":
        return list(models)
    if setting == "strong":
        return [m for m in models if m.beta_ms / m.alpha_ms > STRONG]
    if setting == "weak":
        return [m for m in models if m.beta_ms / m.alpha_ms < STRONG]
    raise ValueError(f"setting must be one of {SETTINGS}, got {setting!r}")


def fig6_models(count: int, beta_ms: float) -> list[LinearModel]:
    """Fig. 6a's synthetic profile: alpha 1 ms, SLO 2 l(8), ``count`` copies."""
    return [LinearModel(f"m{i}", 1.0, beta_ms, 2 * (8 + beta_ms)) for i in range(count)]


@dataclass(frozen=True)
class Policy:
    """A named way to build one dispatcher over shared GPUs; ``timeout_share`` for the timeout grid."""

    name: str
    timeout_share: float | None = None

    def build(self, models: Sequence[LinearModel], slots: Sequence[Slot], max_batch: int) -> Dispatcher:
        slos = {m.name: m.slo_ms / 1e3 for m in models}
        by_name = {m.name: m for m in models}

        def latency(model: str, batch: int) -> float:
            return by_name[model].latency_s(batch)

        if self.timeout_share is not None:
            waits = {name: self.timeout_share * slo for name, slo in slos.items()}
            return TimeoutDispatcher(slos, slots, latency, max_wait_s=waits, max_batch=max_batch)
        kinds: Mapping[str, Callable[..., Dispatcher]] = {
            "deferred": DeferredDispatcher,
            "eager": EagerDispatcher,
            "shepherd": ShepherdDispatcher,
        }
        return kinds[self.name](slos, slots, latency, max_batch=max_batch)


def policies(timeout_shares: Sequence[float], shepherd: bool) -> list[Policy]:
    out = [Policy("deferred"), Policy("eager")]
    out += [Policy(f"timeout {share:g}", share) for share in timeout_shares]
    return out + ([Policy("shepherd")] if shepherd else [])


@dataclass(frozen=True)
class Trials:
    """How one goodput is measured: one bisection per seed, each trial ``duration`` seconds of
    arrivals at least and long enough for ``min_requests`` per model (so that a trial at a low
    rate still resolves 1%), to ``precision`` x the rate bound."""

    seeds: tuple[int, ...] = (1,)
    duration: float = 1.0
    min_requests: int = 500
    precision: float = 0.01
    max_batch: int = 64


def attainments(models: Sequence[LinearModel], gpus: int, policy: Policy, rate: float, trials: Trials, seed: int) -> dict[str, float]:
    """Each model's share of requests on time with ``rate`` req/s in all, split equally."""
    duration = max(trials.duration, trials.min_requests * len(models) / rate)
    slots = [Slot(f"gpu{i}", "X") for i in range(gpus)]
    dispatcher = policy.build(models, slots, trials.max_batch)
    engine = Engine({m.name: dispatcher for m in models}, {s.id: s for s in slots}, ReservedDurations())
    streams = [Stream(m.name, m.name, rate / len(models), m.slo_ms / 1e3) for m in models]
    engine.add_arrivals(stream_requests(streams, duration, np.random.default_rng([seed, round(rate * 1e3)])))
    good = dict.fromkeys((m.name for m in models), 0)
    total = dict.fromkeys((m.name for m in models), 0)
    for record in engine.run().requests.values():
        total[record.model] += 1
        good[record.model] += on_time(record)
    return {name: good[name] / total[name] if total[name] else 1.0 for name in total}


def rate_bound(models: Sequence[LinearModel], gpus: int) -> float:
    """An upper bound on goodput with equal shares: every GPU at each model's best batch."""
    return gpus * len(models) / sum(1 / m.gpu_rate_bound() for m in models)


def goodput(models: Sequence[LinearModel], gpus: int, policy: Policy, trials: Trials, seed: int) -> float:
    """Highest total rate at which every model attains :data:`TARGET`."""

    def meets(rate: float) -> bool:
        return min(attainments(models, gpus, policy, rate, trials, seed).values()) >= TARGET

    return round(highest_rate(meets, rate_bound(models, gpus), trials.precision), 1)


def compare(
    models: Sequence[LinearModel], gpus: int, candidates: Sequence[Policy], trials: Trials, pool: Executor | None = None
) -> dict[str, Any]:
    """Every policy's goodput per seed and mean; the best timeout (eager as share 0); deferred's
    ratio to eager, to the best timeout and to Shepherd. With ``pool``, the searches run in it."""
    if pool is None:
        per_seed = {p.name: [goodput(models, gpus, p, trials, seed) for seed in trials.seeds] for p in candidates}
    else:
        futures = {p.name: [pool.submit(goodput, models, gpus, p, trials, seed) for seed in trials.seeds] for p in candidates}
        per_seed = {name: [f.result() for f in fs] for name, fs in futures.items()}
    mean = {name: round(float(np.mean(values)), 1) for name, values in per_seed.items()}
    grid = {0.0: mean["eager"]} | {p.timeout_share: mean[p.name] for p in candidates if p.timeout_share is not None}
    best_share = max(grid, key=lambda share: grid[share])
    deferred = mean["deferred"]

    def ratio(other: float) -> float | None:
        return round(deferred / other, 3) if other > 0 else None

    ratios = {"deferred_over_eager": ratio(mean["eager"]), "deferred_over_best_timeout": ratio(grid[best_share])}
    if "shepherd" in mean:
        ratios["deferred_over_shepherd"] = ratio(mean["shepherd"])
    return {
        "goodput": mean,
        "goodput_per_seed": per_seed,
        "best_timeout": {"share_of_slo": best_share, "goodput": grid[best_share]},
        **ratios,
    }


def fig6_sweep(
    betas: Sequence[float],
    model_counts: Sequence[int],
    gpus: int,
    timeout_shares: Sequence[float],
    trials: Trials,
    progress: Callable[[str], None] = lambda _msg: None,
    pool: Executor | None = None,
) -> list[dict[str, Any]]:
    """Fig. 6a (and 6b's grid): deferred against eager and every timeout as beta/alpha grows."""
    cases = []
    for count in model_counts:
        points = []
        for beta in betas:
            progress(f"fig. 6: {count} model(s), beta/alpha {beta:g}")
            models = fig6_models(count, beta)
            result = compare(models, gpus, policies(timeout_shares, shepherd=False), trials, pool)
            points.append({"beta_over_alpha": beta, "slo_ms": models[0].slo_ms, **result})
        cases.append({"models": count, "gpus": gpus, "points": points})
    return cases


def zoo_run(
    zoo: str,
    settings: Sequence[str],
    gpus: int,
    timeout_shares: Sequence[float],
    trials: Trials,
    progress: Callable[[str], None] = lambda _msg: None,
    pool: Executor | None = None,
) -> list[dict[str, Any]]:
    """Fig. 9's settings over a zoo: every policy's goodput, the models sharing ``gpus``."""
    everything = load_zoo(zoo)
    rows = []
    for setting in settings:
        models = zoo_setting(everything, setting)
        progress(f"zoo {zoo}: {setting} ({len(models)} models)")
        result = compare(models, gpus, policies(timeout_shares, shepherd=True), trials, pool)
        rows.append({"setting": setting, "models": len(models), "gpus": gpus, **result})
    return rows


def split_numbers(text: str, kind: Callable[[str], Any], what: str) -> list[Any]:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise click.BadParameter(f"{what} is empty")
    return values


QUICK = {
    "betas": "1,15",
    "models": "4",
    "gpus": 8,
    "seeds": "1",
    "timeouts": "0.2",
    "settings": "weak",
    "zoo_gpus": 8,
    "duration": 0.3,
    "zoo_duration": 1.0,
    "precision": 0.03,
    "min_requests": 100,
}


@click.command("symphony")
@click.option("--gpus", type=click.IntRange(min=1), default=32, show_default=True, help="Fig. 6's GPUs (the paper: 32).")
@click.option("--models", default="1,10", show_default=True, help="Fig. 6: comma-separated model counts (the paper: 10).")
@click.option("--betas", default="1,2,4,8,15", show_default=True, help="Fig. 6: beta (ms) with alpha 1 ms, comma-separated.")
@click.option("--timeouts", default="0.05,0.1,0.2,0.3,0.4", show_default=True, help="Timeout grid: shares of each model's SLO.")
@click.option("--zoo", type=click.Choice(ZOOS), default=ZOOS[0], show_default=True, help="Table 3 or Table 4.")
@click.option("--settings", default=",".join(SETTINGS), show_default=True, help="Fig. 9's settings to run ('' for none).")
@click.option("--zoo-gpus", type=click.IntRange(min=1), default=64, show_default=True, help="GPUs the zoo shares (the paper: 64).")
@click.option("--seeds", default="1", show_default=True, help="Comma-separated seeds; one goodput search each.")
@click.option("--duration", type=float, default=1.0, show_default=True, help="Fig. 6: seconds of arrivals per trial.")
@click.option("--zoo-duration", type=float, default=3.0, show_default=True, help="Zoo: seconds of arrivals per trial.")
@click.option("--precision", type=float, default=0.01, show_default=True, help="Bisection stops within this share of the bound.")
@click.option("--min-requests", type=click.IntRange(min=1), default=500, show_default=True, help="Per model and trial, at the least.")
@click.option("--max-batch", type=click.IntRange(min=1), default=64, show_default=True, help="Largest batch of every model.")
@click.option(
    "--jobs", type=click.IntRange(min=1), default=os.cpu_count() or 1, show_default="the CPUs", help="Processes for the searches."
)
@click.option("--quick", is_flag=True, help="A tiny sweep for tests: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()) + ".")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Write the results here.")
def bench_symphony(quick: bool, json_path: str | None, **options: Any) -> None:
    """Symphony's Fig. 6 beta/alpha sweep and its zoo (Fig. 9) in the simulator: deferred against
    eager, the best timeout and Shepherd's rule; prints the ratios (and with --json writes everything)."""
    from daskpipe.progress import progress_bar

    if quick:
        options |= QUICK
    precision, duration, zoo_duration = options["precision"], options["duration"], options["zoo_duration"]
    if not (0 < precision < 1):
        raise click.BadParameter(f"--precision must be in (0, 1), got {precision}")
    for name, value in (("--duration", duration), ("--zoo-duration", zoo_duration)):
        if not (value > 0 and math.isfinite(value)):
            raise click.BadParameter(f"{name} must be a positive number of seconds, got {value}")
    shares = split_numbers(options["timeouts"], float, "--timeouts")
    if any(not 0 < s < 1 for s in shares):
        raise click.BadParameter(f"--timeouts must be shares of the SLO in (0, 1), got {options['timeouts']!r}")
    counts = split_numbers(options["models"], int, "--models")
    if any(c < 1 for c in counts):
        raise click.BadParameter(f"--models must be counts >= 1, got {options['models']!r}")
    betas = split_numbers(options["betas"], float, "--betas")
    if any(not (b > 0 and math.isfinite(b)) for b in betas):
        raise click.BadParameter(f"--betas must be positive numbers of ms, got {options['betas']!r}")
    settings = [s.strip() for s in options["settings"].split(",") if s.strip()]
    if bad := [s for s in settings if s not in SETTINGS]:
        raise click.BadParameter(f"--settings must be among {SETTINGS}, got {bad}")
    seeds = split_numbers(options["seeds"], int, "--seeds")
    started = time.perf_counter()
    trials = Trials(tuple(seeds), duration, options["min_requests"], precision, options["max_batch"])
    zoo_trials = replace(trials, duration=zoo_duration)
    with progress_bar("simulating", total=None) as advance, ProcessPoolExecutor(options["jobs"]) as pool:
        note = lambda msg: advance(note=msg)  # noqa: E731
        fig6 = fig6_sweep(betas, counts, options["gpus"], shares, trials, note, pool)
        zoo_rows = zoo_run(options["zoo"], settings, options["zoo_gpus"], shares, zoo_trials, note, pool)
    out = {
        "settings": {
            "gpus": options["gpus"],
            "models": counts,
            "betas_ms": betas,
            "alpha_ms": 1.0,
            "timeout_shares": shares,
            "zoo": options["zoo"],
            "zoo_gpus": options["zoo_gpus"],
            "seeds": seeds,
            "duration_s": duration,
            "zoo_duration_s": zoo_duration,
            "min_requests": options["min_requests"],
            "precision": precision,
            "max_batch": options["max_batch"],
            "target": TARGET,
            "jobs": options["jobs"],
            "seconds": round(time.perf_counter() - started, 1),
        },
        "fig6": fig6,
        "zoo": zoo_rows,
        "paper": PAPER,
    }
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))
    ratios = ("deferred_over_eager", "deferred_over_best_timeout", "deferred_over_shepherd")
    summary = {
        "fig6": [
            {"models": case["models"], "beta_over_alpha": p["beta_over_alpha"], **{k: p[k] for k in ratios if k in p}}
            for case in fig6
            for p in case["points"]
        ],
        "zoo": [{"setting": row["setting"], **{k: row[k] for k in ratios}} for row in zoo_rows],
    }
    click.echo(json.dumps(summary, indent=1))
