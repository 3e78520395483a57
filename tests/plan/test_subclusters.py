from __future__ import annotations

import random

import pytest

from daskpipe.plan.schema import PlanError
from daskpipe.plan.subclusters import ModelDemand, SubclusterPlan, imbalance, partition, random_partition

MB = 1_000_000


def zoo(n: int, seed: int = 0) -> list[ModelDemand]:
    """``n`` models with rates and weights spread over an order of magnitude."""
    generator = random.Random(seed)
    return [ModelDemand(f"m{i}", generator.uniform(1, 20), int(generator.uniform(10, 200) * MB)) for i in range(n)]


def totals(plan: SubclusterPlan, models: list[ModelDemand]) -> tuple[list[float], list[float]]:
    by_name = {d.name: d for d in models}
    return (
        [sum(by_name[n].rate for n in names) for names in plan.subclusters],
        [sum(by_name[n].weight_bytes for n in names) for names in plan.subclusters],
    )


def test_imbalance_is_range_over_mean():
    assert imbalance([1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert imbalance([5.0, 5.0]) == 0.0


def test_every_model_lands_in_exactly_one_nonempty_subcluster():
    models = zoo(15)
    plan = partition(models, 3, time_limit_s=1, solver="cbc")
    placed = [name for names in plan.subclusters for name in names]
    assert sorted(placed) == sorted(d.name for d in models)
    assert len(plan.subclusters) == 3 and all(plan.subclusters)
    assert set(plan.assignment.values()) == {0, 1, 2}


def test_reported_imbalance_is_that_of_the_split():
    models = zoo(16)
    plan = partition(models, 4, time_limit_s=1, solver="cbc")
    rates, weights = totals(plan, models)
    assert plan.rate_imbalance == pytest.approx(imbalance(rates))
    assert plan.memory_imbalance == pytest.approx(imbalance(weights))


def test_a_perfect_split_is_found_and_proven():
    # {a, b} and {c, d} carry 5 req/s and 5 MB each; no other pairing balances both
    models = [ModelDemand("a", 4, 1 * MB), ModelDemand("b", 1, 4 * MB), ModelDemand("c", 3, 2 * MB), ModelDemand("d", 2, 3 * MB)]
    plan = partition(models, 2, time_limit_s=5, solver="cbc")
    assert {frozenset(names) for names in plan.subclusters} == {frozenset("ab"), frozenset("cd")}
    assert plan.rate_imbalance == pytest.approx(0, abs=1e-9) and plan.memory_imbalance == pytest.approx(0, abs=1e-9)
    assert plan.status == "optimal"


def test_milp_is_no_worse_than_random_search_in_the_same_time():
    models = zoo(24, seed=3)
    milp = partition(models, 4, time_limit_s=1, solver="cbc")
    search = random_partition(models, 4, time_limit_s=1, seed=3)
    assert search.tried and search.tried > 100
    assert milp.objective <= search.objective + 1e-9


def test_a_resplit_moves_no_more_than_allowed():
    models = zoo(20, seed=1)
    first = partition(models, 4, time_limit_s=2, solver="cbc")
    drifted = [ModelDemand(d.name, d.rate * (4 if i % 5 == 0 else 1), d.weight_bytes) for i, d in enumerate(models)]
    again = partition(drifted, 4, previous=first.assignment, max_moves=2, time_limit_s=2, solver="cbc")
    moved = [n for n, j in again.assignment.items() if first.assignment[n] != j]
    assert again.moved == len(moved) <= 2
    held = partition(drifted, 4, previous=first.assignment, max_moves=0, time_limit_s=2, solver="cbc")
    assert held.assignment == first.assignment and held.moved == 0


def test_a_resplit_places_new_models_and_forgets_removed_ones():
    models = zoo(12, seed=2)
    first = partition(models, 3, time_limit_s=2, solver="cbc")
    now = [*models[1:], ModelDemand("new", 5.0, 50 * MB)]
    again = partition(now, 3, previous=first.assignment, max_moves=0, time_limit_s=2, solver="cbc")
    assert set(again.assignment) == {d.name for d in now}
    assert all(again.assignment[d.name] == first.assignment[d.name] for d in models[1:])


def test_each_subcluster_fits_a_gpu_with_its_largest_runtime_memory():
    models = [ModelDemand(f"m{i}", 1.0 + i, (40 + 10 * i) * MB, runtime_bytes=(30 if i == 0 else 5) * MB) for i in range(8)]
    capacity = 300 * MB
    plan = partition(models, 3, gpu_memory_bytes=capacity, time_limit_s=5, solver="cbc")
    by_name = {d.name: d for d in models}
    for names in plan.subclusters:
        used = sum(by_name[n].weight_bytes for n in names) + max(by_name[n].runtime_bytes for n in names)
        assert used <= capacity


def test_rate_bound_is_respected():
    models = zoo(12, seed=4)
    bound = 1.1 * sum(d.rate for d in models) / 3
    plan = partition(models, 3, max_rate=bound, time_limit_s=1, solver="cbc")
    rates, _ = totals(plan, models)
    assert max(rates) <= bound + 1e-6


@pytest.mark.parametrize(
    ("models", "n", "options", "message"),
    [
        ([], 2, {}, "no models"),
        (zoo(3), 4, {}, r"n_subclusters \(4\) is more than the models \(3\)"),
        (zoo(3), 0, {}, "n_subclusters must be an integer >= 1"),
        ([ModelDemand("a", 1, 0), ModelDemand("b", 1, MB)], 2, {}, "model 'a''s weight_bytes must be a positive integer"),
        ([ModelDemand("a", -1, MB), ModelDemand("b", 1, MB)], 2, {}, "model 'a''s rate must be a non-negative number"),
        ([ModelDemand("a", 0, MB), ModelDemand("b", 0, MB)], 2, {}, "every model's rate is 0"),
        ([ModelDemand("a", 1, MB), ModelDemand("a", 1, MB)], 2, {}, "model 'a' is listed twice"),
        (zoo(4), 2, {"previous": {"m0": 2}}, "previous puts model 'm0' in sub-cluster 2"),
        (zoo(4), 2, {"max_moves": 1}, "max_moves bounds the moves from a previous split"),
        (zoo(4), 2, {"previous": {"m0": 0}, "max_moves": -1}, "max_moves must be an integer >= 0"),
        (zoo(4), 2, {"solver": "gurobi"}, "unknown solver 'gurobi'"),
        (zoo(4), 2, {"neighbourhood": 1}, "neighbourhood must be an integer >= 2"),
        (zoo(4), 2, {"time_limit_s": 0}, "time_limit_s must be a positive number"),
        ([ModelDemand("big", 1, 90 * MB, 20 * MB), ModelDemand("b", 1, MB)], 2, {"gpu_memory_bytes": 100 * MB}, r"\['big'\] need more"),
        ([ModelDemand(f"m{i}", 1, 60 * MB) for i in range(4)], 2, {"gpu_memory_bytes": 100 * MB}, "use more sub-clusters"),
        ([ModelDemand("hot", 9, MB), ModelDemand("b", 1, MB)], 2, {"max_rate": 5}, r"\['hot'\] alone exceed max_rate 5"),
        ([ModelDemand(f"m{i}", 1, MB) for i in range(4)], 2, {"max_rate": 1.5}, "carry less than the models' 4 req/s"),
    ],
)
def test_bad_inputs_are_refused_by_name(models, n, options, message):
    with pytest.raises(PlanError, match=message):
        partition(models, n, **options)


def test_a_split_no_gpu_can_hold_is_refused():
    # the three 55 MB models fit two GPUs of 100 MB only if two share one: 110 MB
    models = [ModelDemand(f"m{i}", 1, 55 * MB) for i in range(3)]
    with pytest.raises(PlanError, match="no split of 3 models into 2 sub-clusters meets gpu_memory_bytes"):
        partition(models, 2, gpu_memory_bytes=100 * MB, time_limit_s=2, solver="cbc")
    with pytest.raises(PlanError, match="random search found no split"):
        random_partition(models, 2, gpu_memory_bytes=100 * MB, time_limit_s=0.2)


def test_a_resplit_fills_a_subcluster_the_previous_split_left_empty():
    models = zoo(9, seed=5)
    previous = {d.name: i % 2 for i, d in enumerate(models)}  # sub-cluster 2 holds nothing yet
    plan = partition(models, 3, previous=previous, time_limit_s=2, solver="cbc")
    assert all(plan.subclusters)
    assert plan.moved >= 1
