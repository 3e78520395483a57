"""``daskpipe bench capacity``: how many requests one scheduler can carry, by input size and senders.

A cluster of its own processes, as on a real deployment: ``dask scheduler --preload daskpipe``,
``daskpipe worker --emulate T4:N`` and ``K`` sender processes, each with its own ``Client``.
The model is hold-only: its one block keeps every 64th pixel of the frame, and each batch is held
to its profiled latency, so that the stages cost the two cores almost nothing and what is
measured is the path of the requests, their inputs included. For each input shape and each number
of senders, open-loop Poisson trials at rising rates find the highest rate at which >= 99% of the
requests have their output in their sender's hands within the SLO. Around every trial it counts:

* the scheduler's socket bytes (``ss``'s ``bytes_sent`` and ``bytes_received`` of the scheduler
  process's TCP sockets) and its CPU time, per request: what one request costs the one process
  that every request meets. The scheduler spends CPU with no request at all (heartbeats, the
  plugin's and the dashboard's timers), so its CPU over an idle stretch and over every trial of a
  ladder is fitted (least squares) as ``scheduler_idle_cpu_share`` x wall time plus
  ``scheduler_cpu_us_per_request`` x requests: what a request adds. ``ceiling_per_s`` is what one
  scheduler core allows at that cost, (1 - idle share) / CPU per request. A request costs less
  CPU the higher the rate (a busy stream carries several messages a write), and a small input's
  ladder climbs further than a large one's, so this fit compares input sizes poorly;
  ``same_rates`` compares them at the rates that every shape met: each shape's CPU per request
  above its measured idle share (``scheduler_idle_measured_share``), and its ratio to the smallest input's;
* every other process's CPU per request (the workers', each sender's), idle time included.

The rates rise by :data:`RATE_STEP` (``--rate-step``) until two
trials in a row miss the bar (one miss on a shared machine can be noise). The data plane is
``eager`` by default (``--dispatcher``): it sends a request as soon as a slot is free, so that what
is measured is what the path carries; a deferred data plane holds each request to its batch's last
moment, which makes a lone request's lateness a matter of the dispatch policy, not of capacity.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import time
from typing import Any, Mapping, Sequence

import click
import numpy as np
import torch
from torch import nn

from daskpipe.benchmarks.comm_floor import RELAYED_MESSAGES, relay_floor
from daskpipe.benchmarks.processes import cluster_processes, cpu_s
from daskpipe.benchmarks.serve import READY_S, START_S, latency_figures, poisson_trial, request_payload, sender_seed
from daskpipe.profiles.cli import parse_shape

MODEL = "capacity"
SLO_MS = 200.0
BATCH = 4
HOLD_US = 2000.0  # a batch's profiled latency, at any size: 2,000 requests/s a slot
SLOTS = 2
BW_GBPS = 10.0
ATTAINMENT = 0.99
RATE_STEP = 1.3  # each trial offers this many times the last one's rate
TRIAL_S = 3.0
DRAIN_S = 10.0


class KeepEvery64th(nn.Module):
    """A stage that reads its input and computes next to nothing: what is left to measure is the serving."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., ::64, ::64].flatten(1)


