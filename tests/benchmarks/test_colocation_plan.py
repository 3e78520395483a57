"""The issue's check on the published profiles: co-locating models serves more of the workload mix
than the same cluster without co-location, where the models outnumber the GPUs."""

from __future__ import annotations

import pytest

from daskpipe.benchmarks.colocation_plan import compare
from daskpipe.profiles.loader import load_profiles

LIGHT = ["resnext152", "fcn", "googlenet"]  # the three whose 1/2 slice costs least (1.4-1.7x the whole L4)


@pytest.mark.shared
def test_colocation_serves_the_mix_that_whole_gpus_cannot(ppipe_dir):
    profiles = load_profiles(ppipe_dir, LIGHT)
    figures = compare(profiles, {"L4": 2}, ["np", "ppipe", "inss", "gslice"], duration=6.0, seed=1)["strategies"]
    # Without co-location one model gets no GPU: the mix is not served at all.
    assert figures["np"]["objective"] == figures["ppipe"]["objective"] == 0.0
    assert figures["np"]["throughput"] == figures["ppipe"]["throughput"] == 0.0
    for strategy in ("inss", "gslice"):
        f = figures[strategy]
        assert f["gpus_used"] == {"L4": pytest.approx(2.0, abs=0.3)}
        assert all(lf > 0 for lf in f["max_load_factor"].values()), f  # every model keeps 99% attainment at some load
        assert f["throughput"] > 50.0, f  # req/s of the whole mix, measured in simulation
