"""The toy profile's stage costs, and the tiny CNN cut into four blocks with a profile it is emulated at."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from daskpipe.graft import StageCosts
from daskpipe.profiles.fx import BlockedModel, segment_model
from daskpipe.profiles.model import Profile
from tests.graft.helpers import BLOCK_MS, BUDGET_MS, MAX_BATCH, tiny_model, toy_profile


@pytest.fixture
def costs() -> StageCosts:
    return StageCosts(toy_profile(), "V100")


@pytest.fixture(scope="module")
def model_and_profile() -> tuple[nn.Module, BlockedModel, Profile]:
    """The tiny CNN, its four blocks, and a profile whose latencies (``BLOCK_MS``) it is emulated at."""
    module = tiny_model()
    segmented = segment_model(module, torch.zeros(1, 3, 16, 16))
    bounds = [0, 1, 2, 3, segmented.num_segments]
    blocked = segmented.cut(bounds)
    per_block = np.array([[ms * 1e3 * (1 + (b - 1) / 4) for b in range(1, MAX_BATCH + 1)] for ms in BLOCK_MS])
    profile = Profile(
        model="tiny",
        slo_us=BUDGET_MS * 1e3,
        num_blocks=4,
        latency_us={("V100", 1): per_block / 2, ("V100", 2): per_block},
        boundary_bytes=tuple(float(b) for b in blocked.boundary_bytes),
        input_shape=blocked.input_shape,
        boundary_shapes=tuple(blocked.boundary_shapes),
        meta={"segment_boundaries": bounds},
    )
    return module, blocked, profile
