from __future__ import annotations

import itertools
import math
import random
import time

import pytest

from daskpipe.plan.allocations import Allocation, Valued, frontier, search_levels
from daskpipe.plan.milp import make_plan, new_model
from daskpipe.plan.options import PlannerOptions
from daskpipe.plan.schema import ModelPlan

from .helpers import synthetic_profile

GPUS = {"A": 4, "B": 3}


class Staircase:
    """A model whose value on an allocation is known exactly: ``value(a)``, with a linear (or,
    for a pipeline over both types, a min of linear) LP relaxation above it. Its greedy valuation
    falls short, so only exact solves show what an allocation reaches."""

    def __init__(self, name, value, relaxed):
        self.name, self.value, self.relax = name, value, relaxed
        self.exact_calls = 0
        self.solved: set[Allocation] = set()

    def plan(self, gpus: Allocation, share: float = 1.0) -> ModelPlan:
        return ModelPlan(self.name, 1e6, 1.0, share * self.value(gpus), ())

    def relaxed(self, gpus):
        return self.relax(gpus)

    def greedy(self, gpus):
        return Valued(0.8 * self.value(gpus), math.inf, self.plan(gpus, 0.8))

    def exact(self, gpus, seconds):
        self.exact_calls += 1
        self.solved.add(tuple(gpus))
        return Valued(self.value(gpus), self.value(gpus), self.plan(gpus))


def both(gpus):
    """12 req/s per (A, B) pair: a pipeline over both types; its LP relaxation's supergradient."""
    a, b = gpus
    return 12.0 * min(a, b), (12.0, 0.0) if a < b else (0.0, 12.0) if b < a else (6.0, 6.0)


