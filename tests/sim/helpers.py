"""A toy two-partition model and plan, and a one-stage batching plan: small enough to reason about by hand."""

from __future__ import annotations

import numpy as np

from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan
from daskpipe.profiles.model import Profile


def toy_profile(slo_us: float = 50_000.0) -> Profile:
    # block 0 on A: 1.0/1.5/2.0/2.5 ms at b=1..4; block 1 on B: 2.0/2.6/3.2/3.8 ms
    a = np.array([[1000.0, 1500, 2000, 2500], [9000, 9000, 9000, 9000]])
    b = np.array([[9000.0, 9000, 9000, 9000], [2000, 2600, 3200, 3800]])
    return Profile("toy", slo_us, 2, {("A", 1): a, ("B", 1): b}, boundary_bytes=(125_000.0,))  # 1 ms/sample at 1 Gb/s


def toy_plan(throughput: float = 1000.0) -> Plan:
    pipeline = Pipeline(2, throughput, (Partition((0, 1), "A", 1, 2, 1500.0, 2000.0), Partition((1, 2), "B", 1, 2, 2600.0)))
    model = ModelPlan("toy", 50_000.0, 1.0, throughput, (pipeline,))
    return Plan(1.0, (model,), cluster={"gpus": {"A": 2, "B": 4}, "gpus_per_server": {"A": 1, "B": 1}, "bw_gbps": 1.0})


def batching_plan(slots: int = 2, batch: int = 8) -> tuple[Plan, dict[str, Profile]]:
    """One stage on ``slots`` GPUs at batch ``batch``, 20 ms + 2 ms per sample, SLO 100 ms: a sample
    costs little next to a batch, so at low load a batch waits for the last moment of its head."""
    latency_us = np.array([(20.0 + 2.0 * b) * 1e3 for b in range(1, batch + 1)])
    profile = Profile("g", 100_000.0, 1, {("G", 1): latency_us[None, :]}, boundary_bytes=())
    throughput = slots * batch / (latency_us[-1] * 1e-6)
    pipeline = Pipeline(batch, throughput, (Partition((0, 1), "G", 1, slots, latency_us[-1]),))
    model = ModelPlan("g", 100_000.0, 1.0, throughput, (pipeline,))
    return Plan(throughput, (model,), cluster={"gpus": {"G": slots}, "gpus_per_server": {"G": 1}, "bw_gbps": 10.0}), {"g": profile}
