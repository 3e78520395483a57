"""``daskpipe bench serve``: does a deploy keep its SLO on the cluster it is given, at real time?

It connects to a running cluster (on GPUs: ``dask scheduler --preload daskpipe`` and a
``daskpipe worker`` per node), deploys one torchvision model with random weights and an SLO,
profiled on the cluster as any deploy is, and offers open-loop Poisson load at fractions of its
plan's capacity. The load comes from several client processes, each with its own ``Client``: one
Python client sent at most about 1000 single requests a second on an H200's host, short of what
one GPU serves. A request is on time when its output is in its sender's hands within the SLO of
its scheduled send time. Last, it deploys the model again with an SLO far under what one request
takes, which must be refused at deploy time with the smallest SLO that can be served.

This is the issue's real-GPU bar: at 50% load, 99% on time, or a refusal at deploy time.
"""

from __future__ import annotations

import functools
import gc
import json
import time
from collections import Counter
from typing import Any, Sequence

import click
import numpy as np
import torch
from torch import nn

from daskpipe.plan.schema import Plan, PlanError
from daskpipe.profiles.cli import parse_shape

WARM_UP_LOAD, WARM_UP_S = 0.3, 2.0  # the first batches of a deployment, not counted
READY_S = 120.0  # for every sender process to import, connect and open its stream
START_S = 0.5  # from the last sender's being ready to the first sends
DRAIN_S = 30.0  # after the last send: a request still not ended is counted lost
REFUSED_SLO_MS = 0.1


class BytesToUnit(nn.Module):
    """uint8 pixels to [0, 1] floats, in front of a model served with uint8 inputs (a quarter of
    fp32's bytes on the wire; a GPU stage casts them on the GPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() / 255


def served_model(name: str, input_shape: Sequence[int], input_dtype: str) -> tuple[nn.Module, torch.Tensor]:
    """The torchvision model ``name`` with random weights, and one example request."""
    import torchvision

    try:
        module: nn.Module = torchvision.models.get_model(name, weights=None).eval()
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from None
    example = torch.frombuffer(bytearray(request_payload(input_shape, input_dtype)), dtype=getattr(torch, input_dtype))
    return (nn.Sequential(BytesToUnit(), module).eval() if input_dtype == "uint8" else module), example.reshape(1, *input_shape)


class CollectionPauses:
    """The garbage collector's pauses in this process within the block (``gc.callbacks``). A full
    collection holds a sender's event loop, and so the outputs it is timing and its sends: on an
    H200's host, sender processes whose heap was not frozen paused 88-140 ms twice per trial."""

    def __init__(self) -> None:
        self.pauses_ms: list[float] = []
        self._started = 0.0

    def _time(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses_ms.append((time.perf_counter() - self._started) * 1e3)

    def __enter__(self) -> CollectionPauses:
        gc.callbacks.append(self._time)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._time)


def request_payload(input_shape: Sequence[int], input_dtype: str) -> bytes:
    """One request's raw bytes: random pixels (uint8) or standard normal floats (float32)."""
    rng = np.random.default_rng(0)
    if input_dtype == "uint8":
        return rng.integers(0, 256, size=tuple(input_shape), dtype=np.uint8).tobytes()
    return rng.standard_normal(tuple(input_shape), dtype=np.float32).tobytes()


def send_poisson(
    address: str,
    model: str,
    request: tuple[Sequence[int], str],
    rate: float,
    seconds: float,
    seed: int,
    ready: Any,
    go: Any,
    results: Any,
) -> None:
    """In a client process of its own: once connected, says so on ``ready`` and takes the wall-clock
    start time from ``go``; from then, Poisson requests of ``model`` (inputs of ``request``'s shape
    and dtype) at ``rate`` for ``seconds`` (:func:`poisson_trial`), whose report goes on ``results``.

    The payload is made here, not passed: a spawned process reads its arguments only after it has
    imported the target's module, torch included, so an argument larger than a pipe's buffer held
    the parent's start of the next sender until then. On an H200's host the four senders started
    6 s apart, each sending alone for most of its trial.
    """
    connected = False
    try:
        from distributed import Client

        from daskpipe.benchmarks.remote_client import RemoteSender

        payload = request_payload(*request)
        with Client(address) as client, RemoteSender(client) as sender:
            connected = True
            ready.put(None)
            results.put(poisson_trial(sender, model, payload, rate, seconds, seed, go.get(timeout=READY_S)))
    except Exception as exc:  # the parent reports it with the trial
        (results if connected else ready).put({"error": f"{type(exc).__name__}: {exc}"})


