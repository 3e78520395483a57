"""``daskpipe bench fidelity``: does the Dask runtime sustain the load the simulator says a plan sustains?

For each model and kind of input: one plan (the MILP on a small emulated inventory, ``--gpus``,
counting the input's way in to the first stage) and, at each load
factor, one Poisson workload (``--seed``), served twice: by the simulator (:mod:`daskpipe.sim`)
and by the runtime (``daskpipe.deploy(..., plan=, profiles=, time_dilation=1.0)``) on an
:class:`~daskpipe.runtime.cluster.EmulatedCluster` whose stages hold each batch for its profiled
latency. Both run the PPipe dispatcher on the same slots; the simulator is given the emulated
cluster's layout (every GPU on one server), so no hop crosses a NIC in either.

* Profiles: PPipe's measurements (``--profiles``, default ``../shared/ppipe``) with their SLOs.
  A stand-in model serves their blocks, one torch.fx node per block, cheap enough for 2 cores: it
  passes tensors of the profile's boundary shapes where the profile records them, else small ones
  (PPipe's profiles record only bytes); the output says which.
* Search: the simulator's max load is :func:`daskpipe.sim.find_max_load`'s; the runtime's is the
  same bisection on the same grid (``--step``, 0.025 up to 1.0, attainment assumed not to rise
  with load). The grid is finer than ``find_max_load``'s 0.05: at the loads these plans reach
  (0.5-0.6), a 0.05 step is about a tenth of the load, as coarse as the 0.9 ratio the bench is
  read against: one step more or less in either search moved the ratio by 0.08-0.1. Each
  runtime trial replays exactly the simulator's arrivals at that load (read from its trace), and
  the simulator's attainment on them is reported beside the runtime's.
* Trials are independent, as simulations are: each runs on a fresh deployment of the plan (on the
  same cluster), after a warm-up stream that is not counted and a full garbage collection, so
  nothing measured at one load (queues, the control path's margin, young objects) carries over
  to the next.
* Attainment on the runtime: a request counts when its output is in the client's hands (its future
  yielded by the service's ``as_completed`` to a client thread, and its ``result()`` read there)
  within the SLO of its *scheduled* send time, so a client that falls behind its schedule is
  charged for it, as an open-loop client is.
* The control path's share: the simulator has none, the runtime a few messages per request. The
  simulator's search runs once more with the SLO shortened by the median of the trials' measured
  control paths (``control.total_p50_ms``): what the plan reaches when every request pays that
  median and no more. A runtime below it loses to the path's variance; between it and the
  simulator's, to its median.
"""

from __future__ import annotations

import gc
import json
import math
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import click
import numpy as np
import torch
from torch import nn

from daskpipe.plan.schema import Plan
from daskpipe.profiles.model import Profile

if TYPE_CHECKING:
    from daskpipe.sched.api import Placement
    from daskpipe.sim import ModelResult

DEFAULT_PROFILES = "../shared/ppipe"
DEFAULT_MODELS = ("googlenet-v3", "fcn", "wide_resnet101_2")  # SLOs 23.4, 33.3 and 67.1 ms
DEFAULT_GPUS = {"L4": 1, "T4": 1}
DEFAULT_DURATION_S = 4.0
DEFAULT_MAX_RATE = 400.0
MAX_GPUS = 3  # the emulated cluster runs a worker process per MPS slice on this machine
BW_GBPS = 10.0
PLAN_MARGIN = 0.4  # PPipe's: 40% of the SLO kept in the plan, none at run time
TARGET = 0.99
DEFAULT_STEP, MAX_LOAD = 0.025, 1.0
SMALL_SHAPE = (16,)
READ_VALUES = 16
REAL_INPUT_SHAPES = {"googlenet-v3": (3, 299, 299), "wide_resnet101_2": (3, 224, 224)}
"""The models' own input sizes, which PPipe's profiles do not record; the cityscapes models take
512x1024 frames (their names say so), and any other model here a 224x224 image."""
INPUT_KINDS = ("real", "small")
SERVER = "node-0"  # the emulated cluster's one server
LEAD_S = 0.2  # from the start of a trial to its time zero: the client is ready before the first send
DRAIN_S = 5.0  # after the last send and one SLO: a request still not in hand counts as lost
WORKERS_READY_S = 120.0  # for a worker process of its own to import torch and start every slot
WARM_UP_S, WARM_UP_LOAD = 1.0, 0.5  # each deployment's first batches (fresh streams) are slow, and not counted

