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


def constant_load(
    model: LinearModel, gpus: int, rate: float, duration: float, *, staggered: bool, max_batch: int = 64
) -> tuple[float, float]:
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


def highest_rate(meets: Callable[[float], bool], upper: float, precision: float) -> float:
    """Highest rate in ``[0, upper]`` that ``meets`` its target, by bisection (the target assumed
    met below some rate and missed above it), to ``precision`` x ``upper``; 0 if none is met."""
    lo, hi = 0.0, upper
    while hi - lo > precision * upper:
        mid = (lo + hi) / 2
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_rate(
    model: LinearModel, gpus: int, *, staggered: bool, duration: float = 1.0, target: float = 0.99, precision: float = 0.002
) -> tuple[float, float]:
    """Highest constant rate with ``target`` attainment (:func:`highest_rate`); returns (rate, mean
    batch there)."""
    batches: dict[float, float] = {}

    def meets(rate: float) -> bool:
        attained, batches[rate] = constant_load(model, gpus, rate, duration, staggered=staggered)
        return attained >= target

    rate = highest_rate(meets, gpus * model.gpu_rate_bound(), precision)
    return rate, batches.get(rate, math.nan)


def symphony_table2(gpus: int = 8, duration: float = 1.0, precision: float = 0.002) -> list[dict[str, Any]]:
    """Symphony's Table 2 by formula and by simulation."""
    rows = []
    for model in TABLE2_MODELS:
        for staggered in (True, False):
            batch, throughput = model.analytic(gpus, staggered)
            rate, mean_batch = max_rate(model, gpus, staggered=staggered, duration=duration, precision=precision)
            rows.append(
                {
                    "model": model.name,
                    "scheme": "staggered (deferred)" if staggered else "uncoordinated (per-GPU)",
                    "analytic_batch": batch,
                    "analytic_throughput": round(throughput, 1),
                    "simulated_throughput": round(rate, 1),
                    "simulated_mean_batch": round(mean_batch, 2),
                }
            )
    return rows


# The names of PPipe Fig. 6's clusters (Table 1, large, simulated) and model groups; their specs
# (GPUs, servers, bandwidth, models, workload shares) are read from plans/*.json by daskpipe.plan.specs.
PAPER_CLUSTERS = ("HC1", "HC2", "HC3", "HC4")
PAPER_GROUPS = ("G1", "G2", "G3", "G4")


