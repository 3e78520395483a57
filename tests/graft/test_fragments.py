from __future__ import annotations

import numpy as np
import pytest

from daskpipe.graft import JETSON_NANO, Fragment, StageCosts, Uplink, neurosurgeon_split, sample_fragments
from daskpipe.profiles.model import ProfileError

from .helpers import toy_profile


def test_split_moves_later_as_bandwidth_drops(costs: StageCosts) -> None:
    uplink = Uplink()
    fast = neurosurgeon_split(costs, JETSON_NANO, 10_000.0, uplink)
    slow = neurosurgeon_split(costs, JETSON_NANO, 2.0, uplink)
    assert fast.start_block == 0
    assert slow.start_block > fast.start_block
    device_total = JETSON_NANO.block_latency_ms(costs.profile).sum()
    assert slow.slo_ms == pytest.approx(0.95 * device_total)
    assert slow.budget_ms == pytest.approx(slow.slo_ms - slow.device_ms - slow.upload_ms)


def test_sampled_fragments_have_varied_splits(costs: StageCosts) -> None:
    fragments = sample_fragments(costs, num_devices=40, rng=np.random.default_rng(1))
    assert len({f.start_block for f in fragments}) > 1
    assert all(f.budget_ms > 0 and f.rate_rps == 30.0 for f in fragments)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="budget"):
        Fragment("toy", 1, -3.0, 30.0, ("d",))
    bare = toy_profile()
    bare = type(bare)(model="toy", slo_us=1.0, num_blocks=4, latency_us=bare.latency_us, boundary_bytes=bare.boundary_bytes)
    with pytest.raises(ProfileError, match="block_gflops_batch1"):
        JETSON_NANO.block_latency_ms(bare)