def poisson_due(rate: float, seconds: float, seed: int) -> np.ndarray:
    """Send times (s from the start) of Poisson arrivals at ``rate`` over ``seconds``."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, size=int(rate * seconds * 2) + 10)
    due = np.cumsum(gaps)
    return due[due < seconds]


def sender_seed(trial_seed: int, sender: int) -> int:
    """The arrivals' seed of sender number ``sender`` in a trial of ``trial_seed``: each sender a stream of its own."""
    return trial_seed * 1000 + sender


def poisson_trial(sender: Any, model: str, payload: bytes, rate: float, seconds: float, seed: int, start_at: float) -> dict[str, Any]:
    """From wall-clock ``start_at``, Poisson requests of ``model`` with input ``payload`` at
    ``rate`` for ``seconds`` from ``sender`` (a :class:`~daskpipe.benchmarks.remote_client.RemoteSender`);
    each request's latency in ms (``None`` when it did not end with an output in hand), its
    scheduled send time, and the errors by reason.

    A future is let go as soon as it has ended, as a serving client does: holding every future of a
    trial keeps its key on the scheduler and its output on the worker, and each full garbage
    collection of the three processes walks them all.
    """
    from distributed import wait

    from daskpipe.benchmarks.remote_client import mark_in_hand

    due = poisson_due(rate, seconds, seed)
    in_hand = [float("nan")] * len(due)
    errors: Counter[str] = Counter()
    in_flight: dict[int, Any] = {}

    def ended(index: int, future: Any) -> None:  # Dask's callback thread
        if in_flight.pop(index, None) is None:  # counted as not ended by the sweep below
            return
        mark_in_hand(in_hand, index, future)
        if np.isnan(in_hand[index]):
            errors[why_not_in_hand(future)] += 1

    time.sleep(max(0.0, start_at - time.time()))
    zero, late_start_s = time.perf_counter(), time.time() - start_at
    with CollectionPauses() as collections:
        for i, at in enumerate(due):
            time.sleep(max(0.0, zero + at - time.perf_counter()))
            future = in_flight[i] = sender.submit(model, payload)
            future.add_done_callback(functools.partial(ended, i))
        wait(list(in_flight.values()), timeout=DRAIN_S)
        time.sleep(0.2)  # the last done callbacks
    for index in list(in_flight):
        left = in_flight.pop(index, None)
        if left is not None:
            errors[why_not_in_hand(left)] += 1
    return {
        "latencies_ms": [None if np.isnan(t) else (t - zero - at) * 1e3 for t, at in zip(in_hand, due)],
        "due_s": due.tolist(),
        "errors": dict(errors),
        "late_start_s": late_start_s,
        "gc_pauses_ms": collections.pauses_ms,
    }


def why_not_in_hand(future: Any) -> str:
    """Why a future ended without its output in hand: a drop's reason, ``failed``, or its status."""
    from daskpipe.runtime.errors import RequestDropped, RequestFailed

    if future.status == "error":
        error = future.exception()
        if isinstance(error, RequestDropped):
            return f"dropped: {error.reason}"
        return "failed" if isinstance(error, RequestFailed) else type(error).__name__
    if future.status == "finished":
        return "output lost before it was fetched"
    return f"not ended ({future.status})"