SEARCH = (
    f"bisection on the grid of `step` up to {MAX_LOAD:g} (the top first, then halving the bracket), assuming attainment does not rise "
    "with load; the simulator's is daskpipe.sim.find_max_load on the same grid"
)
TIMING = (
    "a request is on time when its output is in the client's hands (the service's as_completed, then result(), in a client thread) "
    "within the SLO of its scheduled Poisson send time"
)


class BenchOptionError(ValueError):
    """An option of the bench cannot be used as given; ``option`` names it for the command's error."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


# -- the stand-in model ------------------------------------------------------------------------
torch.fx.wrap("hand_over")


def hand_over(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """One stand-in block: the mean of each sample's first :data:`READ_VALUES` values spread over
    a tensor of ``shape``, so that a 6.3 MB frame costs no more compute than 16 floats. Wrapped
    for torch.fx, so that a block is one graph node and the stand-in cuts exactly between blocks."""
    return x.flatten(1)[:, :READ_VALUES].mean(1).view(-1, *(1,) * len(shape)).expand(-1, *shape).contiguous()


class StandIn(nn.Module):
    """A model of ``len(shapes)`` blocks, block ``i`` handing on a tensor of ``shapes[i]`` per sample."""

    def __init__(self, shapes: Sequence[tuple[int, ...]]):
        super().__init__()
        self.shapes = [tuple(shape) for shape in shapes]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for shape in self.shapes:
            x = hand_over(x, shape)
        return x


def real_input_shape(name: str) -> tuple[int, ...]:
    """The sample shape model ``name`` takes (:data:`REAL_INPUT_SHAPES`)."""
    if "cityscapes-512x1024" in name:
        return (3, 512, 1024)
    return next((shape for prefix, shape in REAL_INPUT_SHAPES.items() if name.startswith(prefix)), (3, 224, 224))


def stand_in(profile: Profile, input_shape: tuple[int, ...] | None = None) -> tuple[Profile, StandIn, torch.Tensor, str]:
    """The stand-in for ``profile``'s blocks, the profile re-cut for it (``segment_boundaries``:
    one segment per block), a batch-1 example input, and what its tensors are. ``input_shape``:
    the requests' sample shape, else the profile's or a small one."""
    if profile.input_shape is not None and profile.boundary_shapes is not None:
        shapes = [*profile.boundary_shapes, SMALL_SHAPE]
        input_shape = input_shape or tuple(profile.input_shape)
        tensors = "the profile's boundary shapes"
    else:
        shapes = [SMALL_SHAPE] * profile.num_blocks
        tensors = f"small: {SMALL_SHAPE} float32 per sample at every boundary (the profile records no boundary shapes)"
    input_shape = input_shape or SMALL_SHAPE
    tensors = f"inputs of {input_shape} float32 per sample; {tensors}"
    recut = replace(
        profile,
        input_shape=input_shape,
        input_bytes=4.0 * math.prod(input_shape),  # float32: the plan counts its way in to the first stage
        boundary_shapes=tuple(tuple(s) for s in shapes[:-1]),
        meta={**profile.meta, "segment_boundaries": list(range(profile.num_blocks + 1))},
    )
    return recut, StandIn(shapes).eval(), torch.zeros(1, *input_shape), tensors


# -- what is served ----------------------------------------------------------------------------
@dataclass
class ServedModel:
    """One model as the bench serves it: its re-cut profile, stand-in and plan, and the emulated
    GPUs (type -> count) with the slice count the plan cuts each type into."""

    name: str
    inputs: str  # one of INPUT_KINDS
    profile: Profile
    module: StandIn
    example: torch.Tensor
    tensors: str
    plan: Plan
    gpus: dict[str, int]
    slices: dict[str, int]

    @property
    def rate(self) -> float:
        return self.plan.model(self.name).throughput

    @property
    def slo_s(self) -> float:
        return self.profile.slo_us / 1e6

    def summary(self) -> list[str]:
        """Each pipeline on one line: batch, pools (GPU/slices x pool size [blocks)), planned rate."""
        lines = []
        for pipeline in self.plan.model(self.name).pipelines:
            pools = " -> ".join(f"{p.gpu}/v{p.slices} x{p.vgpus} [{p.blocks[0]},{p.blocks[1]})" for p in pipeline.partitions)
            lines.append(f"batch {pipeline.batch_size}: {pools}, {pipeline.throughput:.1f} req/s")
        return lines


def prepare(
    profiles_path: str | Path, models: Sequence[str], gpus: Mapping[str, int], max_rate: float, inputs: Sequence[str] = INPUT_KINDS
) -> list[ServedModel]:
    """Load, re-cut and plan every model, checking all of them before any cluster starts; one
    :class:`ServedModel` per model and kind of ``inputs`` (its real input size, or a small one),
    each on its own plan: the plan counts the inputs' way in to the first stage."""
    from daskpipe.profiles.loader import load_profiles, resolve_model_names
    from daskpipe.profiles.model import ProfileError

    path = Path(profiles_path)
    if not path.exists():
        where = str(path) if path.is_absolute() else f"{path} ({path.resolve()})"
        raise BenchOptionError(
            "--profiles",
            f"{where} does not exist: pass the PPipe profiles (../shared/ppipe, see its README.md) from the repository root, or their path",
        )
    if sum(gpus.values()) > MAX_GPUS:
        raise BenchOptionError(
            "--gpus", f"at most {MAX_GPUS} GPUs (the emulated cluster runs a process per MPS slice on this machine), got {dict(gpus)}"
        )
    try:
        profiles = load_profiles(path)
    except ProfileError as exc:
        raise BenchOptionError("--profiles", str(exc)) from None
    try:
        names = resolve_model_names(sorted(profiles), list(models), where=str(path))
    except ProfileError as exc:
        raise BenchOptionError("--models", str(exc)) from None
    served = []
    for name in names:
        for kind in inputs:
            variant = stand_in(profiles[name], real_input_shape(name) if kind == "real" else None)
            served.append(ServedModel(name, kind, *variant, *plan_on(variant[0], gpus, max_rate)))
    return served


