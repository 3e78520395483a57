"""``daskpipe bench subclusters``: Symphony's Appendix A.2 at 800 models over 20 sub-clusters.

Models are drawn from a seeded distribution shaped like Symphony's zoo under skewed traffic:
weights lognormal around 100 MB (sigma 0.8: MobileNets at a few MB to VGG-sized 600 MB at the
99th percentile), rates lognormal (sigma 1.0 by default: the busiest of 800 models carries about a
third of a sub-cluster's mean rate; at sigma 1.5 it can carry more than a whole one, and no split
balances) or exponential, as the paper's A.2 draws them. The MILP and
the random search get the same time; then every rate drifts (times a lognormal factor) and the
MILP re-splits from the old split, with a bound on the models it may move.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

from daskpipe.plan.cli import echo_json
from daskpipe.plan.options import SOLVERS
from daskpipe.plan.subclusters import NEIGHBOURHOOD, ModelDemand, SubclusterPlan, imbalance, partition, random_partition

WEIGHT_MEDIAN_BYTES = 100e6
WEIGHT_SIGMA = 0.8
RATE_MEDIAN = 10.0  # req/s; only the shares matter to the split


def zoo(n_models: int, *, seed: int, rates: str = "lognormal", rate_sigma: float = 1.0) -> list[ModelDemand]:
    """``n_models`` models with weights and rates drawn as the module says."""
    generator = np.random.default_rng(seed)
    weights = generator.lognormal(math.log(WEIGHT_MEDIAN_BYTES), WEIGHT_SIGMA, n_models)
    drawn = (
        generator.lognormal(math.log(RATE_MEDIAN), rate_sigma, n_models)
        if rates == "lognormal"
        else generator.exponential(RATE_MEDIAN, n_models)
    )
    return [ModelDemand(f"model-{i}", float(r), int(w)) for i, (w, r) in enumerate(zip(weights, drawn))]


def drifted(models: list[ModelDemand], *, seed: int, sigma: float) -> list[ModelDemand]:
    """The same models with every rate times an independent lognormal(0, ``sigma``) factor."""
    factors = np.random.default_rng(seed + 1).lognormal(0.0, sigma, len(models))
    return [ModelDemand(d.name, d.rate * float(f), d.weight_bytes, d.runtime_bytes) for d, f in zip(models, factors)]


def figures(plan: SubclusterPlan) -> dict[str, Any]:
    return {
        "seconds": plan.seconds,
        "rate_imbalance": plan.rate_imbalance,
        "memory_imbalance": plan.memory_imbalance,
        "objective": plan.objective,
        "status": plan.status,
        "solver": plan.solver,
    }


def run(
    *,
    n_models: int = 800,
    n_subclusters: int = 20,
    time_limit_s: float = 10.0,
    seed: int = 0,
    rates: str = "lognormal",
    rate_sigma: float = 1.0,
    drift_sigma: float = 0.5,
    max_moves: int = 40,
    solver: str = "auto",
    neighbourhood: int = NEIGHBOURHOOD,
) -> dict[str, Any]:
    models = zoo(n_models, seed=seed, rates=rates, rate_sigma=rate_sigma)
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    milp = partition(models, n_subclusters, time_limit_s=time_limit_s, solver=solver, neighbourhood=neighbourhood)
    search = random_partition(models, n_subclusters, time_limit_s=time_limit_s, seed=seed)
    shifted = drifted(models, seed=seed, sigma=drift_sigma)
    previous = milp.assignment
    stale = [sum(d.rate for d in shifted if previous[d.name] == j) for j in range(n_subclusters)]
    again = partition(
        shifted,
        n_subclusters,
        previous=previous,
        max_moves=max_moves,
        time_limit_s=time_limit_s,
        solver=solver,
        neighbourhood=neighbourhood,
    )
    busiest = max(d.rate for d in models) / (sum(d.rate for d in models) / n_subclusters)
    return {
        "models": n_models,
        "subclusters": n_subclusters,
        "time_limit_s": time_limit_s,
        "neighbourhood": neighbourhood,
        "distribution": {
            "weights": f"lognormal(median {WEIGHT_MEDIAN_BYTES / 1e6:g} MB, sigma {WEIGHT_SIGMA})",
            "rates": f"lognormal(median {RATE_MEDIAN:g}, sigma {rate_sigma})"
            if rates == "lognormal"
            else f"exponential(mean {RATE_MEDIAN:g})",
            "seed": seed,
            "busiest_model_share": busiest,  # of a sub-cluster's mean rate
            # no split does better: the busiest model's sub-cluster carries its rate, the least loaded at most the rest's mean
            "rate_imbalance_floor": max(0.0, busiest - (n_subclusters - busiest) / (n_subclusters - 1)) if n_subclusters > 1 else 0.0,
        },
        "milp": figures(milp),
        "random": {**figures(search), "splits": search.tried},
        "repartition": {
            "drift": f"every rate times lognormal(0, {drift_sigma})",
            "max_moves": max_moves,
            "stale_rate_imbalance": imbalance(stale),  # the old split under the new rates
            **figures(again),
            "moved": again.moved,
        },
        "wall_s": time.perf_counter() - began,
        "load_average": {"start": load_before, "end": os.getloadavg()[0]},  # others' work on the machine skews every figure
    }


@click.command("subclusters")
@click.option("--models", "n_models", type=click.IntRange(min=1), default=800, show_default=True)
@click.option("--subclusters", "n_subclusters", type=click.IntRange(min=1), default=20, show_default=True)
@click.option(
    "--time-limit",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds per split, for the MILP and the random search alike.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--rates",
    type=click.Choice(["lognormal", "exponential"]),
    default="lognormal",
    show_default=True,
    help="How models' rates are drawn (exponential: the paper's A.2).",
)
@click.option("--rate-sigma", type=click.FloatRange(min=0), default=1.0, show_default=True, help="Sigma of the lognormal rates.")
@click.option(
    "--drift-sigma",
    type=click.FloatRange(min=0),
    default=0.5,
    show_default=True,
    help="Sigma of the lognormal factor every rate is multiplied by before the re-split.",
)
@click.option("--max-moves", type=click.IntRange(min=0), default=40, show_default=True, help="Models the re-split may move.")
@click.option("--solver", type=click.Choice(SOLVERS), default="auto", show_default=True)
@click.option(
    "--neighbourhood",
    type=click.IntRange(min=2),
    default=NEIGHBOURHOOD,
    show_default=True,
    help="Sub-clusters one MILP re-splits at a time (>= --subclusters: one MILP over all).",
)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Also write the figures here.")
def bench_subclusters(
    n_models, n_subclusters, time_limit, seed, rates, rate_sigma, drift_sigma, max_moves, solver, neighbourhood, json_out
) -> None:
    """Split models into sub-clusters with Symphony's MILP and a random search in the same time, then re-split after
    a rate drift; print imbalances, times and moves as JSON."""
    from daskpipe.plan.schema import PlanError

    try:
        result = run(
            n_models=n_models,
            n_subclusters=n_subclusters,
            time_limit_s=time_limit,
            seed=seed,
            rates=rates,
            rate_sigma=rate_sigma,
            drift_sigma=drift_sigma,
            max_moves=max_moves,
            solver=solver,
            neighbourhood=neighbourhood,
        )
    except PlanError as exc:
        raise click.ClickException(str(exc)) from None
    echo_json(result, json_out)