ORACLES = {
    "pairs-of-a": Staircase("pairs-of-a", lambda g: 20.0 * (g[0] // 2) + 7.0 * g[1], lambda g: (10.0 * g[0] + 7.0 * g[1], (10.0, 7.0))),
    "pairs-of-b": Staircase("pairs-of-b", lambda g: 6.0 * g[0] + 30.0 * (g[1] // 2), lambda g: (6.0 * g[0] + 15.0 * g[1], (6.0, 15.0))),
    "both": Staircase("both", lambda g: 12.0 * min(g), both),
}


def brute_force_optimum(oracles, gpus):
    """The max-min over every split of the GPUs (whole GPUs per model and type)."""
    models = list(oracles)
    options = [list(itertools.product(*(range(n + 1) for n in gpus.values())))] * len(models)
    best = 0.0
    for split in itertools.product(*options):
        if all(sum(a[k] for a in split) <= n for k, n in enumerate(gpus.values())):
            best = max(best, min(oracles[m].value(a) for m, a in zip(models, split)))
    return best


def search(oracles, objective=0.0, bound=1000.0, seconds=30.0, disjunctive_first_s=0.25):
    starts = {m: [(1, 1), tuple(GPUS.values())] for m in oracles}
    return search_levels(
        oracles,
        GPUS,
        starts,
        {},
        objective=objective,
        bound=bound,
        tolerance=1e-3,
        deadline=time.perf_counter() + seconds,
        new_model=lambda: new_model("auto"),
        disjunctive_first_s=disjunctive_first_s,
    )


MASTERS = pytest.mark.parametrize("disjunctive_first_s", [0.25, 0.0], ids=["cuts-first", "least-allocations"])


@MASTERS
def test_the_search_closes_on_the_optimum_of_whole_gpus(disjunctive_first_s):
    optimum = brute_force_optimum(ORACLES, GPUS)
    found = search(ORACLES, disjunctive_first_s=disjunctive_first_s)
    assert found.models is not None
    assert found.objective == pytest.approx(optimum, rel=1e-3)
    assert found.bound >= optimum - 1e-6  # a proven bound never cuts off the optimum
    assert found.bound - found.objective <= 1e-3 * found.bound
    assert all(mp.throughput >= found.objective - 1e-9 for mp in found.models.values())
    assert sum(o.exact_calls for o in ORACLES.values()) > 0  # the greedy alone falls short


@MASTERS
def test_a_bound_below_the_linear_relaxation_is_proven(disjunctive_first_s):
    # the LP relaxations alone allow more than whole GPUs do: the search proves a bound under them
    optimum = brute_force_optimum(ORACLES, GPUS)
    found = search(ORACLES, objective=0.0, bound=100.0, disjunctive_first_s=disjunctive_first_s)
    assert optimum - 1e-6 <= found.bound < 100.0


def test_a_plan_in_hand_is_kept_when_nothing_beats_it():
    optimum = brute_force_optimum(ORACLES, GPUS)
    found = search(ORACLES, objective=optimum, bound=optimum * (1 + 1e-4))
    assert found.models is None and found.objective == optimum


def test_every_allocation_one_gpu_from_the_plan_in_hand_is_valued_exactly_and_the_search_keeps_the_better_plan():
    oracles = {m: Staircase(o.name, o.value, o.relax) for m, o in ORACLES.items()}
    held = {"pairs-of-a": (1, 1), "pairs-of-b": (1, 1), "both": (2, 1)}  # a GPU of A left over
    plans = {m: (a, oracles[m].plan(a)) for m, a in held.items()}
    objective = min(plan.throughput for _, plan in plans.values())
    found = search_levels(
        oracles,
        GPUS,
        {m: [(1, 1), tuple(GPUS.values())] for m in oracles},
        plans,
        objective=objective,
        bound=1000.0,
        tolerance=1e-3,
        deadline=time.perf_counter() + 30,
        new_model=lambda: new_model("auto"),
    )
    for m, a in held.items():
        one_away = {
            b
            for b in itertools.product(*(range(n + 1) for n in GPUS.values()))
            if sum(abs(x - y) for x, y in zip(a, b)) == 1 or (sum(b) == sum(a) and sum(abs(x - y) for x, y in zip(a, b)) == 2)
        }
        assert one_away <= oracles[m].solved, m
    assert found.models is not None and found.objective == pytest.approx(brute_force_optimum(ORACLES, GPUS), rel=1e-3)


@pytest.mark.parametrize("seed", range(20))
def test_the_least_allowed_allocations_are_the_minimal_ones_that_no_cut_or_box_rules_out(seed):
    rng = random.Random(seed)
    most = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
    floor = 10.0
    cuts = [(rng.uniform(-5, 12), tuple(rng.choice([0.0, rng.uniform(0.5, 6)]) for _ in most)) for _ in range(rng.randint(0, 3))]
    boxes = [tuple(rng.randint(0, n) for n in most) for _ in range(rng.randint(0, 3))]
    grid = list(itertools.product(*(range(n + 1) for n in most)))
    allowed = [
        a
        for a in grid
        if all(beta >= floor or beta + sum(p * x for p, x in zip(pi, a)) >= floor for beta, pi in cuts)
        and not any(all(x <= y for x, y in zip(a, box)) for box in boxes)
    ]
    minimal = {a for a in allowed if not any(b != a and all(y <= x for x, y in zip(a, b)) for b in allowed)}
    least = frontier(cuts, boxes, most, floor)
    assert least.shape[1] == len(most) and least.dtype.kind == "i"
    assert {tuple(int(x) for x in row) for row in least} == minimal and len(least) == len(minimal)


def test_six_models_on_six_gpus_get_the_optimum_of_whole_gpus():
    """Six models share 3 A + 3 B, about a GPU each: the LP bound (476) is far above the optimum,
    which the search over allocations must find and prove; the optimum is each model planned alone
    (to optimality) on every share of the GPUs, the best split found by a DP over the models."""
    rng = random.Random(1)
    profiles = {}
    for i in range(6):
        blocks = {}
        for gpu, speed in (("A", 1.0), ("B", 2.5)):
            whole = [rng.uniform(200, 1200) * speed for _ in range(3)]
            blocks[(gpu, 1)] = whole
            blocks[(gpu, 2)] = [x * rng.uniform(1.6, 1.95) for x in whole]
        profiles[f"m{i}"] = synthetic_profile(f"m{i}", blocks, max_batch=2)
    gpus = {"A": 3, "B": 3}
    options = PlannerOptions(solver="cbc", batch_build_estimate=False, time_limit=20)
    plan = make_plan(profiles, gpus, options=options)

    shares = list(itertools.product(range(gpus["A"] + 1), range(gpus["B"] + 1)))
    alone = {}
    for m, profile in profiles.items():
        for a in shares:
            share = {g: n for g, n in zip(gpus, a) if n}
            alone[(m, a)] = make_plan({m: profile}, share, options=options).objective if share else 0.0
    best: dict[Allocation, float] = {(0, 0): math.inf}  # GPUs used so far -> the best max-min of the models so far
    for m in profiles:
        following: dict[Allocation, float] = {}
        for used, level in best.items():
            for a in shares:
                total = (used[0] + a[0], used[1] + a[1])
                if total[0] <= gpus["A"] and total[1] <= gpus["B"]:
                    following[total] = max(following.get(total, 0.0), min(level, alone[(m, a)]))
        best = following
    optimum = max(best.values())

    assert plan.bound is not None and plan.bound >= optimum * (1 - 1e-6)
    assert optimum * (1 - options.gap) <= plan.objective <= optimum * (1 + 1e-6)
    assert plan.solver["status"] == "optimal"
    used = plan.gpus_used()
    assert all(used.get(g, 0) <= n for g, n in gpus.items())
