"""``daskpipe bench tight-slo``: is a tight SLO at real time either served or refused at deploy?

A deploy refuses an SLO that a lone request plus the measured control path cannot meet
(:func:`daskpipe.runtime.scheduler.intake.check_feasible`). This deploys the runtime bench's trivial model
(two 20 us stages on CPU workers, batch 1, the scheduler in a process of its own) again and again
at each SLO, the SLOs interleaved so that the machine's drift hits them alike, and offers each
deploy that is accepted open-loop Poisson load; a request counts as within its SLO when its
output is in the client's hands within the SLO of its submission. The bar: every accepted deploy
serves >= 99% within its SLO.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Callable, Sequence

import click
import numpy as np
import torch

from daskpipe.benchmarks.runtime_overhead import bench_cluster, profile_and_plan, settle, trivial_model

MODEL = "tiny"
WARM_UP = 30  # requests of each deploy, not counted
BAR = 0.99


def offer(svc: Any, x: torch.Tensor, rate: float, count: int, seed: int) -> list[float | None]:
    """Submit ``count`` requests at Poisson times of ``rate`` per second: each one's seconds from
    its submission to its output in hand, ``None`` for one that did not complete."""
    ended: list[float | None] = [None] * count
    futures = []
    offsets = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, size=count))
    start = time.monotonic()

    def done(future: Any, index: int, sent: float) -> None:
        if future.status == "finished":
            ended[index] = time.monotonic() - sent

    for index, offset in enumerate(offsets):
        time.sleep(max(0.0, start + offset - time.monotonic()))
        sent = time.monotonic()
        future = svc.submit(MODEL, x)
        future.add_done_callback(lambda f, index=index, sent=sent: done(f, index, sent))
        futures.append(future)
    from distributed import wait

    wait(futures, timeout=60)
    time.sleep(0.05)  # the last callbacks
    return ended


def one_deploy(client: Any, slo_ms: float, rate: float, count: int, seed: int) -> dict[str, Any]:
    """Deploy at ``slo_ms`` and serve ``count`` requests, or the refusal."""
    import daskpipe
    from daskpipe.runtime.errors import DeployError

    profiles, plan = profile_and_plan({MODEL: 1}, slo_ms=slo_ms)
    x = torch.zeros(1, 16)
    started = time.monotonic()
    try:
        svc = daskpipe.deploy(client, {MODEL: trivial_model()}, example_inputs={MODEL: x}, plan=plan, profiles=profiles)
    except DeployError as exc:
        smallest = re.search(r"smallest SLO it can serve is ([0-9.]+) ms", str(exc))
        return {
            "slo_ms": slo_ms,
            "refused": True,
            "deploy_s": round(time.monotonic() - started, 2),
            "smallest_ms": float(smallest.group(1)) if smallest else None,
            "by_trial": "trial of" in str(exc),
            "error": str(exc)[:300],
        }
    deploy_s = time.monotonic() - started
    try:
        control = svc.status()[MODEL]["control"]
        offer(svc, x, rate, WARM_UP, seed + 1)
        latencies = offer(svc, x, rate, count, seed)
        served = svc.status()[MODEL]
    finally:
        svc.close()
    settle(client)
    within = sum(1 for s in latencies if s is not None and s <= slo_ms * 1e-3)
    done_ms = sorted(s * 1e3 for s in latencies if s is not None)
    return {
        "slo_ms": slo_ms,
        "refused": False,
        "deploy_s": round(deploy_s, 2),
        "within": within,
        "requests": count,
        "within_share": within / count,
        "completed": len(done_ms),
        "latency_p50_ms": float(np.quantile(done_ms, 0.5)) if done_ms else None,
        "latency_p99_ms": float(np.quantile(done_ms, 0.99)) if done_ms else None,
        "deploy_margin_ms": control.get("margin_ms"),
        "deploy_seed_ms": control.get("seed_ms"),
        "serving_margin_ms": served["control"].get("margin_ms"),
        "serving_total_p99_ms": served["control"].get("total_p99_ms"),
        "dropped": served.get("dropped"),
    }


def run_bench(
    slos_ms: Sequence[float], deploys: int, rate: float, count: int, advance: Callable[..., None] = lambda *a, **k: None
) -> dict[str, Any]:
    """``deploys`` rounds, each deploying once at every SLO of ``slos_ms``."""
    from distributed import Client

    load_before = os.getloadavg()
    runs: list[dict[str, Any]] = []
    with bench_cluster(True, "tcp") as cluster, Client(cluster) as client:
        for round_ in range(deploys):
            for slo_ms in slos_ms:
                runs.append({"round": round_, **one_deploy(client, slo_ms, rate, count, seed=round_)})
                advance(note=f"{slo_ms:g} ms, round {round_ + 1}")
    summary = {}
    for slo_ms in slos_ms:
        mine = [r for r in runs if r["slo_ms"] == slo_ms]
        accepted = [r for r in mine if not r["refused"]]
        summary[f"{slo_ms:g}"] = {
            "deploys": len(mine),
            "refused": len(mine) - len(accepted),
            "smallest_ms": sorted(r["smallest_ms"] for r in mine if r["refused"] and r["smallest_ms"] is not None),
            "within_shares": sorted(round(r["within_share"], 4) for r in accepted),
            "accepted_under_bar": sum(r["within_share"] < BAR for r in accepted),
            "deploy_margins_ms": sorted(round(r["deploy_margin_ms"], 2) for r in accepted if r["deploy_margin_ms"] is not None),
        }
    return {
        "cluster": "4 CPU worker processes, the scheduler in its own process, tcp",
        "model": "two 20 us stages, batch 1, time_dilation 1",
        "rate": rate,
        "requests_per_deploy": count,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "summary": summary,
        "runs": runs,
    }


@click.command("tight-slo")
@click.option("--slo-ms", "slos", default="5,10,15,25", show_default=True, help="SLOs to deploy at, comma-separated, in ms.")
@click.option("--deploys", default=10, show_default=True, help="Deploys at each SLO (rounds over all of them).")
@click.option("--rate", default=100.0, show_default=True, help="Requests/s offered to each accepted deploy (Poisson).")
@click.option("--requests", "count", default=300, show_default=True, help="Requests counted per accepted deploy.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Also write the figures to this file.")
def bench_tight_slo(slos: str, deploys: int, rate: float, count: int, json_path: str | None) -> None:
    """Deploys at tight SLOs at real time: refused, or served >= 99% within the SLO?"""
    try:
        slos_ms = [float(s) for s in slos.split(",")]
    except ValueError:
        raise click.BadParameter(f"a comma-separated list of numbers, got {slos!r}", param_hint="--slo-ms") from None
    if not slos_ms or not all(s > 0 for s in slos_ms):
        raise click.BadParameter(f"SLOs must be > 0, got {slos!r}", param_hint="--slo-ms")
    for name, value in (("--deploys", deploys), ("--requests", count)):
        if value < 1:
            raise click.BadParameter("must be >= 1", param_hint=name)
    if not rate > 0:
        raise click.BadParameter("must be > 0", param_hint="--rate")
    from daskpipe.progress import progress_bar

    with progress_bar("deploys", total=deploys * len(slos_ms)) as advance:
        figures = run_bench(slos_ms, deploys, rate, count, advance=advance)
    text = json.dumps(figures, indent=1)
    click.echo(json.dumps({"load_average_before": figures["load_average_before"], "summary": figures["summary"]}, indent=1))
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