def hold_only_plan(input_shape: Sequence[int]):
    """The profile and plan of :class:`KeepEvery64th` on :data:`SLOTS` emulated T4 slots of one
    worker, one partition, batches of up to :data:`BATCH` held :data:`HOLD_US` each.

    The plan's rate is what the hold allows or what the slots' share of one NIC at
    :data:`BW_GBPS` carries of the inputs, whichever is less (6.3 MB frames: 199 req/s), as the
    planner counts a way in (docs/plan.md): it sizes the deploy's trial (half the plan's batches),
    which the hold's 4000 req/s of 6.3 MB frames would have fetch more than two cores move. The
    profile records no input size, so the data plane reserves no way in and the ladder may offer
    more than the plan: what loopback carries, not a NIC, is what it measures."""
    from daskpipe.plan.configs import Budget
    from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan
    from daskpipe.profiles.fx import segment_model
    from daskpipe.profiles.model import Profile

    segmented = segment_model(KeepEvery64th().eval(), torch.zeros(1, *input_shape))
    bounds = [0, segmented.num_segments]
    blocked = segmented.cut(bounds)
    profile = Profile(
        model=MODEL,
        slo_us=SLO_MS * 1e3,
        num_blocks=1,
        latency_us={("T4", 1): np.full((1, BATCH), HOLD_US)},
        boundary_bytes=tuple(float(b) for b in blocked.boundary_bytes),
        input_shape=blocked.input_shape,
        boundary_shapes=tuple(blocked.boundary_shapes),
        meta={"segment_boundaries": bounds},
    )
    nic = Budget(latency_us=SLO_MS * 1e3, bw_gbps=BW_GBPS, gpus_per_server={"T4": SLOTS}, batch_build_rate=None)
    throughput = SLOTS * min(BATCH / (HOLD_US * 1e-6), nic.nic_cap(4.0 * math.prod(input_shape), ("T4", 1)))
    pipeline = Pipeline(BATCH, throughput, (Partition(blocks=(0, 1), gpu="T4", slices=1, vgpus=SLOTS, latency_us=HOLD_US),))
    plan = Plan(
        objective=throughput,
        models=(ModelPlan(name=MODEL, slo_us=SLO_MS * 1e3, weight=1.0, throughput=throughput, pipelines=(pipeline,)),),
        cluster={"bw_gbps": BW_GBPS},
    )
    return profile, plan


def sender_loop(address: str, input_shape: Sequence[int], ready: Any, commands: Any, results: Any) -> None:
    """A sender process: connects once, then runs each ``(rate, seconds, seed, start_at)`` trial it
    is sent (:func:`~daskpipe.benchmarks.serve.poisson_trial`) until it is sent ``None``."""
    connected = False
    try:
        from distributed import Client

        from daskpipe.benchmarks.remote_client import RemoteSender

        payload = request_payload(input_shape, "float32")
        with Client(address) as client, RemoteSender(client) as sender:
            connected = True
            ready.put(os.getpid())
            while (command := commands.get()) is not None:
                rate, seconds, seed, start_at = command
                results.put(poisson_trial(sender, MODEL, payload, rate, seconds, seed, start_at))
    except Exception as exc:
        (results if connected else ready).put({"error": f"{type(exc).__name__}: {exc}"})


class Senders:
    """``count`` sender processes, each with its own client, started once for many trials."""

    def __init__(self, address: str, input_shape: Sequence[int], count: int):
        from distributed.utils import get_mp_context  # as Dask starts its workers: spawn unless configured

        context = get_mp_context()
        self.ready, self.results = context.Queue(), context.Queue()
        self.commands = [context.Queue() for _ in range(count)]
        self.processes = [
            context.Process(target=sender_loop, args=(address, tuple(input_shape), self.ready, commands, self.results))
            for commands in self.commands
        ]
        for process in self.processes:
            process.start()
        self.pids = []
        for _ in self.processes:
            note = self.ready.get(timeout=READY_S)
            if isinstance(note, dict):
                self.close()
                raise RuntimeError(f"a sender process failed: {note['error']}")
            self.pids.append(note)

    def trial(self, rate: float, seconds: float, seed: int) -> list[dict[str, Any]]:
        start_at = time.time() + START_S
        for k, commands in enumerate(self.commands):
            commands.put((rate / len(self.commands), seconds, sender_seed(seed, k), start_at))
        return [self.results.get(timeout=START_S + seconds + DRAIN_S + 60) for _ in self.commands]

    def close(self) -> None:
        for commands in self.commands:
            commands.put(None)
        for process in self.processes:
            process.join(30)
            if process.is_alive():
                process.terminate()


