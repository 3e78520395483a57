"""Pre-partitioning: group a model's many layers (fx segments) into N contiguous blocks.

The MILP plans over blocks, not layers; PPipe's paper groups layers greedily into blocks of equal
runtime on one reference GPU.
"""

from __future__ import annotations

import numpy as np


def greedy_blocks(segment_latency_us: np.ndarray, num_blocks: int) -> list[int]:
    """Block boundaries (segment indices, first 0, last ``len(segments)``) of ~equal runtime.

    Walks the segments once, closing a block when adding the next segment would move its runtime
    further from ``total / num_blocks`` than leaving it out (PPipe §5.2).
    """
    lat = np.asarray(segment_latency_us, dtype=float)
    n = len(lat)
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if n < num_blocks:
        raise ValueError(f"cannot cut {n} segments into {num_blocks} blocks; ask for at most {n} blocks")
    target = lat.sum() / num_blocks
    bounds = [0]
    acc = 0.0
    for i, x in enumerate(lat):
        remaining_blocks = num_blocks - len(bounds)
        remaining_segments = n - i
        if acc > 0 and remaining_blocks > 0 and (
            abs(acc + x - target) > abs(acc - target) or remaining_segments == remaining_blocks
        ):
            bounds.append(i)
            acc = 0.0
        acc += x
    bounds.append(n)
    return bounds
