"""Small co-location fixtures shared by the colocation, plan and sim tests."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from daskpipe.colocation.latency import GpuSpec, InterferenceModel, ModelCoefficients
from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan
from daskpipe.profiles.model import Profile

L4 = GpuSpec("L4", sm_count=58, memory_mb=24576, pcie_gb_per_s=24.0, sched_alpha_us=2.0)


def sliced_profile(
    name: str,
    base_ms: float,
    *,
    slo_ms: float,
    gpus: Sequence[str] = ("L4", "T4"),
    slices: Sequence[int] = (1, 2, 4),
    blocks: int = 2,
    max_batch: int = 4,
) -> Profile:
    """Equal blocks whose whole-model latency is ``base_ms · v^0.8 · (1 + 0.6 (b - 1))`` on 1/v of
    any GPU (``T4`` 2x slower): slicing costs less than it divides, as in the published tables."""
    tables = {}
    for gpu in gpus:
        for v in slices:
            per_batch = base_ms * 1e3 * (2.0 if gpu == "T4" else 1.0) * v**0.8 * (1 + 0.6 * np.arange(max_batch))
            tables[(gpu, v)] = np.tile(per_batch / blocks, (blocks, 1))
    return Profile(model=name, slo_us=slo_ms * 1e3, num_blocks=blocks, latency_us=tables, boundary_bytes=(1000.0,) * (blocks - 1))


def cache_model(models: Sequence[str] = ("a", "b")) -> InterferenceModel:
    """L4 coefficients with a real cross-model cache term: co-runners slow each other down."""
    coefficients = {
        (m, "L4"): ModelCoefficients(
            model=m,
            gpu="L4",
            kernels=50,
            sched_us_per_kernel=5.0,
            running=(0.0, 20.0, 10.0, 2.0, 0.5),
            l2_alpha=0.4,
            l2_beta=0.1,
            cache_sensitivity=0.3,
            input_bytes=6e5,
            output_bytes=4e3,
            mem_base_mb=500.0,
            mem_per_sample_mb=20.0,
        )
        for m in models
    }
    return InterferenceModel(gpus={"L4": L4}, coefficients=coefficients, name="test-cache", max_batch=4)


def shared_gpu_plan(model: InterferenceModel, residents: Sequence[tuple[str, float]], *, device: str = "L4-0", batch: int = 2) -> Plan:
    """Each ``(model name, share)`` one single-partition pipeline on ``device``, blocks [0, 2)."""
    models = tuple(
        ModelPlan(
            name=name,
            slo_us=200_000.0,
            weight=1.0,
            throughput=50.0,
            pipelines=(
                Pipeline(
                    batch_size=batch,
                    throughput=100.0,
                    partitions=(Partition((0, 2), "L4", max(1, round(1 / share)), 1, 10_000.0, device=device, share=share),),
                ),
            ),
        )
        for name, share in residents
    )
    return Plan(objective=50.0, models=models, strategy="inss", cluster={"gpus": {"L4": 1}, "bw_gbps": 10.0}, interference=model.to_dict())
