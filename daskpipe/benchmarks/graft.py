"""``daskpipe bench graft``: Graft vs per-fragment serving vs the exhaustive optimum, in simulation.

Five torchvision CNNs are profiled with the analytic estimator for one server GPU type; devices
(Jetson Nano / TX2 mix) split them as Neurosurgeon would under log-normal uplinks; each model's
fragments are planned by Graft, by per-fragment serving (GSLICE) and by GSLICE+ (uniform
fragments merged), and Graft's and GSLICE's plans are simulated. Small cases (few devices) also
get the exhaustive optimum over groupings.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import click

from daskpipe.graft.fragments import JETSON_NANO, JETSON_TX2

if TYPE_CHECKING:
    from daskpipe.profiles.model import Profile

# torchvision builders (weights=None: latency does not depend on weights) and input sizes
BENCH_MODELS: dict[str, tuple[str, dict[str, Any], int]] = {
    "inception_v3": ("inception_v3", {"aux_logits": False, "init_weights": False}, 299),
    "resnet101": ("resnet101", {}, 224),
    "vgg11": ("vgg11", {}, 224),
    "mobilenet_v3_large": ("mobilenet_v3_large", {}, 224),
    "densenet121": ("densenet121", {}, 224),
}
DEFAULT_CACHE = Path.home() / ".cache" / "daskpipe" / "graft-profiles"


def estimated_profile(model: str, gpu: str, max_batch: int, num_blocks: int, cache_dir: Path | None) -> Profile:
    """The estimator's profile of a bench model with v=1 and v=2 tables up to ``max_batch``.

    Cached as JSON: estimating costs tens of CPU seconds per model (one meta-device pass per batch).
    """
    import torch
    import torchvision.models

    from daskpipe.profiles.estimator import estimate_profile
    from daskpipe.profiles.model import Profile

    path = cache_dir / f"{model}-{gpu}-b{max_batch}-n{num_blocks}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        return Profile.load(path)
    builder, kwargs, size = BENCH_MODELS[model]
    module = getattr(torchvision.models, builder)(weights=None, **kwargs).eval()
    profile = estimate_profile(
        module, torch.zeros(1, 3, size, size), gpus=[gpu], name=model, batch_sizes=2 * max_batch, slices=(1, 2), num_blocks=num_blocks
    )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.save(path)
    return profile


def run_bench(
    *,
    models: list[str],
    gpu: str,
    devices: int,
    small_devices: int,
    small_cases: int,
    max_batch: int,
    num_blocks: int,
    duration_s: float,
    seed: int,
    cache_dir: Path | None,
    burst_risk: float = 0.05,
    log: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Everything ``bench_graft`` reports, as a JSON-ready dict."""
    import numpy as np

    from daskpipe.graft.baselines import optimum, per_fragment
    from daskpipe.graft.costs import StageCosts
    from daskpipe.graft.fragments import sample_fragments
    from daskpipe.graft.planner import plan_graft
    from daskpipe.graft.simulate import simulate

    rng = np.random.default_rng(seed)
    small_rng = np.random.default_rng(seed + 1)  # own stream: the main run does not depend on --small-cases
    per_model: dict[str, Any] = {}
    small: list[dict[str, Any]] = []
    totals = {"graft": 0, "per_fragment": 0, "per_fragment_merged": 0}
    met = arrivals = 0
    for model in models:
        costs = StageCosts(estimated_profile(model, gpu, max_batch, num_blocks, cache_dir), gpu, burst_risk=burst_risk)
        fragments = sample_fragments(costs, num_devices=devices, rng=rng)
        if not fragments:
            log(f"{model}: no device offloads; skipped")
            continue
        started = time.perf_counter()
        graft = plan_graft(costs, fragments, seed=seed)
        planning_s = time.perf_counter() - started
        separate = per_fragment(costs, fragments)
        separate_merged = per_fragment(costs, fragments, merge_uniform=True)
        graft_sim = simulate(graft.serving(), costs, fragments, duration_s=duration_s, seed=seed)
        separate_sim = simulate(separate.serving(), costs, fragments, duration_s=duration_s, seed=seed)
        met += graft_sim.met
        arrivals += graft_sim.arrivals
        totals["graft"] += graft.gpu_share
        totals["per_fragment"] += separate.gpu_share
        totals["per_fragment_merged"] += separate_merged.gpu_share
        per_model[model] = {
            "blocks": costs.num_blocks,
            "fragments": len(fragments),
            "start_blocks": sorted(f.start_block for f in fragments),
            "budget_ms_range": [round(min(f.budget_ms for f in fragments), 1), round(max(f.budget_ms for f in fragments), 1)],
            "gpu_share_graft": graft.gpu_share,
            "gpu_share_per_fragment": separate.gpu_share,
            "gpu_share_per_fragment_merged": separate_merged.gpu_share,
            "reduction_vs_per_fragment": round(1 - graft.gpu_share / separate.gpu_share, 4),
            "groups": len(graft.groups),
            "shared_stages": sum(level.shared is not None and len(level.fragments) > 1 for g in graft.groups for level in g.levels),
            "planning_s": round(planning_s, 3),
            "sim_graft": graft_sim.to_dict(),
            "sim_per_fragment": separate_sim.to_dict(),
            "plan": graft.serving().to_dict(),
        }
        log(
            f"{model}: {len(fragments)} fragments at blocks {sorted({f.start_block for f in fragments})}: "
            f"graft {graft.gpu_share}% vs per-fragment {separate.gpu_share}% (merged {separate_merged.gpu_share}%), "
            f"SLO attainment {graft_sim.slo_attainment:.4f}"
        )
        for case in range(small_cases):
            case_fragments = sample_fragments(costs, num_devices=small_devices, rng=small_rng)
            if not case_fragments:
                continue
            graft_small = plan_graft(costs, case_fragments, seed=seed + case)
            single_pass = plan_graft(costs, case_fragments, seed=seed + case, restarts=1, extra_groups=0)
            best = optimum(costs, case_fragments)
            small.append(
                {
                    "model": model,
                    "fragments": len(case_fragments),
                    "graft": graft_small.gpu_share,
                    "optimum": best.gpu_share,
                    "graft_single_pass": single_pass.gpu_share,
                    "per_fragment": per_fragment(costs, case_fragments).gpu_share,
                }
            )
    return {
        "gpu": gpu,
        "settings": {
            "devices_per_model": devices,
            "device_mix": {JETSON_NANO.name: 0.75, JETSON_TX2.name: 0.25},
            "max_batch": max_batch,
            "duration_s": duration_s,
            "seed": seed,
            "burst_risk": burst_risk,
        },
        "gpu_share_graft": totals["graft"],
        "gpu_share_per_fragment": totals["per_fragment"],
        "gpu_share_per_fragment_merged": totals["per_fragment_merged"],
        "reduction_vs_per_fragment": round(1 - totals["graft"] / totals["per_fragment"], 4) if totals["per_fragment"] else None,
        "slo_attainment": round(met / arrivals, 5) if arrivals else None,
        "small_cases": small,
        "small_cases_gap": _gaps(small, "graft"),
        "small_cases_gap_single_pass": _gaps(small, "graft_single_pass"),
        "models": per_model,
    }


