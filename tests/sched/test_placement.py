"""Packing a plan's pools of slices into physical GPUs and servers."""

from __future__ import annotations

import pytest

from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan
from daskpipe.sched.placement import place


def _plan(cluster: dict | None = None) -> Plan:
    a = ModelPlan(
        "a",
        100e3,
        1.0,
        10.0,
        (
            Pipeline(4, 5.0, (Partition((0, 1), "P4", 1, 3, 1e3), Partition((1, 2), "L4", 2, 3, 1e3))),
            Pipeline(2, 5.0, (Partition((0, 2), "L4", 2, 2, 1e3),)),
        ),
    )
    b = ModelPlan("b", 100e3, 1.0, 10.0, (Pipeline(1, 5.0, (Partition((0, 2), "L4", 2, 1, 1e3),)),))
    return Plan(0.0, (a, b), cluster=cluster or {})


def test_slices_fill_gpus_of_one_model_and_v():
    placements = place(_plan(), gpus_per_server={"L4": 2, "P4": 4})
    a, b = placements["a"], placements["b"]
    assert a.pools[(0, 0)] == ("P4-0/0", "P4-1/0", "P4-2/0")
    # 3 half-L4 slices: L4-0 whole, then half of L4-1, whose other half goes to the model's next v=2 pool
    assert a.pools[(0, 1)] == ("L4-0/0", "L4-0/1", "L4-1/0")
    assert a.pools[(1, 0)] == ("L4-1/1", "L4-2/0")
    # another model never shares a physical GPU
    assert b.pools[(0, 0)] == ("L4-3/0",)
    assert {s.server for s in a.slots.values() if s.gpu == "P4"} == {"P4-srv0"}
    assert [a.slots[x].server for x in ("L4-0/0", "L4-1/0", "L4-2/0")] == ["L4-srv0", "L4-srv0", "L4-srv1"]
    assert b.slots["L4-3/0"].server == "L4-srv1"
    assert all(s.slices == 2 for s in b.slots.values())


def test_defaults_come_from_the_plan_and_ids_are_deterministic():
    plan = _plan({"gpus_per_server": {"L4": 4, "P4": 1}, "gpus": {"L4": 4, "P4": 3}})
    first, second = place(plan), place(plan)
    assert first == second
    assert first["a"].slots["P4-2/0"].server == "P4-srv2"
    assert first["b"].slots["L4-3/0"].server == "L4-srv0"


def test_bad_inputs():
    with pytest.raises(ValueError, match="cluster lists 3"):
        place(_plan({"gpus": {"L4": 3, "P4": 3}}))
    with pytest.raises(ValueError, match="integer >= 1"):
        place(_plan(), gpus_per_server={"L4": 0})
    with pytest.raises(ValueError, match="must map"):
        place(_plan(), gpus_per_server=4)  # type: ignore[arg-type]