def trial(
    svc: Any,
    address: str,
    model: str,
    request: tuple[Sequence[int], str],
    rate: float,
    seconds: float,
    senders: int,
    slo_ms: float,
    seed: int,
) -> dict[str, Any]:
    """One open-loop trial at ``rate`` from ``senders`` processes, which start sending together
    once all are connected; what it measured."""
    from distributed.utils import get_mp_context  # as Dask starts its workers: spawn unless configured

    context = get_mp_context()
    ready, go, results = context.Queue(), context.Queue(), context.Queue()
    before = svc.status()[model]
    processes = [
        context.Process(
            target=send_poisson, args=(address, model, request, rate / senders, seconds, sender_seed(seed, k), ready, go, results)
        )
        for k in range(senders)
    ]
    try:
        for process in processes:
            process.start()
        for _ in processes:
            note = ready.get(timeout=READY_S)
            if note is not None:
                raise RuntimeError(f"a sender process failed: {note['error']}")
        start_at = time.time() + START_S
        for _ in processes:
            go.put(start_at)
        reports = [results.get(timeout=START_S + seconds + DRAIN_S + 60) for _ in processes]
        for process in processes:
            process.join(30)
    finally:  # a sender that failed to start, or never reported, is not left behind
        for process in processes:
            if process.is_alive():
                process.terminate()
    after = svc.status()[model]
    return {
        "offered_rate_per_s": rate,
        "started_at_unix_s": start_at,  # when the first sends were due: to line the trial up with logs
        **latency_figures(reports, slo_ms, seconds),
        "batches": after["batches"] - before["batches"],
        "measured_ratios": after.get("measured_ratios"),
        "control": after.get("control"),
        "late_legs_since_deploy": after.get("late"),
    }


def latency_figures(reports: Sequence[dict[str, Any]], slo_ms: float, seconds: float) -> dict[str, Any]:
    """What the senders' :func:`poisson_trial` reports say together: attainment within ``slo_ms``,
    latency percentiles of the outputs in hand, misses per second, and how the senders kept time."""
    failures = [r["error"] for r in reports if "error" in r]
    if failures:
        raise RuntimeError(f"a sender process failed: {failures[0]}")
    latencies = np.array([np.inf if v is None else v for r in reports for v in r["latencies_ms"]])
    due = np.array([at for r in reports for at in r["due_s"]])
    errors: Counter[str] = Counter()
    for report in reports:
        errors.update(report["errors"])
    in_hand = latencies[np.isfinite(latencies)]
    on_time = int((latencies <= slo_ms).sum())
    return {
        "latest_sender_start_ms": max(r["late_start_s"] for r in reports) * 1e3,
        "sender_gc_pause_max_ms": max((p for r in reports for p in r["gc_pauses_ms"]), default=0.0),
        "sender_gc_pauses_over_10ms": sum(p > 10 for r in reports for p in r["gc_pauses_ms"]),
        "requests": len(latencies),
        "attainment": on_time / len(latencies) if len(latencies) else None,
        "on_time": on_time,
        "late": int((in_hand > slo_ms).sum()),
        "ended_otherwise": dict(errors),
        "p50_ms": float(np.percentile(in_hand, 50)) if len(in_hand) else None,
        "p99_ms": float(np.percentile(in_hand, 99)) if len(in_hand) else None,
        "misses_by_second": np.bincount(due[latencies > slo_ms].astype(int), minlength=int(np.ceil(seconds))).tolist(),
    }


