"""A module's kernels replayed as one CUDA graph per batch size.

Eager torch launches every kernel from Python. On an H200, resnet50 at batch 1 took 6.8 ms from a
Dask worker's thread, most of it launching ~160 kernels one by one; its block timings varied
run to run by a median spread of 0.9, and each launch took the GIL from the worker's event loop. A
CUDA graph captured once per batch size replays them all in one call (``torch.cuda.graphs``), so
a stage and its profile time the GPU's work, not the host's launches. The profiler and the stages
run a module through the same :func:`device_runner`, so that a stage runs what was profiled.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

logger = logging.getLogger(__name__)

WARMUP_RUNS = 3
"""Eager runs on a side stream before a capture, as torch's docs ask: lazy set-ups (cuBLAS
handles, cuDNN's algorithm choice) must not happen inside the capture."""


class CudaGraphs:
    """``module`` on ``device``, captured once per batch size of ``batch_sizes``, taking inputs
    of ``input_dtype`` and casting them to ``dtype`` (its parameters') inside the graph; a batch
    of another size or dtype runs eagerly. Graphs of one instance share a memory pool (the largest
    batch is captured first, the smaller ones fit in its memory).

    Calling it copies ``x`` (host or device) into the graph's input, replays, and returns the
    graph's output tensor, which the next call of the same batch size overwrites: copy it out
    before then (a stage copies every output to the host at once)."""

    def __init__(
        self,
        module: nn.Module,
        input_shape: Sequence[int],
        input_dtype: torch.dtype,
        dtype: torch.dtype,
        device: torch.device,
        batch_sizes: Iterable[int],
    ):
        self.module, self.device, self.dtype = module, torch.device(device), dtype
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        pool = None
        side = torch.cuda.Stream(self.device)
        for batch in sorted(set(batch_sizes), reverse=True):
            # a normal tensor, not an inference one: callers copy into it in or out of inference mode
            static_in = torch.zeros((batch, *input_shape), dtype=input_dtype, device=self.device)
            with torch.inference_mode():
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        module(static_in.to(dtype))
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    static_out = module(static_in.to(dtype))
                if not isinstance(static_out, torch.Tensor):
                    raise TypeError(f"the module returns {type(static_out).__name__}, not one tensor")
                pool = graph.pool()
                self._graphs[batch] = (graph, static_in, static_out)
        torch.cuda.synchronize(self.device)

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        captured = self._graphs.get(x.shape[0])
        if captured is None or captured[1].dtype != x.dtype:
            with torch.inference_mode():
                return self.module(x.to(self.device).to(self.dtype))
        graph, static_in, static_out = captured
        static_in.copy_(x)
        graph.replay()
        return static_out


def capture(
    module: nn.Module,
    input_shape: Sequence[int],
    input_dtype: torch.dtype,
    dtype: torch.dtype,
    device: torch.device,
    batch_sizes: Iterable[int],
    *,
    what: str,
) -> CudaGraphs | None:
    """:class:`CudaGraphs` of ``module``, or ``None`` (logged, naming ``what``) where it cannot be
    captured (a host synchronisation or a shape that depends on the data inside it): it then runs eagerly."""
    try:
        return CudaGraphs(module, input_shape, input_dtype, dtype, device, batch_sizes)
    except Exception as exc:
        logger.warning("daskpipe: %s runs eagerly, it cannot be captured as a CUDA graph: %s: %s", what, type(exc).__name__, exc)
        if torch.cuda.is_available():  # the warm-up runs the failed capture left on its side stream
            torch.cuda.synchronize(device)
        return None


def device_runner(
    module: nn.Module,
    input_shape: Sequence[int],
    device: torch.device,
    batch_sizes: Iterable[int],
    *,
    cuda_graphs: bool,
    to_host: bool,
    what: str,
    dtype: torch.dtype = torch.float32,
    input_dtype: torch.dtype | None = None,
) -> Callable[[torch.Tensor], Any]:
    """``module`` as a stage runs it on a GPU: its input, of ``input_dtype`` (``dtype``'s by
    default), copied in from wherever it is and cast to ``dtype`` there (torch casts a blocking
    host-to-GPU copy on the host, before copying 2-4x the bytes), replayed as CUDA graphs
    (:class:`CudaGraphs`) unless ``cuda_graphs`` is off or it cannot be captured, and
    its output copied to the host if ``to_host`` (an H200 took 0.42 ms to copy a batch of 8 images
    in, 10% of that stage)."""
    arriving = input_dtype or dtype
    graphs = capture(module, input_shape, arriving, dtype, device, batch_sizes, what=what) if cuda_graphs else None
    compute: Callable[[torch.Tensor], torch.Tensor] = graphs or (lambda x: module(x.to(device).to(dtype)))
    if not to_host:
        return compute
    return lambda x: tree_map(
        lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, compute(x)
    )  # a model's last block may return dicts and lists
