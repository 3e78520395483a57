"""Synthetic profiles with hand-computable plans."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from daskpipe.profiles.model import Profile


def synthetic_profile(
    name: str,
    block_us: Mapping[tuple[str, int], Sequence[float]],
    *,
    boundary_bytes: Sequence[float] = (),
    slo_us: float = 1e6,
    max_batch: int = 1,
    batch_scaling: float = 1.0,
) -> Profile:
    """Blocks whose batch-b latency is ``lat * (1 + batch_scaling * (b - 1))``."""
    tables = {}
    for key, lat in block_us.items():
        lat = np.asarray(lat, dtype=float)[:, None]
        tables[key] = lat * (1 + batch_scaling * np.arange(max_batch))[None, :]
    num_blocks = len(next(iter(block_us.values())))
    bytes_ = tuple(boundary_bytes) if boundary_bytes else (1.0,) * (num_blocks - 1)
    return Profile(model=name, slo_us=slo_us, num_blocks=num_blocks, latency_us=tables, boundary_bytes=bytes_)


def linear(name: str, alpha_ms: float, beta_ms: float, slo_ms: float, kinds=(("T4", 1), ("L4", 1))) -> Profile:
    """Two blocks, together alpha * b + beta ms at batch b <= 16 on each kind (L4 twice as fast)."""
    tables = {}
    for gpu, v in kinds:
        speed = 2.0 if gpu == "L4" else 1.0
        total = np.array([(alpha_ms * b + beta_ms) * 1e3 / speed for b in range(1, 17)])
        tables[(gpu, v)] = np.stack([total / 2, total / 2])
    return Profile(model=name, slo_us=slo_ms * 1e3, num_blocks=2, latency_us=tables, boundary_bytes=(100.0,))
