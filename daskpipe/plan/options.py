"""How the planner plans, apart from what it plans: one checked bundle for ``make_plan``, ``deploy``,
the scheduler's elastic re-planner (which receives it over the wire as a dict) and ``daskpipe plan``.

The models, the GPU inventory, the workload weights and the SLOs are each call's inputs and stay
arguments of :func:`~daskpipe.plan.milp.make_plan`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from daskpipe.colocation.policy import Strategy as ColocationStrategy
from daskpipe.plan.schema import PlanError

COLOCATION_STRATEGIES = tuple(s.value for s in ColocationStrategy)  # several models on MPS shares of one GPU
STRATEGIES = ("ppipe", "np", "dart-r", *COLOCATION_STRATEGIES)
SOLVERS = ("auto", "cbc", "highs")


def check_positive(x: Any, what: str) -> None:
    """``x`` is a finite real number > 0, else a :class:`PlanError` naming ``what``."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise PlanError(f"{what} must be a positive number, got {x!r}")


@dataclass(frozen=True)
class PlannerOptions:
    """The planner's knobs; a bad one fails here, named, before any planning.

    ``strategy`` is ``ppipe`` (pooled pipelines of up to ``max_parts`` partitions on MPS slices),
    ``np`` (whole models on whole GPUs), ``dart-r`` (DART's two-GPU plan replicated over GPU pairs)
    or a co-location policy of :data:`COLOCATION_STRATEGIES` (``max_parts``, ``solver`` and the
    batch-build estimate do not apply there). Pipelines must fit ``(1 - margin)`` of the SLO.
    ``allow_missing_gpus`` lets a model plan on the cluster's GPU types its profile has, instead of
    failing on the ones it lacks. ``one_pipeline_per_route`` keeps PPipe's formulation, where each
    sequence of GPU types (a route) carries at most one pipeline. ``time_limit`` bounds the whole
    plan (every solve of it together); planning stops once the plan is proven within ``gap`` of the
    optimum (a relative gap: 0.005 = 0.5%).
    """

    strategy: str = "ppipe"
    bw_gbps: float = 10.0  # effective network bandwidth per server
    margin: float = 0.4  # share of the SLO the plan keeps free
    max_parts: int = 2
    time_limit: float = 60  # seconds for the whole plan
    solver: str = "auto"
    gap: float = 0.005
    batch_build_estimate: bool = True
    allow_missing_gpus: bool = False
    one_pipeline_per_route: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise PlanError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if self.solver not in SOLVERS:
            raise PlanError(f"unknown solver {self.solver!r}; choose one of {', '.join(SOLVERS)}")
        check_positive(self.bw_gbps, "bw_gbps")
        check_positive(self.time_limit, "time_limit")
        if isinstance(self.margin, bool) or not (isinstance(self.margin, (int, float)) and 0 <= self.margin < 1):
            raise PlanError(f"margin must be in [0, 1) (the share of the SLO kept free), got {self.margin!r}")
        if isinstance(self.gap, bool) or not (isinstance(self.gap, (int, float)) and 0 <= self.gap < 1):
            raise PlanError(f"gap must be in [0, 1) (the relative gap at which planning stops), got {self.gap!r}")
        if isinstance(self.max_parts, bool) or not isinstance(self.max_parts, int) or self.max_parts < 1:
            raise PlanError(f"max_parts must be an integer >= 1, got {self.max_parts!r}")
        for name in ("batch_build_estimate", "allow_missing_gpus", "one_pipeline_per_route"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlannerOptions:
        known = sorted(f.name for f in fields(cls))
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise PlanError(f"unknown planner options {unknown}; known: {known}")
        return cls(**data)
