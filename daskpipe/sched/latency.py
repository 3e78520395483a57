"""Stage latencies corrected by what execution measures.

A profile is taken once, on a machine that may have been quieter, and gives a mean. While serving, a
stage can run slower than profiled (another allocator, a busy host) and varies from batch to batch,
so a batch planned to end at its deadline with the mean ends after it about half of the time.
:class:`MeasuredLatency` keeps the recent ratios of measured to profiled compute time of one stage
and derives two factors on its profile: ``typical`` for reservations, the time a slot is busy,
and ``high`` (a high quantile) for deadlines, the time a batch may take.
"""

from __future__ import annotations

import math
from collections import deque

FACTOR_STEP = 0.01
"""Factors are rounded to this step: the tables change when the measure moves, not with every sample,
and execution that keeps to the profile leaves both factors at exactly 1."""


class MeasuredLatency:
    """Recent measured/profiled compute ratios of one stage, and the factors dispatch plans with.

    ``typical`` is a lower confidence bound of the median (the ratio ranked sqrt(n) below the
    middle of n, about two standard errors), and 1 unless that bound is over 1: the profile stands
    until the window shows, beyond its sampling error, that the stage runs slower. Every percent
    added to every reservation is a percent of capacity lost; in the simulator at load 0.85 with
    log-normal noise of sigma 0.2, following the median of the first 20-100 batches (1.05-1.1 by
    chance) tipped a pipeline into a congestion it did not leave. A rank statistic, not the mean,
    so that one stall (a garbage collection) does not lengthen every reservation for a window; not
    below 1, because a stage that runs faster than profiled only ends early, which feedback already
    gives back to the tables. Until ``min_samples`` ratios are in, both factors stay 1.
    """

    __slots__ = ("quantile", "min_samples", "ratios", "typical", "high", "refresh_every", "since_refresh")

    def __init__(self, quantile: float, window: int, min_samples: int):
        if not 0.5 <= quantile < 1:
            raise ValueError(f"quantile must be in [0.5, 1), got {quantile!r}")
        if not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got min_samples={min_samples!r}, window={window!r}")
        self.quantile = quantile
        self.min_samples = min_samples
        self.ratios: deque[float] = deque(maxlen=window)
        self.typical = 1.0
        self.high = 1.0
        self.refresh_every = max(1, window // 10)  # sorting the window on every sample would cost more than the probe
        self.since_refresh = self.refresh_every

    @property
    def median(self) -> float | None:
        """The median measured/profiled ratio of the window, once ``min_samples`` are in: where the
        stage really runs against its profile, in both directions (``typical`` never goes below 1)."""
        ratios = self.ratios
        if len(ratios) < self.min_samples:
            return None
        return float(sorted(ratios)[len(ratios) // 2])

    def add(self, ratio: float) -> bool:
        """Record one measured/profiled ratio; True when the factors moved (the tables need rebuilding)."""
        ratios = self.ratios
        ratios.append(ratio)
        self.since_refresh += 1
        if len(ratios) < self.min_samples or self.since_refresh < self.refresh_every:
            return False
        self.since_refresh = 0
        ordered = sorted(ratios)
        n = len(ordered)
        typical = max(1.0, rounded(ordered[max(0, math.floor(n / 2 - math.sqrt(n)))]))
        high = max(typical, rounded(ordered[min(n - 1, math.ceil(self.quantile * n) - 1)]))
        moved = typical != self.typical or high != self.high
        self.typical, self.high = typical, high
        return moved


def rounded(factor: float) -> float:
    return round(factor / FACTOR_STEP) * FACTOR_STEP
