"""InSS's two-layer scheduler: placement and MPS share above, batch size (BDA) below.

The upper layer picks, per model, a GPU and a number of SM units (one instance per model, InSS's
constraint 1e). We offer the paper's SAC-Discrete agent (``trainer="sac"``, trained in simulation
on the scorer of ``bda.py``, see ``sac.py``) and, by default, a non-learned local search over the same
action space. The lower layer is BDA (Algorithm 1, in the corrected form of the digest): a binary
search for the largest batch in 1..32 that meets the SLO (queueing included), memory, and the
arrival rate.
"""

from __future__ import annotations

import random
from typing import Sequence

from daskpipe.colocation.bda import InssScorer
from daskpipe.colocation.latency import InterferenceModel
from daskpipe.colocation.policy import Gpu, PlacementPlan, PlacementPolicy, Strategy, Workload


class InssPolicy(PlacementPolicy):
    """InSS (TS): SAC-Discrete placement with ``trainer="sac"``, local search otherwise."""

    strategy = Strategy.INSS

    def __init__(
        self,
        model: InterferenceModel,
        *,
        trainer: str = "search",
        omega: float = 100.0,
        max_utilisation: float = 0.85,
        search_budget: int = 3000,
        seed: int = 0,
        sac_steps: int = 2000,
        sac_hidden: tuple[int, ...] = (512, 256),
    ) -> None:
        super().__init__(model)
        if trainer not in ("search", "sac"):
            raise ValueError(f"InSS trainer must be 'search' or 'sac', got {trainer!r}")
        if not 0 < max_utilisation <= 1:
            raise ValueError(f"max_utilisation must be in (0, 1], got {max_utilisation}")
        self.trainer, self.omega, self.max_utilisation = trainer, omega, max_utilisation
        self.search_budget, self.seed, self.sac_steps, self.sac_hidden = search_budget, seed, sac_steps, sac_hidden

    def scorer(self, workloads: Sequence[Workload], gpus: Sequence[Gpu]) -> InssScorer:
        return InssScorer(self.model, workloads, gpus, omega=self.omega, max_utilisation=self.max_utilisation)

    def place(self, workloads: Sequence[Workload], gpus: Sequence[Gpu]) -> PlacementPlan:
        self.check(workloads, gpus)
        scorer = self.scorer(workloads, gpus)
        if self.trainer == "sac":
            from daskpipe.colocation.sac import SacConfig, train_and_act

            assign, units, info = train_and_act(scorer, SacConfig(steps=self.sac_steps, hidden=self.sac_hidden, seed=self.seed))
            return scorer.plan(assign, units, self.strategy.value, {"trainer": "sac", **info})
        assign, units, evals = local_search(scorer, budget=self.search_budget, seed=self.seed)
        return scorer.plan(assign, units, self.strategy.value, {"trainer": "search", "evaluations": evals})


def greedy_start(scorer: InssScorer) -> tuple[list[int], list[int]]:
    """Heaviest model first (by the SM units it needs alone), each onto the GPU with the most free
    units; every GPU's units are then spread over its residents in proportion to their needs."""
    n, num_gpus = len(scorer.workloads), len(scorer.gpus)
    need = [scorer.units_needed_alone(i, 0) for i in range(n)]
    free = list(scorer.units)
    assign = [0] * n
    for i in sorted(range(n), key=lambda i: -need[i]):
        k = max(range(num_gpus), key=lambda k: free[k])
        assign[i] = k
        free[k] -= need[i]
    return assign, scorer.normalise(assign, need)


def local_search(scorer: InssScorer, *, budget: int, seed: int) -> tuple[list[int], list[int], int]:
    """Iterated local search from the greedy start: first-improvement hill climbing over unit
    transfers, relocations and swaps; at a local optimum, relocate two random models and climb
    again, keeping the best; stops after ``budget`` evaluations."""
    rng = random.Random(seed)
    assign, units = greedy_start(scorer)
    best_assign, best_units, best = assign, units, scorer.score(assign, units)
    evals = 1
    while evals < budget:
        assign, units, score, used = _climb(scorer, assign, units, budget - evals, rng)
        evals += used
        if score > best + 1e-9:
            best_assign, best_units, best = assign, units, score
        assign = list(best_assign)
        for i in rng.sample(range(len(assign)), k=min(2, len(assign))):
            assign[i] = rng.randrange(len(scorer.gpus))
        units = scorer.normalise(assign, best_units)
    return best_assign, best_units, evals


def _climb(
    scorer: InssScorer, assign: list[int], units: list[int], budget: int, rng: random.Random
) -> tuple[list[int], list[int], float, int]:
    best = scorer.score(assign, units)
    evals = 1
    improved = True
    while improved and evals < budget:
        improved = False
        moves = list(_neighbours(scorer, assign, units))
        rng.shuffle(moves)
        for cand_assign, cand_units in moves:
            cand_units = scorer.normalise(cand_assign, cand_units)
            score = scorer.score(cand_assign, cand_units)
            evals += 1
            if score > best + 1e-9:
                assign, units, best, improved = cand_assign, cand_units, score, True
                break
            if evals >= budget:
                break
    return assign, units, best, evals


def _neighbours(scorer: InssScorer, assign: list[int], units: list[int]):
    n = len(assign)
    for i in range(n):
        for j in range(n):
            if i != j and assign[i] == assign[j]:
                for step in (1, 2):
                    if units[j] > step:
                        moved = list(units)
                        moved[i] += step
                        moved[j] -= step
                        yield assign, moved
        for k in range(len(scorer.gpus)):
            if k != assign[i]:
                relocated = list(assign)
                relocated[i] = k
                yield relocated, list(units)
    for i in range(n):
        for j in range(i + 1, n):
            if assign[i] != assign[j]:
                swapped = list(assign)
                swapped[i], swapped[j] = assign[j], assign[i]
                yield swapped, list(units)