def low_class(gpus: Mapping[str, int]) -> str:
    """The cluster's low-class GPU type: PPipe's clusters pair 25 high-class GPUs with 75 low-class ones."""
    return max(gpus, key=lambda gpu: gpus[gpu])


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def ppipe_experiment(
    profiles_dir: str | Path,
    *,
    clusters: Sequence[str] = PAPER_CLUSTERS,
    groups: Sequence[str] = PAPER_GROUPS,
    arrivals: Sequence[str] = ("poisson", "bursty"),
    strategies: Sequence[str] = ("ppipe", "np"),
    ablation_cluster: str | None = "HC2",
    duration: float = 30.0,
    seed: int = 1,
    time_limit: float = 60.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Max load factor (>= 99% attainment, steps of 0.05) of every model of ``groups`` on
    ``clusters``, for each planning strategy with PPipe's data plane, plus the ablation (the
    reactive data plane on PPipe's plan) on ``ablation_cluster``; Poisson runs also give low-class
    utilisation at each model's max load. Returns raw runs and the paper's summary figures."""
    from daskpipe.plan.milp import make_plan
    from daskpipe.plan.options import PlannerOptions
    from daskpipe.plan.schema import PlanError
    from daskpipe.plan.specs import group_cases
    from daskpipe.sim.config import SimulationConfig
    from daskpipe.sim.simulate import find_max_load

    if "ppipe" not in strategies:
        raise ValueError("strategies must include 'ppipe': load factors are relative to PPipe's plan")
    note = progress or (lambda _msg: None)
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    for cluster, group, profiles, weights in group_cases(clusters, groups, profiles_dir):
        where = {"cluster": cluster.name, "group": group.name}
        plans = {}
        for strategy in strategies:
            try:
                plans[strategy] = make_plan(
                    profiles,
                    cluster.gpus,
                    weights=weights,
                    gpus_per_server=cluster.gpus_per_server,
                    options=PlannerOptions(strategy=strategy, bw_gbps=cluster.bw_gbps, margin=0.4, max_parts=2, time_limit=time_limit),
                )
            except PlanError as exc:
                runs.append({**where, "strategy": strategy, "error": str(exc)})
        if "ppipe" not in plans:
            continue
        base_rates = {m.name: m.throughput for m in plans["ppipe"].models}
        cases = [(s, "ppipe", kind) for s in plans for kind in arrivals]
        if cluster.name == ablation_cluster:
            cases.append(("ppipe", "reactive", "poisson"))
        for strategy, dataplane, kind in cases:
            note(f"{cluster.name} {group.name} {strategy} plan, {dataplane} data plane, {kind}")
            config = SimulationConfig(dataplane=dataplane, arrivals=kind, duration=duration, seed=seed, base_rates=base_rates)
            result = find_max_load(plans[strategy], profiles, config)
            runs.append(
                {
                    **where,
                    "strategy": strategy,
                    "dataplane": dataplane,
                    "arrivals": kind,
                    "max_load_factor": result.max_load_factor,
                    "attainment": {m: r.attainment for m, r in result.models.items()},
                    "low_class_utilization": result.utilization.get(low_class(cluster.gpus), 0.0),
                    "utilization": result.utilization,
                    "plan_throughput": {m.name: m.throughput for m in plans[strategy].models},
                }
            )
    return {
        "settings": {
            "clusters": list(clusters),
            "groups": list(groups),
            "arrivals": list(arrivals),
            "strategies": list(strategies),
            "ablation_cluster": ablation_cluster,
            "duration": duration,
            "seed": seed,
            "seconds": round(time.perf_counter() - started, 1),
        },
        "summary": summarize(runs),
        "runs": runs,
    }


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The paper's figures: mean max LF per strategy and workload (Fig. 6), PPipe's gain over each
    baseline per cluster (ratio of mean max LFs minus 1), the ablation (Fig. 10) and low-class
    utilisation under Poisson (Fig. 8)."""

    def lfs(**match: str) -> list[float]:
        return [
            lf for r in runs if "error" not in r and all(r.get(k) == v for k, v in match.items()) for lf in r["max_load_factor"].values()
        ]

    done = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {"mean_max_load_factor": {}, "gain_over": {}, "low_class_utilization": {}, "ablation": {}}
    kinds = sorted({r["arrivals"] for r in done if r["dataplane"] == "ppipe"})
    strategies = sorted({r["strategy"] for r in done})
    for kind in kinds:
        out["mean_max_load_factor"][kind] = {s: _mean(lfs(strategy=s, dataplane="ppipe", arrivals=kind)) for s in strategies}
        for base in strategies:
            if base == "ppipe":
                continue
            gains = {}
            for cluster in sorted({r["cluster"] for r in done}):
                ours, theirs = (
                    _mean(lfs(cluster=cluster, strategy="ppipe", dataplane="ppipe", arrivals=kind)),
                    _mean(lfs(cluster=cluster, strategy=base, dataplane="ppipe", arrivals=kind)),
                )
                gains[cluster] = ours / theirs - 1 if ours and theirs else None
            out["gain_over"].setdefault(base, {})[kind] = gains
    for s in strategies:
        out["low_class_utilization"][s] = _mean(
            [r["low_class_utilization"] for r in done if r["strategy"] == s and r["dataplane"] == "ppipe" and r["arrivals"] == "poisson"]
        )
    for r in done:
        if r["dataplane"] == "reactive":
            cluster = r["cluster"]
            out["ablation"][cluster] = {
                "reactive": _mean(lfs(cluster=cluster, strategy="ppipe", dataplane="reactive", arrivals="poisson")),
                "ppipe": _mean(lfs(cluster=cluster, strategy="ppipe", dataplane="ppipe", arrivals="poisson")),
            }
    return out


@click.command("experiments")
@click.option(
    "--profiles",
    "profiles_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The PPipe profile folder (../shared/ppipe).",
)
@click.option(
    "--clusters", default=",".join(PAPER_CLUSTERS), show_default=True, help="Comma-separated cluster names (plans/clusters.json)."
)
@click.option("--groups", default=",".join(PAPER_GROUPS), show_default=True, help="Comma-separated model groups (plans/groups.json).")
@click.option("--arrivals", default="poisson,bursty", show_default=True, help="Comma-separated workloads.")
@click.option("--strategies", default="ppipe,np", show_default=True, help="Planning strategies (ppipe, np, dart-r).")
@click.option("--ablation-cluster", default="HC2", show_default=True, help="Where to run the reactive data plane ('' for nowhere).")
@click.option("--duration", type=float, default=30.0, show_default=True, help="Seconds of arrivals per run (the paper: 30).")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--time-limit", type=float, default=60.0, show_default=True, help="MILP time limit per plan.")
@click.option("--table2/--no-table2", default=True, show_default=True, help="Also simulate Symphony's Table 2.")
@click.option("--json", "json_path", required=True, type=click.Path(dir_okay=False, writable=True))
def experiments(
    profiles_dir, clusters, groups, arrivals, strategies, ablation_cluster, duration, seed, time_limit, table2, json_path
) -> None:
    """Reproduce PPipe's Figs. 6, 8, 10 (and Symphony's Table 2) in the simulator; write JSON."""

    def split(text: str) -> list[str]:
        return [x.strip() for x in text.split(",") if x.strip()]

    from daskpipe.progress import progress_bar

    try:
        with progress_bar("simulating", total=None) as advance:
            out = ppipe_experiment(
                profiles_dir,
                clusters=split(clusters),
                groups=split(groups),
                arrivals=split(arrivals),
                strategies=split(strategies),
                ablation_cluster=ablation_cluster or None,
                duration=duration,
                seed=seed,
                time_limit=time_limit,
                progress=lambda msg: advance(note=msg),
            )
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if table2:
        out["symphony_table2"] = symphony_table2()
    Path(json_path).write_text(json.dumps(out, indent=1))
    click.echo(json.dumps(out["summary"], indent=1))
