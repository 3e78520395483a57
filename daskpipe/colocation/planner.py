"""The planner's co-location strategies: ``make_plan(..., options=PlannerOptions(strategy="inss"))`` and the other policies.

PPipe's strategies maximise min_m throughput_m / weight_m over pool sizes. A co-location policy
instead places given rates, so the planner searches the rate: models ask for ``scale · weight_m``
req/s, and a bisection on ``scale`` finds the largest at which the policy's placement has the
capacity for every model (each replica's capacity as the interference model predicts it next to
its co-runners). Policies see ``(1 - margin) · SLO`` as their latency budget, as PPipe's pipelines
do. The interference model is fitted to the profiles (``profiles.model_from_profiles``) on the
GPU types profiled at two or more slice counts; the others cannot be shared and stay unused.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Mapping

from daskpipe.colocation.latency import Colocated, ColocationError, GpuSpec, InterferenceModel
from daskpipe.colocation.policy import Gpu, PlacementPolicy, Workload, make_policy
from daskpipe.colocation.profiles import model_from_profiles, to_plan
from daskpipe.plan.schema import Plan, PlanError
from daskpipe.profiles.catalog import gpu_specs
from daskpipe.profiles.model import Profile

RELATIVE_PRECISION = 0.01  # the bisection stops when the scale is known to 1%
MAX_STEPS = 30


def plan_colocation(
    profiles: Mapping[str, Profile],
    gpus: Mapping[str, int],
    *,
    strategy: str,
    weights: Mapping[str, float],
    slo_us: Mapping[str, float],
    margin: float,
    gpus_per_server: Mapping[str, int],
    bw_gbps: float,
    time_limit: float = 60.0,
    specs: Mapping[str, GpuSpec] | None = None,
    options: Mapping[str, Any] | None = None,
) -> Plan:
    """The highest-scale placement of ``strategy`` for the models of ``profiles`` on ``gpus``.

    ``specs`` default to the GPU catalog; ``options`` go to the policy's constructor (the
    WSM-MILP gets ``time_limit`` per solve unless they say otherwise). Raises :class:`PlanError`
    when no GPU type can be shared or some model cannot be placed even at a vanishing rate.
    """
    started = time.perf_counter()
    try:
        model = model_from_profiles(profiles, specs if specs is not None else gpu_specs(sorted(gpus)))
        usable = sorted(t for t in gpus if all((m, t) in model.coefficients for m in profiles))
        if not usable:
            raise PlanError(
                f"strategy {strategy!r} shares GPUs through an interference model fitted along the MPS share; no GPU type of the cluster "
                f"{sorted(gpus)} has every model profiled at two or more slice counts (skipped: {model.notes.get('skipped') or 'none'})"
            )
        cluster = [Gpu(f"{t}-{i}", t) for t in usable for i in range(gpus[t])]
        policy = make_policy(strategy, model, **_policy_options(strategy, time_limit, options))
        budget_ms = {m: (1 - margin) * slo_us[m] / 1000.0 for m in profiles}
        search = _ScaleSearch(policy, model, cluster, profiles, weights, budget_ms, slo_us)
        best, steps = search.run()
    except ColocationError as exc:
        raise PlanError(f"strategy {strategy!r}: {exc}") from None
    return replace(
        best,
        cluster={"gpus": dict(gpus), "gpus_per_server": dict(gpus_per_server), "bw_gbps": bw_gbps},
        solver={**best.solver, "status": "feasible", "scale_steps": steps, "seconds": time.perf_counter() - started},
        settings={
            **best.settings,
            "margin": margin,
            "unused_gpus": sorted(t for t in gpus if t not in usable),
            "interference_fit_mean_error_pct": float(model.notes["fit_mean_error_pct"]),
            "interference_fit_max_error_pct": float(model.notes["fit_max_error_pct"]),
        },
    )


def _policy_options(strategy: str, time_limit: float, options: Mapping[str, Any] | None) -> dict[str, Any]:
    given = dict(options or {})
    if strategy == "wsm-milp":
        given.setdefault("time_limit_s", time_limit)
    return given


class _ScaleSearch:
    """Bisection on the common scale of the models' rates (``scale · weight``)."""

    def __init__(
        self,
        policy: PlacementPolicy,
        model: InterferenceModel,
        gpus: list[Gpu],
        profiles: Mapping[str, Profile],
        weights: Mapping[str, float],
        budget_ms: Mapping[str, float],
        slo_us: Mapping[str, float],
    ) -> None:
        self.policy, self.model, self.gpus, self.weights, self.budget_ms, self.slo_us = policy, model, gpus, weights, budget_ms, slo_us
        self.names = list(profiles)
        self.num_blocks = {m: p.num_blocks for m, p in profiles.items()}
        # the worker kinds a partition may name: slice counts every model is profiled at
        self.slice_counts = {g.type: sorted(set.intersection(*(set(p.slices(g.type)) for p in profiles.values()))) for g in gpus}

    def plan_at(self, scale: float) -> Plan:
        workloads = [Workload(m, scale * self.weights[m], self.budget_ms[m]) for m in self.names]
        placement = self.policy.place(workloads, self.gpus)
        return to_plan(
            placement,
            workloads,
            self.gpus,
            self.model,
            num_blocks=self.num_blocks,
            slo_us=self.slo_us,
            weights=self.weights,
            slice_counts=self.slice_counts,
        )

    def serves(self, plan: Plan, scale: float) -> bool:
        """Every model has the capacity for its rate, on replicas whose batch latency fits its budget
        (a policy may place a replica it could not fit, as InSS does when BDA fails)."""
        return all(
            m.pipelines
            and m.throughput >= scale * m.weight * (1 - 1e-9)
            and all(p.latency_us <= 1000.0 * self.budget_ms[m.name] for p in m.pipelines)
            for m in plan.models
        )

    def ceiling(self) -> float:
        """No placement serves more than every GPU running the model alone at its largest batch."""
        batch = self.model.max_batch
        return min(
            sum(1000.0 * batch / self.model.exec_ms(g.type, Colocated(m, 1.0, batch)) for g in self.gpus) / self.weights[m]
            for m in self.names
        )

    def run(self) -> tuple[Plan, int]:
        hi = self.ceiling()
        lo, best = 0.0, None
        for step in range(1, MAX_STEPS + 1):
            scale = (lo + hi) / 2
            plan = self.plan_at(scale)
            if self.serves(plan, scale):
                lo, best = scale, plan
            else:
                hi = scale
            if best is not None and hi - lo <= RELATIVE_PRECISION * hi:
                return best, step
        if best is None:
            unserved = [
                m.name
                for m in self.plan_at(hi).models
                if not m.pipelines or any(p.latency_us > 1000.0 * self.budget_ms[m.name] for p in m.pipelines)
            ]
            raise ColocationError(
                f"no placement serves every model even at {hi:.3g} x its weight req/s"
                + (f"; no replica of {unserved} that the policy places fits (1 - margin) x SLO on these GPUs" if unserved else "")
            )
        return best, MAX_STEPS
