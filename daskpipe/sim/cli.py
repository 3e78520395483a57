"""``daskpipe simulate``: run a plan in the discrete-event simulator and write its figures as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from daskpipe.sched.registry import DATAPLANES
from daskpipe.sim.config import SimulationConfig
from daskpipe.sim.simulate import SimResult, find_max_load, load_grid
from daskpipe.sim.simulate import simulate as run_simulation


def summary(result: SimResult) -> dict[str, Any]:
    """The JSON contract of ``daskpipe simulate``: per model, then utilisation per GPU type."""
    models = {}
    for name, r in result.models.items():
        entry = {
            "attainment": r.attainment,
            "dropped": r.dropped_total,
            "dropped_by_reason": r.dropped,
            "late": r.late,
            "submitted": r.submitted,
            "load_factor": r.load_factor,
            "offered_rate": r.offered_rate,
            "p50_ms": r.p50_ms,
            "p99_ms": r.p99_ms,
            "mean_batch_size": r.mean_batch_size,
        }
        if result.max_load_factor:
            entry["max_load_factor"] = result.max_load_factor[name]
        models[name] = entry
    return {
        "dataplane": result.dataplane,
        "arrivals": result.arrivals,
        "duration": result.duration,
        "seed": result.seed,
        "models": models,
        "utilization": result.utilization,
        "utilization_placed": result.utilization_placed,
    }


def read_ratios(path: str) -> list[float]:
    """Measured/profiled latency ratios, one per line; blank lines and ``#`` comments are skipped."""
    ratios = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            ratios.append(float(text))
        except ValueError:
            raise click.BadParameter(f"line {number} of {path}: {text!r} is not a number", param_hint="--latency-ratios") from None
    return ratios


def parse_quantile(ctx: click.Context, param: click.Parameter, value: str | None) -> float | str | None:
    """``--slack-quantile``: a number, ``off`` (last-moment dispatch), or unset (the default)."""
    if value is None or value == "off":
        return value
    try:
        return float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither a number nor 'off'") from None


def write_report(plan: Any, result: SimResult, path: str) -> None:
    """The live dashboard's pages, filled from the simulated run of each model."""
    from daskpipe.dashboard.report import record_trace, save_report
    from daskpipe.sched.metrics import ServiceMetrics

    metrics = ServiceMetrics()
    for model_plan in plan.models:
        placement, trace = result.runs[model_plan.name]
        record_trace(metrics, model_plan, placement, trace)
    save_report(metrics, path, title=f"daskpipe simulate: {result.dataplane}, {result.arrivals}")


