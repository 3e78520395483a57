"""The plan: which pooled pipelines serve each model, and with how many (virtual) GPUs.

A plan is what the control plane hands to the data plane (simulator or Dask runtime). It is saved
as JSON (``plan.json``) and validated on load so that a corrupt file fails with the field it lacks.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

from daskpipe.jsonfile import read_json_object

FORMAT = "daskpipe-plan/1"


class PlanError(ValueError):
    """A plan file is malformed, or a plan cannot be made; the message says what to change."""


def relative_gap(objective: float, bound: float | None) -> float | None:
    """How far ``objective`` may lie below the optimum, as a share of ``bound``; 0 when the bound is met."""
    if bound is None:
        return None
    return max(0.0, (bound - objective) / bound) if bound > 0 else 0.0


@dataclass(frozen=True)
class Partition:
    """Blocks ``[start, end)`` of a model served by a pool of ``vgpus`` slices of 1/``slices`` of a ``gpu``."""

    blocks: tuple[int, int]
    gpu: str
    slices: int  # v: the GPU is cut into v equal MPS slices
    vgpus: int  # pool size, in slices
    latency_us: float  # one batch of the pipeline's batch size on one slice
    transfer_us: float = 0.0  # the batch's feature map leaving this partition (0 for the last)
    # Co-location (docs/colocation.md): the one vGPU is an MPS ``share`` (fraction of SMs) of the
    # physical GPU ``device`` (a plan-wide id), which other models' partitions may share; "" = none.
    device: str = ""
    share: float = 0.0
    table: str = ""  # where the pool's latency table came from: "measured", "estimated", or "" (not recorded)

    @property
    def num_gpus(self) -> float:
        """Physical GPUs the pool occupies (a co-located partition: its share of its device)."""
        return self.share if self.device else self.vgpus / self.slices


@dataclass(frozen=True)
class Pipeline:
    batch_size: int
    throughput: float  # req/s the plan expects of it
    partitions: tuple[Partition, ...]
    entry_block: int = 0  # hybrid inference: requests entering at this block take it (docs/hybrid.md)
    slo_us: float | None = None  # the latency budget of those requests; None: the model's SLO

    @property
    def latency_us(self) -> float:
        return sum(p.latency_us + p.transfer_us for p in self.partitions)


@dataclass(frozen=True)
class ModelPlan:
    name: str
    slo_us: float
    weight: float
    throughput: float
    pipelines: tuple[Pipeline, ...]

    @cached_property
    def max_batch(self) -> int:
        """The largest planned batch (1 without pipelines): the most samples one request may hold."""
        return max((p.batch_size for p in self.pipelines), default=1)

    def entry_slo_us(self) -> dict[int, float]:
        """The latency budget per entry block: the tightest of the pipelines entering there (a
        model without pipelines still takes whole-model requests, to drop them "no-capacity")."""
        budgets: dict[int, float] = {}
        for p in self.pipelines:
            slo = self.slo_us if p.slo_us is None else p.slo_us
            budgets[p.entry_block] = min(budgets.get(p.entry_block, slo), slo)
        return budgets or {0: self.slo_us}


@dataclass(frozen=True)
class Plan:
    """A solved plan; ``cluster`` records the inventory it was made for.

    ``bound`` is the best upper bound on the objective that planning proved (``None``: no bound,
    as for heuristic strategies); the plan is at most ``gap`` below the optimum.
    """

    objective: float
    models: tuple[ModelPlan, ...]
    strategy: str = "ppipe"
    cluster: Mapping[str, Any] = field(default_factory=dict)  # gpus, gpus_per_server, bw_gbps
    solver: Mapping[str, Any] = field(default_factory=dict)  # name, status, seconds
    settings: Mapping[str, Any] = field(default_factory=dict)  # margin, max_parts, ...
    interference: Mapping[str, Any] = field(default_factory=dict)  # co-location: InterferenceModel.to_dict()
    bound: float | None = None

    @property
    def gap(self) -> float | None:
        """(bound - objective) / bound: how far below the optimum the plan may be; ``None`` without a bound."""
        return relative_gap(self.objective, self.bound)

    def quality(self) -> str:
        """One line for people: the objective, the bound and the gap, or that there is no bound."""
        if self.gap is None:
            return f"objective {self.objective:.1f}, not proven (no bound)"
        proven = "proven" if self.solver.get("status") == "optimal" else "NOT proven"
        return f"objective {self.objective:.1f}, bound {self.bound:.1f}, gap {100 * self.gap:.2f}% ({proven})"

    def model(self, name: str) -> ModelPlan:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(f"plan has no model {name!r} (has {[m.name for m in self.models]})")

    def gpus_used(self) -> dict[str, float]:
        used: dict[str, float] = {}
        for m in self.models:
            for p in m.pipelines:
                for part in p.partitions:
                    used[part.gpu] = used.get(part.gpu, 0.0) + part.num_gpus
        return used

    # -- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def part(p: Partition) -> dict[str, Any]:
            d = asdict(p)
            d["blocks"] = list(p.blocks)
            d["num_gpus"] = p.num_gpus
            if not p.device:  # plans without co-location keep their old form
                del d["device"], d["share"]
            if not p.table:
                del d["table"]
            return d

        return {
            "format": FORMAT,
            "strategy": self.strategy,
            "objective": self.objective,
            **({"bound": self.bound, "gap": self.gap} if self.bound is not None else {}),
            "models": [
                {
                    "name": m.name,
                    "slo_us": m.slo_us,
                    "weight": m.weight,
                    "throughput": m.throughput,
                    "pipelines": [
                        {
                            "throughput": p.throughput,
                            "batch_size": p.batch_size,
                            "latency_us": p.latency_us,
                            "partitions": [part(x) for x in p.partitions],
                            **({"entry_block": p.entry_block} if p.entry_block else {}),
                            **({"slo_us": p.slo_us} if p.slo_us is not None else {}),
                        }
                        for p in m.pipelines
                    ],
                }
                for m in self.models
            ],
            "cluster": dict(self.cluster),
            "solver": dict(self.solver),
            "settings": dict(self.settings),
            **({"interference": dict(self.interference)} if self.interference else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<memory>") -> Plan:
        def get(obj: Mapping[str, Any], key: str, where: str) -> Any:
            if not isinstance(obj, Mapping) or key not in obj:
                raise PlanError(f"{source}: missing field {where}{key!r}")
            return obj[key]

        def num(x: Any, where: str, positive: bool = False) -> float:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0 or (positive and x <= 0):
                raise PlanError(f"{source}: field {where} must be a {'positive' if positive else 'non-negative'} number, got {x!r:.60}")
            return float(x)

        def seq(x: Any, where: str) -> list | tuple:
            if not isinstance(x, (list, tuple)):
                raise PlanError(f"{source}: field {where} must be a list, got {type(x).__name__}")
            return x

        def obj(x: Any, where: str) -> dict[str, Any]:
            if not isinstance(x, Mapping):
                raise PlanError(f"{source}: field {where} must be an object, got {type(x).__name__}")
            return dict(x)

        def integer(x: Any, where: str) -> int:
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise PlanError(f"{source}: field {where} must be an integer >= 1, got {x!r:.60}")
            return x

        if data.get("format", FORMAT) != FORMAT:
            raise PlanError(f"{source}: field 'format' is {data.get('format')!r}, expected {FORMAT!r}")
        models = []
        for mi, m in enumerate(seq(get(data, "models", ""), "models")):
            mw = f"models[{mi}]."
            pipelines = []
            for pi, p in enumerate(seq(get(m, "pipelines", mw), f"{mw}pipelines")):
                pw = f"{mw}pipelines[{pi}]."
                parts = []
                for qi, q in enumerate(seq(get(p, "partitions", pw), f"{pw}partitions")):
                    qw = f"{pw}partitions[{qi}]."
                    blocks = get(q, "blocks", qw)
                    if not (
                        isinstance(blocks, (list, tuple))
                        and len(blocks) == 2
                        and all(isinstance(b, int) for b in blocks)
                        and 0 <= blocks[0] < blocks[1]
                    ):
                        raise PlanError(f"{source}: field {qw}blocks must be [start, end) with 0 <= start < end, got {blocks!r}")
                    slices = integer(get(q, "slices", qw), f"{qw}slices")
                    device = q.get("device", "")
                    if not isinstance(device, str):
                        raise PlanError(f"{source}: field {qw}device must be a GPU id string, got {device!r:.60}")
                    share = num(q.get("share", 0.0), f"{qw}share")
                    if device and not (0 < share <= 1 and q.get("vgpus", 1) == 1):
                        raise PlanError(
                            f"{source}: co-located partition {qw[:-1]} (device {device!r}) needs 0 < share <= 1 and vgpus 1, got share "
                            f"{share!r}, vgpus {q.get('vgpus')!r}"
                        )
                    vgpus = q.get("vgpus")
                    if vgpus is None:  # accept plans that only give physical GPUs
                        vgpus = 1 if device else round(num(get(q, "num_gpus", qw), f"{qw}num_gpus") * slices)
                    parts.append(
                        Partition(
                            blocks=(blocks[0], blocks[1]),
                            gpu=str(get(q, "gpu", qw)),
                            slices=slices,
                            vgpus=integer(vgpus, f"{qw}vgpus"),
                            latency_us=num(get(q, "latency_us", qw), f"{qw}latency_us"),
                            transfer_us=num(q.get("transfer_us", 0.0), f"{qw}transfer_us"),
                            device=device,
                            share=share if device else 0.0,
                            table=str(q.get("table", "")),
                        )
                    )
                if not parts:
                    raise PlanError(f"{source}: field {pw}partitions is empty")
                for a, b in zip(parts, parts[1:]):
                    if a.blocks[1] != b.blocks[0]:
                        raise PlanError(f"{source}: {pw}partitions are not contiguous: {list(a.blocks)} then {list(b.blocks)}")
                entry = p.get("entry_block", 0)
                if isinstance(entry, bool) or not isinstance(entry, int) or entry < 0:
                    raise PlanError(f"{source}: field {pw}entry_block must be an integer >= 0, got {entry!r:.60}")
                if parts[0].blocks[0] != entry:
                    raise PlanError(
                        f"{source}: {pw}partitions[0] must start at block {entry} (its entry_block), starts at {parts[0].blocks[0]}"
                    )
                slo = p.get("slo_us")
                pipelines.append(
                    Pipeline(
                        batch_size=integer(get(p, "batch_size", pw), f"{pw}batch_size"),
                        throughput=num(get(p, "throughput", pw), f"{pw}throughput"),
                        partitions=tuple(parts),
                        entry_block=entry,
                        slo_us=None if slo is None else num(slo, f"{pw}slo_us", positive=True),
                    )
                )
            models.append(
                ModelPlan(
                    name=str(get(m, "name", mw)),
                    slo_us=num(get(m, "slo_us", mw), f"{mw}slo_us", positive=True),
                    weight=num(m.get("weight", 1.0), f"{mw}weight", positive=True),
                    throughput=num(get(m, "throughput", mw), f"{mw}throughput"),
                    pipelines=tuple(pipelines),
                )
            )
        return cls(
            objective=num(get(data, "objective", ""), "objective"),
            models=tuple(models),
            strategy=str(data.get("strategy", "ppipe")),
            cluster=obj(data.get("cluster", {}), "cluster"),
            solver=obj(data.get("solver", {}), "solver"),
            settings=obj(data.get("settings", {}), "settings"),
            interference=dict(data.get("interference", {})),
            bound=None if data.get("bound") is None else num(data["bound"], "bound"),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_dict(read_json_object(path, PlanError), source=str(path))
