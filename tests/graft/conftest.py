"""A toy four-block profile whose latencies are affine in the MPS slice count, as the estimator's."""

from __future__ import annotations

import numpy as np
import pytest

from daskpipe.graft import StageCosts
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


@pytest.fixture
def costs() -> StageCosts:
    return StageCosts(toy_profile(), "V100")


def instances_needed(costs: StageCosts, rate_rps: float, latency_ms: float, batch: int) -> int:
    """Instances for the 99th-percentile burst of one batch time, computed independently of the grid."""
    burst = float(poisson_quantile(np.array(rate_rps * latency_ms / 1e3), 1 - costs.burst_risk))
    return max(1, int(np.ceil(burst / batch - 1e-9)))
