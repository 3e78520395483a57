from __future__ import annotations

import pytest

from daskpipe.sim.config import SimulationConfig
from daskpipe.sim.simulate import simulate


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(dataplane="magic"), "unknown data plane 'magic'; known: ppipe"),
        (dict(duration=0), "duration must be a positive number of seconds, got 0"),
        (dict(duration=float("inf")), "duration must be a positive number of seconds, got inf"),
        (dict(timeout_s=-0.001), "timeout_s must be a non-negative number of seconds, got -0.001"),
        (dict(latency_ratios=[]), "latency_ratios is empty"),
        (dict(latency_ratios=[1.0, -2.0]), r"latency ratios must be positive numbers, got \[-2.0\]"),
    ],
)
def test_a_bad_field_is_named(fields, message):
    with pytest.raises(ValueError, match=message):
        SimulationConfig(**fields)


def test_simulate_takes_a_config_only(toy):
    plan, profiles = toy
    with pytest.raises(TypeError, match="config must be a SimulationConfig, got dict"):
        simulate(plan, profiles, {"duration": 0.1})
    result = simulate(plan, profiles, SimulationConfig(dataplane="deferred", duration=0.2, seed=4), load_factor=0.5)
    assert (result.dataplane, result.duration, result.seed) == ("deferred", 0.2, 4)
