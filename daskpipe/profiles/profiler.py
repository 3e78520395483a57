"""Measure a model's block profile on the local device (CPU or one CUDA GPU / MPS slice).

PPipe's recipe: time the fine segments once at batch 1, group them greedily into blocks of equal
runtime, then time every block at every batch size. The resulting ``Profile`` describes exactly
the ``BlockedModel`` returned beside it, so the runtime serves the blocks that were measured.
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from daskpipe.profiles.fx import BlockedModel, segment_model
from daskpipe.profiles.graphs import device_runner
from daskpipe.profiles.model import Profile
from daskpipe.profiles.prepartition import greedy_blocks

if TYPE_CHECKING:
    from daskpipe.colocation.fit import FitReport, Measurement, ModelInfo
    from daskpipe.colocation.latency import Colocated, InterferenceModel

SLO_FACTOR = 5.0  # PPipe: the SLO is 5x the whole model's batch-1 latency
BUSY_CPU_SHARE = 0.8
"""A CPU timing whose calling thread was on a CPU for less than this share of its wall time ran on
a busy machine (the thread computes or spins in torch's parallel regions the whole time, unless
another process takes its core): it is taken again, up to :data:`BUSY_RETRIES` times."""
BUSY_RETRIES = 2
GPU_WARMUP_S = 0.5
"""Seconds of back-to-back runs of the whole model, at every batch size, before a GPU table is
timed: the GPU's clocks ramp up from idle, and each shape's first runs load its kernels. Two
warm-up runs per cell left an H200's resnet50 tables 0.45-1.59x what serving then measured."""
GPU_MIN_TIMING_S = 0.02
"""A GPU cell is timed until this long has passed, beyond its ``repeats`` (runs are ~0.1-5 ms)."""
GPU_MAX_REPEATS = 200
CHAIN_TOLERANCE = 1.25
"""A GPU table whose column sum differs from the whole model timed as one stage runs it by more
than this factor (either way) was disturbed while it was timed: it is timed once more, and a
table still off is kept with a warning, as an inflated CPU table is."""
Progress = Callable[[str, int, int], None]  # (stage, done, total)


def worker_threads() -> int | None:
    """The threads of the Dask worker this code runs in (its slot computes with them); ``None`` outside one."""
    if "distributed" not in sys.modules:  # not a worker, and a profile run from the CLI need not import it
        return None
    from distributed import get_worker

    try:
        return get_worker().state.nthreads
    except ValueError:
        return None


