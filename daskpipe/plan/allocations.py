"""A search over levels and whole GPUs per model: is there a plan whose max-min reaches z?

The pool-sizing MILP couples the models only through the GPU count per type. A plan at level z
is therefore one integer allocation a_m (GPUs per type) per model with sum_m a_m <= N and
f_m(a_m) >= z, where f_m(a) is the most model m serves per unit of weight on a: its own small
MILP. This is logic-based Benders decomposition: a master MILP picks the allocations and knows
each f_m only through cuts, every one a proven upper bound on f_m:

- **LP cuts**: the value V(a) of the model's LP relaxation is concave in a, so for any a* it
  solved, f_m(a) <= V(a) <= V(a*) + pi . (a - a*), with pi the duals of its GPU rows.
- **Box cuts**: an exact solve that proves f_m(a*) < z rules out every a <= a* at level z.

A master without a solution proves that no plan reaches z: z is an upper bound on the optimum,
and one that counts whole GPUs per model and integer pools (the LP bound counts neither). A
master solution whose allocations are each shown to reach z (by the greedy valuation, else an
exact solve) is a plan. Where an exact solve runs out of time the allocation is set aside
without proof, so the search goes on but that level proves nothing.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from daskpipe.plan.exchange import Allocation
from daskpipe.plan.schema import ModelPlan


@dataclass(frozen=True)
class Valued:
    """What a model serves per unit of weight on an allocation: at least ``lower`` (with ``plan``,
    which fits in it), at most ``upper``."""

    lower: float
    upper: float
    plan: ModelPlan | None


class ModelOracle(Protocol):
    """One model's view of an allocation, in throughput / weight."""

    def relaxed(self, gpus: Allocation) -> tuple[float, tuple[float, ...]] | None:
        """The LP relaxation's value on ``gpus`` and the duals of its GPU rows (>= 0); ``None``
        if it was not solved to optimality."""

    def greedy(self, gpus: Allocation) -> Valued:
        """A quick plan on ``gpus`` (its upper bound may be infinite)."""

    def exact(self, gpus: Allocation, seconds: float) -> Valued:
        """The model's own MILP on ``gpus``, stopped after ``seconds``."""


@dataclass
class _Knowledge:
    """What the search has learnt about one model: LP cuts and valued allocations."""

    cuts: list[tuple[float, tuple[float, ...]]] = field(default_factory=list)  # (V(a*) - pi . a*, pi)
    valued: dict[Allocation, Valued] = field(default_factory=dict)
    unproven: set[Allocation] = field(default_factory=set)  # set aside without proof at the current level

    def reaches(self, gpus: Allocation, level: float) -> ModelPlan | None:
        """A plan known to reach ``level`` within ``gpus`` (f is monotone in the GPUs)."""
        for a, v in self.valued.items():
            if v.lower >= level and v.plan is not None and all(x <= y for x, y in zip(a, gpus)):
                return v.plan
        return None


CUT_SLACK = 1e-6
"""Relative slack on every cut: LP solvers' tolerances must not cut off a plan."""


@dataclass(frozen=True)
class LevelSearch:
    """The outcome of :func:`search_levels`: the best plan found (``None``: none better than the
    start), its level, and the lowest level proven out of reach."""

    models: dict[str, ModelPlan] | None
    objective: float
    bound: float


