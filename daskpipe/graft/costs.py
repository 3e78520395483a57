"""What a server-side stage costs on an MPS share of one GPU type: Graft's ``min_resource`` primitive.

A stage is a contiguous block range ``[start, end)`` of one model. Graft sizes every stage on a
discrete grid: batch size ``b`` (1..max batch), GPU share ``r`` in 1% MPS steps, and ``c``
identical instances pulling from one queue. Its cost is ``r * c`` (percent of one GPU).

Share scaling. A ``Profile`` tabulates each block on ``v`` equal MPS slices. The estimator's
roofline is ``launch + v * work`` per op, so a block's latency is exactly affine in ``v``:
``L(v) = fixed + scalable * v``. We fit ``fixed`` and ``scalable`` per (block, batch) from the
``v = 1`` and ``v = 2`` tables and read an ``r``% share as ``v = 100 / r``. For measured tables
the fit is a two-point interpolation (clipped at zero), extrapolated below 50%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from daskpipe.profiles.model import Profile, ProfileError

SHARE_STEPS = np.arange(1, 101, dtype=float)  # MPS active-thread percentages Graft may give an instance
_EPS = 1e-9
DEFAULT_BURST_RISK = 0.05


def poisson_quantile(means: np.ndarray, level: float) -> np.ndarray:
    """The smallest ``n`` with P(Poisson(mean) <= n) >= ``level``, for each mean."""
    means = np.asarray(means, dtype=float)
    top = int(np.ceil(means.max() + 10 * np.sqrt(means.max()) + 10))
    counts = np.arange(top + 1, dtype=float)
    log_factorial = np.concatenate([[0.0], np.cumsum(np.log(counts[1:]))])
    log_pmf = counts * np.log(np.maximum(means, 1e-300))[..., None] - means[..., None] - log_factorial
    cdf = np.cumsum(np.exp(log_pmf), axis=-1)
    return np.argmax(cdf >= level, axis=-1).astype(float)


@dataclass(frozen=True)
class StageConfig:
    """One sized stage: ``instances`` copies at ``share``% each, running batches of up to ``batch``."""

    start: int
    end: int
    batch: int
    share: int  # percent of one GPU per instance
    instances: int
    latency_ms: float  # one full batch on one instance
    rate_rps: float  # demand the stage was sized for

    @property
    def cost(self) -> int:
        """GPU share the stage holds, in percent of one GPU (Graft's ``r * c``)."""
        return self.share * self.instances

    @property
    def capacity_rps(self) -> float:
        return self.instances * self.batch / (self.latency_ms / 1e3)

    @property
    def margin(self) -> float:
        """Graft's resource margin ``(q_a - q_d) / q_d``."""
        return (self.capacity_rps - self.rate_rps) / self.rate_rps


class StageCosts:
    """Latency and minimum-share sizing of any block range of one model on one GPU type.

    ``max_batch`` caps the batch sizes searched (default: all batches the ``v = 2`` table has).
    ``burst_risk`` sets the instance count. Graft's queueing rule (a request waits at most one
    batch time) holds while the requests arriving during one batch time fit in the next batches
    of the ``c`` instances. Sizing ``c`` for the mean rate (``c = ceil(q L / b)``) breaks it about
    half the time under Poisson arrivals, so we take ``c = ceil(n / b)`` with ``n`` the
    ``1 - burst_risk`` quantile of Poisson(``q L``) arrivals (see docs/hybrid.md).
    """

    def __init__(self, profile: Profile, gpu: str, *, max_batch: int | None = None, burst_risk: float = DEFAULT_BURST_RISK) -> None:
        if 2 not in profile.slices(gpu) or 1 not in profile.slices(gpu):
            raise ProfileError(
                f"{profile.source}: Graft's share scaling needs tables for v=1 and v=2 on {gpu!r}; "
                f"model {profile.model!r} has v={profile.slices(gpu)} (estimate with slices=(1, 2))"
            )
        whole, half = profile.table(gpu, 1), profile.table(gpu, 2)
        width = min(whole.shape[1], half.shape[1])
        if not 0 < burst_risk < 1:
            raise ValueError(f"burst_risk must be in (0, 1), got {burst_risk}")
        if max_batch is not None:
            if max_batch < 1 or max_batch > width:
                raise ValueError(f"max_batch must be in 1..{width} for {profile.model!r} on {gpu!r}, got {max_batch}")
            width = max_batch
        scalable = np.clip(half[:, :width] - whole[:, :width], 0.0, None)
        fixed = np.clip(whole[:, :width] - scalable, 0.0, None)
        zero = np.zeros((1, width))
        self.profile = profile
        self.gpu = gpu
        self.max_batch = width
        self.burst_risk = burst_risk
        self.num_blocks = profile.num_blocks
        # prefix sums over blocks, in ms: range [a, e) costs cum[e] - cum[a]
        self._fixed_cum = np.vstack([zero, np.cumsum(fixed, axis=0)]) / 1e3
        self._scalable_cum = np.vstack([zero, np.cumsum(scalable, axis=0)]) / 1e3
        self._batches = np.arange(1, width + 1, dtype=float)
        self._fronts: dict[tuple[int, int, float], tuple[np.ndarray, tuple[StageConfig, ...]]] = {}

    def _check_range(self, start: int, end: int) -> None:
        if not 0 <= start < end <= self.num_blocks:
            raise ValueError(f"stage blocks [{start}, {end}) outside 0..{self.num_blocks} of {self.profile.model!r}")

    def latency_ms(self, start: int, end: int, batch: int, share: float) -> float:
        """Latency of blocks ``[start, end)`` at ``batch`` on a ``share``% MPS slice."""
        self._check_range(start, end)
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch must be in 1..{self.max_batch}, got {batch}")
        if not 0 < share <= 100:
            raise ValueError(f"share must be in (0, 100] percent, got {share}")
        column = batch - 1
        fixed = self._fixed_cum[end, column] - self._fixed_cum[start, column]
        scalable = self._scalable_cum[end, column] - self._scalable_cum[start, column]
        return float(fixed + scalable * 100.0 / share)

    def front(self, start: int, end: int, rate_rps: float) -> tuple[np.ndarray, tuple[StageConfig, ...]]:
        """Every configuration no other beats on both latency and cost, sorted by latency.

        These are the "efficient points" of Graft's Fig. 4; cost strictly decreases along the list,
        so the cheapest configuration within a budget is the last one that fits it. Memoised per
        (range, rate): Algorithm 1 asks the same stage for many budgets.
        """
        self._check_range(start, end)
        if rate_rps <= 0:
            raise ValueError(f"stage rate must be positive, got {rate_rps}")
        key = (start, end, float(rate_rps))
        if key not in self._fronts:
            fixed = self._fixed_cum[end] - self._fixed_cum[start]
            scalable = self._scalable_cum[end] - self._scalable_cum[start]
            latency = (fixed[:, None] + scalable[:, None] * (100.0 / SHARE_STEPS[None, :])).ravel()
            batches = np.repeat(self._batches, SHARE_STEPS.size)
            shares = np.tile(SHARE_STEPS, self._batches.size)
            instances = np.maximum(1.0, np.ceil(poisson_quantile(rate_rps * latency / 1e3, 1 - self.burst_risk) / batches - _EPS))
            cost = shares * instances
            configs: list[StageConfig] = []
            best_cost = math.inf
            for i in np.lexsort((instances, cost, latency)):
                if cost[i] < best_cost:
                    best_cost = float(cost[i])
                    configs.append(StageConfig(start, end, int(batches[i]), int(shares[i]), int(instances[i]), float(latency[i]), rate_rps))
            self._fronts[key] = (np.array([c.latency_ms for c in configs]), tuple(configs))
        return self._fronts[key]

    def pareto_configs(self, start: int, end: int, rate_rps: float, budget_ms: float) -> tuple[StageConfig, ...]:
        """The efficient configurations whose batch latency fits ``budget_ms``, fastest first."""
        latencies, configs = self.front(start, end, rate_rps)
        return configs[: int(np.searchsorted(latencies, budget_ms + _EPS, side="right"))]

    def min_resource(self, start: int, end: int, rate_rps: float, budget_ms: float) -> StageConfig | None:
        """The cheapest configuration whose batch latency fits ``budget_ms``, or None.

        ``budget_ms`` is an *execution* budget (Graft halves the time budget for queueing before
        calling this). Among equally cheap configurations the fastest wins.
        """
        fitting = self.pareto_configs(start, end, rate_rps, budget_ms)
        return fitting[-1] if fitting else None

    def suffix_batch1_ms(self, start: int) -> float:
        """Blocks ``[start, N)`` at batch 1 on a whole GPU (0 when nothing is left for the server).

        The server term of Neurosurgeon's split choice."""
        return 0.0 if start >= self.num_blocks else self.latency_ms(start, self.num_blocks, 1, 100)
