"""PPipe's worked example: a two-block model on GPU types A and B (Fig. 5), its plans and requests."""

from __future__ import annotations

import numpy as np

from daskpipe.plan.schema import ModelPlan, Partition, Pipeline
from daskpipe.plan.shared import SharedGroup, shared_plan
from daskpipe.profiles.model import Profile
from daskpipe.sched.api import Placement, Request, Slot
from tests.plan.helpers import linear

MS = 1e-3
# per-block latency (ms) at batch 1..4 on GPU A (block 0) and B (block 1)
A_MS = (10.0, 15.0, 20.0, 25.0)
B_MS = (20.0, 30.0, 40.0, 50.0)
BW_GBPS = 8.0
BOUNDARY = 1e6  # bytes per sample: 1 ms per sample at 8 Gbps


def profile(slo_ms: float = 200.0) -> Profile:
    a, b = np.array(A_MS) * 1e3, np.array(B_MS) * 1e3
    tables = {("A", 1): np.array([a, a]), ("B", 1): np.array([b, b])}
    return Profile(model="m", slo_us=slo_ms * 1e3, num_blocks=2, latency_us=tables, boundary_bytes=(BOUNDARY,))


def split(vgpus: tuple[int, int] = (1, 2), bs: int = 4) -> Pipeline:
    """Block 0 on A, block 1 on B."""
    return Pipeline(
        bs, 100.0, (Partition((0, 1), "A", 1, vgpus[0], A_MS[bs - 1] * 1e3), Partition((1, 2), "B", 1, vgpus[1], B_MS[bs - 1] * 1e3))
    )


def whole(gpu: str, vgpus: int = 1, bs: int = 4) -> Pipeline:
    lat = (A_MS if gpu == "A" else B_MS)[bs - 1] * 2e3
    return Pipeline(bs, 100.0, (Partition((0, 2), gpu, 1, vgpus, lat),))


def model(*pipelines: Pipeline, slo_ms: float = 200.0) -> ModelPlan:
    return ModelPlan("m", slo_ms * 1e3, 1.0, 100.0, tuple(pipelines))


def fig5() -> tuple[ModelPlan, Placement]:
    """Pool 1 = {node1}, pool 2 = {node2, node3}, one GPU per node."""
    slots = {f"node{i}": Slot(f"node{i}", "A" if i == 1 else "B", 1, f"node{i}") for i in (1, 2, 3)}
    return model(split((1, 2))), Placement("m", {(0, 0): ("node1",), (0, 1): ("node2", "node3")}, slots)


def req(i: int, t: float, slo_ms: float = 200.0, size: int = 1) -> Request:
    return Request(i, "m", t, t + slo_ms * MS, size)


def two_kind_pool():
    """Models "a" and "b" on one T4 and one L4 (twice as fast), as ``daskpipe.plan.shared`` plans them."""
    profiles = {"a": linear("a", 1.0, 5.0, 20.0), "b": linear("b", 2.0, 4.0, 30.0)}
    plan = shared_plan(profiles, [SharedGroup(("a", "b"), {("T4", 1): 1, ("L4", 1): 1})])
    slots = [Slot("l4", "L4", 1, "s"), Slot("t4", "T4", 1, "s")]
    return plan, profiles, slots