def socket_bytes(pid: int) -> dict[tuple[str, str], int]:
    """Bytes sent plus received so far on each TCP socket of process ``pid``, by (local, peer) address."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    counts: dict[tuple[str, str], int] = {}
    lines = out.splitlines()
    for line, info in zip(lines[::2], lines[1::2]):
        if f"pid={pid}," not in line:
            continue
        fields = line.split()
        sent = re.search(r"bytes_sent:(\d+)", info)
        received = re.search(r"bytes_received:(\d+)", info)
        counts[(fields[3], fields[4])] = int(sent.group(1) if sent else 0) + int(received.group(1) if received else 0)
    return counts


def bytes_since(before: Mapping[tuple[str, str], int], pid: int) -> int:
    """Socket bytes of ``pid`` since ``before`` (:func:`socket_bytes`); a socket opened since counts from zero."""
    return sum(n - before.get(socket, 0) for socket, n in socket_bytes(pid).items())


def idle_cpu(pid: int, seconds: float) -> tuple[float, float]:
    """(wall s, CPU s) of process ``pid`` over ``seconds`` of no requests."""
    before, started = cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return time.monotonic() - started, cpu_s(pid) - before


def measured_trial(senders: Senders, roles: dict[str, int], scheduler_pid: int, rate: float, seconds: float, seed: int) -> dict[str, Any]:
    """One trial at ``rate``, with the scheduler's bytes and every role's CPU per request around it."""
    bytes_before = socket_bytes(scheduler_pid)
    cpu_before = {role: cpu_s(pid) for role, pid in roles.items()}
    started = time.monotonic()
    reports = senders.trial(rate, seconds, seed)
    wall = time.monotonic() - started
    cpu = {role: cpu_s(pid) - cpu_before[role] for role, pid in roles.items()}
    figures = latency_figures(reports, SLO_MS, seconds)
    requests = max(figures["requests"], 1)
    return {
        "offered_rate_per_s": rate,
        "seed": seed,
        **{k: figures[k] for k in ("requests", "attainment", "p50_ms", "p99_ms", "ended_otherwise", "latest_sender_start_ms")},
        "wall_s": wall,
        "scheduler_cpu_s": cpu["scheduler"],
        "scheduler_bytes_per_request": bytes_since(bytes_before, scheduler_pid) / requests,
        "cpu_us_per_request": {role: seconds * 1e6 / requests for role, seconds in cpu.items()},
    }


def fitted_cost(idle: tuple[float, float], trials: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """(idle share of a core, CPU seconds per request) of the scheduler, fitted by least squares to
    its CPU over the idle stretch and the trials: cpu = share x wall + cost x requests."""
    walls = [idle[0], *(t["wall_s"] for t in trials)]
    requests = [0, *(t["requests"] for t in trials)]
    cpu = [idle[1], *(t["scheduler_cpu_s"] for t in trials)]
    (share, cost), *_ = np.linalg.lstsq(np.column_stack([walls, requests]), np.array(cpu), rcond=None)
    return float(share), float(cost)


def above_idle_us(run: Mapping[str, Any], trials: Sequence[dict[str, Any]]) -> float:
    """The scheduler's CPU per request over ``trials`` of ``run``, above its measured idle share."""
    above_idle = sum(t["scheduler_cpu_s"] - run["scheduler_idle_measured_share"] * t["wall_s"] for t in trials)
    return above_idle * 1e6 / max(sum(t["requests"] for t in trials), 1)


