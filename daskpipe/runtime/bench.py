"""``daskpipe bench runtime``: what the Dask path costs per request, against plain Dask tasks.

Two trivial stages (a 2-block model of ReLUs, microseconds of compute) on two plain CPU workers,
served by the PPipe dispatcher, so that everything measured is the runtime: futures, the
client's and the scheduler's streams, the dispatcher, batch messages, the worker-to-worker
feature map, outputs stored on the last worker, completions back to the client.

* requests per second: ``--requests`` requests (rounded up to whole batches, so that no partial
  batch waits for its last moment) sent with ``Service.map`` in chunks as fast as the client can,
  through a pipeline planned at batch 32 with a generous SLO;
* per-request overhead: closed-loop single requests through a pipeline planned at batch 1 (so
  no deferred batching waits), end-to-end latency minus the stages' profiled compute;
* plain Dask: ``client.map`` of a no-op over as many tasks, tasks per second.
"""

from __future__ import annotations

import json
import statistics
import time

import click
import numpy as np
import torch
from torch import nn

STAGE_US = 20.0  # profiled latency of each trivial block, at any batch size
BATCH = 32
SLO_MS = 10_000.0  # generous: the throughput run is a burst, and nothing should be dropped


def _noop(i: int) -> int:
    return i


def _trivial_model() -> nn.Module:
    return nn.Sequential(nn.ReLU(), nn.ReLU()).eval()


def _profile_and_plan(names_batches: dict[str, int]):
    """A profile and a 2-partition plan on ``cpu`` slots for each (model name, batch size)."""
    from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan
    from daskpipe.profiles.fx import segment_model
    from daskpipe.profiles.model import Profile

    segmented = segment_model(_trivial_model(), torch.zeros(1, 16))
    bounds = [0, 1, segmented.num_segments]
    blocked = segmented.cut(bounds)
    profiles, models = {}, []
    for name, batch in names_batches.items():
        table = np.full((2, batch), STAGE_US)
        profiles[name] = Profile(
            model=name, slo_us=SLO_MS * 1e3, num_blocks=2, latency_us={("cpu", 1): table},
            boundary_bytes=tuple(float(b) for b in blocked.boundary_bytes), input_shape=blocked.input_shape,
            boundary_shapes=tuple(blocked.boundary_shapes), meta={"segment_boundaries": bounds},
        )
        throughput = batch / (STAGE_US * 1e-6)
        parts = tuple(Partition(blocks=(i, i + 1), gpu="cpu", slices=1, vgpus=1, latency_us=STAGE_US) for i in range(2))
        models.append(ModelPlan(name=name, slo_us=SLO_MS * 1e3, weight=1.0, throughput=throughput, pipelines=(Pipeline(batch, throughput, parts),)))
    return profiles, Plan(objective=min(m.throughput for m in models), models=tuple(models), cluster={"bw_gbps": 10.0})


def run_bench(requests: int = 5000, *, protocol: str = "tcp", processes: bool = False, chunk: int = 500, latency_samples: int = 200) -> dict:
    from distributed import Client, LocalCluster, wait

    import daskpipe

    requests = -(-requests // BATCH) * BATCH

    if protocol == "ucx":
        from daskpipe.runtime.cluster import resolve_protocol

        protocol = resolve_protocol(protocol)
    # a pipeline's two partitions need two slots; the b=1 pipeline gets two more
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=processes, protocol=protocol, dashboard_address=None) as cluster, Client(cluster) as client:
        tasks_per_second = _dask_tasks_per_second(client, requests)
        profiles, plan = _profile_and_plan({"trivial-b32": BATCH, "trivial-b1": 1})
        model = _trivial_model()
        svc = daskpipe.deploy(
            client, {name: model for name in profiles}, example_inputs={name: torch.zeros(1, 16) for name in profiles},
            plan=plan, profiles=profiles,
        )
        try:
            x = torch.zeros(1, 16)
            wait(svc.map("trivial-b32", [x] * 2 * BATCH))  # warm the path
            start = time.perf_counter()
            futures = []
            for offset in range(0, requests, chunk):
                futures.extend(svc.map("trivial-b32", [x] * min(chunk, requests - offset)))
            wait(futures)
            elapsed = time.perf_counter() - start
            failed = sum(f.status != "finished" for f in futures)
            del futures
            latencies = []
            for _ in range(latency_samples):
                t0 = time.perf_counter()
                svc.submit("trivial-b1", x).result()
                latencies.append(time.perf_counter() - t0)
            status = svc.status()
        finally:
            svc.close()
    compute_s = 2 * STAGE_US * 1e-6
    overhead_ms = sorted((lat - compute_s) * 1e3 for lat in latencies)
    return {
        "cluster": f"LocalCluster, 4 CPU workers, {'processes' if processes else 'in-process (threads)'}, protocol {protocol}",
        "requests": requests,
        "requests_per_second": requests / elapsed,
        "failed": failed,
        "dask_tasks_per_second": tasks_per_second,
        "ratio": (requests / elapsed) / tasks_per_second,
        "overhead_p50_ms": statistics.median(overhead_ms),
        "overhead_p99_ms": overhead_ms[min(len(overhead_ms) - 1, int(0.99 * len(overhead_ms)))],
        "batches": status["trivial-b32"]["batches"],
    }


def _dask_tasks_per_second(client, tasks: int) -> float:
    from distributed import wait

    wait(client.map(_noop, range(100), pure=False))  # warm the path
    start = time.perf_counter()
    futures = client.map(_noop, range(tasks), pure=False)
    wait(futures)
    return tasks / (time.perf_counter() - start)


@click.command("runtime")
@click.option("--requests", default=5000, show_default=True, help="Requests (and plain Dask tasks) to send.")
@click.option("--protocol", type=click.Choice(["tcp", "ucx"]), default="tcp", show_default=True, help="Comms; ucx falls back to tcp with a warning without distributed-ucxx.")
@click.option("--processes/--in-process", default=False, show_default=True, help="Workers as processes, or threads of this process.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Also write the figures to this file.")
def bench_runtime(requests: int, protocol: str, processes: bool, json_path: str | None) -> None:
    """Requests/s and per-request overhead of the Dask runtime with trivial stages, vs plain Dask tasks/s."""
    if requests < 1:
        raise click.BadParameter("must be >= 1", param_hint="--requests")
    figures = run_bench(requests, protocol=protocol, processes=processes)
    text = json.dumps(figures, indent=1)
    click.echo(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
