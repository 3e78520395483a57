"""Shared-pool plans: every model whole on every slot of its sub-cluster, within its memory."""

from __future__ import annotations

import pytest

from daskpipe.plan.schema import PlanError
from daskpipe.plan.shared import SharedGroup, check_memory, largest_batch, shared_plan
from daskpipe.profiles.catalog import load_catalog
from daskpipe.profiles.memory import ModelMemory
from tests.plan.helpers import linear


def test_every_model_gets_one_whole_model_pipeline_per_kind_of_its_sub_cluster():
    profiles = {"a": linear("a", 1.0, 5.0, 20.0), "b": linear("b", 2.0, 4.0, 30.0)}
    plan = shared_plan(profiles, [SharedGroup(("a", "b"), {("T4", 1): 3, ("L4", 1): 1})])
    assert plan.strategy == "shared" and plan.settings["subclusters"] == [["a", "b"]]
    a = plan.model("a")
    by_gpu = {p.partitions[0].gpu: p for p in a.pipelines}
    assert set(by_gpu) == {"L4", "T4"}
    assert all(p.partitions[0].blocks == (0, 2) for p in a.pipelines)
    assert by_gpu["T4"].partitions[0].vgpus == 3 and by_gpu["L4"].partitions[0].vgpus == 1
    assert by_gpu["T4"].batch_size == 15  # 1 * 15 + 5 = 20 ms <= 20 ms; 16 would take 21
    assert by_gpu["L4"].batch_size == 16  # twice as fast: every profiled batch fits


def test_largest_batch_is_zero_when_not_even_one_sample_meets_the_slo():
    assert largest_batch(linear("a", 1.0, 5.0, 20.0), "T4", 1, 5_500.0) == 0
    with pytest.raises(PlanError, match="'a' cannot meet its SLO of 5.5 ms on T4/v1: one sample takes 6 ms"):
        shared_plan({"a": linear("a", 1.0, 5.0, 20.0)}, [SharedGroup(("a",), {("T4", 1): 1})], {"a": 5_500.0})


def test_a_model_in_two_sub_clusters_or_without_a_profile_is_refused():
    profiles = {"a": linear("a", 1.0, 5.0, 20.0)}
    group = SharedGroup(("a",), {("T4", 1): 1})
    with pytest.raises(PlanError, match="model 'a' is in sub-clusters 0 and 1"):
        shared_plan(profiles, [group, group])
    with pytest.raises(PlanError, match="names model 'z', which has no profile"):
        shared_plan(profiles, [SharedGroup(("z",), {("T4", 1): 1})])


def test_a_slot_holds_every_weight_the_largest_batch_and_the_context():
    profiles = {name: linear(name, 1.0, 5.0, 20.0, kinds=(("T4", 1), ("T4", 2))) for name in ("a", "b")}
    group = SharedGroup(("a", "b"), {("T4", 1): 2})
    plan = shared_plan(profiles, [group])
    memory = {"a": ModelMemory(7 * 10**9, 10**7), "b": ModelMemory(8 * 10**9, 2 * 10**7)}  # batch 15: 0.15 and 0.3 GB
    check_memory(plan, [group], memory, context_bytes=5 * 10**8)  # 0.5 + 15 + 0.3 = 15.8 GB <= 16 GB: fits
    with pytest.raises(PlanError) as info:
        check_memory(plan, [group], memory, context_bytes=8 * 10**8)  # 0.8 + 15 + 0.3 = 16.1 GB
    assert str(info.value).startswith(
        "models ['a', 'b'] of sub-cluster 0 do not fit one T4/v1 slot's 16.00 GB: CUDA context 0.80 GB + weights 15.00 GB "
        "(a 7.00, b 8.00) + the largest batch's activations 0.30 GB ('b' at batch 15) = 16.10 GB"
    )
    halves = SharedGroup(("a", "b"), {("T4", 2): 2})  # two MPS slices share a GPU's memory
    with pytest.raises(PlanError, match="T4/v2 slot's 8.00 GB"):
        check_memory(shared_plan(profiles, [halves]), [halves], memory, context_bytes=0)
    assert load_catalog()["T4"].memory_gb == 16