def plan_on(profile: Profile, gpus: Mapping[str, int], max_rate: float) -> tuple[Plan, dict[str, int], dict[str, int]]:
    """The plan of ``profile`` on ``gpus`` (all on one server), the GPUs it uses and the slice
    count it cuts each type into; :class:`BenchOptionError` if the emulated cluster cannot run it."""
    from daskpipe.plan.milp import make_plan
    from daskpipe.plan.options import PlannerOptions
    from daskpipe.plan.schema import PlanError

    name = profile.model
    try:
        options = PlannerOptions(bw_gbps=BW_GBPS, margin=PLAN_MARGIN, max_parts=2)
        plan = make_plan({name: profile}, gpus, gpus_per_server=gpus, options=options)
    except PlanError as exc:
        raise BenchOptionError("--gpus", f"cannot plan {name} on {dict(gpus)}: {exc}") from None
    slices: dict[str, set[int]] = {}
    for pipeline in plan.model(name).pipelines:
        for part in pipeline.partitions:
            slices.setdefault(part.gpu, set()).add(part.slices)
    mixed = {gpu: sorted(v) for gpu, v in slices.items() if len(v) > 1}
    if mixed:
        raise BenchOptionError(
            "--gpus",
            f"the plan of {name} on {dict(gpus)} cuts one GPU type into several slice counts {mixed}; an emulated cluster cuts all "
            f"GPUs of a type alike: pick other --gpus",
        )
    if plan.model(name).throughput > max_rate:
        raise BenchOptionError(
            "--gpus",
            f"the plan of {name} on {dict(gpus)} serves {plan.model(name).throughput:.0f} req/s, over --max-rate {max_rate:g}: this "
            f"machine could not send it open-loop; pick fewer or slower GPUs",
        )
    return plan, {gpu: gpus[gpu] for gpu in slices}, {gpu: v.pop() for gpu, v in slices.items()}


def on_one_server(plan: Plan) -> dict[str, Placement]:
    """The simulator's placement laid out as the emulated cluster's: every slot on one server."""
    from daskpipe.sched.placement import place

    return {name: replace(p, slots={sid: replace(slot, server=SERVER) for sid, slot in p.slots.items()}) for name, p in place(plan).items()}


