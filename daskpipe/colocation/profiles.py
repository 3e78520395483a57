"""Bridges to the rest of daskpipe: an interference model from PPipe-style ``Profile`` tables, and
a co-location placement expressed as a ``Plan`` for the data plane.

A ``Profile`` gives, per GPU type and slice count ``v``, each block's latency when the GPU is cut
into ``v`` equal MPS slices that all run the same model at once. Summed over blocks, that is a
model's latency at share ``1/v`` with its own copies as co-runners; we fit the running-time curve
to it directly (so self-interference is inside the curve) and leave the cross-model L2 terms at
zero, since such tables carry no cross-model information: conservative for a model next to
lighter ones, optimistic next to heavier ones. GPU types profiled at a single slice count cannot
be fitted along the share and are skipped (named in the model's ``notes``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from daskpipe.colocation.fit import fit_running
from daskpipe.colocation.latency import ColocationError, GpuSpec, InterferenceModel, ModelCoefficients
from daskpipe.colocation.policy import Gpu, PlacementPlan, Workload
from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan
from daskpipe.profiles.model import Profile

MAX_BATCH = 32


def model_from_profiles(profiles: Mapping[str, Profile], specs: Mapping[str, GpuSpec]) -> InterferenceModel:
    """Fit one ``ModelCoefficients`` per (model, GPU type) present in both ``profiles`` and ``specs``."""
    coefficients: dict[tuple[str, str], ModelCoefficients] = {}
    skipped: list[str] = []
    for name, profile in sorted(profiles.items()):
        for gpu in profile.gpu_types:
            if gpu not in specs:
                continue
            slices = profile.slices(gpu)
            if len(slices) < 2:
                skipped.append(f"{name}@{gpu}")
                continue
            points = [(b, specs[gpu].sm_count / v, profile.latency(gpu, v, b) / 1000.0) for v in slices for b in range(1, profile.max_batch(gpu, v) + 1)]
            batches, sms, ms = zip(*points)
            coefficients[(name, gpu)] = ModelCoefficients(
                model=name, gpu=gpu, kernels=profile.num_blocks, sched_us_per_kernel=0.0,
                running=fit_running(batches, sms, ms, max_batch=MAX_BATCH),
                l2_alpha=0.0, l2_beta=0.0, cache_sensitivity=0.0,
                input_bytes=profile.input_bytes, output_bytes=profile.output_bytes, mem_base_mb=0.0, mem_per_sample_mb=0.0,
            )
    if not coefficients:
        raise ColocationError(f"no (model, GPU) pair has tables for >= 2 slice counts on a GPU of {sorted(specs)}; skipped: {skipped}")
    return InterferenceModel(gpus=dict(specs), coefficients=coefficients, name="from-profiles", notes={"skipped": ", ".join(skipped)})


def to_plan(placement: PlacementPlan, workloads: Sequence[Workload], gpus: Sequence[Gpu], model: InterferenceModel, num_blocks: Mapping[str, int] | None = None) -> Plan:
    """The placement as a ``Plan``: one single-partition pipeline per replica, whose ``slices`` is
    the nearest equal-slice count to its share; the exact GPU ids and shares travel in
    ``settings["colocation"]`` for a data plane that honours unequal MPS shares."""
    types = {g.uid: g.type for g in gpus}
    models = []
    for w in workloads:
        pipelines = []
        for r in placement.of_model(w.name):
            exec_ms = model.exec_ms(types[r.gpu], r.process(), placement.corunners(r))
            blocks = (num_blocks or {}).get(w.name, 1)
            part = Partition(blocks=(0, blocks), gpu=types[r.gpu], slices=max(1, round(1 / r.share)), vgpus=1, latency_us=exec_ms * 1000.0)
            pipelines.append(Pipeline(batch_size=r.batch, throughput=1000.0 * r.batch / exec_ms, partitions=(part,)))
        served = min(w.rate, sum(p.throughput for p in pipelines))
        models.append(ModelPlan(name=w.name, slo_us=w.slo_ms * 1000.0, weight=1.0, throughput=served, pipelines=tuple(pipelines)))
    counts: dict[str, int] = {}
    for g in gpus:
        counts[g.type] = counts.get(g.type, 0) + 1
    return Plan(
        objective=sum(m.throughput for m in models),
        models=tuple(models),
        strategy=placement.policy,
        cluster={"gpus": counts},
        solver={"name": placement.policy, **{k: v for k, v in placement.info.items() if isinstance(v, (int, float, str))}},
        settings={"colocation": placement.to_dict()},
    )