def normalise_batch_sizes(batch_sizes: int | Iterable[int]) -> list[int]:
    """Sorted distinct batch sizes; an int ``B`` means 1..B."""
    sizes = list(range(1, batch_sizes + 1)) if isinstance(batch_sizes, int) else sorted(set(int(b) for b in batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be integers >= 1, got {batch_sizes!r}")
    return sizes


def device_gpu_type(device: str | torch.device) -> str:
    """The catalog name of ``device``'s GPU type ("cpu" for the CPU)."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise ValueError(f"profiling supports cpu and cuda devices, got {device}")
    from daskpipe.profiles.catalog import normalise_gpu_name

    return normalise_gpu_name(torch.cuda.get_device_name(device))


def time_module(module: nn.Module, x: torch.Tensor, *, repeats: int, warmup: int = 1) -> float:
    """Median time in µs of ``module(x)`` after ``warmup`` runs (:func:`timed`)."""
    return timed(module, x, repeats=repeats, warmup=warmup).median_us


class Timing:
    """``repeats`` wall times of one computation, and the share of them its thread was on a CPU."""

    __slots__ = ("samples_us", "cpu_share")

    def __init__(self, samples_us: list[float], cpu_share: float | None):
        self.samples_us = samples_us
        self.cpu_share = cpu_share  # None on a GPU: its wall time is not the CPU's

    @property
    def median_us(self) -> float:
        return float(statistics.median(self.samples_us))

    @property
    def spread(self) -> float:
        """(max - min) / median of the samples: how noisy the timing was."""
        return (max(self.samples_us) - min(self.samples_us)) / self.median_us if self.median_us > 0 else 0.0

    @property
    def busy(self) -> bool:
        return self.cpu_share is not None and self.cpu_share < BUSY_CPU_SHARE


def timed(
    module: Callable[[torch.Tensor], Any], x: torch.Tensor, *, repeats: int, warmup: int = 1, device: torch.device | None = None
) -> Timing:
    """Time ``module(x)`` ``repeats`` times after ``warmup`` runs, on ``device`` (``x``'s by default).

    On a CPU, a run whose thread was on a CPU for less than :data:`BUSY_CPU_SHARE` of it (another
    process took its core) is taken again, up to :data:`BUSY_RETRIES` times, keeping the least
    disturbed. On a GPU (:func:`timed_on_gpu`) CUDA events time each run."""
    if (device or x.device).type == "cuda":
        return timed_on_gpu(module, x, repeats=repeats, warmup=warmup)
    best: Timing | None = None
    for _ in range(1 + BUSY_RETRIES):
        samples, wall, cpu = [], 0.0, 0.0
        with torch.inference_mode():
            for i in range(warmup + repeats):
                start, cpu_start = time.perf_counter(), time.thread_time()
                module(x)
                if i >= warmup:
                    elapsed = time.perf_counter() - start
                    samples.append(elapsed * 1e6)
                    wall, cpu = wall + elapsed, cpu + time.thread_time() - cpu_start
        timing = Timing(samples, min(1.0, cpu / wall) if wall > 0 else 1.0)
        if best is None or (timing.cpu_share or 1.0) > (best.cpu_share or 1.0):
            best = timing
        if not best.busy:
            break
    assert best is not None, "the loop above runs at least once"
    return best


def timed_on_gpu(module: Callable[[torch.Tensor], Any], x: torch.Tensor, *, repeats: int, warmup: int = 1) -> Timing:
    """CUDA events around each run, which the GPU stamps, so the host's wake from a synchronize is
    not counted; each run ends synchronized, as a stage's batch does. Runs go on past ``repeats``
    until :data:`GPU_MIN_TIMING_S` has passed (at most :data:`GPU_MAX_REPEATS`): five runs of
    0.3 ms say little."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples: list[float] = []
    with torch.inference_mode():
        for _ in range(warmup):
            module(x)
        torch.cuda.synchronize()
        started = time.perf_counter()
        while len(samples) < repeats or (len(samples) < GPU_MAX_REPEATS and time.perf_counter() - started < GPU_MIN_TIMING_S):
            begin.record()
            module(x)
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) * 1e3)
    return Timing(samples, None)


def profile_model(
    module: nn.Module,
    example_input: torch.Tensor,
    *,
    name: str,
    num_blocks: int = 10,
    batch_sizes: int | Sequence[int] = (1, 2, 4, 8),
    device: str | torch.device = "cpu",
    gpu_type: str | None = None,
    slices: int = 1,
    slo_us: float | None = None,
    repeats: int = 5,
    warmup: int = 2,
    cpu_threads: int | None = None,
    cuda_graphs: bool = True,
    progress: Progress | None = None,
) -> tuple[Profile, BlockedModel]:
    """Cut ``module`` into ``num_blocks`` blocks of ~equal runtime and time each at each batch size.

    ``slices`` only labels the table: running inside a 1/v MPS share (the worker sets
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) is the caller's job. Batch sizes missing from a sparse
    ``batch_sizes`` are interpolated linearly (listed in ``meta["interpolated_batch_sizes"]``).
    ``cpu_threads`` pins torch's intra-op threads while timing (recorded as ``meta["cpu_threads"]``):
    by default, inside a Dask worker, the worker's threads, which its slot serves with
    (:func:`~daskpipe.runtime.worker.environ.compute_thread_setup`); elsewhere the caller's. On a busy
    machine the spinning OpenMP threads of a multi-threaded run inflate timings by 10x and more, so
    1 is the stable choice there. On a GPU each block is timed as a stage runs it: after
    :data:`GPU_WARMUP_S` of warm-up, with CUDA events, replayed as CUDA graphs unless
    ``cuda_graphs`` is off (:func:`device_runner`). The blocks share their parameters with
    ``module`` and come back on the CPU.
    """
    _check_settings(slices, repeats, cpu_threads)
    device = torch.device(device)
    segmented = segment_model(module, example_input)
    if segmented.num_segments < num_blocks:
        raise ValueError(f"{name}: has only {segmented.num_segments} single-tensor cut segments; ask for at most that many blocks")
    report = progress or (lambda stage, done, total: None)
    with _intra_op_threads(cpu_threads or worker_threads() or torch.get_num_threads()):
        segments = segmented.segments().to(device)
        if device.type == "cuda":
            warm_up_gpu(segments, [1], device)
        segment_us = [
            time_module(block, _input(segments, i, 1, device), repeats=repeats, warmup=warmup)
            for i, block in _reported(segments.blocks, "segments", report)
        ]
        blocked = segmented.cut(greedy_blocks(np.asarray(segment_us), num_blocks))
        profile = _time_blocks(
            blocked.to(device), name, batch_sizes, device, gpu_type, slices, slo_us, repeats, warmup, cuda_graphs, report
        )
    return replace(profile, meta={**profile.meta, "segment_latency_us": segment_us}), blocked.to("cpu")


def profile_blocks(
    blocked: BlockedModel,
    *,
    name: str,
    batch_sizes: int | Sequence[int] = (1, 2, 4, 8),
    device: str | torch.device = "cpu",
    gpu_type: str | None = None,
    slices: int = 1,
    slo_us: float | None = None,
    repeats: int = 5,
    warmup: int = 2,
    cpu_threads: int | None = None,
    cuda_graphs: bool = True,
    progress: Progress | None = None,
) -> Profile:
    """Time the given blocks at each batch size, as :func:`profile_model` does after cutting.

    What ``deploy`` runs on one worker of each (GPU type, slices) kind: every kind times the same
    blocks, so that their tables line up in one profile. Leaves the blocks on ``device``.
    """
    _check_settings(slices, repeats, cpu_threads)
    device = torch.device(device)
    with _intra_op_threads(cpu_threads or worker_threads() or torch.get_num_threads()):
        return _time_blocks(
            blocked.to(device),
            name,
            batch_sizes,
            device,
            gpu_type,
            slices,
            slo_us,
            repeats,
            warmup,
            cuda_graphs,
            progress or (lambda stage, done, total: None),
        )


def _check_settings(slices: int, repeats: int, cpu_threads: int | None) -> None:
    if slices < 1:
        raise ValueError(f"slices must be >= 1, got {slices}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if cpu_threads is not None and cpu_threads < 1:
        raise ValueError(f"cpu_threads must be >= 1, got {cpu_threads}")


@contextmanager
def _intra_op_threads(threads: int) -> Iterator[None]:
    """Set on this thread: torch's thread count is per thread under OpenMP."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _reported(items: Sequence, stage: str, report: Progress) -> Iterator[tuple[int, Any]]:
    for i, item in enumerate(items):
        report(stage, i, len(items))
        yield i, item
    report(stage, len(items), len(items))


def _time_blocks(
    blocked: BlockedModel,
    name: str,
    batch_sizes: int | Sequence[int],
    device: torch.device,
    gpu_type: str | None,
    slices: int,
    slo_us: float | None,
    repeats: int,
    warmup: int,
    cuda_graphs: bool,
    report: Progress,
) -> Profile:
    measured = sorted(set(normalise_batch_sizes(batch_sizes)) | {1})
    gpu_type = gpu_type or device_gpu_type(device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        warm_up_gpu(blocked, measured, device)
    table, timings = _time_table(blocked, measured, device, repeats, warmup, cuda_graphs, report)
    chain: dict[int, float] = {}
    if on_gpu:  # a table disturbed while timed is timed once more; one still off is said
        chain = _time_chain(blocked, measured, device, repeats, warmup, cuda_graphs)
        if not chain_agrees(table, measured, chain):
            again, again_timings = _time_table(blocked, measured, device, repeats, warmup, cuda_graphs, report)
            chain = _time_chain(blocked, measured, device, repeats, warmup, cuda_graphs)
            if chain_disagreement(again, measured, chain) < chain_disagreement(table, measured, chain):
                table, timings = again, again_timings

    full_range = np.arange(1, measured[-1] + 1)
    latency = np.stack([np.interp(full_range, measured, row) for row in table])
    interpolated = [int(b) for b in full_range if b not in measured]
    meta = {
        "profiler": "daskpipe.profiles.profiler (torch eager, fp32)",
        "device": str(device),
        "repeats": repeats,
        "cpu_threads": torch.get_num_threads(),
        "measured_batch_sizes": measured,
        "segment_boundaries": blocked.segment_boundaries,
        "timing": timing_summary(timings, chain_sums(table, measured, chain) if chain else None),
    }
    if on_gpu:
        meta["cuda_graphs"] = cuda_graphs
    if interpolated:
        meta["interpolated_batch_sizes"] = interpolated
    return Profile(
        model=name,
        slo_us=slo_us if slo_us is not None else SLO_FACTOR * float(latency[:, 0].sum()),
        num_blocks=blocked.num_blocks,
        latency_us={(gpu_type, slices): latency},
        boundary_bytes=tuple(float(b) for b in blocked.boundary_bytes),
        input_bytes=float(blocked.input_bytes),
        output_bytes=float(blocked.output_bytes),
        input_shape=blocked.input_shape,
        boundary_shapes=tuple(blocked.boundary_shapes),
        meta=meta,
    )


def _time_table(
    blocked: BlockedModel, measured: list[int], device: torch.device, repeats: int, warmup: int, cuda_graphs: bool, report: Progress
) -> tuple[np.ndarray, list[Timing]]:
    """Each block at each batch size; on a GPU as a stage runs it (:func:`device_runner`)."""
    cells = [(i, j) for i in range(blocked.num_blocks) for j in range(len(measured))]
    table = np.zeros((blocked.num_blocks, len(measured)))
    timings: list[Timing] = []
    runner: tuple[int, Callable[[torch.Tensor], Any]] | None = None
    for _, (i, j) in _reported(cells, "blocks", report):
        if runner is None or runner[0] != i:  # one block's graphs at a time
            runner = (i, _block_runner(blocked, i, i + 1, measured, device, cuda_graphs))
        timing = timed(runner[1], _input(blocked, i, measured[j], device, host=i == 0), repeats=repeats, warmup=warmup, device=device)
        table[i, j] = timing.median_us
        timings.append(timing)
    return table, timings


def _block_runner(
    blocked: BlockedModel, start: int, end: int, batch_sizes: Sequence[int], device: torch.device, cuda_graphs: bool
) -> Callable[[torch.Tensor], Any]:
    """Blocks ``[start, end)``; on a GPU as a stage runs them, taking the first block's input from the host."""
    module = blocked.blocks[start] if end == start + 1 else nn.Sequential(*blocked.blocks[start:end])
    if device.type != "cuda":
        return module
    shape = blocked.input_shape if start == 0 else blocked.boundary_shapes[start - 1]
    return device_runner(
        module, shape, device, batch_sizes, cuda_graphs=cuda_graphs, to_host=end == blocked.num_blocks, what=f"blocks [{start}, {end})"
    )


def _time_chain(
    blocked: BlockedModel, measured: list[int], device: torch.device, repeats: int, warmup: int, cuda_graphs: bool
) -> dict[int, float]:
    """µs of the whole model, its blocks back to back as a one-stage pipeline runs them, at the
    smallest and the largest batch size."""
    sizes = sorted({measured[0], measured[-1]})
    whole = _block_runner(blocked, 0, blocked.num_blocks, sizes, device, cuda_graphs)
    return {
        b: timed(whole, _input(blocked, 0, b, device, host=True), repeats=repeats, warmup=warmup, device=device).median_us for b in sizes
    }


def warm_up_gpu(blocked: BlockedModel, measured: Sequence[int], device: torch.device, seconds: float = GPU_WARMUP_S) -> None:
    """Run the whole model at every batch size in turn for ``seconds`` (:data:`GPU_WARMUP_S`)."""
    whole = nn.Sequential(*blocked.blocks)
    inputs = [_input(blocked, 0, b, device) for b in measured]
    runs, until = 0, time.perf_counter() + seconds
    with torch.inference_mode():
        while time.perf_counter() < until:
            whole(inputs[runs % len(inputs)])
            runs += 1
            if runs % len(inputs) == 0:
                torch.cuda.synchronize()
    torch.cuda.synchronize()


def chain_sums(table: np.ndarray, measured: Sequence[int], chain: dict[int, float]) -> dict[int, float]:
    """Per batch size timed whole: the table's column sum over the whole model's time."""
    return {b: float(table[:, measured.index(b)].sum() / us) for b, us in sorted(chain.items())}


def chain_disagreement(table: np.ndarray, measured: Sequence[int], chain: dict[int, float]) -> float:
    """The largest factor, either way, between the table's column sums and the whole model's times (1: none)."""
    return max((max(r, 1 / r) for r in chain_sums(table, measured, chain).values() if r > 0), default=1.0)


def chain_agrees(table: np.ndarray, measured: Sequence[int], chain: dict[int, float]) -> bool:
    return chain_disagreement(table, measured, chain) <= CHAIN_TOLERANCE


def timing_summary(timings: Sequence[Timing], chain_ratios: dict[int, float] | None = None) -> dict[str, Any]:
    """How a table's timings went: their median spread, the least CPU share a cell got, and
    whether some cells stayed busy after their retries (then the table is inflated, and says so)."""
    shares = [t.cpu_share for t in timings if t.cpu_share is not None]
    busy = sum(t.busy for t in timings)
    summary: dict[str, Any] = {
        "median_spread": round(float(np.median([t.spread for t in timings])), 3) if timings else 0.0,
        "busy_cells": busy,
    }
    if shares:
        summary["min_cpu_share"] = round(min(shares), 3)
    if chain_ratios:
        summary["table_over_whole"] = {str(b): round(r, 3) for b, r in chain_ratios.items()}
        off = {b: r for b, r in chain_ratios.items() if not 1 / CHAIN_TOLERANCE <= r <= CHAIN_TOLERANCE}
        if off:
            summary["warning"] = (
                "the blocks' times do not add up to the whole model's, timed twice: "
                + ", ".join(f"{r:.2f}x at batch {b}" for b, r in off.items())
                + "; the GPU was disturbed or its clocks moved while profiling; profile again on an idle GPU"
            )
    if busy:
        summary["warning"] = (
            f"the machine was busy while profiling: in {busy} of {len(timings)} timings the profiling thread was on a CPU under "
            f"{BUSY_CPU_SHARE:.0%} of the time "
            f"(at least {min(shares):.0%}) after {BUSY_RETRIES} retries; the table is inflated; profile again on a quiet machine"
        )
    return summary


def _input(blocked: BlockedModel, block: int, batch: int, device: torch.device, *, host: bool = False) -> torch.Tensor:
    """An input of ``block`` at ``batch`` (:meth:`BlockedModel.example`); on the host if ``host`` (a
    stage's first block takes it from there)."""
    return blocked.example(block, batch, "cpu" if host else device)


# -- co-location mode: several models at once on MPS shares of one GPU -------------------------
# What InSS's interference model is fitted from (daskpipe/colocation/fit.py): each model alone on
# a grid of (share, batch), and runs next to co-runners. On a GPU every process of a run is a
# separate OS process whose CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is its share (the MPS control
# daemon must run: ``nvidia-cuda-mps-control -d``); the co-runners loop their batches while the
# probe is timed under torch.profiler, which splits a batch into kernel time (running), copies and
# the gaps between (scheduling). Nsight's L2 counters are out of torch's reach: the probe's kernel
# duty cycle times its share stands in for its L2 pressure (only its proportionality matters, the
# cache sensitivity is fitted against the same proxy). Without a GPU, ``emulate=`` runs the same
# campaign on an interference model (``colocation.fit.emulated_measure``).

COLOCATION_INPUT_SHAPE = (3, 224, 224)


def profile_colocation(
    models: Sequence[str],
    *,
    device: str | torch.device = "cuda",
    emulate: InterferenceModel | None = None,
    gpu_type: str | None = None,
    shares: Sequence[float] | None = None,
    batches: Sequence[int] | None = None,
    co_sets: int = 5,
    noise: float = 0.02,
    repeats: int = 20,
    seed: int = 0,
) -> tuple[InterferenceModel, FitReport]:
    """Profile ``models`` (torchvision names, or the PPipe names of ``profiles.zoo``) alone and
    co-located on MPS shares of one GPU, and fit the interference model to the runs.

    ``emulate`` replaces the GPU by that interference model (``gpu_type`` then names one of its
    GPUs; ``noise`` is the relative measurement noise). Raises ``ValueError`` when neither a CUDA
    GPU nor ``emulate`` is there, or a name or grid is unusable.
    """
    from daskpipe.colocation.fit import PAPER_BATCHES, PAPER_SHARES, collect_samples, emulated_measure, fit_model, model_info

    if not models:
        raise ValueError("co-location profiling needs at least one model")
    shares = tuple(shares or PAPER_SHARES)
    batches = tuple(batches or PAPER_BATCHES)
    if not all(0 < s <= 1 for s in shares) or not all(int(b) >= 1 for b in batches) or co_sets < 0:
        raise ValueError(f"shares must be in (0, 1], batches >= 1 and co_sets >= 0; got {shares}, {batches}, {co_sets}")
    rng = np.random.default_rng(seed)
    if emulate is not None:
        gpu = gpu_type or next(iter(emulate.gpus))
        spec = emulate.gpu(gpu)
        for m in models:
            emulate.coeff(m, gpu)
        measure = emulated_measure(emulate, noise=noise, rng=rng)
        info: dict[tuple[str, str], ModelInfo] = model_info(emulate)
    else:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(
                f"co-location profiling runs on a CUDA GPU under MPS (device {device} is not one here); use the emulated mode without a GPU"
            )
        from daskpipe.profiles.catalog import gpu_specs

        gpu = gpu_type or device_gpu_type(device)
        spec = gpu_specs([gpu])[gpu]
        runner = _MpsRunner(device, repeats)
        measure = runner.measure
        info = runner.info
    solo, co = collect_samples(measure, gpu, list(models), shares=shares, batches=batches, co_sets=co_sets, rng=rng)
    return fit_model(solo, co, [spec], info, name=f"profiled-{gpu}")


class _MpsRunner:
    """Runs each process of a profiling run in its own spawned OS process on ``device``."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats = device, repeats
        self.info: dict[tuple[str, str], ModelInfo] = {}

    def measure(self, gpu: str, probe: Colocated, others: Sequence[Colocated]) -> Measurement:
        from daskpipe.colocation.fit import Measurement, ModelInfo

        ctx = torch.multiprocessing.get_context("spawn")
        ready = ctx.Barrier(len(others) + 1)
        stop = ctx.Event()
        results = ctx.Queue()
        workers = [
            ctx.Process(target=_mps_corunner, args=(o.model, o.batch, o.share, str(self.device), ready, stop), daemon=True) for o in others
        ]
        for w in workers:
            w.start()
        prober = ctx.Process(
            target=_mps_probe, args=(probe.model, probe.batch, probe.share, str(self.device), self.repeats, ready, results), daemon=True
        )
        prober.start()
        try:
            outcome = results.get(timeout=600)
        finally:
            stop.set()
            for p in (prober, *workers):
                p.join(timeout=60)
        if isinstance(outcome, str):
            raise RuntimeError(f"profiling {probe.model} at share {probe.share:.2f}, batch {probe.batch} failed: {outcome}")
        self.info.setdefault((probe.model, gpu), ModelInfo(outcome["kernels"], outcome["input_bytes"], outcome["output_bytes"]))
        return Measurement(
            outcome["running_ms"],
            outcome["sched_ms"],
            outcome["total_ms"],
            outcome["running_ms"] / outcome["total_ms"] * probe.share,
            outcome["memory_mb"],
        )


def _mps_process(name: str, batch: int, share: float, device: str) -> tuple[nn.Module, torch.Tensor]:
    """In a fresh process: pin the MPS share before CUDA starts, build the model and an input."""
    import os

    os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, min(100, round(100 * share))))
    from daskpipe.profiles.zoo import REFERENCE_MODELS, build_reference_model

    if name in REFERENCE_MODELS:
        module, shape = build_reference_model(name)
    else:
        import torchvision

        module, shape = torchvision.models.get_model(name, weights=None).eval(), COLOCATION_INPUT_SHAPE
    return module.to(device), torch.randn(batch, *shape)


def _mps_corunner(name: str, batch: int, share: float, device: str, ready, stop) -> None:
    module, x = _mps_process(name, batch, share, device)
    with torch.inference_mode():
        module(x.to(device))
        torch.cuda.synchronize()
        ready.wait()
        while not stop.is_set():
            module(x.to(device))
            torch.cuda.synchronize()


def _mps_probe(name: str, batch: int, share: float, device: str, repeats: int, ready, results) -> None:
    try:
        from torch.profiler import ProfilerActivity, profile

        module, x = _mps_process(name, batch, share, device)
        with torch.inference_mode():
            for _ in range(3):
                y = module(x.to(device))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            ready.wait()
            totals = []
            with profile(activities=[ProfilerActivity.CUDA]) as trace:
                for _ in range(repeats):
                    start = time.perf_counter()
                    y = module(x.to(device)).cpu()
                    totals.append((time.perf_counter() - start) * 1e3)
        events = [e for e in trace.events() if e.device_type.name == "CUDA"]
        copies = [e for e in events if "memcpy" in e.name.lower()]
        kernels = [e for e in events if e not in copies]
        running = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / repeats
        total = float(statistics.median(totals))
        results.put(
            {
                "total_ms": total,
                "running_ms": running,
                "sched_ms": max(0.0, total - running - sum(e.time_range.elapsed_us() for e in copies) / 1e3 / repeats),
                "memory_mb": torch.cuda.max_memory_allocated() / 2**20,
                "kernels": max(1, len(kernels) // repeats),
                "input_bytes": x[0].numel() * x.element_size(),
                "output_bytes": y[0].numel() * y.element_size(),
            }
        )
    except Exception as exc:  # reported to the parent, which raises it with the run's parameters
        results.put(f"{type(exc).__name__}: {exc}")