# -- one runtime trial -------------------------------------------------------------------------
def serve_trial(service: Any, lag: SchedulerLag, name: str, example: torch.Tensor, arrivals: np.ndarray, slo_s: float) -> dict[str, Any]:
    """Send one request at each of ``arrivals`` (seconds from time zero) open-loop, and account
    for every one of them: on time, late, dropped by reason, failed, or lost (not ended after the drain)."""
    from daskpipe.runtime.errors import RequestDropped

    count = len(arrivals)
    give_up_s = LEAD_S + float(arrivals.max(initial=0.0)) + slo_s + DRAIN_S
    futures: list[Any] = []
    index: dict[Any, int] = {}
    sent, in_hand = np.full(count, np.nan), np.full(count, np.nan)
    completed = service.as_completed(timeout=give_up_s)
    all_sent = threading.Event()

    def collect() -> None:
        while True:
            done_sending = all_sent.is_set()  # before looking: a request added since is still to come
            try:
                future = next(completed)
            except StopIteration:  # nothing outstanding now
                if done_sending:
                    return
                all_sent.wait(0.001)
                continue
            except TimeoutError:
                return
            if future.status == "finished":
                future.result()  # the output in hand: one that came with the completion, at once
            in_hand[index[future.key]] = time.perf_counter()

    before = service.status()[name]
    lag.start()
    collector = threading.Thread(target=collect, name="fidelity-collector", daemon=True)
    zero = time.perf_counter() + LEAD_S
    collector.start()
    for i, at in enumerate(arrivals):
        delay = zero + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sent[i] = time.perf_counter()
        future = service.submit(name, example)
        index[future.key] = i
        futures.append(future)
        completed.add(future)
    all_sent.set()
    collector.join()
    lags_ms = np.asarray(lag.stop()) * 1e3
    after = service.status()[name]
    latency = in_hand - (zero + arrivals)
    statuses = [future.status for future in futures]
    finished = (np.array(statuses, dtype=object) == "finished") & ~np.isnan(in_hand)
    on_time = finished & (latency <= slo_s)
    dropped: Counter[str] = Counter()
    failed = 0
    lost: Counter[str] = Counter()  # by the future's status: pending (never ended), cancelled, finished only after the drain
    for future, status, done in zip(futures, statuses, finished):
        if status == "error":
            exc = future.exception()
            if isinstance(exc, RequestDropped):
                dropped[exc.reason] += 1
            else:
                failed += 1
        elif not done:
            lost[status] += 1
    send_lag_ms = (sent - (zero + arrivals)) * 1e3
    return {
        "attainment": float(on_time.sum()) / count if count else 1.0,
        "on_time": int(on_time.sum()),
        "late": int(finished.sum() - on_time.sum()),
        "dropped_by_reason": dict(dropped),
        "failed": failed,
        "lost": sum(lost.values()),
        "lost_by_status": dict(lost),
        "p50_ms": percentile(latency[finished] * 1e3, 50),
        "p99_ms": percentile(latency[finished] * 1e3, 99),
        "send_lag_p99_ms": percentile(send_lag_ms, 99),
        "send_lag_max_ms": percentile(send_lag_ms, 100),
        "loop_lag_p99_ms": percentile(lags_ms, 99),
        "loop_lag_max_ms": percentile(lags_ms, 100),
        "batches": after["batches"] - before["batches"],
        "overruns": after["overruns"] - before["overruns"],
        "control": after.get("control"),
        "late_legs": after.get("late"),  # the deployment's, its warm-up stream included
    }


def percentile(values: np.ndarray, q: float) -> float | None:
    """The ``q``-th percentile, ``None`` for no values (a trial without requests, or none completed)."""
    return float(np.percentile(values, q)) if values.size else None


def bisect_grid(grid: Sequence[float], passes: Callable[[float], bool]) -> float:
    """The highest load of ``grid`` that passes (0 if none): the top first, then halving the
    bracket, as :func:`daskpipe.sim.find_max_load` searches."""
    good, bad = -1, len(grid) - 1
    if passes(grid[bad]):
        return grid[bad]
    while bad - good > 1:
        mid = (good + bad) // 2
        if passes(grid[mid]):
            good = mid
        else:
            bad = mid
    return grid[good] if good >= 0 else 0.0


