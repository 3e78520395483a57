from __future__ import annotations

import numpy as np
import pytest

from daskpipe.profiles.model import ProfileError
from daskpipe.profiles.prepartition import greedy_blocks, ilp_blocks


def test_ilp_cuts_where_feature_maps_are_small():
    # six equal segments on both GPUs: any 2+2+2 split is balanced; the small maps are after 1 and 3
    latency = {"A": np.ones(6), "B": np.ones(6) * 3}
    boundary_bytes = np.array([100, 1, 100, 1, 100], dtype=float)
    assert ilp_blocks(latency, boundary_bytes, 3) == [0, 2, 4, 6]


def test_ilp_balances_every_gpu_type():
    # cutting after segment 0 is cheapest, but leaves a block at 5% of its share on GPU B; no split
    # fits (0.7, 1.3), so the band widens to (0.5, 1.5), where [0, 2) [2, 4) is the cheaper of two
    latency = {"A": np.array([1.0, 1, 1, 1]), "B": np.array([0.1, 1, 1, 1.9])}
    boundary_bytes = np.array([1, 50, 60], dtype=float)
    bounds = ilp_blocks(latency, boundary_bytes, 2)
    assert bounds == [0, 2, 4]
    for lat in latency.values():
        share = lat.sum() / 2
        for start, end in zip(bounds, bounds[1:]):
            assert 0.5 * share <= lat[start:end].sum() <= 1.5 * share


def test_ilp_widens_the_band_until_feasible():
    # one segment holds half the runtime, 1.5 x the fair share of 3 blocks: (0.5, 1.5) is needed
    latency = {"A": np.array([5.0, 1, 1, 1, 1, 1])}
    bounds = ilp_blocks(latency, np.ones(5), 3)
    assert bounds[:2] == [0, 1] and bounds[-1] == 6 and len(bounds) == 4


def test_ilp_reports_impossible_requests():
    with pytest.raises(ProfileError, match="cannot cut 3 segments into 4 blocks"):
        ilp_blocks({"A": np.ones(3)}, np.ones(2), 4)
    with pytest.raises(ProfileError, match="one entry per boundary"):
        ilp_blocks({"A": np.ones(3)}, np.ones(3), 2)
    with pytest.raises(ProfileError, match=r"no 2 contiguous blocks"):
        ilp_blocks({"A": np.array([100.0, 1.0])}, np.ones(1), 2)


def test_greedy_blocks_still_equal_runtime():
    assert greedy_blocks(np.ones(10), 5) == [0, 2, 4, 6, 8, 10]