def search_levels(
    oracles: Mapping[str, ModelOracle],
    gpus: Mapping[str, int],
    starts: Mapping[str, Sequence[Allocation]],
    held: Mapping[str, tuple[Allocation, ModelPlan]],
    *,
    objective: float,
    bound: float,
    tolerance: float,
    deadline: float,
    new_model: Callable[[], Any],
    exact_seconds: float = 0.5,
    disjunctive_first_s: float = 0.25,
) -> LevelSearch:
    """Search levels between ``objective`` (a plan in hand) and ``bound`` (a proven bound) until
    they are within ``tolerance`` (relative) or ``deadline``.

    ``starts`` are allocations per model whose LP cuts seed the master (the LP's own, the
    inventory); the greedy valuation of every allocation within :data:`NEIGHBOURHOOD` GPUs per type
    of the first start seeds the plans, and so do ``held`` (each model's allocation and plan in
    the plan in hand), the allocations around them, and those one GPU away from them valued
    exactly (:func:`_value_moves`, in :data:`MOVES_SHARE` of the time). ``new_model()`` makes an empty python-mip
    model for the masters; each master works on the cuts for ``disjunctive_first_s`` and, if that
    settles nothing, picks among the models' least allowed allocations (0: at once, where they can
    be listed). The search alternates a step up from the best plan and a step down from
    the bound, each a quarter of the way between them: a level near the optimum is the hardest to
    settle.
    """
    most = list(gpus.values())
    knowledge = {m: _Knowledge() for m in oracles}
    centres = {m: [allocations[0]] for m, allocations in starts.items()}
    for m, allocations in starts.items():
        for a in allocations:
            _add_cut(knowledge[m], oracles[m], a)
    for m, (a, _) in held.items():
        centres.setdefault(m, []).append(a)
    for m, around in centres.items():
        for near in {n for centre in around for n in _neighbourhood(centre, most)}:
            valued = oracles[m].greedy(near)
            if valued.lower > 0:
                knowledge[m].valued[near] = valued
    for m, (a, plan) in held.items():  # the plan in hand is one choice of the column master
        known = knowledge[m].valued.get(a)
        if known is None or known.lower < plan.throughput / plan.weight:
            knowledge[m].valued[a] = Valued(plan.throughput / plan.weight, math.inf, plan)
    search = _Search(oracles, knowledge, gpus, new_model, exact_seconds, disjunctive_first_s)
    if held:
        until = time.perf_counter() + MOVES_SHARE * (deadline - time.perf_counter())
        _value_moves(oracles, knowledge, {m: a for m, (a, _) in held.items()}, most, until)
    best: dict[str, ModelPlan] | None = None
    ceiling = bound  # the lowest level a step up found no plan at, proven or not
    unsettled = objective  # the highest level a step down failed to prove out of reach
    up = False
    while bound - objective > tolerance * bound and time.perf_counter() < deadline:
        up = not up
        step = tolerance * bound / 2
        if up:
            level = objective + max((ceiling - objective) / 4, step)
            if level >= ceiling:
                continue  # no room below a level that failed: step down instead
        else:
            level = bound - max((bound - max(objective, unsettled)) / 4, step)
        until = time.perf_counter() + LEVEL_TIME_SHARE * (deadline - time.perf_counter())
        found, proven = search.at_level(level, until)
        if found is not None:
            best = found
            objective = min(mp.throughput / mp.weight for mp in found.values())  # at least the level
        elif proven:
            bound = ceiling = min(bound, level)
        elif up:
            ceiling = level
        else:
            unsettled = level
    return LevelSearch(best, objective, bound)


MOVES_SHARE = 0.3
"""Share of the search's time that :func:`_value_moves` may take before the first level."""

MOVE_EXACT_S = 0.1
"""Time limit of one exact solve of :func:`_value_moves` (most take 5-40 ms; a model whose MILP is
slow keeps its greedy value there)."""

NEIGHBOURHOOD = 2
"""GPUs per type around the LP's allocation of a model within which every allocation is valued by the greedy first."""

LEVEL_TIME_SHARE = 0.4
"""Share of the time left that one level may take before the search moves on without settling it."""


def _value_moves(
    oracles: Mapping[str, ModelOracle],
    knowledge: Mapping[str, _Knowledge],
    held: Mapping[str, Allocation],
    most: Sequence[int],
    until: float,
) -> None:
    """Value exactly, until ``until``, every allocation one GPU away from each model's ``held``
    one: a GPU more of a type, then a GPU fewer, then one of a type for one of another, each move
    for every model before the next. The column master then combines them: where the exchange's
    greedy undervalues, these are the plans one GPU from the plan in hand (20 models on 100 GPUs:
    206.9-209.3 without them, 209.9-211.9 with them, as many as are solved in time). Only the plans
    are kept, not the solves' upper bounds: as box cuts those slowed the masters until no level
    settled (10 models on 100 GPUs)."""
    types = range(len(most))
    more = [tuple(int(i == k) for i in types) for k in types]
    fewer = [tuple(-x for x in move) for move in more]
    trade = [tuple(int(i == k) - int(i == j) for i in types) for k in types for j in types if k != j]
    for move in more + fewer + trade:
        for m, a in held.items():
            if time.perf_counter() >= until:
                return
            moved = tuple(x + d for x, d in zip(a, move))
            known = knowledge[m].valued.get(moved)
            if any(not 0 <= x <= n for x, n in zip(moved, most)) or (known is not None and known.upper < math.inf):
                continue
            solved = oracles[m].exact(moved, min(MOVE_EXACT_S, until - time.perf_counter()))
            if solved.plan is not None and (known is None or solved.lower > known.lower):
                knowledge[m].valued[moved] = Valued(solved.lower, math.inf, solved.plan)


