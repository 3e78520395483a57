"""The placement-policy interface: workloads and GPUs in, replicas (GPU, MPS share, batch) out.

This is the thesis's ``run_placement_policy(clients, gpus)`` in our terms. A policy is a
``PlacementPolicy`` subclass, registered under a ``Strategy``; ``make_policy`` is the factory (the
vLLM habit: an enum plus a factory over an ABC). Policies never read a clock or touch a GPU: they
see the latency model only, and the evaluator (or the runtime) executes what they return.
"""

from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Sequence

from daskpipe.colocation.latency import Colocated, ColocationError, InterferenceModel


@dataclass(frozen=True)
class Workload:
    """One model (or pipeline stage) to serve: its arrival rate (req/s) and latency SLO (ms)."""

    name: str
    rate: float
    slo_ms: float

    def __post_init__(self) -> None:
        if self.rate < 0 or self.slo_ms <= 0:
            raise ColocationError(f"workload {self.name!r}: rate must be >= 0 and slo_ms > 0, got rate={self.rate}, slo_ms={self.slo_ms}")


@dataclass(frozen=True)
class Gpu:
    """One physical GPU of the cluster: a unique id and its type (a key of the model's ``gpus``)."""

    uid: str
    type: str


@dataclass(frozen=True)
class Replica:
    """One process serving ``model`` on GPU ``gpu`` with MPS ``share`` at batch ``batch``.

    ``weight`` is the share of the model's traffic routed to it (relative to its siblings);
    ``timeout_ms`` bounds how long a partial batch waits (``None``: until the oldest request's
    deadline forces it out).
    """

    model: str
    gpu: str
    share: float
    batch: int
    weight: float = 1.0
    timeout_ms: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1 or self.batch < 1 or self.weight <= 0:
            raise ColocationError(f"replica of {self.model!r} on {self.gpu!r}: need 0 < share <= 1, batch >= 1, weight > 0; got {self}")

    def process(self) -> Colocated:
        return Colocated(self.model, self.share, self.batch)


@dataclass(frozen=True)
class PlacementPlan:
    """What a policy returns; ``info`` carries policy-specific figures (search score, solver status)."""

    policy: str
    replicas: tuple[Replica, ...]
    info: dict[str, Any] = field(default_factory=dict)

    def on_gpu(self, uid: str) -> list[Replica]:
        return [r for r in self.replicas if r.gpu == uid]

    def of_model(self, model: str) -> list[Replica]:
        return [r for r in self.replicas if r.model == model]

    def corunners(self, replica: Replica) -> list[Colocated]:
        """The processes sharing ``replica``'s GPU (the same replica object excluded once)."""
        siblings = self.on_gpu(replica.gpu)
        siblings.remove(replica)
        return [r.process() for r in siblings]

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "replicas": [asdict(r) for r in self.replicas], "info": dict(self.info)}


class Strategy(str, enum.Enum):
    """Every co-location policy, by the name the planner's ``--strategy`` and the bench use."""

    INSS = "inss"
    IGNITER = "igniter"
    USHER = "usher"
    WSM_MILP = "wsm-milp"
    GSLICE = "gslice"
    GPULET = "gpulet"


# Where each strategy's class lives (imported on use, so mip and torch load only when needed).
_REGISTRY: dict[Strategy, str] = {
    Strategy.INSS: "daskpipe.colocation.inss:InssPolicy",
    Strategy.IGNITER: "daskpipe.colocation.igniter:IgniterPolicy",
    Strategy.USHER: "daskpipe.colocation.usher:UsherPolicy",
    Strategy.WSM_MILP: "daskpipe.colocation.usher:WsmMilpPolicy",
    Strategy.GSLICE: "daskpipe.colocation.fixed_share:GslicePolicy",
    Strategy.GPULET: "daskpipe.colocation.fixed_share:GpuletPolicy",
}


class PlacementPolicy(ABC):
    """Decides a static placement. Subclasses take their knobs as keyword-only ``__init__``
    arguments and implement ``place``."""

    strategy: ClassVar[Strategy]

    def __init__(self, model: InterferenceModel) -> None:
        self.model = model

    @abstractmethod
    def place(self, workloads: Sequence[Workload], gpus: Sequence[Gpu]) -> PlacementPlan:
        """Replicas for ``workloads`` on ``gpus``; a workload the policy cannot serve gets none."""

    # -- helpers every policy uses ---------------------------------------------------------------
    def check(self, workloads: Sequence[Workload], gpus: Sequence[Gpu]) -> None:
        if not workloads or not gpus:
            raise ColocationError(f"{self.strategy.value}: need at least one workload and one GPU, got {len(workloads)} and {len(gpus)}")
        for names, what in (([w.name for w in workloads], "workload"), ([g.uid for g in gpus], "GPU uid")):
            dup = {n for n in names if names.count(n) > 1}
            if dup:
                raise ColocationError(f"{self.strategy.value}: duplicate {what}(s) {sorted(dup)}")
        for g in gpus:
            self.model.gpu(g.type)
            for w in workloads:
                self.model.coeff(w.name, g.type)

    def solo_exec_ms(self, workload: str, gpu_type: str, share: float, batch: int) -> float:
        return self.model.exec_ms(gpu_type, Colocated(workload, share, batch))

    def min_share_for(self, workload: Workload, gpu_type: str, batch: int, budget_ms: float, step: float) -> float | None:
        """Smallest multiple of ``step`` at which one batch alone takes <= ``budget_ms`` (``None`` if
        even the whole GPU is too slow)."""
        steps = int(round(1.0 / step))
        for n in range(1, steps + 1):
            share = min(1.0, n * step)
            if self.solo_exec_ms(workload.name, gpu_type, share, batch) <= budget_ms:
                return share
        return None


def make_policy(strategy: str | Strategy, model: InterferenceModel, **options: Any) -> PlacementPolicy:
    """Build the policy registered for ``strategy`` (a ``Strategy`` or its value)."""
    try:
        key = Strategy(strategy)
    except ValueError as exc:
        raise ColocationError(f"Unknown co-location strategy {strategy!r}; choose one of {[s.value for s in Strategy]}") from exc
    module, attr = _REGISTRY[key].split(":")
    cls = getattr(importlib.import_module(module), attr)
    return cls(model, **options)


def run_placement_policy(
    workloads: Sequence[Workload],
    gpus: Sequence[Gpu],
    strategy: str | Strategy = Strategy.INSS,
    model: InterferenceModel | None = None,
    **options: Any,
) -> PlacementPlan:
    """The thesis's one-call API; without ``model`` the emulated InSS testbed is used."""
    if model is None:
        from daskpipe.colocation.defaults import inss_testbed

        model = inss_testbed()
    return make_policy(strategy, model, **options).place(workloads, gpus)
