"""A small CNN and its estimated whole-GPU profile: a real model to serve on emulated GPUs (the
runtime's tests, ``daskpipe bench chaos`` and ``daskpipe bench overload``) whose CPU compute stays
far below its dilated emulated latency."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from torch import nn

    from daskpipe.profiles.model import Profile


def small_cnn() -> nn.Module:
    """Three 3x3 convolutions and a linear head: a real model whose CPU compute stays far below
    its dilated emulated latency, so the emulation holds every batch to its profiled time."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    ).eval()


def estimated_profile(model, example, gpus: Sequence[str] = ("L4", "T4", "A10"), name: str = "small-cnn", batch_sizes: int = 8) -> Profile:
    """The analytic estimator's whole-GPU tables of ``gpus`` for ``model``, batches 1..``batch_sizes``."""
    from daskpipe.profiles.estimator import estimate_profile

    estimated = estimate_profile(model, example, gpus=sorted(gpus), name=name, slices=[1], num_blocks=4, batch_sizes=batch_sizes)
    return replace(estimated, latency_us={kind: table for kind, table in estimated.latency_us.items() if kind[1] == 1})