def _neighbourhood(centre: Allocation, most: Sequence[int]) -> list[Allocation]:
    ranges = [range(max(c - NEIGHBOURHOOD, 0), min(c + NEIGHBOURHOOD, n) + 1) for c, n in zip(centre, most)]
    return [a for a in itertools.product(*ranges) if any(a)]


def _add_cut(knowledge: _Knowledge, oracle: ModelOracle, gpus: Allocation) -> float:
    """The LP cut at ``gpus``, learnt; the LP's value there (infinite if it was not solved)."""
    relaxed = oracle.relaxed(gpus)
    if relaxed is None:
        return math.inf
    value, duals = relaxed
    knowledge.cuts.append((value - sum(p * x for p, x in zip(duals, gpus)), duals))
    return value


@dataclass
class _Search:
    """What every level of :func:`search_levels` works with."""

    oracles: Mapping[str, ModelOracle]
    knowledge: Mapping[str, _Knowledge]
    gpus: Mapping[str, int]
    new_model: Callable[[], Any]
    exact_seconds: float
    disjunctive_first_s: float

    @property
    def types(self) -> list[str]:
        return list(self.gpus)

    def at_level(self, level: float, deadline: float) -> tuple[dict[str, ModelPlan] | None, bool]:
        """(a plan at ``level``, or ``None``; whether no plan reaches it is proven)."""
        for k in self.knowledge.values():
            k.unproven.clear()
        while time.perf_counter() < deadline:
            picked = self.pick(level, deadline)
            if picked is not None:
                return picked, False
            proposal, settled = self.master(level, deadline)
            if proposal is None:
                return None, settled and not any(k.unproven for k in self.knowledge.values())
            plans: dict[str, ModelPlan] = {}
            undecided = []
            for m, a in proposal.items():  # the quick tests first: one model ruled out is enough to go on
                plan, ruled_out = _decide_quickly(level, self.oracles[m], self.knowledge[m], a)
                if plan is not None:
                    plans[m] = plan
                elif not ruled_out:
                    undecided.append(m)
            if len(plans) + len(undecided) < len(self.oracles):
                continue
            for m in undecided:
                plan, ruled_out = _decide_exactly(level, self.oracles[m], self.knowledge[m], proposal[m], deadline, self.exact_seconds)
                if ruled_out:
                    break
                if plan is not None:
                    plans[m] = plan
            if len(plans) == len(self.oracles):
                return plans, False
        return None, False

    def master(self, level: float, deadline: float) -> tuple[dict[str, Allocation] | None, bool]:
        """(allocations within ``gpus`` that no cut rules out at ``level``, or ``None``; whether that
        answer is settled: ``None`` and ``False`` is out of time). It hands out every GPU it can: an
        allocation then fails only where a generous one does, and its box cut rules out much.

        It works on the cuts themselves first (:meth:`_disjunctive_master`). Near the bound that
        formulation can run out of time unsettled; where each model's allowed allocations can be
        listed (:func:`frontier`), the master then picks one of each model's least ones, a
        formulation whose relaxation is each model's convex hull (on 20 models and 100 GPUs it
        proves the levels the other leaves unsettled)."""
        floor = level * (1 - CUT_SLACK)
        most = [self.gpus[g] for g in self.types]
        if math.prod(n + 1 for n in most[:-1]) > FRONTIER_GRID:
            return self._disjunctive_master(floor, level, deadline)
        if self.disjunctive_first_s > 0:
            proposal, settled = self._disjunctive_master(floor, level, min(deadline, time.perf_counter() + self.disjunctive_first_s))
            if settled:
                return proposal, settled
        frontiers = {}
        for m, known in self.knowledge.items():
            least = frontier(known.cuts, self._boxes(known, level), most, floor)
            if len(least) == 0:
                return None, True  # no allocation of this model reaches the level
            frontiers[m] = least
        if sum(map(len, frontiers.values())) > FRONTIER_COLUMNS:
            return self._disjunctive_master(floor, level, deadline)
        return self._pick_least(frontiers, deadline)

    def _boxes(self, known: _Knowledge, level: float) -> list[Allocation]:
        """The allocations ``known`` rules out at ``level``, with every one below them."""
        return [b for b, v in known.valued.items() if v.upper < level] + sorted(known.unproven)

    def _pick_least(self, frontiers: Mapping[str, np.ndarray], deadline: float) -> tuple[dict[str, Allocation] | None, bool]:
        """One of each model's least allowed allocations, within ``gpus``; the GPUs left over are
        handed out after (every cut holds on more GPUs)."""
        chosen, settled = self._one_each({m: [tuple(int(n) for n in a) for a in least] for m, least in frontiers.items()}, deadline)
        if chosen is None:
            return None, settled
        picked = {m: list(a) for m, a in chosen.items()}
        for k, g in enumerate(self.types):
            left = self.gpus[g] - sum(a[k] for a in picked.values())
            for i, a in enumerate(picked.values()):
                share = left // (len(picked) - i)
                a[k] += share
                left -= share
        return {m: tuple(a) for m, a in picked.items()}, True

    def _one_each(self, columns: Mapping[str, Sequence[Allocation]], deadline: float) -> tuple[dict[str, Allocation] | None, bool]:
        """One of each model's ``columns`` within ``gpus``, any that fits (proving the most GPUs
        handed out took 1 s a master where finding a choice takes 0.06 s), or ``None``; whether that
        answer is settled (``None`` and ``False``: out of time)."""
        import mip

        model = self.new_model()
        model.verbose = 0
        chosen = {m: [model.add_var(var_type=mip.BINARY) for _ in cs] for m, cs in columns.items()}
        for xs in chosen.values():
            model += mip.xsum(xs) == 1
        for k, g in enumerate(self.types):
            using = [(x, a[k]) for m, cs in columns.items() for x, a in zip(chosen[m], cs) if a[k]]
            if using:  # HiGHS refuses a row without variables
                model += mip.xsum(n * x for x, n in using) <= self.gpus[g]
        status = model.optimize(max_seconds=max(deadline - time.perf_counter(), 0.05))
        if status in (mip.OptimizationStatus.INFEASIBLE, mip.OptimizationStatus.INT_INFEASIBLE):
            return None, True
        if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
            return None, False
        return {m: next(a for x, a in zip(chosen[m], cs) if (x.x or 0) > 0.5) for m, cs in columns.items()}, True

    def _disjunctive_master(self, floor: float, level: float, deadline: float) -> tuple[dict[str, Allocation] | None, bool]:
        """:meth:`master` over the cuts themselves: each box cut a disjunction (one type above the box)."""
        import mip

        model = self.new_model()
        model.verbose = 0
        a = {m: [model.add_var(var_type=mip.INTEGER, lb=0, ub=self.gpus[g]) for g in self.types] for m in self.knowledge}
        for k, g in enumerate(self.types):
            model += mip.xsum(a[m][k] for m in self.knowledge) <= self.gpus[g]
        for m, known in self.knowledge.items():
            for beta, pi in known.cuts:
                if beta >= floor:
                    continue
                if not any(pi):
                    return None, True  # no allocation reaches the level
                model += mip.xsum(p * x for p, x in zip(pi, a[m]) if p) >= floor - beta  # HiGHS refuses a row without variables
            for box in self._boxes(known, level):
                above = [k for k, g in enumerate(self.types) if box[k] < self.gpus[g]]
                if not above:
                    return None, True
                raised = [model.add_var(var_type=mip.BINARY) for _ in above]
                model += mip.xsum(raised) >= 1
                for k, r in zip(above, raised):
                    model += a[m][k] >= (box[k] + 1) * r
        model.objective = mip.maximize(mip.xsum(x for xs in a.values() for x in xs))
        status = model.optimize(max_seconds=max(deadline - time.perf_counter(), 0.05))
        if status in (mip.OptimizationStatus.INFEASIBLE, mip.OptimizationStatus.INT_INFEASIBLE):
            return None, True
        if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
            return None, False
        return {m: tuple(round(x.x or 0) for x in xs) for m, xs in a.items()}, True

    def pick(self, level: float, deadline: float) -> dict[str, ModelPlan] | None:
        """A plan at ``level`` from allocations already valued: one per model, within ``gpus``."""
        columns = {}
        for m, known in self.knowledge.items():
            reaching = [a for a, v in known.valued.items() if v.lower >= level and v.plan is not None]
            if not reaching:
                return None
            columns[m] = _minimal(reaching)
        chosen, _ = self._one_each(columns, deadline)
        if chosen is None:
            return None
        picked = {}
        for m, a in chosen.items():
            plan = self.knowledge[m].valued[a].plan
            assert plan is not None
            picked[m] = plan
        return picked


