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

from daskpipe.profiles.prepartition import greedy_blocks
from daskpipe.profiles.fx import BlockedModel, segment_model
from daskpipe.profiles.model import Profile

if TYPE_CHECKING:
    from daskpipe.colocation.fit import FitReport, Measurement, ModelInfo
    from daskpipe.colocation.latency import Colocated, InterferenceModel

SLO_FACTOR = 5.0  # PPipe: the SLO is 5x the whole model's batch-1 latency
BUSY_CPU_SHARE = 0.8
"""A CPU timing whose calling thread was on a CPU for less than this share of its wall time ran on
a busy machine (the thread computes or spins in torch's parallel regions the whole time, unless
another process takes its core): it is taken again, up to :data:`BUSY_RETRIES` times."""
BUSY_RETRIES = 2
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
    """Median wall time in µs of ``module(x)`` after ``warmup`` runs (synchronising CUDA)."""
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


def timed(module: nn.Module, x: torch.Tensor, *, repeats: int, warmup: int = 1) -> Timing:
    """Time ``module(x)`` ``repeats`` times after ``warmup`` runs (synchronising CUDA). On a CPU,
    a run whose thread was on a CPU for less than :data:`BUSY_CPU_SHARE` of it (another process
    took its core) is taken again, up to :data:`BUSY_RETRIES` times, keeping the least disturbed."""
    on_gpu = x.device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    best: Timing | None = None
    for _ in range(1 + (0 if on_gpu else BUSY_RETRIES)):
        samples, wall, cpu = [], 0.0, 0.0
        with torch.inference_mode():
            for i in range(warmup + repeats):
                sync()
                start, cpu_start = time.perf_counter(), time.thread_time()
                module(x)
                sync()
                if i >= warmup:
                    elapsed = time.perf_counter() - start
                    samples.append(elapsed * 1e6)
                    wall, cpu = wall + elapsed, cpu + time.thread_time() - cpu_start
        timing = Timing(samples, None if on_gpu else min(1.0, cpu / wall) if wall > 0 else 1.0)
        if best is None or (timing.cpu_share or 1.0) > (best.cpu_share or 1.0):
            best = timing
        if not best.busy:
            break
    assert best is not None, "the loop above runs at least once"
    return best


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
    progress: Progress | None = None,
) -> tuple[Profile, BlockedModel]:
    """Cut ``module`` into ``num_blocks`` blocks of ~equal runtime and time each at each batch size.

    ``slices`` only labels the table: running inside a 1/v MPS share (the worker sets
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) is the caller's job. Batch sizes missing from a sparse
    ``batch_sizes`` are interpolated linearly (listed in ``meta["interpolated_batch_sizes"]``).
    ``cpu_threads`` pins torch's intra-op threads while timing (recorded as ``meta["cpu_threads"]``):
    by default, inside a Dask worker, the worker's threads, which its slot serves with
    (:func:`~daskpipe.runtime.environ.compute_thread_setup`); elsewhere the caller's. On a busy
    machine the spinning OpenMP threads of a multi-threaded run inflate timings by 10x and more, so
    1 is the stable choice there. The blocks share their parameters with ``module`` and come back on the CPU.
    """
    _check_settings(slices, repeats, cpu_threads)
    device = torch.device(device)
    module = module.eval()
    home = next(module.parameters(), example_input).device
    segmented = segment_model(module, example_input[:1].to(home))
    if segmented.num_segments < num_blocks:
        raise ValueError(f"{name}: has only {segmented.num_segments} single-tensor cut segments; ask for at most that many blocks")
    report = progress or (lambda stage, done, total: None)
    with _intra_op_threads(cpu_threads or worker_threads() or torch.get_num_threads()):
        segments = segmented.segments().to(device)
        segment_us = [
            time_module(block, _input(segments, i, 1, device), repeats=repeats, warmup=warmup)
            for i, block in _reported(segments.blocks, "segments", report)
        ]
        blocked = segmented.cut(greedy_blocks(np.asarray(segment_us), num_blocks))
        profile = _time_blocks(blocked.to(device), name, batch_sizes, device, gpu_type, slices, slo_us, repeats, warmup, report)
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
    report: Progress,
) -> Profile:
    measured = sorted(set(normalise_batch_sizes(batch_sizes)) | {1})
    gpu_type = gpu_type or device_gpu_type(device)
    cells = [(i, j) for i in range(blocked.num_blocks) for j in range(len(measured))]
    table = np.zeros((blocked.num_blocks, len(measured)))
    timings: list[Timing] = []
    for _, (i, j) in _reported(cells, "blocks", report):
        timing = timed(blocked.blocks[i], _input(blocked, i, measured[j], device), repeats=repeats, warmup=warmup)
        table[i, j] = timing.median_us
        timings.append(timing)

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
        "timing": timing_summary(timings),
    }
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


def timing_summary(timings: Sequence[Timing]) -> dict[str, Any]:
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
    if busy:
        summary["warning"] = (
            f"the machine was busy while profiling: in {busy} of {len(timings)} timings the profiling thread was on a CPU under {BUSY_CPU_SHARE:.0%} of the time "
            f"(at least {min(shares):.0%}) after {BUSY_RETRIES} retries; the table is inflated; profile again on a quiet machine"
        )
    return summary


def _input(blocked: BlockedModel, block: int, batch: int, device: torch.device) -> torch.Tensor:
    shape = blocked.input_shape if block == 0 else blocked.boundary_shapes[block - 1]
    return torch.randn((batch, *shape), device=device)


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
