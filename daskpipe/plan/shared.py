"""Shared pools: every model of a sub-cluster whole on every slot of it, as in Symphony (§2.6).

A PPipe plan gives each model pools of its own; a shared pool gives all of a sub-cluster's models
all of its slots, and one multiplexing dispatcher (``daskpipe.sched.registry.make_shared_dispatcher``)
decides batch by batch which model a free slot runs next. The plan of a shared pool is written in
the same schema: per model, one single-partition pipeline per (GPU, slices) kind of its
sub-cluster, whose pool is every slot of that kind there, at the largest batch that kind runs
within the model's SLO.

Which models go to which sub-cluster is an input here (a list of :class:`SharedGroup`); Symphony's
partitioning MILP (``daskpipe.plan.subclusters``) is one way to make that list. What a slot must
hold is counted here too (:func:`check_memory`): Symphony's constraint (5), every model's weights
plus the largest activations of any one batch (a GPU runs one batch at a time, and the caching
allocator reuses one model's activations for the next's), plus the CUDA context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan, PlanError
from daskpipe.profiles.catalog import GPUSpec, load_catalog
from daskpipe.profiles.memory import ModelMemory
from daskpipe.profiles.model import Profile

STRATEGY = "shared"
"""``Plan.strategy`` of a shared-pool plan; ``Plan.settings["subclusters"]`` lists each one's models."""


@dataclass(frozen=True)
class SharedGroup:
    """One sub-cluster as the planner sees it: its models, and its slots by (GPU, slices) kind."""

    models: tuple[str, ...]
    kinds: Mapping[tuple[str, int], int]


def largest_batch(profile: Profile, gpu: str, slices: int, slo_us: float) -> int:
    """The largest profiled batch that one slot of the kind runs within ``slo_us``; 0 if not even one."""
    best = 0
    for batch in range(1, profile.max_batch(gpu, slices) + 1):
        if profile.latency(gpu, slices, batch) > slo_us:
            break
        best = batch
    return best


def shared_plan(profiles: Mapping[str, Profile], groups: Sequence[SharedGroup], slo_us: Mapping[str, float] | None = None) -> Plan:
    """The plan of ``groups``: every model whole on every slot of its group. ``slo_us`` overrides a
    profile's SLO. A model in no group, in two, or that no kind of its group can serve within its
    SLO is a :class:`PlanError` naming it."""
    seen: dict[str, int] = {}
    for index, group in enumerate(groups):
        if not group.models or not any(group.kinds.values()):
            raise PlanError(f"sub-cluster {index} needs at least one model and one slot, got {list(group.models)} on {dict(group.kinds)}")
        for model in group.models:
            if model in seen:
                raise PlanError(f"model {model!r} is in sub-clusters {seen[model]} and {index}; a model belongs to one")
            if model not in profiles:
                raise PlanError(f"sub-cluster {index} names model {model!r}, which has no profile (have {sorted(profiles)})")
            seen[model] = index
    models = []
    for group in groups:
        for name in group.models:
            profile = profiles[name]
            slo = (slo_us or {}).get(name, profile.slo_us)
            pipelines = []
            for (gpu, slices), count in sorted(group.kinds.items()):
                if not count:
                    continue
                if (gpu, slices) not in profile.latency_us:
                    raise PlanError(f"model {name!r} has no profile on {gpu}/v{slices}, a kind of its sub-cluster's slots")
                batch = largest_batch(profile, gpu, slices, slo)
                if batch == 0:
                    raise PlanError(
                        f"model {name!r} cannot meet its SLO of {slo / 1e3:g} ms on {gpu}/v{slices}: one sample takes "
                        f"{profile.latency(gpu, slices, 1) / 1e3:g} ms"
                    )
                latency = profile.latency(gpu, slices, batch)
                part = Partition(blocks=(0, profile.num_blocks), gpu=gpu, slices=slices, vgpus=count, latency_us=latency)
                pipelines.append(Pipeline(batch, count * batch / (latency * 1e-6), (part,)))
            throughput = sum(p.throughput for p in pipelines)
            models.append(ModelPlan(name=name, slo_us=slo, weight=1.0, throughput=throughput, pipelines=tuple(pipelines)))
    objective = min((m.throughput for m in models), default=0.0)
    return Plan(objective=objective, models=tuple(models), strategy=STRATEGY, settings={"subclusters": [list(g.models) for g in groups]})


def slot_bytes(gpu: str, slices: int, catalog: Mapping[str, GPUSpec]) -> float | None:
    """What one 1/``slices`` slot of ``gpu`` may hold (its GPU's memory shared by the slices' processes); ``None``: unknown."""
    spec = catalog.get(gpu)
    return None if spec is None else spec.memory_gb * 1e9 / slices


def check_memory(
    plan: Plan,
    groups: Sequence[SharedGroup],
    memory: Mapping[str, ModelMemory],
    context_bytes: int,
    catalog: Mapping[str, GPUSpec] | None = None,
) -> None:
    """Refuse a group whose models do not fit one of its slots, with a :class:`PlanError` naming
    the models and the figures. A GPU type the catalog does not know (a CPU slot) is not checked."""
    catalog = load_catalog() if catalog is None else catalog
    for index, group in enumerate(groups):
        for gpu, slices in sorted(k for k, count in group.kinds.items() if count):
            capacity = slot_bytes(gpu, slices, catalog)
            if capacity is None:
                continue
            batches = {
                m: next(p.batch_size for p in plan.model(m).pipelines if (p.partitions[0].gpu, p.partitions[0].slices) == (gpu, slices))
                for m in group.models
            }
            weights = sum(memory[m].weights_bytes for m in group.models)
            biggest = max(group.models, key=lambda m: memory[m].activations(batches[m]))
            activations = memory[biggest].activations(batches[biggest])
            need = context_bytes + weights + activations
            if need > capacity:
                gb = 1e9
                each = ", ".join(f"{m} {memory[m].weights_bytes / gb:.2f}" for m in group.models)
                raise PlanError(
                    f"models {list(group.models)} of sub-cluster {index} do not fit one {gpu}/v{slices} slot's {capacity / gb:.2f} GB: "
                    f"CUDA context {context_bytes / gb:.2f} GB + weights {weights / gb:.2f} GB ({each}) + the largest batch's "
                    f"activations {activations / gb:.2f} GB ({biggest!r} at batch {batches[biggest]}) = {need / gb:.2f} GB; split "
                    f"them over more sub-clusters or give them bigger GPUs"
                )
