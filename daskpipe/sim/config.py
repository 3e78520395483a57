"""How a plan is simulated, apart from the load factor: one checked bundle for :func:`~daskpipe.sim.simulate.simulate`,
:func:`~daskpipe.sim.simulate.find_max_load` and ``daskpipe simulate``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from daskpipe.sched.api import Placement
from daskpipe.sched.registry import check_name
from daskpipe.sim.engine import check_ratios
from daskpipe.sim.workload import Trace as ArrivalTrace


@dataclass(frozen=True)
class SimulationConfig:
    """The workload, the data plane and the cluster's unplanned details of a simulation; a bad
    field fails here with a ``ValueError`` naming it, before any run.

    ``arrivals``: ``"poisson"``, ``"bursty"`` (gamma gaps with ``bursty_cv``), a trace file path or
    a loaded trace. ``noise``: sigma of a mean-one log-normal factor on every duration;
    ``latency_ratios``: measured/profiled compute ratios, one drawn for each compute (latency noise
    as the runtime measured it; docs/simulator.md). ``bw_gbps`` defaults to the plan's cluster
    record. ``base_rates`` feed each model at ``load_factor`` times this rate instead of its plan
    throughput (to feed a baseline's plan at PPipe's absolute rates); ``placements`` replace the
    plan's own. ``timeout_s``/``max_batch`` are the timeout data plane's knobs (``max_batch`` also
    caps the eager and deferred ones); ``settings`` goes to the dispatcher.
    """

    dataplane: str = "ppipe"
    arrivals: str | ArrivalTrace = "poisson"
    duration: float = 30.0  # seconds of arrivals; the run goes on until every request has ended
    seed: int = 1
    noise: float = 0.0
    latency_ratios: Sequence[float] | None = None
    bursty_cv: float = 2.0
    bw_gbps: float | None = None
    gpus_per_server: Mapping[str, int] | None = None
    base_rates: Mapping[str, float] | None = None
    placements: Mapping[str, Placement] | None = None
    timeout_s: float = 0.002
    max_batch: int | None = None
    settings: Any = None

    def __post_init__(self) -> None:
        check_name(self.dataplane)
        if not (self.duration > 0 and math.isfinite(self.duration)):
            raise ValueError(f"duration must be a positive number of seconds, got {self.duration!r}")
        if not (self.timeout_s >= 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"timeout_s must be a non-negative number of seconds, got {self.timeout_s!r}")
        if self.latency_ratios is not None:
            check_ratios(self.latency_ratios)