FRONTIER_GRID = 20_000
"""The most allocations of all types but the last that :func:`frontier` lists a model's least
allowed allocations over (26 GPUs of each of four types); above it the master works on the cuts."""

FRONTIER_COLUMNS = 20_000
"""The most least allocations, all models together, that the master picks among."""


def frontier(cuts: Sequence[tuple[float, tuple[float, ...]]], boxes: Sequence[Allocation], most: Sequence[int], floor: float) -> np.ndarray:
    """A model's least allocations (no other allowed one below them) within ``most`` GPUs per type
    that satisfy its LP ``cuts`` at ``floor`` and lie in none of ``boxes``, one row each.

    Every constraint holds on more GPUs, so for each choice of the other types the last type's
    least count is one number, and an allocation is least exactly where one GPU fewer of any other
    type would need more of the last."""
    *others, last = most
    shape = tuple(n + 1 for n in others)
    grid = np.indices(shape).reshape(len(others), -1).T.astype(float) if others else np.zeros((1, 0))
    need = np.zeros(len(grid))
    for beta, pi in cuts:
        if beta >= floor:
            continue
        short = floor - beta - grid @ np.asarray(pi[:-1], dtype=float)
        if pi[-1] > 0:
            need = np.maximum(need, np.ceil(short / pi[-1] - 1e-9))
        else:
            need[short > 0] = np.inf
    for box in boxes:
        inside = np.all(grid <= np.asarray(box[:-1]), axis=1)
        need[inside] = np.maximum(need[inside], box[-1] + 1)
    table = need.reshape(shape)
    least = table <= last
    for k in range(len(others)):
        fewer = np.full(shape, np.inf)  # the last type's need with one GPU fewer of type k (none fewer than 0)
        before = (slice(None),) * k
        fewer[before + (slice(1, None),)] = table[before + (slice(None, -1),)]
        least &= fewer > table
    return np.column_stack([np.argwhere(least), table[least]]).astype(int)


