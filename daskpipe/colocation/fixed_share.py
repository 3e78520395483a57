"""Fixed-share baselines in the style of GSLICE (SoCC'20) and Gpulet (ATC'22), as InSS compares them.

Both size batches by the "half the SLO for execution" rule and wait at most SLO/2 for a batch.
GSLICE-like: one instance per model; its GPU share is the smallest 10% step at which the solo
latency of the SLO/2 batch keeps up with the rate (the self-tuning's fixed point); interference is
ignored. Gpulet-like: each GPU is cut into at most two partitions of fixed sizes; models, busiest
first, take the smallest partition that serves their remaining rate (several partitions if one is
not enough), with its interference estimate (ours) towards the partition's neighbour.
"""

from __future__ import annotations

from typing import Sequence

from daskpipe.colocation.latency import Colocated, InterferenceModel
from daskpipe.colocation.policy import Gpu, PlacementPlan, PlacementPolicy, Replica, Strategy, Workload


def half_slo_batch(exec_ms, slo_ms: float, max_batch: int) -> tuple[int, float]:
    """Largest batch in 1..max_batch whose execution fits in SLO/2, and its throughput (req/s); (1, 0) if none."""
    best = (1, 0.0)
    for b in range(1, max_batch + 1):
        t = exec_ms(b)
        if t > slo_ms / 2:
            break
        best = (b, 1000.0 * b / t)
    return best


class GslicePolicy(PlacementPolicy):
    """GSLICE-like: per-model share in 10% steps, interference-unaware, first-fit by share."""

    strategy = Strategy.GSLICE

    def __init__(self, model: InterferenceModel, *, share_step: float = 0.1) -> None:
        super().__init__(model)
        if not 0 < share_step <= 1:
            raise ValueError(f"share_step must be in (0, 1], got {share_step}")
        self.share_step = share_step

    def place(self, workloads: Sequence[Workload], gpus: Sequence[Gpu]) -> PlacementPlan:
        self.check(workloads, gpus)
        gpu_type = gpus[0].type  # GSLICE sizes shares once, on the first GPU's type
        sized = []
        for w in workloads:
            steps = int(round(1 / self.share_step))
            for n in range(1, steps + 1):
                share = min(1.0, n * self.share_step)
                batch, thr = half_slo_batch(lambda b: self.solo_exec_ms(w.name, gpu_type, share, b), w.slo_ms, self.model.max_batch)
                if thr >= w.rate:
                    break
            sized.append((w, share, batch))
        free = {g.uid: 1.0 for g in gpus}
        replicas = []
        for w, share, batch in sorted(sized, key=lambda t: -t[1]):
            uid = next((u for u in free if free[u] >= share - 1e-9), max(free, key=free.get))
            free[uid] -= share
            replicas.append(Replica(w.name, uid, share, batch, timeout_ms=w.slo_ms / 2))
        return PlacementPlan(self.strategy.value, tuple(replicas), {"oversubscribed": sorted(u for u, f in free.items() if f < -1e-9)})


class GpuletPolicy(PlacementPolicy):
    """Gpulet-like: at most two partitions per GPU from fixed sizes, replicas until the rate is served."""

    strategy = Strategy.GPULET
    SIZES = (0.2, 0.4, 0.5, 0.6, 0.8, 1.0)

    def place(self, workloads: Sequence[Workload], gpus: Sequence[Gpu]) -> PlacementPlan:
        self.check(workloads, gpus)
        parts: dict[str, list[Replica]] = {g.uid: [] for g in gpus}
        types = {g.uid: g.type for g in gpus}
        replicas: list[Replica] = []
        unserved = []
        for w in sorted(workloads, key=lambda w: -w.rate):
            remaining = w.rate
            while remaining > 1e-9:
                option = self._best_partition(w, remaining, parts, types)
                if option is None:
                    unserved.append(w.name)
                    break
                uid, share, batch, thr = option
                replica = Replica(w.name, uid, share, batch, weight=max(thr, 1e-6), timeout_ms=w.slo_ms / 2)
                parts[uid].append(replica)
                replicas.append(replica)
                remaining -= thr
        return PlacementPlan(self.strategy.value, tuple(replicas), {"rate_not_covered": unserved})

    def _best_partition(self, w: Workload, remaining: float, parts: dict[str, list[Replica]], types: dict[str, str]):
        """The smallest partition that serves ``remaining``; else the one serving the most."""
        options = []
        for uid, residents in parts.items():
            if len(residents) >= 2:
                continue
            free = 1.0 - sum(r.share for r in residents)
            neighbours = [r.process() for r in residents]
            for share in (s for s in self.SIZES if s <= free + 1e-9):
                batch, thr = half_slo_batch(
                    lambda b: self.model.exec_ms(types[uid], Colocated(w.name, share, b), neighbours), w.slo_ms, self.model.max_batch
                )
                if thr > 0:
                    options.append((uid, share, batch, thr))
        if not options:
            return None
        enough = [o for o in options if o[3] >= remaining]
        if enough:
            return min(enough, key=lambda o: (o[1], -o[3]))
        return max(options, key=lambda o: (o[3], -o[1]))
