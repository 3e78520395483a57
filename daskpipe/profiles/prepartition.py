"""Pre-partitioning: group a model's many layers (fx segments) into N contiguous blocks.

The MILP plans over blocks, not layers. PPipe's paper groups layers greedily into blocks of equal
runtime on one reference GPU; its artifact instead solves a small ILP that balances the blocks on
every GPU type and cuts where the feature maps are small.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from daskpipe.mipmodels import mip_model
from daskpipe.profiles.model import ProfileError


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
        if acc > 0 and remaining_blocks > 0 and (abs(acc + x - target) > abs(acc - target) or remaining_segments == remaining_blocks):
            bounds.append(i)
            acc = 0.0
        acc += x
    bounds.append(n)
    return bounds


# PPipe's artifact relaxes the per-block runtime band step by step until the ILP is feasible.
BALANCE_BANDS = ((0.7, 1.3), (0.5, 1.5), (0.5, 2.0), (0.5, 3.0), (0.4, 4.0))


def ilp_blocks(segment_latency_us: Mapping[str, np.ndarray], segment_bytes: np.ndarray, num_blocks: int) -> list[int]:
    """Block boundaries (as :func:`greedy_blocks`) that cut the fewest feature-map bytes.

    Every block's runtime on every GPU type must lie within ``[lb, ub] / num_blocks`` of that
    type's total, so that no GPU type sees a block far off its fair share; the band is widened
    through :data:`BALANCE_BANDS` until a partition exists (the artifact's ``prepartition_ilp``).
    ``segment_bytes[i]`` is what segment ``i`` hands to segment ``i + 1``.
    """
    import mip

    if not segment_latency_us:
        raise ProfileError("ilp_blocks needs the segment latencies of at least one GPU type")
    latency = {gpu: np.asarray(lat, dtype=float) for gpu, lat in segment_latency_us.items()}
    n = len(next(iter(latency.values())))
    for gpu, lat in latency.items():
        if lat.shape != (n,) or np.any(lat < 0) or not np.all(np.isfinite(lat)):
            raise ProfileError(f"segment latencies of GPU {gpu!r} must be {n} finite non-negative numbers, got shape {lat.shape}")
    cut_bytes = np.asarray(segment_bytes, dtype=float)
    if cut_bytes.shape != (n - 1,):
        raise ProfileError(
            f"segment_bytes must have one entry per boundary between the {n} segments ({n - 1}), "
            f"got {cut_bytes.shape[0] if cut_bytes.ndim else 0}"
        )
    if not 1 <= num_blocks <= n:
        raise ProfileError(f"cannot cut {n} segments into {num_blocks} blocks; ask for 1 to {n} blocks")
    for lb, ub in BALANCE_BANDS:
        bounds = _balanced_min_cut(latency, cut_bytes, num_blocks, lb, ub, mip)
        if bounds is not None:
            return bounds
    lb, ub = BALANCE_BANDS[-1]
    raise ProfileError(f"no {num_blocks} contiguous blocks keep every GPU type within [{lb}, {ub}] x its fair share; ask for fewer blocks")


def _balanced_min_cut(
    latency: Mapping[str, np.ndarray], cut_bytes: np.ndarray, num_blocks: int, lb: float, ub: float, mip
) -> list[int] | None:
    n = len(cut_bytes) + 1
    model = mip_model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    model.verbose = 0
    # in_block[s][j]: segment s belongs to block j; blocks are contiguous and in order
    in_block = [[model.add_var(var_type=mip.BINARY) for _ in range(num_blocks)] for _ in range(n)]
    cut = [model.add_var(lb=0, ub=1) for _ in range(n - 1)]
    for s in range(n):
        model += mip.xsum(in_block[s]) == 1
    model += in_block[0][0] == 1
    model += in_block[n - 1][num_blocks - 1] == 1
    for s in range(n - 1):
        for j in range(num_blocks):
            model += in_block[s + 1][j] <= in_block[s][j] + (in_block[s][j - 1] if j > 0 else 0)
            model += cut[s] >= in_block[s + 1][j] - in_block[s][j]
    for j in range(num_blocks):
        model += mip.xsum(in_block[s][j] for s in range(n)) >= 1
        for lat in latency.values():
            share = lat.sum() / num_blocks
            runtime = mip.xsum(float(lat[s]) * in_block[s][j] for s in range(n))
            model += runtime >= lb * share
            model += runtime <= ub * share
    model.objective = mip.minimize(mip.xsum(float(cut_bytes[s]) * cut[s] for s in range(n - 1)))
    status = model.optimize()
    if status != mip.OptimizationStatus.OPTIMAL:
        return None
    block_of = [max(range(num_blocks), key=lambda j: in_block[s][j].x) for s in range(n)]
    return [0] + [s for s in range(1, n) if block_of[s] != block_of[s - 1]] + [n]