# -- one model, both ways ----------------------------------------------------------------------
def sim_summary(result: ModelResult) -> dict[str, Any]:
    """The simulator's figures on a trial's arrivals, under the runtime's names, side by side."""
    return {
        "attainment": result.attainment,
        "late": result.late,
        "dropped_by_reason": result.dropped,
        "p99_ms": result.p99_ms,
        "mean_batch_size": result.mean_batch_size,
    }


@dataclass(frozen=True)
class SchedulerLag:
    """Samples the scheduler's loop lag over a trial, wherever that scheduler runs."""

    start: Callable[[], Any]
    stop: Callable[[], list[float]]


@contextmanager
def emulated_cluster(model: ServedModel, scheduler_process: bool) -> Iterator[tuple[Any, SchedulerLag]]:
    """A client of an emulated cluster of ``model``'s GPUs, and its scheduler's loop lag: the
    scheduler in this process (an :class:`~daskpipe.runtime.cluster.EmulatedCluster`, sharing the
    client's loop) or, with ``scheduler_process``, in a process of its own, as deployed."""
    from distributed import Client

    from daskpipe.benchmarks.processes import cluster_processes
    from daskpipe.benchmarks.runtime_overhead import LoopLag, start_loop_lag, stop_loop_lag
    from daskpipe.runtime.cluster import EmulatedCluster

    if scheduler_process:
        slots = sum(count * model.slices[gpu] for gpu, count in model.gpus.items())
        with cluster_processes(model.gpus, slices=model.slices) as address, Client(address) as client:
            client.wait_for_workers(slots, timeout=WORKERS_READY_S)
            yield client, SchedulerLag(lambda: client.run_on_scheduler(start_loop_lag), lambda: client.run_on_scheduler(stop_loop_lag))
        return
    with EmulatedCluster(model.gpus, slices=model.slices, dashboard_address=None) as cluster, Client(cluster) as client:
        lag = LoopLag()
        yield client, SchedulerLag(lambda: cluster.sync(lag.start), lambda: cluster.sync(lag.stop))


def measure_model(
    model: ServedModel, *, duration: float, seed: int, step: float, advance: Callable[..., None], scheduler_process: bool = False
) -> dict[str, Any]:
    """The simulator's and the runtime's max load factor for one model, with every runtime trial."""
    import daskpipe
    from daskpipe.runtime.errors import DeployError
    from daskpipe.sim import SimulationConfig, find_max_load, simulate
    from daskpipe.sim.simulate import load_grid
    from daskpipe.sim.workload import poisson_arrivals

    profiles = {model.name: model.profile}
    placements = on_one_server(model.plan)
    config = SimulationConfig(duration=duration, seed=seed, placements=placements)
    sim_best = find_max_load(model.plan, profiles, config, target=TARGET, step=step, max_load=MAX_LOAD).max_load_factor[model.name]
    out: dict[str, Any] = {
        "slo_ms": model.profile.slo_us / 1e3,
        "sim_max_load_factor": sim_best,
        "runtime_max_load_factor": 0.0,
        "ratio": None,
        "planned_rate_per_s": model.rate,
        "plan": model.summary(),
        "emulated_gpus": {gpu: {"count": count, "slices": model.slices[gpu]} for gpu, count in model.gpus.items()},
        "tensors": model.tensors,
        "trials": [],
    }
    trials: list[dict[str, Any]] = out["trials"]
    advance(0, note=f"{model.name}: starting {sum(c * model.slices[g] for g, c in model.gpus.items())} emulated slots")
    warm_up = poisson_arrivals(WARM_UP_LOAD * model.rate, WARM_UP_S, np.random.default_rng(seed))
    with emulated_cluster(model, scheduler_process) as (client, lag):

        def serve(arrivals: np.ndarray) -> dict[str, Any]:
            """``arrivals`` served by a deployment of their own, warmed up first, so that every
            trial starts from an idle, steady service (no queue, no delays of another load), as
            every simulation starts idle."""
            try:
                service = daskpipe.deploy(
                    client,
                    {model.name: model.module},
                    example_inputs={model.name: model.example},
                    plan=model.plan,
                    profiles=profiles,
                    time_dilation=1.0,
                    elastic=None,
                )
            except DeployError as exc:  # e.g. an SLO the runtime's control path cannot meet
                return {"attainment": 0.0, "deploy_error": str(exc)}
            with service:
                serve_trial(service, lag, model.name, model.example, warm_up, model.slo_s)
                # what the deploy, the simulation and the warm-up left is old by now, as in a service
                # that has run a while: else the collector's first middle-generation pass in the trial
                # walks it all, a stall of 11-13 ms of the scheduler's loop (an in-process scheduler
                # shares this process) in every trial
                gc.collect()
                return serve_trial(service, lag, model.name, model.example, arrivals, model.slo_s)

        def passes(load: float) -> bool:
            sim = simulate(model.plan, profiles, config, load_factor=load)
            _, trace = sim.runs[model.name]
            arrivals = np.sort([r.arrival for r in trace.requests.values()])
            advance(note=f"{model.name}: load {load:.2f} on the runtime ({len(arrivals)} requests)")
            runtime = serve(arrivals)
            trials.append(
                {
                    "load_factor": load,
                    "offered_rate_per_s": load * model.rate,
                    "requests": len(arrivals),
                    "sim": sim_summary(sim.models[model.name]),
                    "runtime": runtime,
                }
            )
            return runtime["attainment"] >= TARGET

        out["runtime_max_load_factor"] = bisect_grid(load_grid(step, MAX_LOAD), passes)
    if sim_best > 0:
        out["ratio"] = out["runtime_max_load_factor"] / sim_best
    paths_ms = [t["runtime"]["control"]["total_p50_ms"] for t in trials if "total_p50_ms" in (t["runtime"].get("control") or {})]
    if paths_ms:
        cut_ms = float(np.median(paths_ms))
        shortened = replace(model.plan, models=tuple(replace(m, slo_us=m.slo_us - cut_ms * 1e3) for m in model.plan.models))
        out["control_path_p50_ms"] = cut_ms
        out["sim_with_control_path_max_load_factor"] = find_max_load(
            shortened, profiles, config, target=TARGET, step=step, max_load=MAX_LOAD
        ).max_load_factor[model.name]
    return out