def run_serve(
    address: str,
    *,
    model: str,
    input_shape: Sequence[int],
    input_dtype: str,
    slo_ms: float,
    loads: Sequence[float],
    seconds: float,
    senders: int,
    time_dilation: float,
) -> dict[str, Any]:
    """Deploy, offer each load, then check a refusal (module docstring); the figures."""
    from distributed import Client

    import daskpipe
    from daskpipe.runtime.errors import DeployError

    module, example = served_model(model, input_shape, input_dtype)
    request = (tuple(input_shape), input_dtype)
    figures: dict[str, Any] = {
        "scheduler": address,
        "model": model,
        "input_shape": list(input_shape),
        "input_dtype": input_dtype,
        "slo_ms": slo_ms,
        "time_dilation": time_dilation,
        "senders": senders,
        "seconds": seconds,
        "timing": "a request is on time when its output is in its sender's hands within the SLO (times the dilation) of its scheduled "
        "Poisson send time",
    }
    on_time_ms = slo_ms * time_dilation
    with Client(address) as client:
        figures["workers"] = sorted(str(w.get("name")) for w in client.scheduler_info(n_workers=-1)["workers"].values())
        started = time.perf_counter()
        svc = daskpipe.deploy(
            client, {model: module}, example_inputs={model: example}, slo_ms={model: slo_ms}, time_dilation=time_dilation, elastic=None
        )
        try:
            figures["deploy_s"] = time.perf_counter() - started
            plan = svc.plan
            assert isinstance(plan, Plan), "a synchronous client's service has its plan at hand"
            capacity = plan.model(model).throughput / time_dilation  # the plan's, in undilated time
            figures["plan_rate_per_s"] = capacity
            figures["plan"] = plan.to_dict()
            figures["profile_timing"] = svc.profiles[model].meta.get("measurements")
            trial(svc, address, model, request, WARM_UP_LOAD * capacity, WARM_UP_S, senders, on_time_ms, seed=0)
            figures["loads"] = {
                f"{load:g}": trial(svc, address, model, request, load * capacity, seconds, senders, on_time_ms, seed=1 + i)
                for i, load in enumerate(loads)
            }
        finally:
            svc.close()
        try:
            daskpipe.deploy(
                client,
                {model: module},
                example_inputs={model: example},
                slo_ms={model: REFUSED_SLO_MS},
                time_dilation=time_dilation,
                elastic=None,
            ).close()
            figures["refusal"] = {"slo_ms": REFUSED_SLO_MS, "refused": False}
        except (DeployError, PlanError) as exc:
            figures["refusal"] = {"slo_ms": REFUSED_SLO_MS, "refused": True, "error": f"{type(exc).__name__}: {exc}"}
    return figures


def parse_loads(ctx: click.Context, param: click.Parameter, value: str) -> list[float]:
    try:
        loads = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"comma-separated fractions of the plan's capacity, got {value!r}") from None
    if not loads or not all(0 < load <= 2 for load in loads):
        raise click.BadParameter(f"each load must be in (0, 2], got {value!r}")
    return loads


@click.command("serve")
@click.argument("scheduler_address")
@click.option("--model", default="resnet50", show_default=True, help="A torchvision model name (random weights).")
@click.option(
    "--input-shape",
    default="3,224,224",
    show_default=True,
    callback=lambda ctx, param, value: parse_shape(value),
    help="One sample's shape.",
)
@click.option(
    "--input-dtype",
    type=click.Choice(["float32", "uint8"]),
    default="float32",
    show_default=True,
    help="uint8: pixels, scaled to [0, 1] in the model.",
)
@click.option(
    "--slo-ms", default=30.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="The SLO the model is deployed with."
)
@click.option(
    "--loads", default="0.25,0.5", show_default=True, callback=parse_loads, help="Fractions of the plan's capacity offered, one trial each."
)
@click.option(
    "--seconds", default=6.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="Seconds of arrivals per trial."
)
@click.option("--senders", default=4, show_default=True, type=click.IntRange(min=1), help="Client processes the load comes from.")
@click.option(
    "--time-dilation",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Only for emulated GPUs on a slow machine (docs/runtime.md).",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Also write the figures to this file.")
def bench_serve(
    scheduler_address: str,
    model: str,
    input_shape: tuple[int, ...],
    input_dtype: str,
    slo_ms: float,
    loads: list[float],
    seconds: float,
    senders: int,
    time_dilation: float,
    json_path: str | None,
) -> None:
    """Attainment of a real-time deploy on a running cluster, under open-loop load from several client processes."""
    figures = run_serve(
        scheduler_address,
        model=model,
        input_shape=input_shape,
        input_dtype=input_dtype,
        slo_ms=slo_ms,
        loads=loads,
        seconds=seconds,
        senders=senders,
        time_dilation=time_dilation,
    )
    text = json.dumps(figures, indent=1, default=str)
    click.echo(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