def _decide_quickly(level: float, oracle: ModelOracle, knowledge: _Knowledge, gpus: Allocation) -> tuple[ModelPlan | None, bool]:
    """(a plan known, or found by the greedy, that reaches ``level`` on ``gpus``; whether a new LP
    cut rules ``gpus`` out)."""
    plan = knowledge.reaches(gpus, level)
    if plan is not None:
        return plan, False
    quick = oracle.greedy(gpus)
    if quick.lower >= level:
        knowledge.valued[gpus] = quick
        return quick.plan, False
    return None, _add_cut(knowledge, oracle, gpus) < level * (1 - CUT_SLACK)


def _decide_exactly(
    level: float, oracle: ModelOracle, knowledge: _Knowledge, gpus: Allocation, deadline: float, exact_seconds: float
) -> tuple[ModelPlan | None, bool]:
    """(a plan that reaches ``level`` on ``gpus`` by an exact solve; whether the solve proved that
    none does). Neither: the allocation is set aside without proof."""
    seconds = min(exact_seconds, deadline - time.perf_counter())
    if seconds <= 0:
        knowledge.unproven.add(gpus)
        return None, False
    solved = oracle.exact(gpus, seconds)
    known = knowledge.valued.get(gpus)
    if known is not None and known.lower > solved.lower:  # keep the better plan, and the tighter bound
        solved = Valued(known.lower, min(known.upper, solved.upper), known.plan)
    knowledge.valued[gpus] = solved
    if solved.lower >= level and solved.plan is not None:
        return solved.plan, False
    if solved.upper < level:
        return None, True
    knowledge.unproven.add(gpus)
    return None, False


def _minimal(allocations: Sequence[Allocation]) -> list[Allocation]:
    """The allocations that hold no other one of ``allocations`` (each listed once)."""
    points = np.array(sorted(set(allocations)))
    below = np.all(points[None, :, :] <= points[:, None, :], axis=2)  # below[i, j]: j fits in i
    np.fill_diagonal(below, False)
    return [tuple(int(x) for x in p) for p, held in zip(points, below.any(axis=1)) if not held]