def at_common_rates(shapes: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per sender count: each shape's scheduler CPU per request above its idle share, over the
    offered rates at which every shape's trial met the bar, and its ratio to the smallest input's.

    A request's CPU falls as the rate rises (a busy stream carries several messages a write), and a
    small input's ladder climbs further than a large one's, so input sizes compare at the same
    rates only: the ladders share their rates and seeds, so these are the same requests at the same
    times, differing in their inputs alone."""
    by_size = sorted(shapes, key=lambda shape: shapes[shape]["input_bytes"])
    out: dict[str, Any] = {}
    for count in shapes[by_size[0]]["senders"]:
        runs = {shape: shapes[shape]["senders"].get(count) for shape in by_size}
        if any(run is None for run in runs.values()):
            continue
        passed = [
            {round(t["offered_rate_per_s"], 6): t for t in run["trials"] if (t["attainment"] or 0) >= ATTAINMENT} for run in runs.values()
        ]
        rates = sorted(set.intersection(*(set(p) for p in passed)))
        if not rates:
            continue
        cpu = {shape: above_idle_us(runs[shape], [trials[rate] for rate in rates]) for shape, trials in zip(by_size, passed)}
        smallest = cpu[by_size[0]]
        out[count] = {
            "offered_rates_per_s": rates,
            "scheduler_cpu_us_per_request_above_idle": cpu,
            "ratio_to_smallest_input": {shape: value / smallest if smallest > 0 else None for shape, value in cpu.items()},
        }
    return out


def run_capacity(
    input_shapes: Sequence[tuple[int, ...]],
    sender_counts: Sequence[int],
    start_rate: float,
    seconds: float,
    dispatcher: str = "eager",
    rate_step: float = RATE_STEP,
    comm_floor: bool = False,
) -> dict:
    """For each input shape: deploy the hold-only model, then for each sender count the trials up
    to the first that misses the 99% bar (module docstring); with ``comm_floor``, the floor of
    :mod:`~daskpipe.benchmarks.comm_floor` at every rate the ladders offered, with their seeds."""
    from distributed import Client

    import daskpipe

    figures: dict[str, Any] = {
        "slo_ms": SLO_MS,
        "attainment_bar": ATTAINMENT,
        "trial_s": seconds,
        "rate_step": rate_step,
        "dispatcher": dispatcher,
        "shapes": {},
    }
    for input_shape in input_shapes:
        profile, plan = hold_only_plan(input_shape)
        per_shape: dict[str, Any] = {"input_bytes": 4 * math.prod(input_shape), "senders": {}}
        with cluster_processes({"T4": SLOTS}) as address, Client(address) as client:
            client.wait_for_workers(SLOTS, timeout=READY_S)
            svc = daskpipe.deploy(
                client,
                {MODEL: KeepEvery64th().eval()},
                example_inputs={MODEL: torch.zeros(1, *input_shape)},
                plan=plan,
                profiles={MODEL: profile},
                dispatcher=dispatcher,
                elastic=None,
            )
            try:
                scheduler_pid = client.run_on_scheduler(os.getpid)
                workers = client.run(os.getpid)
                for count in sender_counts:
                    senders = Senders(address, input_shape, count)
                    try:
                        roles = {"scheduler": scheduler_pid, **{f"worker-{i}": pid for i, pid in enumerate(workers.values())}}
                        roles.update({f"sender-{k}": pid for k, pid in enumerate(senders.pids)})
                        senders.trial(start_rate / 2, 1.0, seed=0)  # warm-up: streams opened, first batches
                        idle = idle_cpu(scheduler_pid, seconds)
                        trials, rate, seed, misses = [], start_rate, 1, 0
                        while misses < 2:
                            trials.append(measured_trial(senders, roles, scheduler_pid, rate, seconds, seed))
                            misses = misses + 1 if (trials[-1]["attainment"] or 0) < ATTAINMENT else 0
                            rate, seed = rate * rate_step, seed + 1
                    finally:
                        senders.close()
                    passed = [t for t in trials[:-2] if (t["attainment"] or 0) >= ATTAINMENT]
                    share, cost = fitted_cost(idle, trials)
                    per_shape["senders"][str(count)] = {
                        "highest_rate_at_bar_per_s": passed[-1]["offered_rate_per_s"] if passed else None,
                        "scheduler_bytes_per_request": float(np.median([t["scheduler_bytes_per_request"] for t in trials])),
                        "scheduler_idle_cpu_share": share,
                        "scheduler_cpu_us_per_request": cost * 1e6,
                        "ceiling_per_s": (1 - share) / cost if cost > 0 else None,
                        "scheduler_idle_measured_share": idle[1] / idle[0],
                        "trials": trials,
                    }
            finally:
                svc.close()
        figures["shapes"][",".join(map(str, input_shape))] = per_shape
    figures["same_rates"] = at_common_rates(figures["shapes"])
    if comm_floor:
        ladders = [run["trials"] for shape in figures["shapes"].values() for run in shape["senders"].values()]
        offered = {t["offered_rate_per_s"]: t["seed"] for trials in ladders for t in trials}
        rates = sorted(offered)
        floor = relay_floor(rates, seconds, [offered[rate] for rate in rates])
        figures["comm_floor"] = {"relayed_messages_per_request": RELAYED_MESSAGES, "trials": against_floor(figures["shapes"], floor)}
    return figures


def against_floor(shapes: Mapping[str, Mapping[str, Any]], floor: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each floor trial with, per input shape and sender count whose ladder offered its rate, the
    scheduler's CPU per request above its measured idle share there and its ratio to the floor's."""
    out = []
    for trial in floor:
        floor_us = trial["relay_cpu_us_per_request"]
        scheduler: dict[str, dict[str, Any]] = {}
        for shape, per_shape in shapes.items():
            for count, run in per_shape["senders"].items():
                for t in (t for t in run["trials"] if t["offered_rate_per_s"] == trial["offered_rate_per_s"]):
                    cost = above_idle_us(run, [t])
                    scheduler.setdefault(shape, {})[count] = {
                        "scheduler_cpu_us_per_request_above_idle": cost,
                        "attainment": t["attainment"],
                        "ratio_to_floor": cost / floor_us if floor_us > 0 else None,
                    }
        out.append({**trial, "scheduler": scheduler})
    return out


@click.command("capacity")
@click.option(
    "--input-shape",
    "input_shapes",
    multiple=True,
    default=("3,64,64", "3,512,1024"),
    show_default=True,
    callback=lambda ctx, param, value: [parse_shape(v) for v in value],
    help="One sample's shape (float32); repeat for several, measured in the same run.",
)
@click.option(
    "--senders",
    default="1,2,4",
    show_default=True,
    callback=lambda ctx, param, value: [int(v) for v in value.split(",")],
    help="Numbers of sender processes, each with its own Client.",
)
@click.option(
    "--start-rate", default=10.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="The first trial's rate, requests/s."
)
@click.option("--seconds", default=TRIAL_S, show_default=True, type=click.FloatRange(min=0, min_open=True), help="Seconds per trial.")
@click.option(
    "--rate-step",
    default=RATE_STEP,
    show_default=True,
    type=click.FloatRange(min=1, min_open=True),
    help="Each trial offers this many times the last one's rate (finer near a bar: with --start-rate close under it).",
)
@click.option("--dispatcher", default="eager", show_default=True, help="The data plane (deploy's dispatcher=).")
@click.option(
    "--comm-floor/--no-comm-floor",
    default=True,
    show_default=True,
    help="Also measure, at the ladders' rates, a relay of a request's three scheduler messages over Dask's comm and nothing else.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Also write the figures to this file.")
def bench_capacity(
    input_shapes: list[tuple[int, ...]],
    senders: list[int],
    start_rate: float,
    seconds: float,
    rate_step: float,
    dispatcher: str,
    comm_floor: bool,
    json_path: str | None,
) -> None:
    """What one scheduler carries: its bytes and CPU per request, and the highest rate at 99% within the SLO."""
    if any(k < 1 for k in senders):
        raise click.BadParameter(f"sender counts must be >= 1, got {senders}", param_hint="--senders")
    figures = run_capacity(input_shapes, senders, start_rate, seconds, dispatcher, rate_step, comm_floor)
    text = json.dumps(figures, indent=1)
    click.echo(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
