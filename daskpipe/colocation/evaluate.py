"""Execute a placement in simulation: Poisson arrivals, one FIFO batch queue per replica, batch
latencies from the interference model, SLO violations and drops counted.

Every policy is executed by the same rules, so that only placement differs (the thesis's fairness
point). A model's arrivals are split over its replicas at random in proportion to their weights
(which keeps each replica's stream Poisson). A replica runs one batch at a time: it starts when
the previous one is done and either ``batch`` requests wait, or its ``timeout_ms`` has passed since
the oldest arrived, or the oldest would otherwise miss its deadline. Requests that cannot finish
in time even alone are dropped (InSS's drop rule) and count as violations. Interference is static:
a replica is slowed by every process placed on its GPU, as InSS's model assumes. Each batch's
latency is multiplied by lognormal noise of relative size ``noise`` (the model is never exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from daskpipe.colocation.latency import Colocated, ColocationError, InterferenceModel
from daskpipe.colocation.policy import Gpu, PlacementPlan, PlacementPolicy, Replica, Workload


@dataclass
class ModelStats:
    arrived: int = 0
    served: int = 0  # finished, in time or late
    late: int = 0
    dropped: int = 0
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def violations(self) -> int:
        return self.late + self.dropped


@dataclass(frozen=True)
class EvalResult:
    duration_s: float
    per_model: dict[str, ModelStats]

    @property
    def arrived(self) -> int:
        return sum(s.arrived for s in self.per_model.values())

    @property
    def throughput(self) -> float:
        """Requests served per second (late ones included, drops not)."""
        return sum(s.served for s in self.per_model.values()) / self.duration_s

    @property
    def goodput(self) -> float:
        return sum(s.served - s.late for s in self.per_model.values()) / self.duration_s

    @property
    def slo_violation_rate(self) -> float:
        arrived = self.arrived
        return sum(s.violations for s in self.per_model.values()) / arrived if arrived else 0.0

    def to_dict(self) -> dict:
        return {
            "throughput": round(self.throughput, 2),
            "goodput": round(self.goodput, 2),
            "slo_violation_rate": round(self.slo_violation_rate, 5),
            "per_model": {
                m: {
                    "arrived": s.arrived,
                    "served": s.served,
                    "late": s.late,
                    "dropped": s.dropped,
                    "p99_ms": round(float(np.percentile(s.latencies_ms, 99)), 2) if s.latencies_ms else None,
                }
                for m, s in sorted(self.per_model.items())
            },
        }


def evaluate(
    plan: PlacementPlan,
    workloads: Sequence[Workload],
    gpus: Sequence[Gpu],
    model: InterferenceModel,
    *,
    duration_s: float = 20.0,
    noise: float = 0.03,
    seed: int = 0,
) -> EvalResult:
    """Run ``plan`` against Poisson arrivals at the workloads' rates for ``duration_s`` seconds."""
    if duration_s <= 0:
        raise ColocationError(f"duration_s must be positive, got {duration_s}")
    gpu_type = {g.uid: g.type for g in gpus}
    unknown = {r.gpu for r in plan.replicas} - set(gpu_type)
    if unknown:
        raise ColocationError(f"plan {plan.policy!r} places replicas on unknown GPU(s) {sorted(unknown)}")
    rng = np.random.default_rng(seed)
    per_model: dict[str, ModelStats] = {}
    for w in workloads:
        stats = per_model[w.name] = ModelStats()
        arrivals = _poisson(rng, w.rate, duration_s)
        stats.arrived = arrivals.size
        replicas = plan.of_model(w.name)
        if not replicas:
            stats.dropped = arrivals.size
            continue
        weights = np.array([r.weight for r in replicas], float)
        route = rng.choice(len(replicas), size=arrivals.size, p=weights / weights.sum())
        for index, replica in enumerate(replicas):
            others = plan.corunners(replica)
            exec_ms = [
                model.exec_ms(gpu_type[replica.gpu], Colocated(replica.model, replica.share, n), others)
                for n in range(1, replica.batch + 1)
            ]
            _run_replica(arrivals[route == index] * 1000.0, replica, exec_ms, w.slo_ms, noise, rng, stats)
    return EvalResult(duration_s, per_model)


def _poisson(rng: np.random.Generator, rate: float, duration_s: float) -> np.ndarray:
    if rate <= 0:
        return np.zeros(0)
    count = rng.poisson(rate * duration_s)
    return np.sort(rng.uniform(0.0, duration_s, size=count))


def _run_replica(
    arrivals_ms: np.ndarray,
    replica: Replica,
    exec_ms: list[float],
    slo_ms: float,
    noise: float,
    rng: np.random.Generator,
    stats: ModelStats,
) -> None:
    """One replica's batch queue, batch by batch (arrivals are sorted)."""
    n = arrivals_ms.size
    head, free_at = 0, 0.0
    sigma = float(np.sqrt(np.log1p(noise * noise)))
    full_exec = exec_ms[-1]
    while head < n:
        oldest = arrivals_ms[head]
        if max(free_at, oldest) + exec_ms[0] > oldest + slo_ms:  # hopeless even alone: drop
            stats.dropped += 1
            head += 1
            continue
        last = head + replica.batch - 1
        filled_at = arrivals_ms[last] if last < n else np.inf
        latest = oldest + max(0.0, slo_ms - full_exec)
        if replica.timeout_ms is not None:
            latest = min(latest, oldest + replica.timeout_ms)
        start = max(free_at, oldest, min(filled_at, latest))
        size = int(np.searchsorted(arrivals_ms, start, side="right")) - head
        size = max(1, min(size, replica.batch))
        end = start + exec_ms[size - 1] * float(rng.lognormal(-sigma * sigma / 2, sigma))
        latency = end - arrivals_ms[head : head + size]
        stats.served += size
        stats.late += int(np.count_nonzero(latency > slo_ms))
        stats.latencies_ms.extend(latency.tolist())
        free_at = end
        head += size


@dataclass(frozen=True)
class SweepPoint:
    scale: float
    offered: float  # req/s
    result: EvalResult
    plan: PlacementPlan


def load_sweep(
    policy: PlacementPolicy,
    workloads: Sequence[Workload],
    gpus: Sequence[Gpu],
    model: InterferenceModel,
    scales: Sequence[float],
    *,
    duration_s: float = 10.0,
    noise: float = 0.03,
    seed: int = 0,
) -> list[SweepPoint]:
    """Plan and execute at every ``scale`` of the workloads' rates (the policy sees the scaled
    rates, as it would see the monitor's estimate)."""
    points = []
    for scale in scales:
        scaled = [Workload(w.name, w.rate * scale, w.slo_ms) for w in workloads]
        plan = policy.place(scaled, gpus)
        result = evaluate(plan, scaled, gpus, model, duration_s=duration_s, noise=noise, seed=seed)
        points.append(SweepPoint(scale, sum(w.rate for w in scaled), result, plan))
    return points


def sustainable(points: Sequence[SweepPoint], max_violation: float) -> SweepPoint | None:
    """The point with the highest goodput among those violating the SLO at most ``max_violation``."""
    ok = [p for p in points if p.result.slo_violation_rate <= max_violation]
    return max(ok, key=lambda p: p.result.goodput, default=None)
