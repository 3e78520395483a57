"""Symphony's sub-cluster partitioning (§4.4, Appendix A): which models each group of GPUs holds.

Every GPU of a sub-cluster pre-loads all of that sub-cluster's models, so one dispatcher can send
any of its models' batches to any of its GPUs; sub-clusters never share models or GPUs. The split
balances the models' weights (each GPU of a sub-cluster holds them all) and their request rates
(each sub-cluster's dispatcher and GPUs carry them) across sub-clusters. Re-run every epoch as
rates shift, it moves few models: a model that moves is unloaded from one sub-cluster's GPUs and
loaded on another's, and serves nowhere meanwhile.

Appendix A's MILP, over x_ij (model i in sub-cluster j), with rates r_i, weights s_i, runtime memory
d_i and means R = sum r / l, S = sum s / l::

    minimize   dR / R + w dS / S + q (mean deviation) + p (models moved) / m                (3)
    subject to sum_j x_ij = 1                        every model in one sub-cluster        (8)
               |sum_i r_i x_ij - R| <= dR            rates near the mean                   (6)
               |sum_i s_i x_ij - S| <= dS            weights near the mean                 (7)
               sum_i s_i x_ij + D_j <= S_max,  D_j >= d_i x_ij   fits a GPU (optional)    (5)
               sum_i r_i x_ij <= R_max               a dispatcher's rate (optional)        (4)
               sum_i (1 - x_{i,j'(i)}) <= C_max      models moved since the last epoch     (10)

Where it departs from the paper, and why:

* the deviations are relative to the means: the paper's dR + w dS adds req/s to bytes, so its w
  carries the units; here w = 1 weighs a point of rate imbalance like a point of memory imbalance;
* the disruption bound (10) counts moved models (c_ij = 1/2: a move is one unload and one load);
  a small penalty p per move keeps models in place when moving them buys no balance, and a small
  weight q on the sub-clusters' mean deviation rewards balancing those that are not the worst;
* it is not solved whole. CBC does not improve a 16 000-binary instance (800 x 20) on its greedy
  start in 10 s on two cores, nor prove a 24 x 4 one optimal in a second, but it solves the same
  MILP over two sub-clusters (their models; the others held, their deviations the floor of dR
  and dS, so the pair's objective is the whole split's) in a fraction of one. ``partition``
  starts from a greedy split (or the previous one), makes the single model moves that lower the
  objective most while any does (numpy, milliseconds each), then re-splits pairs, the most
  unbalanced first, until the time is up or none improves: a large-neighbourhood search whose
  steps are Appendix A's MILP. x_ij = 0 for j > i breaks the symmetry of a split solved whole.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from daskpipe.plan.milp import SOLVING_SHARE, new_model
from daskpipe.plan.options import SOLVERS
from daskpipe.plan.schema import PlanError

NEIGHBOURHOOD = 2
"""Sub-clusters re-split together by one MILP of ``_Problem.improve``: a pair (at 800 models over
20, 80 models and 160 binaries, which CBC solves in a fraction of a second) re-balanced a drifted
split better in 10 s than 3 or 4 at a time, and far better than one MILP over all 16 000
binaries, which stalls at its warm start (docs/benchmarks.md#sub-cluster-partitioning-daskpipe-bench-subclusters)."""

SUBSOLVE_S = 1.0
"""Most seconds one neighbourhood's MILP may take."""

SPREAD_WEIGHT = 0.1
"""Objective weight of the sub-clusters' mean deviation beside the worst one, so that a MILP over
a pair that holds no worst sub-cluster still gains from balancing it. Five alternating re-splits
against 0 gave no difference beyond their spread (docs/benchmarks.md), so it stays for that."""

MOVE_PENALTY = 0.01
"""Objective cost of moving every model (a tenth of it per 10% moved): far below a point of
imbalance, so balance comes first and, among splits about as balanced, the one that moves fewest."""


@dataclass(frozen=True)
class ModelDemand:
    """What a model asks of the sub-cluster it is in: ``rate`` (req/s, or any load measure
    summed across models), ``weight_bytes`` (loaded on every GPU of it) and ``runtime_bytes``
    (activations at its largest batch: one model at a time runs on a GPU, so a sub-cluster needs
    only its models' largest)."""

    name: str
    rate: float
    weight_bytes: int
    runtime_bytes: int = 0


@dataclass(frozen=True)
class SubclusterPlan:
    """Models per sub-cluster, and how balanced the split is.

    The imbalance factors are Symphony's Fig. 16: (max - min) / mean of the sub-clusters' total
    rates and weights. ``objective`` is Appendix A's balance term, dR / R + w dS / S (the largest
    deviations from the means). ``moved`` counts models whose sub-cluster changed from ``previous``.
    ``status`` is the solver's (``optimal``, ``feasible``) or ``random`` for the random search,
    which also says how many random splits it ``tried``.
    """

    subclusters: tuple[tuple[str, ...], ...]
    rate_imbalance: float
    memory_imbalance: float
    moved: int
    objective: float
    status: str
    solver: str
    seconds: float
    tried: int | None = None

    @property
    def assignment(self) -> dict[str, int]:
        """Each model's sub-cluster index."""
        return {name: j for j, names in enumerate(self.subclusters) for name in names}


def imbalance(totals: Sequence[float]) -> float:
    """(max - min) / mean of per-sub-cluster totals; 0 when they are all zero."""
    mean = sum(totals) / len(totals)
    return (max(totals) - min(totals)) / mean if mean > 0 else 0.0


def partition(
    models: Sequence[ModelDemand],
    n_subclusters: int,
    *,
    previous: Mapping[str, int] | None = None,
    max_moves: int | None = None,
    gpu_memory_bytes: int | None = None,
    max_rate: float | None = None,
    memory_weight: float = 1.0,
    time_limit_s: float = 10.0,
    solver: str = "auto",
    neighbourhood: int = NEIGHBOURHOOD,
) -> SubclusterPlan:
    """Split ``models`` into ``n_subclusters`` with Appendix A's MILP within ``time_limit_s`` (the
    whole call: building the model, the warm start and the solve).

    ``previous`` maps model names to their sub-cluster in the last epoch (models new since then
    have none; names it has that ``models`` lacks were removed and are ignored); ``max_moves`` then
    bounds how many of them may change sub-cluster. ``gpu_memory_bytes`` is what one GPU can give
    the models (after the CUDA context): a sub-cluster's weights plus its largest runtime memory
    must fit it. ``max_rate`` bounds a sub-cluster's total rate (a dispatcher's capacity).
    ``neighbourhood`` is how many sub-clusters one MILP re-splits at a time; at ``n_subclusters``
    or more, a single MILP takes them all (the paper's way: CBC does not prove even 24 x 4 optimal
    in a second, and at 800 x 20 it stalls near its warm start).

    Raises ``ValueError`` (:class:`PlanError`) naming a bad input, a model or a split that cannot
    fit, or a time limit too short for the solver to return any split.
    """
    started = time.perf_counter()
    _check(models, n_subclusters, previous=previous, max_moves=max_moves, gpu_memory_bytes=gpu_memory_bytes, max_rate=max_rate)
    _check_number(memory_weight, "memory_weight", allow_zero=True)
    _check_number(time_limit_s, "time_limit_s")
    if solver not in SOLVERS:
        raise PlanError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    if isinstance(neighbourhood, bool) or not isinstance(neighbourhood, int) or neighbourhood < 2:
        raise PlanError(f"neighbourhood must be an integer >= 2 (sub-clusters re-split together), got {neighbourhood!r}")
    problem = _Problem(models, n_subclusters, previous, max_moves, gpu_memory_bytes, max_rate, memory_weight, solver)
    current = problem.start()
    deadline = started + SOLVING_SHARE * time_limit_s
    status = "feasible"
    if n_subclusters <= neighbourhood or not problem.feasible(current):
        # a start that breaks a constraint is repaired by the whole MILP; its first split will do when pairs follow
        current, status = problem.solve(range(n_subclusters), current, deadline, first_found=n_subclusters > neighbourhood)
    if n_subclusters > neighbourhood:
        current = problem.improve(problem.shift(current, deadline), deadline, neighbourhood)
    return _plan(models, current, n_subclusters, previous, status, problem.solver_name, time.perf_counter() - started, memory_weight)


def random_partition(
    models: Sequence[ModelDemand],
    n_subclusters: int,
    *,
    time_limit_s: float = 10.0,
    gpu_memory_bytes: int | None = None,
    max_rate: float | None = None,
    memory_weight: float = 1.0,
    seed: int = 0,
) -> SubclusterPlan:
    """Appendix A.2's baseline: uniformly random splits for ``time_limit_s``, each checked against
    the constraints and scored with the MILP's objective; the best one found."""
    started = time.perf_counter()
    _check(models, n_subclusters, gpu_memory_bytes=gpu_memory_bytes, max_rate=max_rate)
    _check_number(time_limit_s, "time_limit_s")
    rates, weights = (np.asarray(shares) for shares in _shares(models, n_subclusters))
    rate_bound = max_rate * n_subclusters / sum(d.rate for d in models) if max_rate is not None else math.inf
    weight_bytes = np.array([d.weight_bytes for d in models], dtype=float)
    runtime_bytes = np.array([d.runtime_bytes for d in models], dtype=float)
    generator = np.random.default_rng(seed)
    m, n = len(models), n_subclusters
    batch = max(1, 200_000 // m)  # splits scored per numpy round
    offsets = np.arange(batch)[:, None] * n
    best, best_score, tried = [0] * m, math.inf, 0
    while tried == 0 or time.perf_counter() - started < time_limit_s:
        splits = generator.integers(0, n, size=(batch, m))
        flat = (splits + offsets).ravel()

        def per_subcluster(values: np.ndarray) -> np.ndarray:
            return np.bincount(flat, np.tile(values, batch), batch * n).reshape(batch, n)

        rate_totals, memory_totals = per_subcluster(rates), per_subcluster(weights)
        scores = np.abs(rate_totals - 1).max(axis=1) + memory_weight * np.abs(memory_totals - 1).max(axis=1)
        scores[rate_totals.max(axis=1) > rate_bound * (1 + 1e-9)] = math.inf
        scores[(np.bincount(flat, minlength=batch * n).reshape(batch, n) == 0).any(axis=1)] = math.inf
        if gpu_memory_bytes is not None:
            largest = np.zeros(batch * n)
            np.maximum.at(largest, flat, np.tile(runtime_bytes, batch))
            scores[(per_subcluster(weight_bytes) + largest.reshape(batch, n)).max(axis=1) > gpu_memory_bytes] = math.inf
        tried += batch
        k = int(np.argmin(scores))
        if scores[k] < best_score:
            best, best_score = splits[k].tolist(), float(scores[k])
    if not math.isfinite(best_score):
        raise PlanError(f"the random search found no split of {m} models into {n} sub-clusters within the constraints in {tried} tries")
    return _plan(models, best, n, None, "random", "random search", time.perf_counter() - started, memory_weight, tried)


def _check(
    models: Sequence[ModelDemand],
    n_subclusters: int,
    *,
    previous: Mapping[str, int] | None = None,
    max_moves: int | None = None,
    gpu_memory_bytes: int | None = None,
    max_rate: float | None = None,
) -> None:
    """A :class:`PlanError` naming the first bad input."""
    if not models:
        raise PlanError("no models to partition")
    if isinstance(n_subclusters, bool) or not isinstance(n_subclusters, int) or n_subclusters < 1:
        raise PlanError(f"n_subclusters must be an integer >= 1, got {n_subclusters!r}")
    if n_subclusters > len(models):
        raise PlanError(f"n_subclusters ({n_subclusters}) is more than the models ({len(models)}): a sub-cluster would hold none")
    seen: set[str] = set()
    for d in models:
        if not isinstance(d, ModelDemand):
            raise PlanError(f"models must be ModelDemand, got {type(d).__name__}")
        if d.name in seen:
            raise PlanError(f"model {d.name!r} is listed twice")
        seen.add(d.name)
        _check_number(d.rate, f"model {d.name!r}'s rate", allow_zero=True)
        _check_bytes(d.weight_bytes, f"model {d.name!r}'s weight_bytes")
        _check_bytes(d.runtime_bytes, f"model {d.name!r}'s runtime_bytes", allow_zero=True)
    if sum(d.rate for d in models) <= 0:
        raise PlanError("every model's rate is 0: there is no load to balance")
    if previous is not None:
        for name, j in previous.items():
            if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < n_subclusters:
                raise PlanError(f"previous puts model {name!r} in sub-cluster {j!r}; sub-clusters are 0..{n_subclusters - 1}")
    if max_moves is not None:
        if previous is None:
            raise PlanError("max_moves bounds the moves from a previous split: pass previous too")
        if isinstance(max_moves, bool) or not isinstance(max_moves, int) or max_moves < 0:
            raise PlanError(f"max_moves must be an integer >= 0, got {max_moves!r}")
    if max_rate is not None:
        _check_number(max_rate, "max_rate")
        too_busy = [d.name for d in models if d.rate > max_rate]
        if too_busy:
            raise PlanError(f"model(s) {too_busy} alone exceed max_rate {max_rate}")
        total = sum(d.rate for d in models)
        if max_rate * n_subclusters < total:
            raise PlanError(
                f"{n_subclusters} sub-clusters at max_rate {max_rate} carry less than the models' {total:g} req/s: use more sub-clusters"
            )
    if gpu_memory_bytes is not None:
        _check_bytes(gpu_memory_bytes, "gpu_memory_bytes")
        too_big = [d.name for d in models if d.weight_bytes + d.runtime_bytes > gpu_memory_bytes]
        if too_big:
            raise PlanError(
                f"model(s) {too_big} need more than a GPU's {gpu_memory_bytes} bytes on their own (weights plus runtime memory)"
            )
        per_subcluster = sum(d.weight_bytes for d in models) / n_subclusters
        if per_subcluster > gpu_memory_bytes:
            raise PlanError(
                f"{len(models)} models' weights over {n_subclusters} sub-clusters are {per_subcluster:.0f} bytes each at best, "
                f"more than a GPU's {gpu_memory_bytes}: use more sub-clusters"
            )


def _check_number(x: object, what: str, *, allow_zero: bool = False) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        raise PlanError(f"{what} must be a {'non-negative' if allow_zero else 'positive'} number, got {x!r}")


def _check_bytes(x: object, what: str, *, allow_zero: bool = False) -> None:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0 or (x == 0 and not allow_zero):
        raise PlanError(f"{what} must be a {'non-negative' if allow_zero else 'positive'} integer (bytes), got {x!r}")


def _shares(models: Sequence[ModelDemand], n_subclusters: int) -> tuple[list[float], list[float]]:
    """Each model's rate and weight as a share of a sub-cluster's mean (the means become 1)."""
    rate_mean = sum(d.rate for d in models) / n_subclusters
    weight_mean = sum(d.weight_bytes for d in models) / n_subclusters
    return [d.rate / rate_mean for d in models], [d.weight_bytes / weight_mean for d in models]


def _greedy(rates: Sequence[float], weights: Sequence[float], n_subclusters: int, *, fixed: Mapping[int, int]) -> list[int]:
    """The MILP's warm start: ``fixed`` models where they are, then the others, largest first,
    each into the sub-cluster it leaves least loaded in its worse dimension."""
    chosen = [-1] * len(rates)
    rate_totals, weight_totals = [0.0] * n_subclusters, [0.0] * n_subclusters
    for i, j in fixed.items():
        chosen[i] = j
        rate_totals[j] += rates[i]
        weight_totals[j] += weights[i]
    for i in sorted((i for i in range(len(rates)) if i not in fixed), key=lambda i: -max(rates[i], weights[i])):
        j = min(
            range(n_subclusters),
            key=lambda j: (max(rate_totals[j] + rates[i], weight_totals[j] + weights[i]), rate_totals[j] + weight_totals[j]),
        )
        chosen[i] = j
        rate_totals[j] += rates[i]
        weight_totals[j] += weights[i]
    return chosen


def _first_seen_order(chosen: Sequence[int]) -> list[int]:
    """``chosen`` with sub-clusters renumbered in the order models first use them, so that model i
    is in sub-cluster <= i (the MILP's symmetry breaking)."""
    labels: dict[int, int] = {}
    return [labels.setdefault(j, len(labels)) for j in chosen]


def _plan(
    models: Sequence[ModelDemand],
    chosen: Sequence[int],
    n_subclusters: int,
    previous: Mapping[str, int] | None,
    status: str,
    solver: str,
    seconds: float,
    memory_weight: float,
    tried: int | None = None,
) -> SubclusterPlan:
    rate_totals, weight_totals = [0.0] * n_subclusters, [0.0] * n_subclusters
    names: list[list[str]] = [[] for _ in range(n_subclusters)]
    for d, j in zip(models, chosen):
        rate_totals[j] += d.rate
        weight_totals[j] += d.weight_bytes
        names[j].append(d.name)
    if not all(names):
        raise PlanError(f"the split leaves sub-cluster(s) {[j for j, n in enumerate(names) if not n]} without models")
    moved = sum(1 for d, j in zip(models, chosen) if previous and d.name in previous and previous[d.name] != j)
    rate_mean, weight_mean = sum(rate_totals) / n_subclusters, sum(weight_totals) / n_subclusters
    objective = max(abs(t / rate_mean - 1) for t in rate_totals) + memory_weight * max(abs(t / weight_mean - 1) for t in weight_totals)
    return SubclusterPlan(
        tuple(tuple(n) for n in names),
        imbalance(rate_totals),
        imbalance(weight_totals),
        moved,
        objective,
        status,
        solver,
        seconds,
        tried,
    )


def _infeasible(n_models: int, n_subclusters: int, limits: Mapping[str, float | None]) -> str:
    given = ", ".join(f"{what} {value}" for what, value in limits.items() if value is not None)
    return f"no split of {n_models} models into {n_subclusters} sub-clusters meets {given or 'the constraints'}"


class _Problem:
    """Appendix A's MILP over one instance, solved whole (:meth:`solve` over every sub-cluster)
    or a few sub-clusters at a time (:meth:`improve`; the module docstring says why)."""

    def __init__(
        self,
        models: Sequence[ModelDemand],
        n_subclusters: int,
        previous: Mapping[str, int] | None,
        max_moves: int | None,
        gpu_memory_bytes: int | None,
        max_rate: float | None,
        memory_weight: float,
        solver: str,
    ):
        self.models, self.n = models, n_subclusters
        self.rates, self.weights = _shares(models, n_subclusters)
        self.kept = {i: previous[d.name] for i, d in enumerate(models) if d.name in previous} if previous else {}
        self.max_moves, self.gpu_memory_bytes, self.memory_weight, self.solver = max_moves, gpu_memory_bytes, memory_weight, solver
        self.rate_bound = max_rate * n_subclusters / sum(d.rate for d in models) if max_rate is not None else None
        self.solver_name = "HiGHS" if new_model(solver).solver_name.lower() == "highs" else "CBC"
        self.generator = random.Random(0)
        self.limits = {"gpu_memory_bytes": gpu_memory_bytes, "max_rate": max_rate, "max_moves": max_moves}

    def start(self) -> list[int]:
        """The previous split with new models placed greedily, or (a first split) the greedy one
        with sub-clusters numbered as the symmetry breaking wants."""
        chosen = _greedy(self.rates, self.weights, self.n, fixed=self.kept)
        return chosen if self.kept else _first_seen_order(chosen)

    def totals(self, chosen: Sequence[int]) -> tuple[list[float], list[float]]:
        rate_totals, weight_totals = [0.0] * self.n, [0.0] * self.n
        for i, j in enumerate(chosen):
            rate_totals[j] += self.rates[i]
            weight_totals[j] += self.weights[i]
        return rate_totals, weight_totals

    def score(self, chosen: Sequence[int]) -> float:
        rate_totals, weight_totals = self.totals(chosen)
        moves = sum(1 for i, j in self.kept.items() if chosen[i] != j)
        rate_devs, weight_devs = [abs(t - 1) for t in rate_totals], [abs(t - 1) for t in weight_totals]
        spread = (sum(rate_devs) + self.memory_weight * sum(weight_devs)) / self.n
        return max(rate_devs) + self.memory_weight * max(weight_devs) + SPREAD_WEIGHT * spread + MOVE_PENALTY / len(chosen) * moves

    def feasible(self, chosen: Sequence[int]) -> bool:
        """Whether ``chosen`` meets every constraint (a previous split may leave a sub-cluster empty)."""
        if len(set(chosen)) < self.n:
            return False
        rate_totals, _ = self.totals(chosen)
        if self.rate_bound is not None and max(rate_totals) > self.rate_bound * (1 + 1e-9):
            return False
        if self.max_moves is not None and sum(1 for i, j in self.kept.items() if chosen[i] != j) > self.max_moves:
            return False
        if self.gpu_memory_bytes is not None:
            used, largest = [0] * self.n, [0] * self.n
            for d, j in zip(self.models, chosen):
                used[j] += d.weight_bytes
                largest[j] = max(largest[j], d.runtime_bytes)
            return all(u + r <= self.gpu_memory_bytes for u, r in zip(used, largest))
        return True

    def shift(self, chosen: list[int], deadline: float) -> list[int]:
        """``chosen`` improved one model move (or, once no move helps, one :meth:`swap`) at a time,
        the one that lowers the objective most first, within the constraints: milliseconds each
        where a pair's MILP takes a tenth of a second, so a drifted split gets most of its moves
        before the MILPs refine them."""
        m, n = len(chosen), self.n
        rates, weights = np.asarray(self.rates), np.asarray(self.weights)
        home = np.full(m, -1)
        for i, j in self.kept.items():
            home[i] = j
        rows, bins = np.arange(m), np.arange(n)
        best = self.score(chosen)
        while deadline - time.perf_counter() > 0.05:
            here = np.asarray(chosen)
            moves = int(np.sum((home >= 0) & (home != here)))
            deviations = []
            for shares, total in zip((rates, weights), self.totals(chosen)):
                after = np.broadcast_to(np.asarray(total), (m, n, n)).copy()  # [model, destination, sub-cluster]
                after[rows, :, here] -= shares[:, None]
                after[rows[:, None], bins[None, :], bins[None, :]] += shares[:, None]
                deviations.append(np.abs(after - 1))
            rate_dev, weight_dev = deviations
            # moves each (model, destination) adds: leaving its previous sub-cluster, or returning to it
            change = ((home == here)[:, None] & (home[:, None] != bins[None, :])).astype(int) - (home[:, None] == bins[None, :])
            scores = (
                rate_dev.max(axis=2)
                + self.memory_weight * weight_dev.max(axis=2)
                + SPREAD_WEIGHT * (rate_dev.sum(axis=2) + self.memory_weight * weight_dev.sum(axis=2)) / n
                + MOVE_PENALTY / m * (moves + change)
            )
            scores[rows, here] = np.inf
            if self.max_moves is not None:
                scores[moves + change > self.max_moves] = np.inf
            counts = np.bincount(here, minlength=n)
            scores[counts[here] == 1, :] = np.inf  # a sub-cluster keeps at least one model
            improved = False
            for _ in range(n):
                i, j = (int(k) for k in np.unravel_index(int(np.argmin(scores)), scores.shape))
                if scores[i, j] >= best - 1e-9:
                    break
                candidate = list(chosen)
                candidate[i] = j
                if self.feasible(candidate):
                    chosen, best, improved = candidate, float(scores[i, j]), True
                    break
                scores[i, j] = np.inf
            if not improved:
                swapped = self.swap(chosen, best, home)
                if swapped is None:
                    return chosen
                chosen, best = swapped
        return chosen

    def swap(self, chosen: list[int], best: float, home: np.ndarray) -> tuple[list[int], float] | None:
        """The best exchange of two models between the most and the least loaded sub-cluster of
        either dimension, if it lowers the objective below ``best``: where no single move helps
        because it would unbalance the other dimension, an exchange of models of like weight
        and unlike rate (or the reverse) still does."""
        here = np.asarray(chosen)
        totals = np.array(self.totals(chosen))  # [dimension, sub-cluster]
        shares = np.array([self.rates, self.weights])  # [dimension, model]
        moved = (home >= 0) & (home != here)
        found: tuple[list[int], float] | None = None
        for high, low in {(int(np.argmax(t)), int(np.argmin(t))) for t in totals}:
            givers, takers = (a.ravel() for a in np.meshgrid(np.flatnonzero(here == high), np.flatnonzero(here == low), indexing="ij"))
            carried = shares[:, givers] - shares[:, takers]  # [dimension, candidate]: what goes from high to low
            after = np.repeat(totals[:, None, :], len(givers), axis=1)
            after[:, :, high] -= carried
            after[:, :, low] += carried
            deviation = np.abs(after - 1)
            change = sum(((home[who] >= 0) & (home[who] != to)).astype(int) - moved[who] for who, to in ((givers, low), (takers, high)))
            scores = (
                deviation[0].max(axis=1)
                + self.memory_weight * deviation[1].max(axis=1)
                + SPREAD_WEIGHT * (deviation[0].sum(axis=1) + self.memory_weight * deviation[1].sum(axis=1)) / self.n
                + MOVE_PENALTY / len(chosen) * (moved.sum() + change)
            )
            if self.max_moves is not None:
                scores[moved.sum() + change > self.max_moves] = np.inf
            for c in np.argsort(scores)[: self.n]:
                if scores[c] >= (found[1] if found else best) - 1e-9:
                    break
                candidate = list(chosen)
                candidate[givers[c]], candidate[takers[c]] = low, high
                if self.feasible(candidate):
                    found = (candidate, float(scores[c]))
                    break
        return found

    def improve(self, chosen: list[int], deadline: float, size: int) -> list[int]:
        """Re-split neighbourhoods of the worst sub-clusters (plus random ones once those stall)
        while time is left and one of the last ``n`` neighbourhoods improved the split."""
        best = self.score(chosen)
        stalled = 0
        while stalled < self.n and deadline - time.perf_counter() > 0.05:
            rate_totals, weight_totals = self.totals(chosen)
            extremes = list(
                dict.fromkeys(pick(range(self.n), key=t.__getitem__) for t in (rate_totals, weight_totals) for pick in (max, min))
            )
            bins = extremes[:size] if stalled == 0 else [extremes[stalled % len(extremes)]]
            others = [j for j in range(self.n) if j not in bins]
            bins += self.generator.sample(others, size - len(bins)) if len(bins) < size else []
            candidate, _ = self.solve(bins, chosen, min(deadline, time.perf_counter() + SUBSOLVE_S))
            score = self.score(candidate)
            if score < best - 1e-9:
                chosen, best, stalled = candidate, score, 0
            else:
                stalled += 1
        return chosen

    def solve(self, bins: Sequence[int], chosen: Sequence[int], deadline: float, *, first_found: bool = False) -> tuple[list[int], str]:
        """The MILP over the models in ``bins`` (every other model held where ``chosen`` has it),
        from ``chosen``; the split and the solver's status. ``first_found`` stops at the first split
        that meets the constraints."""
        import mip

        bins = list(bins)
        whole = len(bins) == self.n
        free = list(range(len(chosen))) if whole else [i for i, j in enumerate(chosen) if j in bins]
        rate_totals, weight_totals = self.totals(chosen)
        held_rate = [abs(rate_totals[j] - 1) for j in range(self.n) if j not in bins]
        held_weight = [abs(weight_totals[j] - 1) for j in range(self.n) if j not in bins]

        milp = new_model(self.solver, sense=mip.MINIMIZE)
        milp.verbose = 0
        symmetric = whole and not self.kept
        x = {(i, j): milp.add_var(var_type=mip.BINARY, ub=0 if symmetric and j > i else 1) for i in free for j in bins}
        rate_dev = milp.add_var(lb=max(held_rate, default=0.0))
        memory_dev = milp.add_var(lb=max(held_weight, default=0.0))
        for i in free:
            milp += mip.xsum(x[i, j] for j in bins) == 1
        spread = []
        for j in bins:
            milp += mip.xsum(x[i, j] for i in free) >= 1  # a sub-cluster with no models leaves its GPUs idle
            rate_total = mip.xsum(self.rates[i] * x[i, j] for i in free)
            memory_total = mip.xsum(self.weights[i] * x[i, j] for i in free)
            rate_off, memory_off = milp.add_var(lb=0), milp.add_var(lb=0)
            for total, off, worst in ((rate_total, rate_off, rate_dev), (memory_total, memory_off, memory_dev)):
                milp += total - 1 <= off
                milp += 1 - total <= off
                milp += off <= worst
            spread += [rate_off, self.memory_weight * memory_off]
            if self.rate_bound is not None:
                milp += rate_total <= self.rate_bound
            if self.gpu_memory_bytes is not None:
                largest_runtime = milp.add_var(lb=0)
                for i in free:
                    if self.models[i].runtime_bytes:
                        milp += largest_runtime >= self.models[i].runtime_bytes * x[i, j]
                milp += mip.xsum(self.models[i].weight_bytes * x[i, j] for i in free) + largest_runtime <= self.gpu_memory_bytes
        free_set = set(free)
        movable = [(i, j) for i, j in self.kept.items() if i in free_set and j in bins]
        moves = mip.xsum(1 - x[i, j] for i, j in movable)
        if self.max_moves is not None:
            moved_elsewhere = sum(1 for i, j in self.kept.items() if chosen[i] != j and (i, j) not in set(movable))
            milp += moves <= self.max_moves - moved_elsewhere
        milp.objective = mip.minimize(
            rate_dev + self.memory_weight * memory_dev + SPREAD_WEIGHT / self.n * mip.xsum(spread) + MOVE_PENALTY / len(chosen) * moves
        )
        milp.start = [(x[i, chosen[i]], 1.0) for i in free if chosen[i] in bins]
        seconds = max(deadline - time.perf_counter(), 0.05)
        status = milp.optimize(max_seconds=seconds, max_solutions=1) if first_found else milp.optimize(max_seconds=seconds)
        if status in (mip.OptimizationStatus.INFEASIBLE, mip.OptimizationStatus.INT_INFEASIBLE):
            raise PlanError(_infeasible(len(self.models), self.n, self.limits))
        if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
            if not whole:
                return list(chosen), status.name.lower()
            raise PlanError(
                f"{self.solver_name} found no split of {len(chosen)} models into {self.n} sub-clusters "
                f"in the time limit ({status.name.lower()}); give it longer"
            )
        out = list(chosen)
        for i in free:
            out[i] = max(bins, key=lambda j: x[i, j].x or 0.0)
        return out, status.name.lower()
