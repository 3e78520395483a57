from __future__ import annotations

from dataclasses import replace

import pytest

from daskpipe.plan.configs import Budget, enumerate_configs, prune_dominated, resources_of

from .helpers import synthetic_profile


def budget(latency_us: float = 1e9, bw_gbps: float = 10.0, rate: float | None = None, per_server: dict | None = None) -> Budget:
    return Budget(latency_us=latency_us, bw_gbps=bw_gbps, gpus_per_server=per_server or {}, batch_build_rate=rate)


def test_enumerates_every_cut_chain_and_batch(two_block):
    configs = enumerate_configs(two_block, resources_of(two_block, ["A", "B"]), budget(), max_parts=2)
    # A[0] -> B[1] needs (1000 req/s per A, 100 per B): B[0] -> A[1] (1000 per A, 833 per B) dominates it
    routes = {(c.bounds, c.resources) for c in configs}
    assert routes == {((0, 2), (("A", 1),)), ((0, 2), (("B", 1),)), ((0, 1, 2), (("B", 1), ("A", 1)))}


def test_slo_budget_counts_transfer_linear_in_batch():
    p = synthetic_profile("m", {("A", 1): [100, 100], ("B", 1): [100, 100]}, boundary_bytes=[1e6], max_batch=2, batch_scaling=0.0)
    # 1 MB at 8 Gbit/s: 1000 µs per request, so batch 2 takes 2000 µs on the wire
    b = budget(latency_us=1500, bw_gbps=8)
    split = [c for c in enumerate_configs(p, resources_of(p, ["A", "B"]), b, max_parts=2) if c.num_parts == 2]
    assert {c.batch_size for c in split} == {1}
    assert split[0].transfer_us == pytest.approx((1000.0, 0.0))


def test_the_input_counts_on_its_way_in_to_the_first_partition():
    p = synthetic_profile("m", {("A", 1): [100, 100], ("B", 1): [100, 100]}, boundary_bytes=[1e3], max_batch=4, batch_scaling=0.0)
    # 1 MB inputs at 8 Gbit/s: 1000 µs a sample before the first partition starts, 1000 req/s on its NIC
    b = budget(latency_us=2300, bw_gbps=8, per_server={"A": 1, "B": 1})
    without = enumerate_configs(p, resources_of(p, ["A"]), b, max_parts=1)
    with_input = enumerate_configs(replace(p, input_bytes=1e6), resources_of(p, ["A"]), b, max_parts=1)
    assert [c.batch_size for c in without] == [4]  # 200 µs at any batch: 4 dominates
    assert [c.vgpu_throughput for c in without] == [pytest.approx((20000.0,))]
    assert with_input and all(c.batch_size <= 2 for c in with_input)  # b * 1000 + 200 µs <= 2300
    assert all(c.total_latency_us == pytest.approx(c.batch_size * 1000 + 200) for c in with_input)
    assert all(c.vgpu_throughput == pytest.approx((1000.0,)) for c in with_input)  # the NIC's, not the compute's


def test_batch_build_estimate_limits_batch():
    p = synthetic_profile("m", {("A", 1): [100]}, max_batch=4, batch_scaling=0.0)
    # 1.3 * (b - 1) / 1000 req/s = 1300 µs per extra request
    configs = enumerate_configs(p, [("A", 1)], budget(latency_us=100 + 1300 * 2, rate=1000.0), max_parts=1)
    assert max(c.batch_size for c in configs) <= 3
    best = max(configs, key=lambda c: c.vgpu_throughput[0])
    assert best.batch_size == 3 and best.total_latency_us == pytest.approx(100 + 2600)


def test_nic_cap_shared_by_slices_and_server():
    p = synthetic_profile("m", {("A", 1): [10, 10], ("A", 2): [20, 20], ("B", 1): [10, 10]}, boundary_bytes=[1e6])
    b = budget(bw_gbps=8, per_server={"A": 2})  # 1000 req/s per NIC, shared by 2 GPUs x v slices
    per_resource = {
        frozenset(c.resources): dict(zip(c.resources, c.vgpu_throughput))
        for c in enumerate_configs(p, resources_of(p, ["A", "B"]), b, max_parts=2)
        if c.num_parts == 2
    }
    assert per_resource[frozenset({("B", 1), ("A", 2)})] == pytest.approx({("B", 1): 1000.0, ("A", 2): 250.0})
    assert per_resource[frozenset({("A", 1), ("B", 1)})] == pytest.approx({("A", 1): 500.0, ("B", 1): 1000.0})


def test_prune_keeps_pareto_front_and_lowest_latency_on_ties():
    p = synthetic_profile("m", {("A", 1): [100, 100, 100], ("B", 1): [100, 300, 100]})
    configs = enumerate_configs(p, resources_of(p, ["A", "B"]), budget(), max_parts=2)
    # B->A cut after block 0 (B 100 µs, A 200 µs) beats cut after block 1 (B 400, A 100)? neither dominates
    for c in configs:
        others = [o for o in configs if o is not c and set(o.resources) == set(c.resources)]
        for o in others:
            mine, theirs = dict(zip(c.resources, c.vgpu_throughput)), dict(zip(o.resources, o.vgpu_throughput))
            assert not all(theirs[r] >= mine[r] for r in mine), (c, o)
    assert prune_dominated(configs) == configs


def test_free_boundaries_cost_nothing():
    p = synthetic_profile("m", {("A", 1): [100, 100], ("B", 1): [100, 100]}, boundary_bytes=[0.0])
    split = [c for c in enumerate_configs(p, resources_of(p, ["A", "B"]), budget(), max_parts=2) if c.num_parts == 2]
    assert split and all(c.transfer_us == (0.0, 0.0) and c.vgpu_throughput == pytest.approx((1e4, 1e4)) for c in split)


def test_a_pool_used_twice_keeps_the_pipeline_without_it():
    """A -> B -> A has two pools on A: it must not pass for a faster A -> B and prune it."""
    p = synthetic_profile("m", {("A", 1): [100, 1000, 100], ("B", 1): [1000, 100, 1000]})
    configs = enumerate_configs(p, resources_of(p, ["A", "B"]), budget(), max_parts=3)
    routes = {tuple(g for g, _ in c.resources) for c in configs}
    assert {("A", "B"), ("A", "B", "A")} <= routes