def max_trials(step: float) -> int:
    """Runtime trials of one model's search at most: the top of the grid, then the bisection."""
    from daskpipe.sim.simulate import load_grid

    return 1 + math.ceil(math.log2(len(load_grid(step, MAX_LOAD))))


def run_fidelity(
    profiles: str | Path = DEFAULT_PROFILES,
    models: Sequence[str] = DEFAULT_MODELS,
    gpus: Mapping[str, int] = DEFAULT_GPUS,
    *,
    duration: float = DEFAULT_DURATION_S,
    seed: int = 1,
    max_rate: float = DEFAULT_MAX_RATE,
    step: float = DEFAULT_STEP,
    inputs: Sequence[str] = INPUT_KINDS,
    scheduler_process: bool = False,
    advance: Callable[..., None] = lambda *a, **k: None,
) -> dict[str, Any]:
    """The figures of ``daskpipe bench fidelity``, per model and kind of inputs;
    :class:`BenchOptionError` names a bad argument."""
    if not (duration > 0 and math.isfinite(duration)):
        raise BenchOptionError("--duration", f"must be a positive number of seconds, got {duration!r}")
    if not (max_rate > 0 and math.isfinite(max_rate)):
        raise BenchOptionError("--max-rate", f"must be a positive number of requests/s, got {max_rate!r}")
    check_step(step)
    if not inputs or any(kind not in INPUT_KINDS for kind in inputs):
        raise BenchOptionError("--inputs", f"name one or both of {list(INPUT_KINDS)}, got {list(inputs)}")
    started = time.perf_counter()
    served = prepare(profiles, models, gpus, max_rate, inputs)
    results: dict[str, dict[str, Any]] = {}
    for model in served:
        figures = results.setdefault(model.name, {})[model.inputs] = measure_model(
            model, duration=duration, seed=seed, step=step, advance=advance, scheduler_process=scheduler_process
        )
        advance(max_trials(step) - len(figures["trials"]), note=f"{model.name} ({model.inputs} inputs) done")
    for figures in results.values():
        if "real" in figures and "small" in figures and figures["small"]["runtime_max_load_factor"] > 0:
            figures["runtime_real_over_small"] = figures["real"]["runtime_max_load_factor"] / figures["small"]["runtime_max_load_factor"]
    return {
        "profiles": str(profiles),
        "gpus": dict(gpus),
        "bw_gbps": BW_GBPS,
        "plan_margin": PLAN_MARGIN,
        "time_dilation": 1.0,
        "scheduler": "a process of its own" if scheduler_process else "in the client's process, on its event loop",
        "dataplane": "ppipe",
        "duration_s": duration,
        "seed": seed,
        "target_attainment": TARGET,
        "step": step,
        "search": SEARCH,
        "attainment_timing": TIMING,
        "ratio_definition": "runtime_max_load_factor / sim_max_load_factor (null when the simulator's is 0)",
        "inputs": "per model, `real`: requests of the model's own input size (REAL_INPUT_SHAPES), `small`: of 16 floats; "
        "runtime_real_over_small compares their runtime max load factors",
        "models": results,
        "wall_s": time.perf_counter() - started,
    }


