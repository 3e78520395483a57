"""iGniter-like (TPDS'22) as the thesis ran it: minimise GPUs, then map the plan best-effort.

Per workload, half the SLO goes to inference; the batch is what arrives in that time
(``b = ceil(slo/2 · λ · B / (B + d_in · λ))``), and the share starts at ``r_lower``, the smallest
2.5% step that runs the batch alone within slo/2. Heaviest first, each workload goes to the open
GPU where growing every resident's share (+2.5% at a time, until all predicted latencies, with
interference, fit their slo/2) costs the fewest extra resources; else a new GPU opens. A workload
no GPU can serve alone is split into replicas. The plan's GPUs then take the real GPUs in order;
what lands beyond the last real GPU is not served (the thesis's "best-effort" adaptation).
Power capping (iGniter's frequency term) is not modelled.
"""

from __future__ import annotations

import math
from typing import Sequence

from daskpipe.colocation.latency import Colocated, InterferenceModel
from daskpipe.colocation.policy import Gpu, PlacementPlan, PlacementPolicy, Replica, Strategy, Workload

SHARE_STEP = 0.025


class IgniterPolicy(PlacementPolicy):
    strategy = Strategy.IGNITER

    def __init__(self, model: InterferenceModel, *, max_replicas: int = 8) -> None:
        super().__init__(model)
        self.max_replicas = max_replicas

    def place(self, workloads: Sequence[Workload], gpus: Sequence[Gpu]) -> PlacementPlan:
        self.check(workloads, gpus)
        plan_types = [g.type for g in gpus]
        jobs = [job for w in workloads for job in self._split(w, plan_types[0])]
        plan_gpus: list[list[tuple[Workload, int, float]]] = []  # per plan GPU: (workload, batch, share)
        for w, batch, r_lower in sorted(jobs, key=lambda j: -j[2]):
            best = None
            for index, residents in enumerate(plan_gpus):
                grown = self._grow(residents + [(w, batch, r_lower)], plan_types[min(index, len(plan_types) - 1)])
                if grown is not None:
                    added = sum(s for *_, s in grown) - sum(s for *_, s in residents)
                    if best is None or added < best[0]:
                        best = (added, index, grown)
            if best is None:
                plan_gpus.append([(w, batch, r_lower)])
            else:
                plan_gpus[best[1]] = best[2]
        replicas = []
        for index, residents in enumerate(plan_gpus[: len(gpus)]):
            for w, batch, share in residents:
                replicas.append(Replica(w.name, gpus[index].uid, share, batch, weight=batch, timeout_ms=w.slo_ms / 2))
        return PlacementPlan(
            self.strategy.value, tuple(replicas), {"gpus_wanted": len(plan_gpus), "gpus_used": min(len(plan_gpus), len(gpus))}
        )

    def _batch(self, w: Workload, rate: float, gpu_type: str) -> int:
        c = self.model.coeff(w.name, gpu_type)
        bytes_per_ms = self.model.gpu(gpu_type).pcie_gb_per_s * 1e6
        per_ms = rate / 1000.0
        return max(1, min(self.model.max_batch, math.ceil(w.slo_ms / 2 * per_ms * bytes_per_ms / (bytes_per_ms + c.input_bytes * per_ms))))

    def _split(self, w: Workload, gpu_type: str) -> list[tuple[Workload, int, float]]:
        """Replicas (workload at its per-replica rate, batch, r_lower): as few as make r_lower <= 100%."""
        for replicas in range(1, self.max_replicas + 1):
            part = Workload(w.name, w.rate / replicas, w.slo_ms)
            batch = self._batch(part, part.rate, gpu_type)
            r_lower = self.min_share_for(part, gpu_type, batch, w.slo_ms / 2, SHARE_STEP)
            if r_lower is not None and 1000.0 * batch / self.solo_exec_ms(w.name, gpu_type, r_lower, batch) >= part.rate:
                return [(part, batch, r_lower)] * replicas
        return []

    def _grow(self, residents: list[tuple[Workload, int, float]], gpu_type: str) -> list[tuple[Workload, int, float]] | None:
        """Raise the share of every resident missing its slo/2 by one step until all fit; None if
        the shares would pass 100%."""
        shares = [s for *_, s in residents]
        while sum(shares) <= 1.0 + 1e-9:
            procs = [Colocated(w.name, s, b) for (w, b, _), s in zip(residents, shares)]
            late = [
                i
                for i, (w, b, _) in enumerate(residents)
                if self.model.exec_ms(gpu_type, procs[i], procs[:i] + procs[i + 1 :]) > w.slo_ms / 2
            ]
            if not late:
                return [(w, b, s) for (w, b, _), s in zip(residents, shares)]
            if all(shares[i] >= 1.0 for i in late):
                return None
            for i in late:
                shares[i] = min(1.0, shares[i] + SHARE_STEP)
        return None
