"""``daskpipe bench colocation-plan``: does sharing GPUs between models serve more, in simulation?

Every strategy plans the same models, weights and cluster (``make_plan``); each plan is then
simulated with Poisson arrivals in the models' weight mix, and the highest load at which every
model keeps ``target`` SLO attainment is found per model (``find_max_load``; with static
interference the models of a plan are independent runs). Loads are absolute: load factor 1 is
``weight_m · S`` req/s for model ``m``, with ``S`` the highest objective any strategy planned, so
every plan is fed the same rates. Per plan, ``throughput`` is the mix it sustains (the smallest
load factor over its models times ``Σ weight · S``), ``throughput_total`` what each model sustains
on its own, summed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import click

from daskpipe.plan.cli import FloatList, NameList, Pairs, echo_json, profiles_dir_or_default, profiles_option
from daskpipe.plan.milp import make_plan
from daskpipe.plan.options import COLOCATION_STRATEGIES, PlannerOptions
from daskpipe.plan.schema import Plan, PlanError
from daskpipe.profiles.model import Profile
from daskpipe.sim.config import SimulationConfig
from daskpipe.sim.simulate import find_max_load


def sustained(
    plan: Plan,
    profiles: Mapping[str, Profile],
    base_rates: Mapping[str, float],
    *,
    step: float,
    max_load: float,
    duration: float,
    seed: int,
    target: float,
) -> dict[str, Any]:
    """What ``plan`` sustains in simulation at ``target`` attainment, fed ``load · base_rates``."""
    config = SimulationConfig(duration=duration, seed=seed, base_rates=base_rates)
    result = find_max_load(plan, profiles, config, step=step, max_load=max_load, target=target)
    loads = result.max_load_factor
    return {
        "throughput": round(min(loads.values()) * sum(base_rates.values()), 2),
        "throughput_total": round(sum(loads[m] * base_rates[m] for m in loads), 2),
        "max_load_factor": loads,
        "at_edge": any(lf >= max_load for lf in loads.values()),  # then the figure is a lower bound
    }


def compare(
    profiles: Mapping[str, Profile],
    gpus: Mapping[str, int],
    strategies: Sequence[str],
    *,
    weights: Mapping[str, float] | None = None,
    gpus_per_server: Mapping[str, int] | None = None,
    bw_gbps: float = 10.0,
    margin: float = 0.4,
    duration: float = 10.0,
    seed: int = 1,
    target: float = 0.99,
    step: float = 0.02,
    max_load: float = 1.5,
    advance: Callable[..., None] = lambda *a, **k: None,
) -> dict[str, Any]:
    """Plan with every strategy, then simulate every plan at the same absolute rates."""
    weights = dict(weights) if weights is not None else {m: 1.0 for m in profiles}
    plans: dict[str, Plan] = {}
    figures: dict[str, dict[str, Any]] = {}
    for strategy in strategies:
        started = time.perf_counter()
        try:
            options = PlannerOptions(strategy=strategy, bw_gbps=bw_gbps, margin=margin)
            plans[strategy] = make_plan(profiles, gpus, weights=weights, gpus_per_server=gpus_per_server, options=options)
            figures[strategy] = {"objective": round(plans[strategy].objective, 2), "plan_seconds": round(time.perf_counter() - started, 2)}
        except PlanError as exc:
            figures[strategy] = {"objective": 0.0, "error": str(exc)}
        advance(0.5, note=f"planned {strategy}")
    scale = max((p.objective for p in plans.values()), default=0.0)
    if scale <= 0:
        raise PlanError(f"no strategy of {list(strategies)} serves every model on {dict(gpus)}: {figures}")
    base_rates = {m: w * scale for m, w in weights.items()}
    for strategy, plan in plans.items():
        figures[strategy].update(
            sustained(plan, profiles, base_rates, step=step, max_load=max_load, duration=duration, seed=seed, target=target)
        )
        figures[strategy]["gpus_used"] = {g: round(n, 3) for g, n in plan.gpus_used().items()}
        advance(0.5, note=f"simulated {strategy}")
    for strategy in strategies:
        if strategy not in plans:
            figures[strategy].update({"throughput": 0.0, "throughput_total": 0.0})
    return {
        "setting": {
            "models": list(profiles),
            "weights": weights,
            "gpus": dict(gpus),
            "margin": margin,
            "target_attainment": target,
            "duration_s": duration,
            "seed": seed,
            "arrivals": "poisson",
            "load_factor_1_req_s": base_rates,
        },
        "strategies": figures,
    }


@click.command("colocation-plan")
@profiles_option
@click.option(
    "--models",
    type=NameList(),
    default="colorization,googlenet,repvgg",
    show_default=True,
    help="Models (unique prefixes); default: group G2.",
)
@click.option("--weights", type=FloatList(), default="0.30,0.33,0.37", show_default=True, help="Workload mix, in --models order.")
@click.option("--gpus", type=Pairs(int, "COUNT"), default="L4=2,T4=2", show_default=True, help="The cluster.")
@click.option("--strategy", "strategies", multiple=True, help="Strategies (repeatable; default: np, ppipe and every co-location policy).")
@click.option("--margin", type=float, default=0.4, show_default=True)
@click.option("--duration", type=float, default=10.0, show_default=True, help="Simulated seconds per load point.")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Also write the figures here.")
def bench_colocation_plan(profiles_dir, models, weights, gpus, strategies, margin, duration, seed, json_path) -> None:
    """Plan with and without co-location on one cluster and compare what each plan sustains in simulation (JSON)."""
    from daskpipe.plan.options import STRATEGIES
    from daskpipe.profiles.loader import load_profiles
    from daskpipe.profiles.model import ProfileError
    from daskpipe.progress import progress_bar

    if len(weights) != len(models):
        raise click.BadParameter(f"{len(weights)} weights for {len(models)} models", param_hint="--weights")
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        raise click.BadParameter(f"unknown strategy {unknown}; choose from {list(STRATEGIES)}", param_hint="--strategy")
    chosen = list(strategies) or ["np", "ppipe", *COLOCATION_STRATEGIES]
    try:
        profiles = load_profiles(profiles_dir_or_default(profiles_dir), models)
        with progress_bar("planning and simulating", total=len(chosen)) as advance:
            figures = compare(
                profiles, gpus, chosen, weights=dict(zip(profiles, weights)), margin=margin, duration=duration, seed=seed, advance=advance
            )
    except (PlanError, ProfileError) as exc:
        raise click.ClickException(str(exc)) from None
    echo_json(figures, json_path)