@click.command("simulate")
@click.option("--plan", "plan_path", required=True, type=click.Path(exists=True, dir_okay=False), help="Plan JSON (daskpipe plan).")
@click.option(
    "--profiles",
    "profiles_dir",
    required=True,
    type=click.Path(exists=True),
    help="Profiles: a PPipe-layout folder, a folder of JSON profiles or one file.",
)
@click.option(
    "--dataplane",
    type=click.Choice(DATAPLANES),
    default="ppipe",
    show_default=True,
    help="Data plane that dispatches the requests (the names deploy(dispatcher=...) takes; docs/dataplane.md).",
)
@click.option(
    "--arrivals",
    default="poisson",
    show_default=True,
    help="poisson, bursty (gamma gaps, see --bursty-cv) or a trace FILE (docs/simulator.md).",
)
@click.option(
    "--load-factor", type=float, default=0.9, show_default=True, help="Offered rate as a multiple of each model's plan throughput."
)
@click.option(
    "--find-max-load",
    "search_max_load",
    is_flag=True,
    help="Search the highest load factor (steps of 0.05) with >= 99% attainment per model.",
)
@click.option("--max-load", type=float, default=1.0, show_default=True, help="Upper end of the --find-max-load search.")
@click.option("--duration", type=float, default=30.0, show_default=True, help="Seconds of arrivals per run.")
@click.option("--seed", type=int, default=1, show_default=True, help="Seeds arrivals and noise; a run is fixed by it.")
@click.option("--noise", type=float, default=0.0, show_default=True, help="Sigma of a mean-one log-normal factor on every duration.")
@click.option(
    "--latency-ratios",
    "ratios_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="File of measured/profiled compute ratios, one per line: each compute takes its profiled time times one drawn from them.",
)
@click.option(
    "--slack-quantile",
    callback=parse_quantile,
    default=None,
    help="ppipe: the quantile of measured latency a waiting batch keeps slack for (default 0.95), or 'off' for last-moment dispatch.",
)
@click.option("--bursty-cv", type=float, default=2.0, show_default=True, help="Coefficient of variation of the bursty gaps.")
@click.option("--bw-gbps", type=float, default=None, help="Network bandwidth (default: the plan's cluster record).")
@click.option(
    "--timeout-ms",
    type=float,
    default=2.0,
    show_default=True,
    help="timeout data plane: a batch goes when its oldest request has waited this long.",
)
@click.option("--max-batch", type=int, default=None, help="timeout/eager/deferred: largest batch (default: the profiles' largest).")
@click.option("--json", "json_path", required=True, type=click.Path(dir_okay=False, writable=True), help="Where to write the figures.")
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Also write the dashboard's pages for the reported run (at the max load with --find-max-load) as one HTML file.",
)
def simulate_command(
    plan_path,
    profiles_dir,
    dataplane,
    arrivals,
    load_factor,
    search_max_load,
    max_load,
    duration,
    seed,
    noise,
    ratios_path,
    slack_quantile,
    bursty_cv,
    bw_gbps,
    timeout_ms,
    max_batch,
    json_path,
    report_path,
) -> None:
    """Simulate PLAN under a workload and write per-model SLO attainment, drops, latency and
    batch size, and utilisation per GPU type, to --json."""
    from daskpipe.plan.schema import Plan, PlanError
    from daskpipe.profiles.loader import load_profiles
    from daskpipe.profiles.model import ProfileError

    try:
        plan = Plan.load(plan_path)
        profiles = load_profiles(profiles_dir, [m.name for m in plan.models])
    except (PlanError, ProfileError) as exc:
        raise click.ClickException(str(exc)) from None
    if arrivals not in ("poisson", "bursty") and not Path(arrivals).is_file():
        raise click.BadParameter(f"{arrivals!r} is neither poisson, bursty nor a trace file", param_hint="--arrivals")
    settings = None
    if slack_quantile is not None:
        if dataplane != "ppipe":
            raise click.BadParameter(f"only the ppipe data plane has it, not {dataplane}", param_hint="--slack-quantile")
        from daskpipe.sched.ppipe import PPipeSettings

        try:
            settings = PPipeSettings(slack_quantile=None if slack_quantile == "off" else slack_quantile)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--slack-quantile") from None
    try:
        config = SimulationConfig(
            dataplane=dataplane,
            arrivals=arrivals,
            duration=duration,
            seed=seed,
            noise=noise,
            bursty_cv=bursty_cv,
            latency_ratios=read_ratios(ratios_path) if ratios_path else None,
            bw_gbps=bw_gbps,
            timeout_s=timeout_ms / 1e3,
            max_batch=max_batch,
            settings=settings,
        )
        if search_max_load:
            from daskpipe.progress import progress_bar

            grid = load_grid(0.05, max_load)
            with progress_bar("finding max load", total=len(plan.models) * max(1, len(grid).bit_length())) as advance:
                result = find_max_load(
                    plan, profiles, config, max_load=max_load, progress=lambda model, lf: advance(note=f"{model[:24]} LF {lf:.2f}")
                )
        else:
            result = run_simulation(plan, profiles, config, load_factor=load_factor)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    out = summary(result)
    Path(json_path).write_text(json.dumps(out, indent=1))
    if report_path:
        write_report(plan, result, report_path)
    for name, entry in out["models"].items():
        extra = f"  max LF {entry['max_load_factor']:.2f}" if "max_load_factor" in entry else ""
        click.echo(
            f"{name}: attainment {entry['attainment']:.4f}  dropped {entry['dropped']}  late {entry['late']}  "
            f"p99 {entry['p99_ms'] or 0:.1f} ms  batch {entry['mean_batch_size'] or 0:.2f}{extra}"
        )
    click.echo("utilization: " + ", ".join(f"{gpu} {u:.1%}" for gpu, u in out["utilization"].items()))


simulate = simulate_command  # the name daskpipe.cli registers ("daskpipe.sim.cli:simulate")
