"""``daskpipe bench runtime``: what the Dask path costs per request, against plain Dask tasks.

Two trivial stages (a 2-block model of ReLUs, microseconds of compute) on two plain CPU workers,
served by the PPipe dispatcher, so that everything measured is the runtime: futures, the
client's and the scheduler's streams, the dispatcher, batch messages, the worker-to-worker
feature map, outputs stored on the last worker, completions back to the client.

* requests per second: ``--requests`` requests (rounded up to whole batches, so that no partial
  batch waits for its last moment) sent with one ``Service.map`` call (a message per
  ``SUBMIT_CHUNK`` requests) through a pipeline planned at batch 32 with a generous SLO, until
  every future has ended;
* plain Dask: ``client.map`` of a no-op over as many tasks, until every future has ended;
* per-request overhead: closed-loop single requests through a pipeline planned at batch 1 (so
  no deferred batching waits), end-to-end latency (result fetched) minus the stages' profiled
  compute; plain Dask's closed-loop ``submit(no-op).result()`` latency alongside, for scale;
* per-request overhead under load: the same closed-loop requests on their own idle pipeline,
  while another model of the same service takes Poisson load at ``LOAD_FACTOR`` of its plan's
  capacity from another thread of the same client: the control path shared with real traffic;
* the scheduler's event-loop lag (max, p99) during the daskpipe throughput rounds and the loaded run;
* CPU per request, by role (the client's process, the scheduler's, the workers' together), in the
  idle closed loop and in the daskpipe throughput rounds: where the time goes. When the closed
  loop's CPU per request exceeds its wall time per request, its processes keep more than one core
  busy, and on a small machine every hop then waits for a core (``closed_loop_cores_busy``).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

import click
import numpy as np
import torch
from torch import nn

STAGE_US = 20.0  # profiled latency of each trivial block, at any batch size
BATCH = 32
LOAD_BATCH, LOAD_STAGE_US = 8, 4000.0
"""The loaded run's background model: batches of 8 reserved 4 ms per stage, a capacity of 2000
requests/s, offered at ``LOAD_FACTOR`` of it, or of the throughput the run measured if that is
less (large inputs: a 2-core machine carries a few hundred 110 KB requests a second, and a
backlog of 2000 a second took a minute to drain, measuring the queue rather than the path)."""
LOAD_FACTOR = 0.8
SLO_MS = 10_000.0  # generous: the throughput run is a burst, and nothing should be dropped
LOAD_SLO_MS = 1_000.0
"""The background model's SLO, generous for its 8 ms path: once the load stops, its last partial
batch is held to its latest start, and the loaded run waits for it (10 s at :data:`SLO_MS`)."""
INPUT_SHAPE = (16,)
"""A request's sample: 64 bytes of float32, so that the control path is all there is to measure
(``--input-shape 3,224,224`` carries 602 KB images instead, to measure their way through)."""


def _noop(i: int) -> int:
    return i


def trivial_model() -> nn.Module:
    """A model of two parameter-free blocks: what it computes is irrelevant, the serving is measured."""
    return nn.Sequential(nn.ReLU(), nn.ReLU()).eval()


def profile_and_plan(
    names_batches: dict[str, int], stage_us: float = STAGE_US, input_shape: tuple[int, ...] = INPUT_SHAPE, slo_ms: float = SLO_MS
):
    """A profile and a 2-partition plan on ``cpu`` slots for each (model name, batch size), each
    block profiled at ``stage_us`` at any batch size, for requests of ``input_shape`` under ``slo_ms``."""
    from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan
    from daskpipe.profiles.fx import segment_model
    from daskpipe.profiles.model import Profile

    segmented = segment_model(trivial_model(), torch.zeros(1, *input_shape))
    bounds = [0, 1, segmented.num_segments]
    blocked = segmented.cut(bounds)
    profiles, models = {}, []
    for name, batch in names_batches.items():
        table = np.full((2, batch), stage_us)
        profiles[name] = Profile(
            model=name,
            slo_us=slo_ms * 1e3,
            num_blocks=2,
            latency_us={("cpu", 1): table},
            boundary_bytes=tuple(float(b) for b in blocked.boundary_bytes),
            input_shape=blocked.input_shape,
            boundary_shapes=tuple(blocked.boundary_shapes),
            meta={"segment_boundaries": bounds},
        )
        throughput = batch / (stage_us * 1e-6)
        parts = tuple(Partition(blocks=(i, i + 1), gpu="cpu", slices=1, vgpus=1, latency_us=stage_us) for i in range(2))
        models.append(
            ModelPlan(name=name, slo_us=slo_ms * 1e3, weight=1.0, throughput=throughput, pipelines=(Pipeline(batch, throughput, parts),))
        )
    return profiles, Plan(objective=min(m.throughput for m in models), models=tuple(models), cluster={"bw_gbps": 10.0})


class LoopLag:
    """How late the scheduler's event loop runs a timer, sampled every ``interval_s``: what every
    handler, stream and timer on that loop waits for (D5: the lag must stay bounded at peak rate).
    ``held_cpu_s``: the CPU the loop's thread spent between a sample's sleep and its wake-up, what
    the loop itself held it for, without the time a busy machine gave the thread no core.

    Started and stopped on the loop it measures (``cluster.sync``, or :func:`start_loop_lag` on the scheduler).
    """

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.lags_s: list[float] = []
        self.held_cpu_s: list[float] = []
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self.lags_s, self.held_cpu_s = [], []
        self._task = asyncio.ensure_future(self._sample())

    async def stop(self) -> list[float]:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        return self.lags_s

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked, cpu = loop.time() + self.interval_s, time.thread_time()
            await asyncio.sleep(self.interval_s)
            self.lags_s.append(loop.time() - asked)
            self.held_cpu_s.append(time.thread_time() - cpu)


def run_bench(
    requests: int = 5000,
    *,
    protocol: str = "tcp",
    processes: bool = True,
    latency_samples: int = 200,
    rounds: int = 2,
    input_shape: tuple[int, ...] = INPUT_SHAPE,
    advance: Callable[..., None] = lambda *a, **k: None,
) -> dict:
    """The figures of ``daskpipe bench runtime``, all on one cluster, with requests of ``input_shape``.

    Throughput rounds alternate plain Dask and daskpipe so that drift (warm-up, other load on the
    machine) hits both alike; each figure is the best of its rounds (noise only slows a run), and
    every round is listed. Both paths are warmed up first; the latency runs come before the
    throughput rounds, so no release of a round's futures is still being processed while they run.
    """
    from distributed import Client, wait

    import daskpipe

    requests = -(-requests // BATCH) * BATCH

    if protocol == "ucx":
        from daskpipe.runtime.wire.protocols import resolve_protocol

        protocol = resolve_protocol(protocol)
    with bench_cluster(processes, protocol) as cluster, Client(cluster) as client:
        profiles, plan = profile_and_plan({"trivial-b32": BATCH, "trivial-b1": 1}, input_shape=input_shape)
        model, x = trivial_model(), torch.zeros(1, *input_shape)
        svc = daskpipe.deploy(
            client,
            {name: model for name in profiles},
            example_inputs={name: x for name in profiles},
            plan=plan,
            profiles=profiles,
        )
        try:
            wait(client.map(_noop, range(100), pure=False))  # warm both paths
            wait(svc.map("trivial-b32", [x] * 2 * BATCH))
            wait(svc.map("trivial-b1", [x] * 10))
            settle(client)
            roles = process_roles(client, processes)
            before, started = cpu_seconds(roles), time.perf_counter()
            daskpipe_latencies = _closed_loop(lambda: svc.submit("trivial-b1", x), latency_samples)
            closed_loop_wall_s, closed_loop_cpu = time.perf_counter() - started, spent_since(before, roles)
            dask_latencies = _closed_loop(lambda: client.submit(_noop, 0, pure=False), latency_samples)
            dask_rates, daskpipe_rates, lags, failed = [], [], [], 0
            throughput_cpu = dict.fromkeys(roles, 0.0)
            for _ in range(rounds):
                settle(client)
                dask_rates.append(_throughput(lambda: client.map(_noop, range(requests), pure=False), requests)[0])
                advance(note="plain Dask round")
                settle(client)
                client.run_on_scheduler(start_loop_lag)
                before = cpu_seconds(roles)
                rate, round_failed = _throughput(lambda: svc.map("trivial-b32", [x] * requests), requests)
                for role, seconds in spent_since(before, roles).items():
                    throughput_cpu[role] += seconds
                lags.extend(client.run_on_scheduler(stop_loop_lag))
                daskpipe_rates.append(rate)
                advance(note="daskpipe round")
                failed += round_failed
            status = svc.status()
        finally:
            svc.close()
        settle(client)
        loaded_latencies, load = _loaded(client, latency_samples, input_shape, max(daskpipe_rates))
        lags.extend(load.pop("loop_lags_s"))
        advance(note="loaded run")
    compute_s = 2 * STAGE_US * 1e-6
    overhead_ms = sorted((latency - compute_s) * 1e3 for latency in daskpipe_latencies)
    loaded_ms = sorted((latency - compute_s) * 1e3 for latency in loaded_latencies)
    lags_ms = sorted(lag_s * 1e3 for lag_s in lags)
    return {
        "cluster": f"LocalCluster, 4 CPU workers, {'processes' if processes else 'in-process (threads)'}, protocol {protocol}",
        "requests": requests,
        "input_shape": list(input_shape),
        "input_bytes": 4 * math.prod(input_shape),
        "rounds": rounds,
        "requests_per_second": max(daskpipe_rates),
        "failed": failed,
        "dask_tasks_per_second": max(dask_rates),
        "ratio": max(daskpipe_rates) / max(dask_rates),
        "requests_per_second_rounds": daskpipe_rates,
        "dask_tasks_per_second_rounds": dask_rates,
        "overhead_p50_ms": _percentile(overhead_ms, 0.5),
        "overhead_p99_ms": _percentile(overhead_ms, 0.99),
        "overhead_loaded_p50_ms": _percentile(loaded_ms, 0.5),
        "overhead_loaded_p99_ms": _percentile(loaded_ms, 0.99),
        "load": load,
        "dask_task_latency_p50_ms": _percentile(sorted(latency * 1e3 for latency in dask_latencies), 0.5),
        "loop_lag_max_ms": lags_ms[-1] if lags_ms else None,
        "loop_lag_p99_ms": _percentile(lags_ms, 0.99) if lags_ms else None,
        "cpu_ms_per_request": {
            "closed_loop": per_request_ms(closed_loop_cpu, latency_samples),
            "throughput": per_request_ms(throughput_cpu, requests * rounds),
        },
        "closed_loop_cores_busy": sum(closed_loop_cpu.values()) / closed_loop_wall_s,
        "batches": status["trivial-b32"]["batches"],
    }


def process_roles(client: Any, processes: bool) -> dict[str, list[int]]:
    """The process ids of each role: this client's, the scheduler's and the workers'; one ``all``
    when they share this process."""
    import os

    if not processes:
        return {"all": [os.getpid()]}
    return {"client": [os.getpid()], "scheduler": [client.run_on_scheduler(os.getpid)], "workers": sorted(client.run(os.getpid).values())}


def cpu_seconds(roles: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """Each role's CPU seconds so far: user and system time, summed over its processes."""
    import psutil

    spent = {}
    for role, pids in roles.items():
        times = [psutil.Process(pid).cpu_times() for pid in pids]
        spent[role] = sum(t.user + t.system for t in times)
    return spent


