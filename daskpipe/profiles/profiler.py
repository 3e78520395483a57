"""Measure a model's block profile on the local device (CPU or one CUDA GPU / MPS slice).

PPipe's recipe: time the fine segments once at batch 1, group them greedily into blocks of equal
runtime, then time every block at every batch size. The resulting ``Profile`` describes exactly
the ``BlockedModel`` returned beside it, so the runtime serves the blocks that were measured.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from daskpipe.plan.prepartition import greedy_blocks
from daskpipe.profiles.fx import BlockedModel, SegmentedModel, segment_model
from daskpipe.profiles.model import Profile

SLO_FACTOR = 5.0  # PPipe: the SLO is 5x the whole model's batch-1 latency
Progress = Callable[[str, int, int], None]  # (stage, done, total)


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
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    samples = []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            sync()
            start = time.perf_counter()
            module(x)
            sync()
            if i >= warmup:
                samples.append((time.perf_counter() - start) * 1e6)
    return float(statistics.median(samples))


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
    ``cpu_threads`` pins torch's intra-op threads while timing on the CPU: on a busy machine the
    spinning OpenMP threads of a multi-threaded run inflate timings by 10x and more, so 1 is the
    stable choice there. The blocks share their parameters with ``module`` and come back on the CPU.
    """
    if slices < 1:
        raise ValueError(f"slices must be >= 1, got {slices}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if cpu_threads is not None and cpu_threads < 1:
        raise ValueError(f"cpu_threads must be >= 1, got {cpu_threads}")
    measured = sorted(set(normalise_batch_sizes(batch_sizes)) | {1})
    device = torch.device(device)
    gpu_type = gpu_type or device_gpu_type(device)
    module = module.eval()
    home = next(module.parameters(), example_input).device
    segmented = segment_model(module, example_input[:1].to(home))
    if segmented.num_segments < num_blocks:
        raise ValueError(
            f"{name}: has only {segmented.num_segments} single-tensor cut segments; ask for at most that many blocks"
        )
    report = progress or (lambda stage, done, total: None)
    with _intra_op_threads(cpu_threads if device.type == "cpu" else None):
        profile, blocked = _measure(segmented, name, num_blocks, measured, device, gpu_type, slices, slo_us, repeats, warmup, report)
    return profile, blocked.to("cpu")


@contextmanager
def _intra_op_threads(threads: int | None) -> Iterator[None]:
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _measure(
    segmented: SegmentedModel, name: str, num_blocks: int, measured: list[int], device: torch.device, gpu_type: str,
    slices: int, slo_us: float | None, repeats: int, warmup: int, report: Progress,
) -> tuple[Profile, BlockedModel]:
    segments = segmented.segments().to(device)
    segment_us = []
    for i, block in enumerate(segments.blocks):
        report("segments", i, segments.num_blocks)
        segment_us.append(time_module(block, _input(segments, i, 1, device), repeats=repeats, warmup=warmup))
    report("segments", segments.num_blocks, segments.num_blocks)

    blocked = segmented.cut(greedy_blocks(np.asarray(segment_us), num_blocks)).to(device)
    table = np.zeros((blocked.num_blocks, len(measured)))
    total = blocked.num_blocks * len(measured)
    for i, block in enumerate(blocked.blocks):
        for j, batch in enumerate(measured):
            report("blocks", i * len(measured) + j, total)
            table[i, j] = time_module(block, _input(blocked, i, batch, device), repeats=repeats, warmup=warmup)
    report("blocks", total, total)

    full_range = np.arange(1, measured[-1] + 1)
    latency = np.stack([np.interp(full_range, measured, row) for row in table])
    interpolated = [int(b) for b in full_range if b not in measured]
    meta = {
        "profiler": "daskpipe.profiles.profiler (torch eager, fp32)",
        "device": str(device),
        "repeats": repeats,
        "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
        "measured_batch_sizes": measured,
        "segment_boundaries": blocked.segment_boundaries,
        "segment_latency_us": segment_us,
    }
    if interpolated:
        meta["interpolated_batch_sizes"] = interpolated
    profile = Profile(
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
    return profile, blocked


def _input(blocked: BlockedModel, block: int, batch: int, device: torch.device) -> torch.Tensor:
    shape = blocked.input_shape if block == 0 else blocked.boundary_shapes[block - 1]
    return torch.randn((batch, *shape), device=device)
