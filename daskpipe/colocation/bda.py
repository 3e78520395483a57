"""InSS's lower layer, BDA (the largest batch that meets SLO, memory and rate), and the scorer
that rates an upper-layer action with it: shared by the local search (``inss.py``) and the
SAC-Discrete agent (``sac.py``), which trains on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from daskpipe.colocation.latency import Colocated, InterferenceModel, worst_task_latency_ms
from daskpipe.colocation.policy import Gpu, PlacementPlan, Replica, Workload


@dataclass(frozen=True)
class BatchDecision:
    """BDA's answer for one model: ``batch`` (``None``: no batch meets SLO, memory and rate),
    its throughput ``capacity`` (req/s), and the fraction of tasks expected to violate."""

    batch: int | None
    capacity: float
    violation: float


def decide_batch(
    model: InterferenceModel,
    gpu_type: str,
    me: str,
    share: float,
    others: Sequence[Colocated],
    workload: Workload,
    memory_free_mb: float,
    max_utilisation: float,
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

    def __init__(
        self,
        model: InterferenceModel,
        workloads: Sequence[Workload],
        gpus: Sequence[Gpu],
        *,
        omega: float,
        max_utilisation: float,
        default_batch: int = 4,
    ) -> None:
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
            decisions.append(
                (
                    i,
                    decide_batch(
                        self.model,
                        gpu_type,
                        procs[pos].model,
                        procs[pos].share,
                        others,
                        self.workloads[i],
                        spec.memory_mb - co_memory,
                        self.max_utilisation,
                    ),
                )
            )
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