def spent_since(before: Mapping[str, float], roles: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """Each role's CPU seconds since ``before`` (:func:`cpu_seconds`)."""
    return {role: seconds - before[role] for role, seconds in cpu_seconds(roles).items()}


def per_request_ms(cpu_s: Mapping[str, float], requests: int) -> dict[str, float]:
    """Milliseconds of CPU per request, by role and in total."""
    per_role = {role: seconds * 1e3 / requests for role, seconds in cpu_s.items()}
    return {**per_role, "total": sum(per_role.values())}


def _loaded(client: Any, samples: int, input_shape: tuple[int, ...], carried_per_s: float) -> tuple[list[float], dict]:
    """Closed-loop latencies of ``samples`` requests of trivial-b1, on its own pipeline, while
    another client, in a process of its own as clients are, sends trivial-load Poisson load at
    ``LOAD_FACTOR`` of its plan's capacity or of ``carried_per_s``, the lesser; and what the load
    saw, with the scheduler's loop lags."""
    from distributed import wait
    from distributed.utils import get_mp_context  # as Dask starts its workers: spawn unless configured

    import daskpipe

    profiles, plan = profile_and_plan({"trivial-b1": 1}, input_shape=input_shape)
    load_profiles, load_plan = profile_and_plan(
        {"trivial-load": LOAD_BATCH}, stage_us=LOAD_STAGE_US, input_shape=input_shape, slo_ms=LOAD_SLO_MS
    )
    plan = type(plan)(objective=plan.objective, models=plan.models + load_plan.models, cluster=plan.cluster)
    model, x = trivial_model(), torch.zeros(1, *input_shape)
    svc = daskpipe.deploy(
        client,
        {"trivial-b1": model, "trivial-load": model},
        example_inputs={"trivial-b1": x, "trivial-load": x},
        plan=plan,
        profiles={**profiles, **load_profiles},
    )
    rate = LOAD_FACTOR * min(load_plan.models[0].throughput, carried_per_s)
    context = get_mp_context()
    flowing, stop, report = context.Event(), context.Event(), context.Queue()
    loader = context.Process(
        target=offer_load, args=(client.scheduler.address, "trivial-load", x.numpy().tobytes(), rate, flowing, stop, report), daemon=True
    )
    try:
        wait(svc.map("trivial-load", [x] * 2 * LOAD_BATCH))
        wait(svc.map("trivial-b1", [x] * 10))
        loader.start()
        if not flowing.wait(60):
            raise RuntimeError("the load generator did not start")
        client.run_on_scheduler(start_loop_lag)
        time.sleep(1.0)  # the load is flowing
        latencies = _closed_loop(lambda: svc.submit("trivial-b1", x), samples)
        lags = client.run_on_scheduler(stop_loop_lag)
        stop.set()
        offered, ended, on_time = report.get(timeout=120)
        loader.join(30)
    finally:
        svc.close()
    return latencies, {
        "model_capacity": load_plan.models[0].throughput,
        "offered_rate": offered,
        "attainment": on_time / ended if ended else None,
        "loop_lags_s": lags,
    }


def offer_load(address: str, model: str, payload: bytes, rate: float, flowing: Any, stop: Any, report: Any) -> None:
    """Another client: Poisson requests of ``model`` (already served) at ``rate`` from this process,
    each at its scheduled time, until ``stop``; reports (offered rate, ended, on time within the
    model's SLO) once every request has ended (:class:`~daskpipe.benchmarks.remote_client.RemoteSender`)."""
    from distributed import Client, wait

    from daskpipe.benchmarks.remote_client import RemoteSender

    with Client(address) as client, RemoteSender(client) as sender:
        slo_s = LOAD_SLO_MS * 1e-3
        futures, sent_at, done_at = [], [], {}
        flowing.set()
        started = due = time.perf_counter()
        for gap in np.random.default_rng(0).exponential(1 / rate, size=10**7):
            due += gap
            time.sleep(max(0.0, due - time.perf_counter()))
            if stop.is_set():
                break
            future = sender.submit(model, payload)
            future.add_done_callback(lambda f: done_at.__setitem__(f.key, time.perf_counter()))
            futures.append(future)
            sent_at.append(due)
        offered = len(futures) / (time.perf_counter() - started)
        wait(futures)
        time.sleep(0.1)  # the last callbacks
        ended = [(f, t) for f, t in zip(futures, sent_at) if f.status == "finished"]
        report.put((offered, len(futures), sum(done_at.get(f.key, float("inf")) - t <= slo_s for f, t in ended)))


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _throughput(submit: Callable[[], list], requests: int) -> tuple[float, int]:
    """Items per second from the first submission until every future has ended, and how many
    did not finish."""
    from distributed import wait

    start = time.perf_counter()
    futures = submit()
    wait(futures)
    rate = requests / (time.perf_counter() - start)
    return rate, sum(f.status != "finished" for f in futures)


def settle(client: Any, timeout_s: float = 60.0) -> None:
    """Wait until the scheduler holds only the stage actors: the previous run's keys are released
    and forgotten, work on its event loop that the next run must not be charged for."""
    deadline = time.monotonic() + timeout_s
    while client.run_on_scheduler(_unsettled_keys) and time.monotonic() < deadline:
        time.sleep(0.05)


def _unsettled_keys(dask_scheduler: Any) -> int:
    return sum(not ts.actor for ts in dask_scheduler.tasks.values())


_SCHEDULER_LAG: dict[str, LoopLag] = {}
"""The loop-lag sampler running on the scheduler, in the scheduler's process."""


async def start_loop_lag(dask_scheduler: Any) -> None:
    """``client.run_on_scheduler``: start sampling the scheduler's loop lag."""
    lag = _SCHEDULER_LAG["lag"] = LoopLag()
    await lag.start()


async def stop_loop_lag(dask_scheduler: Any) -> list[float]:
    """``client.run_on_scheduler``: the lags sampled since :func:`start_loop_lag`, in seconds."""
    return await _SCHEDULER_LAG.pop("lag").stop()


@contextmanager
def bench_cluster(processes: bool, protocol: str) -> Iterator[Any]:
    """Four 1-thread CPU workers (a pipeline's two partitions need two slots; the b=1 pipeline
    gets two more). As processes, the scheduler runs in a process of its own, as
    ``dask scheduler --preload daskpipe`` does: the client's own work (making futures, waiting on
    them) and the workers' Nannies must not be charged to the scheduler's event loop, as they are
    when all share the loop of a ``LocalCluster``'s process."""
    from distributed import LocalCluster
    from distributed.deploy.subprocess import SubprocessCluster

    from daskpipe.runtime.worker.environ import stage_worker_environ

    workers = 4
    with stage_worker_environ():
        if not processes:
            with LocalCluster(
                n_workers=workers, threads_per_worker=1, processes=False, protocol=protocol, dashboard_address=None
            ) as cluster:
                yield cluster
            return
        with SubprocessCluster(
            n_workers=workers,
            threads_per_worker=1,
            worker_class="distributed.Worker",  # from this environment, without the allocator settings a Nanny would add
            scheduler_kwargs={"preload": ["daskpipe"], "protocol": protocol},
            worker_kwargs={"protocol": protocol},
            dashboard_address=None,
        ) as cluster:
            cluster.wait_for_workers(workers)  # its workers start as processes of their own, after it returns
            yield cluster


def _closed_loop(submit: Callable[[], Any], samples: int) -> list[float]:
    """End-to-end seconds of ``samples`` requests, one at a time, each result fetched."""
    latencies = []
    for _ in range(samples):
        start = time.perf_counter()
        submit().result()
        latencies.append(time.perf_counter() - start)
    return latencies


@click.command("runtime")
@click.option("--requests", default=5000, show_default=True, help="Requests (and plain Dask tasks) to send.")
@click.option(
    "--protocol",
    type=click.Choice(["tcp", "ucx"]),
    default="tcp",
    show_default=True,
    help="Comms; ucx falls back to tcp with a warning without distributed-ucxx.",
)
@click.option(
    "--processes/--in-process",
    default=True,
    show_default=True,
    help="Workers as processes (as daskpipe runs them), or threads of this process (all under one GIL).",
)
@click.option("--rounds", default=3, show_default=True, help="Throughput rounds of each kind, alternated; the best of each is reported.")
@click.option(
    "--latency-samples",
    default=200,
    show_default=True,
    help="Closed-loop requests of each latency run (daskpipe, plain Dask, daskpipe under load).",
)
@click.option(
    "--input-shape",
    default=",".join(map(str, INPUT_SHAPE)),
    show_default=True,
    help="Shape of a request's float32 sample, e.g. 3,224,224 (602 KB images, which travel as frames of their own); the loaded run's "
    "background load stays at 1600 requests/s, more than 2 cores move at that size.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Also write the figures to this file.")
def bench_runtime(
    requests: int, protocol: str, processes: bool, rounds: int, latency_samples: int, input_shape: str, json_path: str | None
) -> None:
    """Requests/s and per-request overhead of the Dask runtime with trivial stages, vs plain Dask tasks/s."""
    from daskpipe.profiles.cli import parse_shape

    if requests < 1:
        raise click.BadParameter("must be >= 1", param_hint="--requests")
    if rounds < 1:
        raise click.BadParameter("must be >= 1", param_hint="--rounds")
    if latency_samples < 2:
        raise click.BadParameter("must be >= 2 (a median and a p99 of one request say nothing)", param_hint="--latency-samples")
    try:
        shape = parse_shape(input_shape)
    except click.BadParameter as exc:
        raise click.BadParameter(exc.message, param_hint="--input-shape") from None
    from daskpipe.progress import progress_bar

    with progress_bar("throughput rounds, loaded run", total=2 * rounds + 1) as advance:
        figures = run_bench(
            requests,
            protocol=protocol,
            processes=processes,
            latency_samples=latency_samples,
            rounds=rounds,
            input_shape=shape,
            advance=advance,
        )
    text = json.dumps(figures, indent=1)
    click.echo(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
