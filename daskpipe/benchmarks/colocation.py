"""``daskpipe bench colocation``: InSS's setting in simulation, every policy, and the model's fit error.

Setting: InSS's eight models with its SLOs on its four GPUs (2x RTX 2060 Super, 2x RTX 2060),
Poisson arrivals in the mix of ``INSS_RATES``, scaled over a load sweep. Each policy plans at each
load and is executed by the same evaluator. Per policy, ``throughput`` is its peak goodput (req/s
finished within their SLO) over the sweep, what the cluster delivers under that policy, and
``slo_violation_rate`` the fraction of requests late or dropped at the nominal load (1x, the start
rates of InSS's evaluation). ``throughput_1pct``/``throughput_5pct`` are the highest goodput at a
load where at most 1%/5% of requests violate (the paper: InSS < 1%, baselines 3.8-4.5%). Gains of
InSS over iGniter, GSLICE and Gpulet are printed next to the paper's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import click

PAPER_GAIN_PCT = {"igniter": 189.7, "gslice": 47.7, "gpulet": 28.1}
# InSS's eight models in the paper's order (A, R, V, M, M1, E, R1, V1), also in defaults.INSS_SLO_MS.
INSS_MODELS = ("alexnet", "resnet50", "vgg16", "mnasnet", "mobilenet", "efficientnet", "resnet18", "vgg19")


def fit_figures(seed: int, noise: float) -> dict:
    """Emulated profiling of the testbed (InSS's grid, five co-location sets per model), refit."""
    from daskpipe.colocation.defaults import inss_testbed
    from daskpipe.colocation.fit import emulate_profiling, fit_model, model_info

    truth = inss_testbed()
    solo, co = [], []
    for gpu in truth.gpus:
        s, c = emulate_profiling(truth, gpu, truth.models, noise=noise, seed=seed)
        solo += s
        co += c
    _, report = fit_model(solo, co, truth.gpus.values(), model_info(truth))
    return {"profiling_noise": noise, **report.to_dict(), "paper_max_error_pct": 3.9}


def calibration_figures() -> dict:
    """How well the default parameter set reproduces the published measurements it was fitted to."""
    from daskpipe.colocation.defaults import ANCHOR_GPU, ANCHORS, inss_testbed
    from daskpipe.colocation.latency import Colocated

    model = inss_testbed()
    errors = [
        100 * abs(model.exec_ms(ANCHOR_GPU.name, Colocated(name, a.share, a.batch), a.others) - a.total_ms) / a.total_ms
        for name, anchors in ANCHORS.items()
        for a in anchors
    ]
    return {
        "anchors": len(errors),
        "mean_error_pct": round(float(sum(errors)) / len(errors), 2),
        "max_error_pct": round(float(max(errors)), 2),
    }


def run(
    *,
    duration_s: float,
    seed: int,
    scales: list[float],
    strategies: list[str],
    models: list[str],
    inss_options: dict,
    advance: Callable[..., None] = lambda *a, **k: None,
) -> dict:
    from daskpipe.colocation.defaults import INSS_RATES, INSS_SLO_MS, inss_gpus, inss_testbed
    from daskpipe.colocation.evaluate import load_sweep, sustainable
    from daskpipe.colocation.policy import Gpu, Strategy, Workload, make_policy

    model = inss_testbed()
    gpus = [Gpu(uid, kind) for uid, kind in inss_gpus()]
    workloads = [Workload(name, INSS_RATES[name], INSS_SLO_MS[name]) for name in models]
    policies: dict[str, dict] = {}
    for name in strategies:
        options = inss_options if name == Strategy.INSS.value else {}
        advance(0, note=name)
        started = time.perf_counter()
        points = load_sweep(make_policy(name, model, **options), workloads, gpus, model, scales, duration_s=duration_s, seed=seed)
        peak = sustainable(points, 1.0)
        strict, loose = sustainable(points, 0.01), sustainable(points, 0.05)
        nominal = min(points, key=lambda p: abs(p.scale - 1.0))
        policies[name] = {
            "throughput": round(peak.result.goodput, 1),
            "slo_violation_rate": round(nominal.result.slo_violation_rate, 4),
            "peak_scale": peak.scale,
            "peak_at_sweep_edge": peak.scale == max(scales),  # then the peak is a lower bound
            "slo_violation_rate_at_peak": round(peak.result.slo_violation_rate, 4),
            "throughput_1pct": round(strict.result.goodput, 1) if strict else 0.0,
            "throughput_5pct": round(loose.result.goodput, 1) if loose else 0.0,
            "slo_violation_rate_at_1pct": round(strict.result.slo_violation_rate, 4) if strict else None,
            "plan_at_peak": peak.plan.to_dict(),
            "sweep": [
                {"scale": p.scale, "offered": round(p.offered, 1), **{k: v for k, v in p.result.to_dict().items() if k != "per_model"}}
                for p in points
            ],
            "seconds": round(time.perf_counter() - started, 2),
        }
        advance(1)
    gains = {}
    if "inss" in policies:
        for base, paper in PAPER_GAIN_PCT.items():
            if base in policies:
                gains[base] = {
                    "paper_pct": paper,
                    "ours_pct": _gain(policies["inss"]["throughput"], policies[base]["throughput"]),
                    "ours_5pct_pct": _gain(policies["inss"]["throughput_5pct"], policies[base]["throughput_5pct"]),
                }
    return {
        "setting": {
            "gpus": [{"uid": g.uid, "type": g.type} for g in gpus],
            "models": {w.name: {"slo_ms": w.slo_ms, "base_rate": w.rate} for w in workloads},
            "scales": scales,
            "duration_s": duration_s,
            "seed": seed,
            "arrivals": "poisson",
            "latency_noise": 0.03,
        },
        "policies": policies,
        "gains_of_inss": gains,
    }


def _gain(ours: float, base: float) -> float | None:
    return round(100.0 * (ours - base) / base, 1) if base > 0 else None


@click.command("colocation")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the figures to this file.")
@click.option("--duration", "duration_s", type=float, default=10.0, show_default=True, help="Simulated seconds per load point.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--scales", default="0.25,0.5,0.75,1,1.25,1.5,1.75,2,2.25,2.5,3,3.5,4", show_default=True, help="Load multipliers of the base rates."
)
@click.option("--strategy", "strategies", multiple=True, help="Policies to run (repeatable; default: all).")
@click.option(
    "--models", default=",".join(INSS_MODELS), show_default=True, help="InSS models to serve (its main experiment used the first six)."
)
@click.option("--trainer", type=click.Choice(["search", "sac"]), default="search", show_default=True, help="InSS's placement search.")
@click.option("--sac-steps", type=int, default=3000, show_default=True, help="SAC-Discrete training steps (with --trainer sac).")
@click.option("--fit-noise", type=float, default=0.02, show_default=True, help="Relative noise of the emulated profiling runs.")
def bench_colocation(
    json_path: Path | None,
    duration_s: float,
    seed: int,
    scales: str,
    strategies: tuple[str, ...],
    models: str,
    trainer: str,
    sac_steps: int,
    fit_noise: float,
) -> None:
    """Co-location policies on InSS's setting (8 models, 4 GPUs, Poisson) in simulation."""
    from daskpipe.colocation.policy import Strategy

    try:
        scale_list = sorted(float(s) for s in scales.split(","))
    except ValueError:
        raise click.BadParameter(f"--scales must be comma-separated numbers, got {scales!r}") from None
    if not scale_list or scale_list[0] <= 0:
        raise click.BadParameter("--scales must be positive")
    chosen = list(strategies) or [s.value for s in Strategy]
    unknown = set(chosen) - {s.value for s in Strategy}
    if unknown:
        raise click.BadParameter(f"unknown strategy {sorted(unknown)}; choose from {[s.value for s in Strategy]}")
    model_list = [m.strip() for m in models.split(",") if m.strip()]
    if not model_list or set(model_list) - set(INSS_MODELS):
        raise click.BadParameter(f"--models must name some of {list(INSS_MODELS)}, got {models!r}")
    from daskpipe.progress import progress_bar

    with progress_bar("placing and simulating policies", total=len(chosen)) as advance:
        figures = run(
            duration_s=duration_s,
            seed=seed,
            scales=scale_list,
            strategies=chosen,
            models=model_list,
            inss_options={"trainer": trainer, "sac_steps": sac_steps, "seed": seed},
            advance=advance,
        )
    figures["latency_model"] = {"fit_on_own_data": fit_figures(seed, fit_noise), "calibration_to_paper": calibration_figures()}
    click.echo(f"{'policy':10s} {'throughput':>11s} {'viol@1x':>8s} {'viol@peak':>10s} {'thr<=1%':>9s} {'thr<=5%':>9s}")
    for name, p in figures["policies"].items():
        click.echo(
            f"{name:10s} {p['throughput']:11.1f}{'+' if p['peak_at_sweep_edge'] else ' '} {100 * p['slo_violation_rate']:6.2f}%"
            f" {100 * p['slo_violation_rate_at_peak']:9.2f}% {p['throughput_1pct']:9.1f} {p['throughput_5pct']:9.1f}"
        )
    click.echo("(+: peak at the largest load of the sweep, a lower bound)")
    for base, g in figures["gains_of_inss"].items():
        loose = f"{g['ours_5pct_pct']:+}%" if g["ours_5pct_pct"] is not None else f"n/a, {base} never <= 5%"
        click.echo(f"InSS over {base:8s}: ours {g['ours_pct']:+}% (at <=5% violations: {loose})   paper +{g['paper_pct']}%")
    fit = figures["latency_model"]["fit_on_own_data"]
    click.echo(f"latency model on its own fitted data: mean {fit['mean_error_pct']}%, max {fit['max_error_pct']}% (paper <= 3.9%)")
    if json_path is not None:
        json_path.write_text(json.dumps(figures, indent=1))
        click.echo(f"wrote {json_path}")
