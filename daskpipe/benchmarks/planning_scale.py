"""``daskpipe bench planning``: how long plans for growing inventories take, and how good they are.

The default suite is issue #45's table: PPipe's setting (group G1 on V100 + P4), the same with 3
partitions, G1 on four GPU types, and the first 10 and 20 models of the profiles' ``models.csv``
on 100, 400 and 1000 GPUs of four types. Per case: wall and CPU time, objective, bound, gap and status.
"""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import click

from daskpipe.benchmarks.planning import cpu_seconds
from daskpipe.plan.cli import echo_json, profiles_dir_or_default, profiles_option
from daskpipe.plan.milp import make_plan
from daskpipe.plan.options import SOLVERS, PlannerOptions
from daskpipe.plan.specs import groups

FOUR_TYPES = ("L4", "T4", "P4", "V100")
FOUR_TYPES_PER_SERVER = {"L4": 1, "T4": 2, "P4": 1, "V100": 2}
V100_P4_PER_SERVER = {"V100": 2, "P4": 1}
BW_GBPS = 6.0


@dataclass(frozen=True)
class Case:
    """One planning problem: ``models`` is a group name (``G1``) or ``first-N`` of ``models.csv``."""

    name: str
    models: str
    gpus: Mapping[str, int]
    gpus_per_server: Mapping[str, int]
    max_parts: int
    time_limit: float  # the budget the issue sets for the case


def four_types(total: int) -> dict[str, int]:
    """``total`` GPUs split evenly over L4, T4, P4 and V100 (V100 takes the remainder)."""
    quarter = total // 4
    return {**{g: quarter for g in FOUR_TYPES[:-1]}, FOUR_TYPES[-1]: total - 3 * quarter}


SUITE = (
    Case("ppipe-40", "G1", {"V100": 10, "P4": 30}, V100_P4_PER_SERVER, 2, 10),
    Case("ppipe-100", "G1", {"V100": 25, "P4": 75}, V100_P4_PER_SERVER, 2, 10),
    Case("3-parts-40", "G1", {"V100": 10, "P4": 30}, V100_P4_PER_SERVER, 3, 30),
    Case("3-parts-100", "G1", {"V100": 25, "P4": 75}, V100_P4_PER_SERVER, 3, 30),
    Case("4-types-40", "G1", four_types(40), FOUR_TYPES_PER_SERVER, 2, 10),
    *(Case(f"{n}-models-{g}", f"first-{n}", four_types(g), FOUR_TYPES_PER_SERVER, 2, 10) for n in (10, 20) for g in (100, 400, 1000)),
)


def run_suite(
    profiles_dir: str | Path,
    cases: Sequence[Case] = SUITE,
    *,
    solver: str = "auto",
    advance: Callable[..., None] | None = None,
) -> dict[str, Any]:
    """Plan every case with the ppipe strategy; ``advance(note=...)`` is called after each."""
    from daskpipe.profiles.loader import load_profiles

    rows = []
    for case in cases:
        names, weights = _models(case.models, Path(profiles_dir))
        profiles = load_profiles(profiles_dir, names)
        options = PlannerOptions(bw_gbps=BW_GBPS, max_parts=case.max_parts, time_limit=case.time_limit, solver=solver)
        started, cpu_started = time.perf_counter(), cpu_seconds()
        plan = make_plan(
            profiles,
            dict(case.gpus),
            weights=dict(zip(profiles, weights)) if weights else None,
            gpus_per_server=dict(case.gpus_per_server),
            options=options,
        )
        rows.append(
            {
                "case": case.name,
                "models": len(profiles),
                "gpus": dict(case.gpus),
                "max_parts": case.max_parts,
                "time_limit": case.time_limit,
                "seconds": time.perf_counter() - started,
                "cpu_seconds": cpu_seconds() - cpu_started,  # the planner's own, solver threads included: steadier on a shared machine
                "objective": plan.objective,
                "bound": plan.bound,
                "gap": plan.gap,
                "status": plan.solver["status"],
                "solver": plan.solver["name"],
            }
        )
        if advance is not None:
            advance(note=f"{case.name}: gap {100 * (plan.gap or 0):.2f}%")
    return {"profiles": str(profiles_dir), "gap_tolerance": PlannerOptions().gap, "cases": rows}


def _models(spec: str, profiles_dir: Path) -> tuple[list[str], list[float] | None]:
    """A group's models and weights, or the first N names of ``models.csv`` at equal weights."""
    if spec.startswith("first-"):
        with open(profiles_dir / "models.csv", newline="") as f:
            names = [row["model"] for row in csv.DictReader(f)]
        return names[: int(spec.removeprefix("first-"))], None
    group = groups()[spec]
    return list(group.models), list(group.weights)


@click.command("planning")
@profiles_option
@click.option("--solver", type=click.Choice(SOLVERS), default="auto", show_default=True)
@click.option("--cases", "case_names", default=None, help="Comma-separated case names to run (default: the whole suite).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Also write the figures here.")
def bench_planning(profiles_dir, solver, case_names, json_out) -> None:
    """Plan issue #45's inventories (up to 20 models on 1000 GPUs of four types); print time, objective, bound and gap as JSON."""
    from daskpipe.plan.schema import PlanError
    from daskpipe.profiles.model import ProfileError
    from daskpipe.progress import progress_bar

    known = {c.name: c for c in SUITE}
    wanted = [n.strip() for n in case_names.split(",")] if case_names else list(known)
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise click.BadParameter(f"unknown case(s) {unknown}; known: {sorted(known)}", param_hint="--cases")
    try:
        with progress_bar("planning the scale suite", total=len(wanted)) as advance:
            figures = run_suite(profiles_dir_or_default(profiles_dir), [known[n] for n in wanted], solver=solver, advance=advance)
    except (PlanError, ProfileError) as exc:
        raise click.ClickException(str(exc)) from None
    echo_json(figures, json_out)
