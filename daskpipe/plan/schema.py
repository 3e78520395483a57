"""The plan: which pooled pipelines serve each model, and with how many (virtual) GPUs.

A plan is what the control plane hands to the data plane (simulator or Dask runtime). It is saved
as JSON (``plan.json``) and validated on load so that a corrupt file fails with the field it lacks.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from daskpipe.jsonfile import read_json_object

FORMAT = "daskpipe-plan/1"


class PlanError(ValueError):
    """A plan file is malformed, or a plan cannot be made; the message says what to change."""


@dataclass(frozen=True)
class Partition:
    """Blocks ``[start, end)`` of a model served by a pool of ``vgpus`` slices of 1/``slices`` of a ``gpu``."""

    blocks: tuple[int, int]
    gpu: str
    slices: int  # v: the GPU is cut into v equal MPS slices
    vgpus: int  # pool size, in slices
    latency_us: float  # one batch of the pipeline's batch size on one slice
    transfer_us: float = 0.0  # the batch's feature map leaving this partition (0 for the last)

    @property
    def num_gpus(self) -> float:
        """Physical GPUs the pool occupies."""
        return self.vgpus / self.slices


@dataclass(frozen=True)
class Pipeline:
    batch_size: int
    throughput: float  # req/s the plan expects of it
    partitions: tuple[Partition, ...]

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


@dataclass(frozen=True)
class Plan:
    """A solved plan; ``cluster`` records the inventory it was made for."""

    objective: float
    models: tuple[ModelPlan, ...]
    strategy: str = "ppipe"
    cluster: Mapping[str, Any] = field(default_factory=dict)  # gpus, gpus_per_server, bw_gbps
    solver: Mapping[str, Any] = field(default_factory=dict)  # name, status, seconds
    settings: Mapping[str, Any] = field(default_factory=dict)  # margin, max_parts, ...

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
            return d

        return {
            "format": FORMAT,
            "strategy": self.strategy,
            "objective": self.objective,
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
                        }
                        for p in m.pipelines
                    ],
                }
                for m in self.models
            ],
            "cluster": dict(self.cluster),
            "solver": dict(self.solver),
            "settings": dict(self.settings),
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

        def integer(x: Any, where: str) -> int:
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise PlanError(f"{source}: field {where} must be an integer >= 1, got {x!r:.60}")
            return x

        if data.get("format", FORMAT) != FORMAT:
            raise PlanError(f"{source}: field 'format' is {data.get('format')!r}, expected {FORMAT!r}")
        models = []
        for mi, m in enumerate(get(data, "models", "")):
            mw = f"models[{mi}]."
            pipelines = []
            for pi, p in enumerate(get(m, "pipelines", mw)):
                pw = f"{mw}pipelines[{pi}]."
                parts = []
                for qi, q in enumerate(get(p, "partitions", pw)):
                    qw = f"{pw}partitions[{qi}]."
                    blocks = get(q, "blocks", qw)
                    if not (isinstance(blocks, (list, tuple)) and len(blocks) == 2 and all(isinstance(b, int) for b in blocks) and 0 <= blocks[0] < blocks[1]):
                        raise PlanError(f"{source}: field {qw}blocks must be [start, end) with 0 <= start < end, got {blocks!r}")
                    slices = integer(get(q, "slices", qw), f"{qw}slices")
                    vgpus = q.get("vgpus")
                    if vgpus is None:  # accept plans that only give physical GPUs
                        vgpus = round(num(get(q, "num_gpus", qw), f"{qw}num_gpus") * slices)
                    parts.append(
                        Partition(
                            blocks=(blocks[0], blocks[1]),
                            gpu=str(get(q, "gpu", qw)),
                            slices=slices,
                            vgpus=integer(vgpus, f"{qw}vgpus"),
                            latency_us=num(get(q, "latency_us", qw), f"{qw}latency_us"),
                            transfer_us=num(q.get("transfer_us", 0.0), f"{qw}transfer_us"),
                        )
                    )
                if not parts:
                    raise PlanError(f"{source}: field {pw}partitions is empty")
                for a, b in zip(parts, parts[1:]):
                    if a.blocks[1] != b.blocks[0]:
                        raise PlanError(f"{source}: {pw}partitions are not contiguous: {list(a.blocks)} then {list(b.blocks)}")
                if parts[0].blocks[0] != 0:
                    raise PlanError(f"{source}: {pw}partitions[0] must start at block 0, starts at {parts[0].blocks[0]}")
                pipelines.append(
                    Pipeline(
                        batch_size=integer(get(p, "batch_size", pw), f"{pw}batch_size"),
                        throughput=num(get(p, "throughput", pw), f"{pw}throughput"),
                        partitions=tuple(parts),
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
            cluster=dict(data.get("cluster", {})),
            solver=dict(data.get("solver", {})),
            settings=dict(data.get("settings", {})),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_dict(read_json_object(path, PlanError), source=str(path))
