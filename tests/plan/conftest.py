"""Synthetic profiles with hand-computable plans."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pytest

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


@pytest.fixture
def two_block() -> Profile:
    """Block 0 runs nearly as fast on the slow GPU B; block 1 is 10x slower there.

    One A + one B: whole models give 1/2 ms + 1/11.2 ms = 589.3 req/s, the pipeline B[0] -> A[1]
    gives min(1/1.2 ms, 1/1 ms) = 833.3 req/s.
    """
    return synthetic_profile("two-block", {("A", 1): [1000, 1000], ("B", 1): [1200, 10000]})
