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

import math
from typing import Mapping, Sequence

from daskpipe.colocation.fit import FitReport, fit_running
from daskpipe.colocation.latency import ColocationError, GpuSpec, InterferenceModel, ModelCoefficients
from daskpipe.colocation.policy import Gpu, PlacementPlan, Workload
from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan
from daskpipe.profiles.model import Profile


def model_from_profiles(profiles: Mapping[str, Profile], specs: Mapping[str, GpuSpec]) -> InterferenceModel:
    """Fit one ``ModelCoefficients`` per (model, GPU type) present in both ``profiles`` and ``specs``.

    ``max_batch`` is the smallest largest-profiled batch: policies never plan beyond the tables.
    ``notes["fit_mean_error_pct"]``/``notes["fit_max_error_pct"]`` say how far the fitted curves
    are from the tables they were fitted to.
    """
    coefficients: dict[tuple[str, str], ModelCoefficients] = {}
    skipped: list[str] = []
    max_batch = min(profile.max_batch(gpu, v) for profile in profiles.values() for gpu, v in profile.latency_us)
    errors: list[float] = []
    for name, profile in sorted(profiles.items()):
        for gpu in profile.gpu_types:
            if gpu not in specs:
                continue
            slices = profile.slices(gpu)
            if len(slices) < 2:
                skipped.append(f"{name}@{gpu}")
                continue
            points = [
                (b, specs[gpu].sm_count / v, profile.latency(gpu, v, b) / 1000.0)
                for v in slices
                for b in range(1, profile.max_batch(gpu, v) + 1)
            ]
            batches, sms, ms = zip(*points)
            running = fit_running(batches, sms, ms, max_batch=max_batch)
            coefficients[(name, gpu)] = ModelCoefficients(
                model=name,
                gpu=gpu,
                kernels=profile.num_blocks,
                sched_us_per_kernel=0.0,
                running=running,
                l2_alpha=0.0,
                l2_beta=0.0,
                cache_sensitivity=0.0,
                input_bytes=profile.input_bytes,
                output_bytes=profile.output_bytes,
                mem_base_mb=0.0,
                mem_per_sample_mb=0.0,
            )
            errors += [100.0 * abs(coefficients[(name, gpu)].solo_running_ms(b, s) - y) / y for b, s, y in points]
    if not coefficients:
        raise ColocationError(f"no (model, GPU) pair has tables for >= 2 slice counts on a GPU of {sorted(specs)}; skipped: {skipped}")
    report = FitReport(solo_errors_pct=tuple(errors), co_errors_pct=())
    notes = {
        "skipped": ", ".join(skipped),
        "fit_mean_error_pct": f"{report.mean_error_pct:.2f}",
        "fit_max_error_pct": f"{report.max_error_pct:.2f}",
    }
    return InterferenceModel(gpus=dict(specs), coefficients=coefficients, name="from-profiles", notes=notes, max_batch=max_batch)


def to_plan(
    placement: PlacementPlan,
    workloads: Sequence[Workload],
    gpus: Sequence[Gpu],
    model: InterferenceModel,
    *,
    num_blocks: Mapping[str, int] | None = None,
    slo_us: Mapping[str, float] | None = None,
    weights: Mapping[str, float] | None = None,
    slice_counts: Mapping[str, Sequence[int]] | None = None,
) -> Plan:
    """The placement as an executable ``Plan``: one single-partition pipeline per replica, a
    co-located partition on its GPU (``device``) with its MPS ``share``, and ``slices`` the
    equal-slice count nearest to that share (the worker kind that serves it), among
    ``slice_counts[gpu type]`` when given (the profiled kinds). The plan carries ``model``,
    with which the simulator and the runtime execute it. ``slo_us`` overrides the workloads' SLOs
    (a planner hands policies a tighter budget than the SLO), ``weights`` the equal shares of the
    objective, min throughput / weight as for every strategy."""
    types = {g.uid: g.type for g in gpus}
    weights = weights or {}
    models = []
    for w in workloads:
        pipelines = []
        for r in placement.of_model(w.name):
            exec_ms = model.exec_ms(types[r.gpu], r.process(), placement.corunners(r))
            blocks = (num_blocks or {}).get(w.name, 1)
            slices = nearest_slices(r.share, (slice_counts or {}).get(types[r.gpu]))
            part = Partition(
                blocks=(0, blocks), gpu=types[r.gpu], slices=slices, vgpus=1, latency_us=exec_ms * 1000.0, device=r.gpu, share=r.share
            )
            pipelines.append(Pipeline(batch_size=r.batch, throughput=1000.0 * r.batch / exec_ms, partitions=(part,)))
        served = min(w.rate, sum(p.throughput for p in pipelines))
        slo = (slo_us or {}).get(w.name, w.slo_ms * 1000.0)
        models.append(ModelPlan(name=w.name, slo_us=slo, weight=weights.get(w.name, 1.0), throughput=served, pipelines=tuple(pipelines)))
    counts: dict[str, int] = {}
    for g in gpus:
        counts[g.type] = counts.get(g.type, 0) + 1
    return Plan(
        objective=min(m.throughput / m.weight for m in models),
        models=tuple(models),
        strategy=placement.policy,
        cluster={"gpus": counts},
        solver={"name": placement.policy, **{k: v for k, v in placement.info.items() if isinstance(v, (int, float, str))}},
        settings={"colocation": placement.to_dict()},
        interference=model.to_dict(),
    )


def nearest_slices(share: float, available: Sequence[int] | None = None) -> int:
    """The slice count ``v`` whose 1/v is closest to ``share`` by ratio, among ``available``."""
    candidates = sorted(available) if available else range(1, max(1, round(1 / share)) + 2)
    return min(candidates, key=lambda v: (abs(math.log(share * v)), v))
