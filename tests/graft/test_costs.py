from __future__ import annotations

import pytest

from daskpipe.graft import StageCosts
from daskpipe.profiles.model import ProfileError

from .helpers import instances_needed, toy_profile


def test_share_scaling_reproduces_the_slice_tables(costs: StageCosts) -> None:
    profile = toy_profile()
    whole = profile.latency("V100", 1, 3, 1, 3) / 1e3
    half = profile.latency("V100", 2, 3, 1, 3) / 1e3
    assert costs.latency_ms(1, 3, 3, 100) == pytest.approx(whole)
    assert costs.latency_ms(1, 3, 3, 50) == pytest.approx(half)
    assert costs.latency_ms(1, 3, 3, 25) > half


def test_min_resource_is_the_cheapest_fitting_config(costs: StageCosts) -> None:
    config = costs.min_resource(0, 4, 60.0, 40.0)
    assert config is not None and config.latency_ms <= 40.0
    assert config.capacity_rps >= 60.0
    for batch in range(1, costs.max_batch + 1):
        for share in range(1, 101):
            latency = costs.latency_ms(0, 4, batch, share)
            if latency <= 40.0:
                instances = instances_needed(costs, 60.0, latency, batch)
                assert share * instances >= config.cost
    assert costs.min_resource(0, 4, 60.0, 0.1) is None


def test_front_trades_latency_for_cost(costs: StageCosts) -> None:
    configs = costs.pareto_configs(0, 4, 100.0, 50.0)
    assert len(configs) > 2
    assert all(a.latency_ms <= b.latency_ms and a.cost > b.cost for a, b in zip(configs, configs[1:]))


def test_needs_two_slice_counts_and_valid_ranges() -> None:
    profile = toy_profile().restricted(["V100"])
    one_slice = type(profile)(
        model="toy", slo_us=1.0, num_blocks=4, latency_us={("V100", 1): profile.table("V100", 1)}, boundary_bytes=profile.boundary_bytes
    )
    with pytest.raises(ProfileError, match="v=1 and v=2"):
        StageCosts(one_slice, "V100")
    costs = StageCosts(profile, "V100")
    with pytest.raises(ValueError, match="outside"):
        costs.latency_ms(3, 3, 1, 50)
    with pytest.raises(ValueError, match="share"):
        costs.latency_ms(0, 1, 1, 0)
