"""InSS's two-layer scheduler: placement and MPS share above, batch size (BDA) below.

The upper layer picks, per model, a GPU and a number of SM units (one instance per model, InSS's
constraint 1e). We offer the paper's SAC-Discrete agent (``trainer="sac"``, trained in simulation
on this module's scorer, see ``sac.py``) and, by default, a non-learned local search over the same
action space. The lower layer is BDA (Algorithm 1, in the corrected form of the digest): a binary
search for the largest batch in 1..32 that meets the SLO (queueing included), memory, and the
arrival rate.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from daskpipe.colocation.latency import Colocated, InterferenceModel, worst_task_latency_ms
from daskpipe.colocation.policy import Gpu, PlacementPlan, PlacementPolicy, Replica, Strategy, Workload



@dataclass(frozen=True)
class BatchDecision:
    """BDA's answer for one model: ``batch`` (``None``: no batch meets SLO, memory and rate),
    its throughput ``capacity`` (req/s), and the fraction of tasks expected to violate."""

    batch: int | None
    capacity: float
    violation: float


def decide_batch(
    model: InterferenceModel, gpu_type: str, me: str, share: float, others: Sequence[Colocated], workload: Workload, memory_free_mb: float, max_utilisation: float
) -> BatchDecision:
    """BDA for one model: latency, throughput and memory grow with the batch, so binary-search
    the largest batch that fits the SLO and memory, accepting it only if it keeps up with the
    rate at ``max_utilisation`` (Poisson arrivals need headroom, which the paper leaves implicit).
    """

    def exec_ms(b: int) -> float:
        return model.exec_ms(gpu_type, Colocated(me, share, b), others)

    lo, hi, found = 1, model.max_batch, None
    best_capacity = 0.0
    while lo <= hi:
        mid = (lo + hi) // 2
        t = exec_ms(mid)
        capacity = 1000.0 * mid / t
        fits = model.memory_mb(me, gpu_type, mid) <= memory_free_mb and worst_task_latency_ms(t, mid, workload.rate) <= workload.slo_ms
        if not fits:
            hi = mid - 1
            continue
        best_capacity = max(best_capacity, capacity)
        if capacity * max_utilisation >= workload.rate:
            found = mid
        lo = mid + 1
    if found is not None:
        return BatchDecision(found, 1000.0 * found / exec_ms(found), 0.0)
    if best_capacity == 0.0:
        return BatchDecision(None, 0.0, 1.0)
    return BatchDecision(None, best_capacity, max(0.0, 1.0 - best_capacity * max_utilisation / max(workload.rate, 1e-9)))


class InssScorer:
    """Scores an action (GPU and SM units per model) as InSS's reward: normalised throughput minus
    ``omega`` times the expected violation fraction; memoised per GPU configuration."""

    def __init__(self, model: InterferenceModel, workloads: Sequence[Workload], gpus: Sequence[Gpu], *, omega: float, max_utilisation: float, default_batch: int = 4) -> None:
        self.model, self.workloads, self.gpus = model, list(workloads), list(gpus)
        self.omega, self.max_utilisation, self.default_batch = omega, max_utilisation, default_batch
        self.units = [model.gpu(g.type).share_units() for g in gpus]
        # H_i: whole-GPU batch-1 throughput on the first GPU type, InSS's reward normaliser.
        self.norm = {w.name: 1000.0 / model.exec_ms(gpus[0].type, Colocated(w.name, 1.0, 1)) for w in workloads}
        self._gpu_cache = lru_cache(maxsize=100_000)(self._score_gpu)

    def share(self, gpu_index: int, units: int) -> float:
        return min(1.0, units / self.units[gpu_index])

    def normalise(self, assign: Sequence[int], units: Sequence[int]) -> list[int]:
        """Per GPU, adjust units round-robin by one so the residents' units sum to the capacity
        (InSS's released code), each keeping at least one unit."""
        out = [max(1, u) for u in units]
        for k, cap in enumerate(self.units):
            residents = [i for i, g in enumerate(assign) if g == k]
            turn = 0
            while residents and sum(out[i] for i in residents) != cap:
                i = residents[turn % len(residents)]
                if sum(out[j] for j in residents) > cap:
                    if out[i] > 1:
                        out[i] -= 1
                    elif all(out[j] == 1 for j in residents):
                        break  # more residents than units: over-subscribed, MPS allows it
                else:
                    out[i] += 1
                turn += 1
        return out

    def units_needed_alone(self, i: int, k: int) -> int:
        """Fewest SM units of GPU ``k`` with which model ``i`` passes BDA alone (all if none do)."""
        for u in range(1, self.units[k] + 1):
            if self._gpu_cache(k, ((i, u),))[0][1].batch:
                return u
        return self.units[k]

    def _score_gpu(self, k: int, residents: tuple[tuple[int, int], ...]) -> tuple[tuple[int, BatchDecision], ...]:
        gpu_type = self.gpus[k].type
        spec = self.model.gpu(gpu_type)
        procs = [Colocated(self.workloads[i].name, self.share(k, u), self.default_batch) for i, u in residents]
        decisions = []
        for pos, (i, _) in enumerate(residents):
            others = procs[:pos] + procs[pos + 1 :]
            co_memory = sum(self.model.memory_mb(p.model, gpu_type, self.default_batch) for p in others)
            decisions.append((i, decide_batch(self.model, gpu_type, procs[pos].model, procs[pos].share, others, self.workloads[i], spec.memory_mb - co_memory, self.max_utilisation)))
        return tuple(decisions)

    def decisions(self, assign: Sequence[int], units: Sequence[int]) -> dict[int, BatchDecision]:
        out: dict[int, BatchDecision] = {}
        for k in range(len(self.gpus)):
            residents = tuple(sorted((i, units[i]) for i, g in enumerate(assign) if g == k))
            if residents:
                out.update(self._gpu_cache(k, residents))
        return out

    def reward_terms(self, assign: Sequence[int], units: Sequence[int]) -> tuple[list[float], list[float]]:
        """Per model: normalised throughput ĥ_i (0 when BDA fails) and expected violation v_i."""
        decisions = self.decisions(assign, units)
        h, v = [], []
        for i, w in enumerate(self.workloads):
            d = decisions[i]
            h.append(min(d.capacity, max(w.rate, 1e-9)) / self.norm[w.name] if d.batch else 0.0)
            v.append(d.violation)
        return h, v

    def score(self, assign: Sequence[int], units: Sequence[int]) -> float:
        h, v = self.reward_terms(assign, units)
        return sum(h) - self.omega * sum(v)

    def plan(self, assign: Sequence[int], units: Sequence[int], policy: str, info: dict) -> PlacementPlan:
        decisions = self.decisions(assign, units)
        replicas = []
        for i, w in enumerate(self.workloads):
            d = decisions[i]
            replicas.append(Replica(w.name, self.gpus[assign[i]].uid, self.share(assign[i], units[i]), d.batch or 1))
        failed = [self.workloads[i].name for i, d in decisions.items() if d.batch is None]
        return PlacementPlan(policy, tuple(replicas), {**info, "bda_failed": failed, "score": round(float(self.score(assign, units)), 4)})


class InssPolicy(PlacementPolicy):
    """InSS (TS): SAC-Discrete placement with ``trainer="sac"``, local search otherwise."""

    strategy = Strategy.INSS

    def __init__(
        self, model: InterferenceModel, *, trainer: str = "search", omega: float = 100.0, max_utilisation: float = 0.85, search_budget: int = 3000, seed: int = 0, sac_steps: int = 2000, sac_hidden: tuple[int, ...] = (512, 256)
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


def _climb(scorer: InssScorer, assign: list[int], units: list[int], budget: int, rng: random.Random) -> tuple[list[int], list[int], float, int]:
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