def _gaps(cases: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Mean and worst relative excess of ``key``'s GPU share over the optimum's."""
    gaps = [c[key] / c["optimum"] - 1 for c in cases]
    return {"mean": round(sum(gaps) / len(gaps), 4), "max": round(max(gaps), 4)} if gaps else {}


@click.command("graft")
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the results to this JSON file."
)
@click.option("--models", default=",".join(BENCH_MODELS), show_default=True, help="Comma-separated bench models.")
@click.option("--gpu", default="V100", show_default=True, help="Server GPU type (catalog name) to estimate.")
@click.option("--devices", default=20, show_default=True, help="Devices per model in the main run.")
@click.option("--small-devices", default=10, show_default=True, help="Devices per small case (exhaustive optimum).")
@click.option("--small-cases", default=3, show_default=True, help="Small cases per model.")
@click.option("--max-batch", default=8, show_default=True, help="Largest batch a stage may run.")
@click.option("--num-blocks", default=12, show_default=True, help="Blocks to cut each model into.")
@click.option("--duration", "duration_s", default=10.0, show_default=True, help="Simulated seconds per plan.")
@click.option(
    "--burst-risk",
    default=0.05,
    show_default=True,
    help="Chance that one batch time's Poisson arrivals overflow a stage's instances (0.5 ~ mean-rate sizing).",
)
@click.option("--seed", default=0, show_default=True, help="Seed for devices, bandwidths, grouping and arrivals.")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_CACHE,
    show_default=True,
    help="Where estimated profiles are cached.",
)
def bench_graft(
    json_path: Path | None,
    models: str,
    gpu: str,
    devices: int,
    small_devices: int,
    small_cases: int,
    max_batch: int,
    num_blocks: int,
    duration_s: float,
    burst_risk: float,
    seed: int,
    cache_dir: Path,
) -> None:
    """Graft's GPU share against per-fragment serving and the exhaustive optimum, with simulated SLOs."""
    names = [m.strip() for m in models.split(",") if m.strip()]
    unknown = [m for m in names if m not in BENCH_MODELS]
    if unknown or not names:
        raise click.BadParameter(f"unknown model(s) {unknown}; choose from {', '.join(BENCH_MODELS)}", param_hint="--models")
    result = run_bench(
        models=names,
        gpu=gpu,
        devices=devices,
        small_devices=small_devices,
        small_cases=small_cases,
        max_batch=max_batch,
        num_blocks=num_blocks,
        duration_s=duration_s,
        seed=seed,
        cache_dir=cache_dir,
        burst_risk=burst_risk,
        log=click.echo,
    )
    click.echo(
        f"total GPU share: graft {result['gpu_share_graft']}%, per-fragment {result['gpu_share_per_fragment']}% "
        f"(reduction {result['reduction_vs_per_fragment']}), SLO attainment {result['slo_attainment']}, "
        f"gap to optimum on small cases {result['small_cases_gap']} "
        f"(single greedy pass {result['small_cases_gap_single_pass']})"
    )
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1))
        click.echo(f"wrote {json_path}")
