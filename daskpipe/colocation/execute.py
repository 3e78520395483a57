"""Executing a plan's co-located partitions: who shares each physical GPU, and how long a stage
takes there, for the simulator and the runtime's emulated workers alike.

A co-located partition (``Partition.device`` set) is one MPS share of a physical GPU that other
models' partitions may share. Its latency is the plan's interference model
(``Plan.interference``) evaluated with every other partition on that device as a co-runner at its
pipeline's batch size: static interference, as InSS's model assumes (a co-runner is counted
whether or not it is busy at that instant, which is conservative).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np

from daskpipe.colocation.latency import Colocated, ColocationError, InterferenceModel
from daskpipe.plan.schema import Plan
from daskpipe.profiles.model import Profile
from daskpipe.sched.api import Placement, Slot


@dataclass(frozen=True)
class ColocatedStage:
    """One co-located partition: its GPU type, itself at its pipeline's batch, and its co-runners."""

    gpu: str
    me: Colocated
    corunners: tuple[Colocated, ...]


def colocated_latency_us(model: InterferenceModel, stage: ColocatedStage, batch: int) -> float:
    """The latency (µs) of one batch of ``batch`` on ``stage``'s share next to its co-runners."""
    return 1000.0 * model.exec_ms(stage.gpu, replace(stage.me, batch=batch), stage.corunners)


def is_colocated(plan: Plan) -> bool:
    return any(part.device for m in plan.models for p in m.pipelines for part in p.partitions)


def interference_of(plan: Plan) -> InterferenceModel:
    """The interference model a co-located plan carries (``PlanError``-like message if it has none)."""
    if not plan.interference:
        raise ColocationError(
            f"the {plan.strategy!r} plan co-locates partitions but carries no interference model (field 'interference'); re-plan it"
        )
    return InterferenceModel.from_dict(plan.interference, source="plan field 'interference'")


def colocated_stages(plan: Plan) -> dict[tuple[str, int, int], ColocatedStage]:
    """Every co-located partition of ``plan`` by (model, pipeline, partition), with its co-runners.

    Raises :class:`ColocationError` if one device holds partitions of two GPU types. Shares may add
    up to more than the GPU: MPS allows it, and the latency model then time-shares the SMs.
    """
    residents: dict[str, list[tuple[tuple[str, int, int], str, Colocated]]] = {}
    for m in plan.models:
        for pi, pipeline in enumerate(m.pipelines):
            for qi, part in enumerate(pipeline.partitions):
                if part.device:
                    residents.setdefault(part.device, []).append(
                        ((m.name, pi, qi), part.gpu, Colocated(m.name, part.share, pipeline.batch_size))
                    )
    stages = {}
    for device, rows in residents.items():
        types = sorted({gpu for _, gpu, _ in rows})
        if len(types) > 1:
            raise ColocationError(f"device {device!r} holds partitions of GPU types {types}; a physical GPU has one type")
        for key, gpu, proc in rows:
            stages[key] = ColocatedStage(gpu, proc, tuple(p for k, _, p in rows if k != key))
    return stages


class ColocatedLatency:
    """The co-located latency of each co-located stage of one model of a plan; pure (no clock, no
    GPU), so the simulator's ground truth and the runtime's emulated hold time are one function.

    ``scale`` multiplies every latency (the runtime's time dilation).
    """

    def __init__(self, model: InterferenceModel, stages: Mapping[tuple[int, int], ColocatedStage], scale: float = 1.0) -> None:
        if not scale > 0:
            raise ColocationError(f"scale must be > 0, got {scale!r}")
        self.model, self.stages, self.scale = model, dict(stages), scale

    def latency_us(self, pipeline: int, partition: int, batch: int) -> float | None:
        """µs for a batch of ``batch`` on that stage; ``None`` if the stage is not co-located."""
        stage = self.stages.get((pipeline, partition))
        return None if stage is None else self.scale * colocated_latency_us(self.model, stage, batch)


def colocated_latency(plan: Plan, model: str, *, scale: float = 1.0) -> ColocatedLatency | None:
    """``model``'s co-located stages in ``plan``; ``None`` when none of its partitions is co-located."""
    stages = {(pi, qi): stage for (name, pi, qi), stage in colocated_stages(plan).items() if name == model}
    return ColocatedLatency(interference_of(plan), stages, scale) if stages else None


def colocated_placements(plan: Plan) -> dict[str, Placement]:
    """One slot per co-located partition, on a server named after its device (single-partition
    pipelines never cross a NIC). Plans mixing co-located and pooled partitions are refused."""
    placements = {}
    for m in plan.models:
        pools: dict[tuple[int, int], tuple[str, ...]] = {}
        slots: dict[str, Slot] = {}
        for pi, pipeline in enumerate(m.pipelines):
            for qi, part in enumerate(pipeline.partitions):
                if not part.device:
                    raise ColocationError(
                        f"model {m.name!r} pipeline {pi} partition {qi} is pooled, other partitions of the plan are co-located; "
                        "the simulator executes plans that are one or the other"
                    )
                slot = Slot(id=f"{part.device}/{m.name}/{pi}.{qi}", gpu=part.gpu, slices=part.slices, server=part.device)
                slots[slot.id] = slot
                pools[(pi, qi)] = (slot.id,)
        placements[m.name] = Placement(model=m.name, pools=pools, slots=slots)
    return placements


def colocated_profile(profile: Profile, plan: Plan) -> Profile:
    """``profile`` with the table of every (GPU type, slices) that a co-located partition of its
    model uses replaced by the co-located latency, so that dispatchers plan with what the
    interference model predicts. Partitions of the model sharing one such key (replicas at nearby
    shares) get the slowest of their latencies: the dispatcher's belief stays on the safe side.
    The latency of a batch is spread over the partition's blocks in the proportions of the
    profile's own table there (evenly without one).
    """
    latency = colocated_latency(plan, profile.model)
    if latency is None:
        return profile
    model_plan = plan.model(profile.model)
    batches = latency.model.max_batch
    tables = dict(profile.latency_us)
    worst: dict[tuple[str, int], np.ndarray] = {}
    for (pi, qi), _ in sorted(latency.stages.items()):
        part = model_plan.pipelines[pi].partitions[qi]
        key = (part.gpu, part.slices)
        totals = np.array([latency.latency_us(pi, qi, b) for b in range(1, batches + 1)])
        worst[key] = np.maximum(worst[key], totals) if key in worst else totals
        start, end = part.blocks
        own = profile.latency_us.get(key)
        if own is not None:  # block proportions at each batch (the last profiled one beyond it)
            rows = own[start:end, np.minimum(np.arange(batches), own.shape[1] - 1)]
            weights = rows / np.maximum(rows.sum(axis=0, keepdims=True), 1e-12)
        else:
            weights = np.full((end - start, batches), 1.0 / (end - start))
        table = np.zeros((profile.num_blocks, batches))
        if key in tables:
            previous = tables[key][:, :batches]
            table[:, : previous.shape[1]] = previous
        table[start:end] = weights * worst[key]
        tables[key] = table
    return replace(profile, latency_us=tables)
