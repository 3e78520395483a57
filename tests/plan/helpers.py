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
