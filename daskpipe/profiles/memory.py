"""What a model holds in a GPU's memory: its weights, and the activations of the batch it runs.

A shared pool (``daskpipe.plan.shared``) puts every model of a sub-cluster on every GPU of it, so
what a GPU holds is counted before anything is placed. Torch is imported only to measure a module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

CUDA_CONTEXT_BYTES = 512 * 2**20
"""What a process's CUDA context takes of its GPU before any model (the driver's state, cuBLAS and
cuDNN kernels): 300-800 MiB with PyTorch, by GPU and library versions."""


@dataclass(frozen=True)
class ModelMemory:
    """``weights_bytes`` (parameters and buffers) and ``activation_bytes``, the largest activations
    one sample keeps live at once (a layer's input and output): a batch of ``b`` holds ``b`` times those."""

    weights_bytes: int
    activation_bytes: int

    def __post_init__(self) -> None:
        for name in ("weights_bytes", "activation_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a number of bytes (an integer >= 0), got {value!r}")

    def activations(self, batch: int) -> int:
        return batch * self.activation_bytes


def measure_memory(module: Any, example: Any) -> ModelMemory:
    """``module``'s weights, and its activations per sample measured by one forward pass of
    ``example`` (a batched tensor) on the host: the largest input plus output of any leaf module.
    The caching allocator of a GPU keeps about that much for a batch (plus fragmentation)."""
    import torch

    from daskpipe.profiles.fx import call_arguments

    args, kwargs = call_arguments(example)
    weights = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    peak = 0

    def nbytes(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)):
            return sum(nbytes(v) for v in value)
        if isinstance(value, dict):
            return sum(nbytes(v) for v in value.values())
        return 0

    def record(_module: Any, inputs: Any, output: Any) -> None:
        nonlocal peak
        peak = max(peak, nbytes(inputs) + nbytes(output))

    leaves = [m for m in module.modules() if not any(True for _ in m.children())]
    hooks = [leaf.register_forward_hook(record) for leaf in leaves]
    try:
        with torch.no_grad():
            output = module(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    peak = max(peak, nbytes(example) + nbytes(output))
    first = next((t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.dim()), None)
    samples = first.shape[0] if first is not None else 1
    return ModelMemory(int(weights), int(math.ceil(peak / max(samples, 1))))