def check_step(step: float) -> None:
    """A load grid's step: :class:`BenchOptionError` naming ``--step`` unless 0 < step <= 0.5 (a
    grid of one point measures nothing)."""
    if not 0 < step <= MAX_LOAD / 2:  # NaN and infinities fail it too
        raise BenchOptionError("--step", f"must be a load factor step in (0, {MAX_LOAD / 2:g}], got {step!r}")


def parse_gpus(ctx: click.Context, param: click.Parameter, value: str) -> dict[str, int]:
    """``--gpus`` as ``daskpipe worker --emulate`` reads its pairs, with errors naming ``--gpus``."""
    from daskpipe.runtime.worker.slots import WorkerSpecError, parse_pairs

    try:
        return parse_pairs(value, ":", option="--gpus")
    except WorkerSpecError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command("fidelity")
@click.option(
    "--profiles",
    default=DEFAULT_PROFILES,
    show_default=True,
    help="PPipe-layout profiles (their SLOs from models.csv), or a folder of daskpipe JSON profiles.",
)
@click.option("--models", default=",".join(DEFAULT_MODELS), show_default=True, help="Comma-separated model names or unique prefixes.")
@click.option(
    "--gpus",
    default=",".join(f"{k}:{v}" for k, v in DEFAULT_GPUS.items()),
    show_default=True,
    callback=parse_gpus,
    help=f"The emulated inventory each model is planned on and served by, TYPE:COUNT,... (at most {MAX_GPUS} GPUs).",
)
@click.option("--duration", default=DEFAULT_DURATION_S, show_default=True, help="Seconds of Poisson arrivals per trial.")
@click.option("--seed", default=1, show_default=True, help="Seed of the arrivals (the simulator's convention: the same workload in both).")
@click.option("--step", default=DEFAULT_STEP, show_default=True, help="Step of the load-factor grid both searches bisect.")
@click.option(
    "--max-rate", default=DEFAULT_MAX_RATE, show_default=True, help="Refuse plans of more req/s than this machine can send open-loop."
)
@click.option(
    "--inputs",
    default=",".join(INPUT_KINDS),
    show_default=True,
    help="Request inputs, each measured in the same run: real (the model's own input size, e.g. 3x512x1024 for fcn) and small (16 floats).",
)
@click.option(
    "--scheduler-process",
    is_flag=True,
    help="Run the scheduler in a process of its own (dask scheduler --preload daskpipe), as deployed, not on this client's event loop.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Also write the figures to this file.")
def bench_fidelity(
    profiles: str,
    models: str,
    gpus: dict[str, int],
    duration: float,
    seed: int,
    step: float,
    max_rate: float,
    inputs: str,
    scheduler_process: bool,
    json_path: str | None,
) -> None:
    """Max load factor at 99% attainment of each model's plan, in the simulator and on the Dask runtime."""
    names = [name.strip() for name in models.split(",") if name.strip()]
    if not names:
        raise click.BadParameter("name at least one model", param_hint="--models")
    from daskpipe.progress import progress_bar

    try:
        check_step(step)
        kinds = [kind.strip() for kind in inputs.split(",") if kind.strip()]
        with progress_bar("fidelity", total=len(names) * len(kinds) * max_trials(step)) as advance:
            figures = run_fidelity(
                profiles,
                names,
                gpus,
                duration=duration,
                seed=seed,
                max_rate=max_rate,
                step=step,
                inputs=kinds,
                scheduler_process=scheduler_process,
                advance=advance,
            )
    except BenchOptionError as exc:
        raise click.BadParameter(str(exc), param_hint=exc.option) from None
    text = json.dumps(figures, indent=1)
    click.echo(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
