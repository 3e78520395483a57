"""``daskpipe bench plan``: plan the paper's model groups on its clusters with every strategy.

Reports what the issue's done-when asks for: the ppipe/np (and ppipe/dart-r) objective ratios per
case and per cluster next to the artifact's MILP-level figures, and the wall and CPU time of each
ppipe solve (enumeration and the NP pre-solve for the batch-build estimate included).
"""

from __future__ import annotations

import resource
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import click

from daskpipe.plan.cli import echo_json, profiles_dir_or_default, profiles_option
from daskpipe.plan.milp import make_plan
from daskpipe.plan.options import PlannerOptions
from daskpipe.plan.specs import group_cases

STRATEGIES = ("ppipe", "np", "dart-r")


def run_bench(
    profiles_dir: str | Path,
    *,
    cluster_names: Sequence[str] = ("HC1", "HC2", "HC3", "HC4"),
    group_names: Sequence[str] = ("G1", "G2", "G3", "G4"),
    solver: str = "auto",
    time_limit: float = 60,
    advance: Callable[..., None] | None = None,
) -> dict[str, Any]:
    """``advance(note=...)`` is called after each solve (3 strategies per case)."""
    cases, paper_ratio = [], {}
    for cluster, group, profiles, weights in group_cases(cluster_names, group_names, profiles_dir):
        paper_ratio[cluster.name] = cluster.paper_ratio
        case: dict[str, Any] = {"cluster": cluster.name, "group": group.name, "objective": {}, "seconds": {}, "cpu_seconds": {}}
        for strategy in STRATEGIES:
            started, cpu_started = time.perf_counter(), cpu_seconds()
            plan = make_plan(
                profiles,
                cluster.gpus,
                weights=weights,
                gpus_per_server=cluster.gpus_per_server,
                options=PlannerOptions(strategy=strategy, bw_gbps=cluster.bw_gbps, solver=solver, time_limit=time_limit),
            )
            case["seconds"][strategy] = time.perf_counter() - started
            case["cpu_seconds"][strategy] = cpu_seconds() - cpu_started
            case["objective"][strategy] = plan.objective
            case.setdefault("solver", plan.solver["name"])
            case.setdefault("status", {})[strategy] = plan.solver["status"]
            if advance is not None:
                advance(note=f"{group.name} on {cluster.name}, {strategy}")
        case["ratio"] = {f"ppipe/{s}": _ratio(case["objective"]["ppipe"], case["objective"][s]) for s in ("np", "dart-r")}
        cases.append(case)
    per_cluster = {}
    for cname in cluster_names:
        mine = [c for c in cases if c["cluster"] == cname]
        per_cluster[cname] = {
            key: {"mean": _mean([c["ratio"][key] for c in mine]), "paper": paper_ratio[cname].get(key)}
            for key in ("ppipe/np", "ppipe/dart-r")
        }
    wall = [c["seconds"]["ppipe"] for c in cases]
    cpu = [c["cpu_seconds"]["ppipe"] for c in cases]
    return {
        "profiles": str(profiles_dir),
        "solver": sorted({c["solver"] for c in cases}),
        "solve_seconds": {"median": statistics.median(wall), "worst": max(wall), "cases": len(cases)},
        "solve_cpu_seconds": {"median": statistics.median(cpu), "worst": max(cpu)},  # steadier than wall time on a shared machine
        "per_cluster": per_cluster,
        "cases": cases,
    }


@click.command("plan")
@profiles_option
@click.option("--solver", type=click.Choice(["auto", "cbc", "highs"]), default="auto", show_default=True)
@click.option("--time-limit", type=float, default=60, show_default=True, help="Solver time limit per plan, seconds.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Also write the figures here.")
def bench_plan(profiles_dir, solver, time_limit, json_out) -> None:
    """Plan groups G1-G4 on clusters HC1-HC4 with ppipe, np and dart-r; print ratios and solve times as JSON."""
    from daskpipe.plan.schema import PlanError
    from daskpipe.profiles.model import ProfileError
    from daskpipe.progress import progress_bar

    try:
        with progress_bar("planning G1-G4 on HC1-HC4", total=16 * len(STRATEGIES)) as advance:
            figures = run_bench(profiles_dir_or_default(profiles_dir), solver=solver, time_limit=time_limit, advance=advance)
    except (PlanError, ProfileError) as exc:
        raise click.ClickException(str(exc)) from None
    echo_json(figures, json_out)


def cpu_seconds() -> float:
    """CPU time of this process, solver threads included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _ratio(a: float, b: float) -> float | None:
    """``None`` where the baseline serves nothing (JSON has no infinity)."""
    return a / b if b > 0 else None


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None
