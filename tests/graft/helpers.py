"""A toy four-block profile whose latencies are affine in the MPS slice count, as the estimator's;
and a tiny real CNN with a hand-made Graft plan whose fragments enter at blocks 0, 1 and 2."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from daskpipe.graft import Fragment, GraftPlan, GroupPlan, Level, ServingPlan, StageConfig, StageCosts
from daskpipe.graft.costs import poisson_quantile
from daskpipe.profiles.model import Profile

FIXED_US = np.array([900.0, 600.0, 600.0, 300.0])  # per block, per batch
SCALABLE_US_PER_SAMPLE = np.array([2000.0, 1500.0, 1000.0, 500.0])


def toy_profile(max_batch: int = 8) -> Profile:
    batches = np.arange(1, max_batch + 1)
    scalable = SCALABLE_US_PER_SAMPLE[:, None] * (0.75 + 0.25 * batches[None, :])  # batching amortises most work
    fixed = np.repeat(FIXED_US[:, None], max_batch, axis=1)
    return Profile(
        model="toy",
        slo_us=100_000.0,
        num_blocks=4,
        latency_us={("V100", 1): fixed + scalable, ("V100", 2): fixed + 2 * scalable},
        boundary_bytes=(60_000.0, 25_000.0, 10_000.0),
        input_bytes=150_000.0,
        output_bytes=4_000.0,
        meta={"block_gflops_batch1": [2.0, 1.5, 1.0, 0.5]},
    )


def instances_needed(costs: StageCosts, rate_rps: float, latency_ms: float, batch: int) -> int:
    """Instances for the 99th-percentile burst of one batch time, computed independently of the grid."""
    burst = float(poisson_quantile(np.array(rate_rps * latency_ms / 1e3), 1 - costs.burst_risk))
    return max(1, int(np.ceil(burst / batch - 1e-9)))


BLOCK_MS = (4.0, 4.0, 150.0, 150.0)  # at batch 1 on a 1/2 V100; the shared blocks hold the slot long
MAX_BATCH = 8
BUDGET_MS = 4000.0


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    ).eval()


def serving_plan() -> tuple[ServingPlan, tuple[Fragment, ...]]:
    """Devices enter at blocks 0, 1 and 2; all are re-aligned at block 2 and share [2, 4) at batch 8."""
    fragments = tuple(Fragment("tiny", k, BUDGET_MS, 10.0, (f"dev{k}",)) for k in (0, 1, 2))
    private = tuple(StageConfig(k, 2, 2, 40, 1, 10.0, 10.0) for k in (0, 1)) + (None,)
    level = Level(2, fragments, private, StageConfig(2, 4, MAX_BATCH, 50, 1, 300.0, 30.0))
    return GraftPlan("tiny", "V100", (GroupPlan((level,)),)).serving(), fragments
