"""Slack-aware dispatch against last-moment dispatch, in the simulator with latency noise."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from daskpipe.sched.ppipe import PPipeSettings
from daskpipe.sim import SimulationConfig, simulate

from .helpers import batching_plan

LAST_MOMENT = PPipeSettings(slack_quantile=None)
SLACK_AWARE = PPipeSettings()
# measured/profiled compute ratios shaped like the runtime's on a CPU (issue 18: a median 14% over
# the profile, 7% under to 39% over); fixed, so that the test does not depend on a draw
RUNTIME_LIKE_RATIOS = [float(r) for r in np.clip(1.14 * np.exp(np.random.default_rng(0).normal(0.0, 0.1, 50)), 0.93, 1.39)]


def attainments(settings: PPipeSettings, load: float, **noise) -> list[float]:
    plan, profiles = batching_plan()
    return [
        simulate(plan, profiles, SimulationConfig(duration=10.0, seed=seed, settings=settings, **noise), load_factor=load)
        .models["g"]
        .attainment
        for seed in (1, 2, 3)
    ]


@pytest.mark.parametrize(
    "load, noise",
    [(0.2, {"noise": 0.2}), (0.3, {"latency_ratios": RUNTIME_LIKE_RATIOS})],
    ids=["log-normal", "runtime-like-ratios"],
)
def test_slack_aware_dispatch_meets_more_deadlines_under_noise(load, noise):
    """Batches wait for their head's last moment at this load: with the profiled mean a batch
    then misses whenever it runs over, with the measured p95 it rarely does. At 10 s, seeds 1-3:
    0.93 -> 0.98 (log-normal), 0.94 -> 0.99 (ratios)."""
    slack, last = attainments(SLACK_AWARE, load, **noise), attainments(LAST_MOMENT, load, **noise)
    assert all(s > x for s, x in zip(slack, last)), (slack, last)
    assert np.mean(slack) >= np.mean(last) + 0.03, (slack, last)


@pytest.mark.parametrize("plan_of", ["toy", "batching"])
def test_without_noise_both_policies_decide_alike(toy, plan_of):
    plan, profiles = toy if plan_of == "toy" else batching_plan()
    decided = []
    for settings in (SLACK_AWARE, LAST_MOMENT):
        result = simulate(plan, profiles, SimulationConfig(duration=2.0, settings=settings), load_factor=0.6)
        decided.append(
            [(at, d.batch_size, d.hops, [r.id for r in d.requests]) for _, trace in result.runs.values() for at, d in trace.dispatches]
        )
    assert decided[0] == decided[1]


def test_near_capacity_under_noise_batches_sent_one_ahead_and_kept_full_keep_the_plan_served():
    """Compute 14% over the profile at 0.8 of the plan, a batch costing far less than its samples
    alone: with every batch sent as soon as it is full and shrunk for its head, slots build lines
    of batches planned on time and run short batches, and the backlog grows. At 10 s, seeds 1-3:
    0.63 -> 0.96."""
    paper_like = replace(SLACK_AWARE, lead_batches=None, keep_full=False)
    ahead, eager = (
        attainments(replace(SLACK_AWARE, keep_full=True), 0.8, latency_ratios=RUNTIME_LIKE_RATIOS),
        attainments(paper_like, 0.8, latency_ratios=RUNTIME_LIKE_RATIOS),
    )
    assert min(ahead) >= 0.9 and all(a > e for a, e in zip(ahead, eager)), (ahead, eager)
    assert np.mean(ahead) >= np.mean(eager) + 0.2, (ahead, eager)
