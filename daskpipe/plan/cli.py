"""``daskpipe plan``: a thin click wrapper around :func:`make_plan`.

Flags mirror the keyword arguments of ``make_plan`` and the fields of its ``PlannerOptions`` name
for name; parsing errors name the flag and the bad value, planning errors (:class:`PlanError`)
come back as click errors with the planner's message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import click

from daskpipe.plan.options import SOLVERS, STRATEGIES, PlannerOptions

DEFAULT_PROFILES = Path(__file__).resolve().parents[3] / "shared" / "ppipe"


class Pairs(click.ParamType):
    """``KEY=VALUE,KEY=VALUE`` into a dict, with VALUE converted by ``convert_value``."""

    def __init__(self, convert_value: Callable[[str], Any], what: str):
        self.convert_value = convert_value
        self.name = f"KEY={what},..."
        self.what = what

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> dict[str, Any]:
        if isinstance(value, dict):
            return value
        out: dict[str, Any] = {}
        for item in str(value).split(","):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or not key:
                self.fail(f"{item!r} is not KEY={self.what} (in {value!r})", param, ctx)
            if key in out:
                self.fail(f"{key!r} is given twice", param, ctx)
            try:
                out[key] = self.convert_value(raw.strip())
            except ValueError:
                self.fail(f"{item!r}: {raw.strip()!r} is not a valid {self.what}", param, ctx)
        return out


class NameList(click.ParamType):
    """``A,B,C`` into a list of names."""

    name = "NAME,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[str]:
        if isinstance(value, list):
            return value
        names = [n.strip() for n in str(value).split(",")]
        if not all(names):
            self.fail(f"{value!r} has an empty name", param, ctx)
        if len(set(names)) != len(names):
            self.fail(f"{value!r} names a model twice", param, ctx)
        return names


class FloatList(click.ParamType):
    """``0.3,0.7`` into a list of floats."""

    name = "X,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[float]:
        if isinstance(value, list):
            return value
        try:
            return [float(x) for x in str(value).split(",")]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of numbers", param, ctx)


def profiles_dir_or_default(value: Path | None) -> Path:
    """The ``--profiles`` folder given, else the measured profiles beside the repo."""
    if value is not None:
        return value
    if DEFAULT_PROFILES.is_dir():
        return DEFAULT_PROFILES
    raise click.UsageError(f"give --profiles DIR (the default {DEFAULT_PROFILES} does not exist)")


profiles_option = click.option(
    "--profiles",
    "profiles_dir",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="Folder of profiles (PPipe table layout or daskpipe JSON); default ../shared/ppipe beside the repo.",
)


@click.command()
@profiles_option
@click.option("--models", required=True, type=NameList(), help="Models to serve together (full names or unique prefixes).")
@click.option("--weights", type=FloatList(), default=None, help="Workload share of each model, in --models order (default: equal).")
@click.option("--gpus", required=True, type=Pairs(int, "COUNT"), help="GPU inventory, e.g. L4=25,P4=75.")
@click.option("--gpus-per-server", type=Pairs(int, "COUNT"), default=None, help="GPUs sharing one server's NIC, per type (default 1).")
@click.option("--bw-gbps", type=float, default=10.0, show_default=True, help="Effective network bandwidth per server, Gbit/s.")
@click.option("--slo-us", type=Pairs(float, "MICROSECONDS"), default=None, help="SLO per model, overriding the profiles'.")
@click.option("--margin", type=float, default=0.4, show_default=True, help="Share of the SLO the plan keeps free.")
@click.option("--max-parts", type=int, default=2, show_default=True, help="Most partitions per pipeline.")
@click.option(
    "--strategy",
    type=click.Choice(STRATEGIES),
    default="ppipe",
    show_default=True,
    help="ppipe, np, dart-r; or a co-location policy sharing GPUs between models (docs/colocation.md).",
)
@click.option("--time-limit", type=float, default=60, show_default=True, help="Time limit for the whole plan, seconds.")
@click.option("--gap", type=float, default=0.005, show_default=True, help="Stop once the plan is proven within this relative gap.")
@click.option("--solver", type=click.Choice(SOLVERS), default="auto", show_default=True)
@click.option("--allow-missing-gpus", is_flag=True, help="Plan a model on the GPU types it has profiles for, ignoring the others.")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Where to write plan.json.")
def plan(
    profiles_dir,
    models,
    weights,
    gpus,
    gpus_per_server,
    bw_gbps,
    slo_us,
    margin,
    max_parts,
    strategy,
    time_limit,
    gap,
    solver,
    allow_missing_gpus,
    out,
) -> None:
    """Solve a serving plan and write it as JSON."""
    from daskpipe.plan.milp import make_plan
    from daskpipe.plan.schema import PlanError
    from daskpipe.profiles.loader import load_profiles
    from daskpipe.profiles.model import ProfileError
    from daskpipe.progress import progress_bar

    if weights is not None and len(weights) != len(models):
        raise click.BadParameter(
            f"{len(weights)} weights for {len(models)} models; give one per model, in --models order", param_hint="--weights"
        )
    try:
        options = PlannerOptions(
            strategy=strategy,
            bw_gbps=bw_gbps,
            margin=margin,
            max_parts=max_parts,
            time_limit=time_limit,
            gap=gap,
            solver=solver,
            allow_missing_gpus=allow_missing_gpus,
        )
        profiles = load_profiles(profiles_dir_or_default(profiles_dir), models)
        names = list(profiles)  # full names, in --models order
        slo = {_full_name(k, names, "--slo-us"): v for k, v in (slo_us or {}).items()}
        with progress_bar(f"planning {len(names)} model(s) with {strategy}", total=None):
            result = make_plan(
                profiles,
                gpus,
                weights=dict(zip(names, weights)) if weights else None,
                gpus_per_server=gpus_per_server,
                slo_us=slo,
                options=options,
            )
    except (PlanError, ProfileError) as exc:
        raise click.ClickException(str(exc)) from None
    result.save(out)
    _print_plan(result)
    click.echo(f"wrote {out}")


def _full_name(name: str, names: list[str], flag: str) -> str:
    matches = [n for n in names if n == name] or [n for n in names if n.startswith(name)]
    if len(matches) != 1:
        raise click.BadParameter(f"{name!r} is {'ambiguous' if matches else 'not one of the --models'}", param_hint=flag)
    return matches[0]


def _print_plan(result) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result.strategy} plan: objective {result.objective:.1f} req/s (min throughput / weight)")
    for column in ("model", "req/s", "batch", "partitions (blocks GPU/v x vGPUs)", "latency ms", "tables"):
        table.add_column(column)
    for m in result.models:
        for i, p in enumerate(m.pipelines):
            route = " -> ".join(f"[{a},{b}) {_where(q)}" for q in p.partitions for a, b in [q.blocks])
            origins = " -> ".join(q.table or "not recorded" for q in p.partitions)
            table.add_row(m.name if i == 0 else "", f"{p.throughput:.1f}", str(p.batch_size), route, f"{p.latency_us / 1e3:.2f}", origins)
        if not m.pipelines:
            table.add_row(m.name, "0", "-", "(no GPUs)", "-", "-")
    console = Console()
    console.print(table)
    used = ", ".join(f"{g} {n:g}/{result.cluster['gpus'][g]}" for g, n in sorted(result.gpus_used().items()))
    console.print(
        f"GPUs used: {used or 'none'}; solver {result.solver['name']} {result.solver['status']} in {result.solver['seconds']:.2f} s"
    )
    console.print(f"plan quality: {result.quality()}")


def _where(part) -> str:
    """``L4/2 x3`` for a pool, ``L4-0 share 0.35`` for a co-located partition."""
    if part.device:
        return f"{part.device} share {part.share:.2f}"
    return f"{part.gpu}{'' if part.slices == 1 else f'/{part.slices}'} x{part.vgpus}"


def echo_json(figures: Any, path: Path | None) -> None:
    """Print a bench's figures as JSON, and write them to ``path`` too when given."""
    text = json.dumps(figures, indent=1)
    click.echo(text)
    if path is not None:
        path.write_text(text)
