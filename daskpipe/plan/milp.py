"""The planner: how many (virtual) GPUs of which type serve which pooled pipelines of each model.

PPipe's MILP (paper §5.3, Appendix A) chooses partitions, GPU types, MPS slice counts, one batch
size per pipeline and pool sizes together. Here the discrete choices are enumerated up front
(:mod:`daskpipe.plan.configs`) and the MILP only sizes pools: integer vGPUs per partition of every
configuration, integer physical GPUs per (model, GPU type, slices) so that slices of one GPU are
all alike, and a max-min objective over the models' weighted throughputs.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Iterator, Mapping, Sequence

from daskpipe.mipmodels import mip_model
from daskpipe.plan.allocations import Allocation, Valued, search_levels
from daskpipe.plan.configs import Budget, Config, enumerate_configs, pool_order, resources_of
from daskpipe.plan.exchange import Share, Valuation, exchange_gpus
from daskpipe.plan.options import COLOCATION_STRATEGIES, PlannerOptions, check_positive
from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan, PlanError, relative_gap
from daskpipe.profiles.model import Profile


def make_plan(
    profiles: Mapping[str, Profile],
    gpus: Mapping[str, int],
    *,
    weights: Mapping[str, float] | None = None,
    gpus_per_server: Mapping[str, int] | None = None,
    slo_us: Mapping[str, float] | None = None,
    options: PlannerOptions = PlannerOptions(),
) -> Plan:
    """Plan the serving of ``profiles`` (model name -> profile) on a cluster of ``gpus`` (type -> count).

    ``weights`` are the models' workload shares: the plan maximises min_m throughput_m / weight_m
    (default: equal). ``slo_us`` overrides the profiles' SLOs; pipelines must fit
    ``(1 - options.margin)`` of it. ``options`` say how to plan (:class:`PlannerOptions`: the
    strategy, bandwidth, margin, solver...); co-location strategies plan in
    :mod:`daskpipe.colocation.planner`. Without ``options.one_pipeline_per_route`` several
    pipelines may share a route with different cuts, slices or batch sizes.

    Raises :class:`PlanError` naming the bad input, or what would make an infeasible one feasible.
    """
    spec = _Spec.check(profiles, gpus, weights, gpus_per_server, slo_us, options)
    strategy = options.strategy
    if strategy in COLOCATION_STRATEGIES:
        from daskpipe.colocation.planner import plan_colocation

        colocated = plan_colocation(
            spec.profiles,
            spec.gpus,
            strategy=strategy,
            weights=spec.weights,
            slo_us=spec.slo_us,
            margin=options.margin,
            gpus_per_server=spec.gpus_per_server,
            bw_gbps=options.bw_gbps,
            time_limit=options.time_limit,
        )
        return replace(colocated, models=_with_table_origins(colocated.models, profiles))
    started = time.perf_counter()
    deadline = started + SOLVING_SHARE * options.time_limit
    rates = _batch_build_rates(spec, deadline) if options.batch_build_estimate else None
    if strategy == "np":
        plan = _plan_np(spec, rates, drop_infeasible=False, deadline=deadline)
    elif strategy == "ppipe":
        plan = _plan_ppipe(spec, rates, deadline=deadline)
    else:
        plan = _plan_dart_r(spec, rates, deadline)
    settings = {
        "margin": options.margin,
        "max_parts": 1 if strategy == "np" else options.max_parts,
        "batch_build_estimate": options.batch_build_estimate,
        "batch_build_rate": rates,
        "allow_missing_gpus": options.allow_missing_gpus,
        "one_pipeline_per_route": options.one_pipeline_per_route,
    }
    return Plan(
        objective=plan.objective,
        models=_with_table_origins(plan.models, profiles),
        strategy=strategy,
        cluster={"gpus": dict(spec.gpus), "gpus_per_server": dict(spec.gpus_per_server), "bw_gbps": options.bw_gbps},
        solver={**plan.solver, "seconds": time.perf_counter() - started},
        settings=settings,
        bound=plan.bound,
    )


SOLVING_SHARE = 0.95
"""Share of the time limit the solves may take: the last solver stops a little late, and the plan is assembled after it."""


def _with_table_origins(models: tuple[ModelPlan, ...], profiles: Mapping[str, Profile]) -> tuple[ModelPlan, ...]:
    """Each partition marked with whether its latency table was measured or estimated (``Profile.origin``)."""
    return tuple(
        replace(
            m,
            pipelines=tuple(
                replace(p, partitions=tuple(replace(q, table=profiles[m.name].origin(q.gpu, q.slices) or "") for q in p.partitions))
                for p in m.pipelines
            ),
        )
        for m in models
    )


@dataclass(frozen=True)
class _Spec:
    """Checked inputs of :func:`make_plan`."""

    profiles: Mapping[str, Profile]
    gpus: Mapping[str, int]
    weights: Mapping[str, float]
    gpus_per_server: Mapping[str, int]
    slo_us: Mapping[str, float]
    options: PlannerOptions
    model_gpus: Mapping[str, tuple[str, ...]]  # the cluster's GPU types each model can use

    @classmethod
    def check(cls, profiles, gpus, weights, gpus_per_server, slo_us, options) -> _Spec:
        if not isinstance(options, PlannerOptions):
            raise PlanError(f"options must be a PlannerOptions, got {type(options).__name__}")
        if not profiles:
            raise PlanError("no models to plan: give at least one profile")
        if not gpus:
            raise PlanError("no GPUs: give at least one GPU type with a positive count, e.g. L4=4")
        for gpu, count in gpus.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise PlanError(f"GPU count for {gpu!r} must be a positive integer, got {count!r}")
        names = list(profiles)
        weights = dict(weights) if weights is not None else {m: 1.0 for m in names}
        if set(weights) != set(names):
            raise PlanError(f"weights are for {sorted(weights)} but the models are {sorted(names)}; give one weight per model")
        for m, w in weights.items():
            check_positive(w, f"weight of {m!r}")
        per_server = {g: 1 for g in gpus}
        for gpu, count in (gpus_per_server or {}).items():
            if gpu not in gpus:
                raise PlanError(f"gpus_per_server names GPU type {gpu!r}, which the cluster does not have (it has {sorted(gpus)})")
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise PlanError(f"gpus_per_server for {gpu!r} must be a positive integer, got {count!r}")
            per_server[gpu] = count
        slos = {m: p.slo_us for m, p in profiles.items()}
        for m, slo in (slo_us or {}).items():
            if m not in profiles:
                raise PlanError(f"slo_us names model {m!r}, which is not among the models {names}")
            check_positive(slo, f"SLO of {m!r}")
            slos[m] = float(slo)
        model_gpus = {}
        for m, p in profiles.items():
            usable = tuple(g for g in gpus if g in p.gpu_types)
            missing = [g for g in gpus if g not in p.gpu_types]
            if missing and not options.allow_missing_gpus:
                raise PlanError(
                    f"model {m!r} has no profile for GPU type(s) {missing} (it has {p.gpu_types}); "
                    "profile it there, drop those GPUs, or allow planning on the other types"
                )
            if not usable:
                raise PlanError(f"model {m!r} has no profile for any GPU type of the cluster {sorted(gpus)} (it has {p.gpu_types})")
            model_gpus[m] = usable
        return cls(profiles, dict(gpus), weights, per_server, slos, options, model_gpus)

    def budget(self, model: str, batch_build_rate: float | None) -> Budget:
        return Budget(
            latency_us=(1 - self.options.margin) * self.slo_us[model],
            bw_gbps=self.options.bw_gbps,
            gpus_per_server=self.gpus_per_server,
            batch_build_rate=batch_build_rate,
        )

    def configs(
        self, model: str, *, max_parts: int, max_slices: int | None, rate: float | None, gpus: Sequence[str] | None = None
    ) -> list[Config]:
        """The model's configurations on ``gpus`` (default: all it may use)."""
        profile = self.profiles[model]
        resources = resources_of(profile, gpus if gpus is not None else self.model_gpus[model], max_slices)
        return enumerate_configs(profile, resources, self.budget(model, rate), max_parts)

    def infeasible(self, model: str, max_slices: int | None) -> PlanError:
        """Why ``model`` has no configuration: its fastest whole-model latency against the budget."""
        profile = self.profiles[model]
        fastest = min((profile.latency(g, v, 1), g, v) for g, v in resources_of(profile, self.model_gpus[model], max_slices))
        latency, gpu, v = fastest
        where = gpu if v == 1 else f"1/{v} of a {gpu}"
        budget = (1 - self.options.margin) * self.slo_us[model]
        return PlanError(
            f"model {model!r} cannot meet its SLO: the plan budget is (1 - margin) x SLO = {budget:.0f} µs, but the fastest "
            f"pipeline takes {latency:.0f} µs (whole model on {where} at batch 1); raise its SLO to at least "
            f"{latency / (1 - self.options.margin):.0f} µs, lower the margin, or add faster GPUs"
        )


@dataclass(frozen=True)
class _Solved:
    objective: float
    models: tuple[ModelPlan, ...]
    solver: Mapping[str, Any]
    bound: float | None = None  # a proven upper bound on ``objective`` over the space it was solved in


# -- strategies -----------------------------------------------------------------------------


def _plan_np(spec: _Spec, rates: Mapping[str, float] | None, *, drop_infeasible: bool, deadline: float) -> _Solved:
    """Whole models on whole GPUs (PPipe's NP baseline: max one partition, no slices).

    With ``drop_infeasible`` a model that no GPU can serve in time gets an empty plan instead of an
    error, so that the others still get a meaningful allocation (used for the batch-build estimate).
    """
    configs = {}
    for m in spec.profiles:
        configs[m] = spec.configs(m, max_parts=1, max_slices=1, rate=(rates or {}).get(m))
        if not configs[m] and not drop_infeasible:
            raise spec.infeasible(m, max_slices=1)
    solvable = {m: c for m, c in configs.items() if c}
    if not solvable:
        return _Solved(0.0, tuple(_model_plan(spec, m, []) for m in spec.profiles), {"name": "none", "status": "infeasible"})
    solved = _size_pools(spec, solvable, spec.gpus, deadline=deadline)
    if len(solvable) < len(configs):  # a model without pools serves nothing: the max-min is 0
        models = tuple(_find(solved.models, m) or _model_plan(spec, m, []) for m in spec.profiles)
        return _Solved(0.0, models, {**solved.solver, "status": "optimal"}, 0.0)
    return solved


def _batch_build_rates(spec: _Spec, deadline: float) -> dict[str, float] | None:
    """x_np per model: the throughput of the NP plan solved without the estimate, the arrival rate
    every strategy's batch-build estimate then assumes (the NP baseline's too, as in the artifact).

    A model the NP plan cannot serve gets no estimate, as in the artifact.
    """
    np_plan = _plan_np(spec, None, drop_infeasible=True, deadline=_share_of(deadline, PRESOLVE_SHARE))
    return {m.name: m.throughput for m in np_plan.models if m.throughput > 0}


PRESOLVE_SHARE = 0.08
"""Share of the time left that an NP plan solved on the way (for x_np, or as a start) may take."""


def _share_of(deadline: float, share: float) -> float:
    """The deadline of a step that may take ``share`` of the time left before ``deadline``."""
    now = time.perf_counter()
    return now + share * max(deadline - now, 0.0)


def _plan_ppipe(spec: _Spec, rates: Mapping[str, float] | None, *, deadline: float, parts: int | None = None) -> _Solved:
    """Pooled pipelines of up to ``parts`` partitions, never worse than the NP plan.

    The NP plan (whole models on whole GPUs: configurations of this space too) is solved first and
    starts the search. Beyond two partitions the configurations multiply, so the plan for one
    partition fewer is solved first, in the first half of the time left, and starts this one; its
    configurations are all in this space, so this solve's bound holds for both.
    """
    parts = spec.options.max_parts if parts is None else parts
    configs = {}
    for m in spec.profiles:
        configs[m] = spec.configs(m, max_parts=parts, max_slices=None, rate=(rates or {}).get(m))
        if not configs[m]:
            raise spec.infeasible(m, max_slices=None)
    if parts > 2:
        start = _plan_ppipe(spec, rates, deadline=_share_of(deadline, 0.5), parts=parts - 1)
    else:
        start = _plan_np(spec, rates, drop_infeasible=True, deadline=_share_of(deadline, PRESOLVE_SHARE))
    return _size_pools(spec, configs, spec.gpus, deadline=deadline, start=start)


def _plan_dart_r(spec: _Spec, rates: Mapping[str, float] | None, deadline: float) -> _Solved:
    """DART-r (PPipe §7.1): the NP plan splits the GPUs among the models, the GPUs it leaves idle are
    split evenly (the artifact leaves the remainder of that division idle, and so do we), then each
    model replicates DART's best plan for one GPU of each type over as many (type A, type B) pairs
    as it has, and runs the whole model on the GPUs left without a partner."""
    if len(spec.gpus) != 2:
        raise PlanError(f"dart-r pairs GPUs of two types; the cluster has {len(spec.gpus)} ({sorted(spec.gpus)})")
    np_plan = _plan_np(spec, rates, drop_infeasible=True, deadline=deadline)
    used = {m.name: _physical_gpus(m) for m in np_plan.models}
    share = {m: dict(used[m]) for m in spec.profiles}
    for gpu, count in spec.gpus.items():
        idle = count - sum(used[m].get(gpu, 0) for m in spec.profiles)
        for m in spec.profiles:
            share[m][gpu] = share[m].get(gpu, 0) + idle // len(spec.profiles)
    models, statuses = [], []
    for m in spec.profiles:
        pipelines, status = _dart_r_model(spec, m, share[m], (rates or {}).get(m), deadline)
        statuses.append(status)
        models.append(_model_plan(spec, m, pipelines))
    objective = min(mp.throughput / spec.weights[mp.name] for mp in models)
    worst = "optimal" if all(s == "optimal" for s in statuses) else next(s for s in statuses if s != "optimal")
    return _Solved(objective, tuple(models), {"name": np_plan.solver.get("name", "none"), "status": worst})


def _dart_r_model(spec: _Spec, model: str, share: Mapping[str, int], rate: float | None, deadline: float) -> tuple[list[Pipeline], str]:
    a, b = spec.gpus
    pairs = min(share.get(a, 0), share.get(b, 0)) if set(spec.model_gpus[model]) == {a, b} else 0
    pipelines: list[Pipeline] = []
    status = "optimal"
    if pairs:
        pair_configs = spec.configs(model, max_parts=spec.options.max_parts, max_slices=1, rate=rate)
        if pair_configs:
            pair = _size_pools(spec, {model: pair_configs}, {a: 1, b: 1}, deadline=deadline)
            status = pair.solver["status"]
            pipelines += [_scaled(p, pairs) for p in pair.models[0].pipelines]
    for gpu in spec.model_gpus[model]:
        left = share.get(gpu, 0) - pairs
        whole = spec.configs(model, max_parts=1, max_slices=1, rate=rate, gpus=[gpu])
        if left > 0 and whole:
            best = max(whole, key=lambda c: (c.vgpu_throughput[0], -c.total_latency_us))
            pipelines.append(_pipeline(best, [left]))
    return pipelines, status


def _scaled(pipeline: Pipeline, times: int) -> Pipeline:
    parts = tuple(Partition(p.blocks, p.gpu, p.slices, p.vgpus * times, p.latency_us, p.transfer_us) for p in pipeline.partitions)
    return Pipeline(pipeline.batch_size, pipeline.throughput * times, parts)


# -- the pool-sizing MILP ---------------------------------------------------------------------

SPARE_CAPACITY_BONUS = 1e-3
"""Weight of the total weighted throughput beside the max-min objective: small enough never to
trade a visible share of the minimum for it, large enough for the solver to use GPUs left over."""


SHORTLIST_SIZE = 12
"""Configurations per model in the shortlist MILP: the cheapest at the LP's GPU prices."""

SHORTLIST_SHARE = 0.08
"""Share of the time left that the shortlist MILP may take: its plans help on large fleets (10 models
on 1000 GPUs: 3947.7 with it, 3931.2 without), but the searches after it need the time more."""

SMALL_MILP = 400
"""Configurations (all models together) up to which the full MILP is tried before the level search:
PPipe's 3-model clusters of two GPU types have at most 200 (G1 on HC4), and CBC proves those in about a second."""

FULL_FIRST_SHARE = 0.25
"""Share of the time left after the shortlist that a small full MILP takes first."""

LEVEL_SHARE = 0.95
"""Share of the time left then that the search over levels may take; the full MILP gets the rest."""

LAST_FULL_SHARE = 0.75
"""Share of the time left that the last full MILP takes: CBC stops up to 0.8 s past its limit on
these (four types on 40 GPUs: 10.1-10.2 s with the whole rest of a 10 s limit)."""

FEW_MODELS = 3
"""Up to this many models (PPipe's groups) on up to :data:`FEW_TYPES` GPU types, the search over
levels with one priced MILP per model (:func:`_search_levels`) proves plans that the search over
allocations does not (3 partitions on 40 GPUs: 0.36% against 0.7-1.8%); with more models the search
over allocations finds better plans."""

FEW_TYPES = 2
"""With more GPU types the search over allocations does better for few models too (PPipe's four
groups on four types, 40 and 100 GPUs, December 6: the gap smaller on six of eight, e.g. 5.3% ->
4.1% and 2.0% -> 0.7-1.0%, larger on one, 1.8% -> 2.0%; with 3 partitions 7.0% -> 6.5% and
4.2% -> 2.3%)."""

FEW_MODELS_LEVEL_SHARE = 0.7
"""Share of the time left that :func:`_search_levels` may take; the full MILP gets the rest."""


def _size_pools(
    spec: _Spec, configs: Mapping[str, Sequence[Config]], gpus: Mapping[str, int], *, deadline: float, start: _Solved | None = None
) -> _Solved:
    """Integer vGPUs per partition pool of every configuration, to maximise min_m throughput_m / w_m.

    The only coupling between models is the GPU count per type, and on large fleets the MILP over
    every configuration proves little in seconds. So: the LP relaxation gives a bound and, through
    the duals of the GPU counts, a price per GPU type; water-filling at those prices gives a first
    plan, a MILP over each model's cheapest configurations (plus those of ``start``) and the GPU
    exchange better ones; a search over levels then tightens both the plan and the bound (with up
    to :data:`FEW_MODELS` models on up to :data:`FEW_TYPES` GPU types :func:`_search_levels`, one
    priced MILP per model; else :func:`_search_allocations` over whole GPUs per model); the full
    MILP, started from the best plan so far, uses the time left. Each stage is skipped once the
    plan is proven within ``options.gap``; ``start`` is never bettered by a worse plan.
    """
    tolerance = spec.options.gap
    full = _PoolSizing(spec, configs, gpus)
    bound = full.relaxation_bound()
    best = _better(_water_fill(spec, full.cheapest(), gpus), start)
    if not _proven(best, bound, tolerance):
        shortlist = full.shortlist(SHORTLIST_SIZE, keep=best)
        if any(len(shortlist[m]) < len(configs[m]) for m in configs):
            restricted = _PoolSizing(spec, shortlist, gpus)
            seconds = SHORTLIST_SHARE * (deadline - time.perf_counter())
            best = _better(best, restricted.solve(spec, seconds, start=best, bounded=False))
    if not _proven(best, bound, tolerance) and len(configs) > 1:
        best = _better(best, _exchanged(spec, configs, gpus, full, best, _share_of(deadline, EXCHANGE_SHARE)))
    if not _proven(best, bound, tolerance) and sum(map(len, configs.values())) <= SMALL_MILP:
        best, bound = _solve_full(spec, full, best, bound, _share_of(deadline, FULL_FIRST_SHARE))
    if not _proven(best, bound, tolerance) and len(configs) > 1:
        if len(configs) > FEW_MODELS or sum(n > 0 for n in gpus.values()) > FEW_TYPES:
            best, bound = _search_allocations(spec, configs, gpus, full, best, bound, _share_of(deadline, LEVEL_SHARE))
        else:
            best, bound = _search_levels(spec, configs, gpus, full.prices, best, bound, _share_of(deadline, FEW_MODELS_LEVEL_SHARE))
    if not _proven(best, bound, tolerance):
        best, bound = _solve_full(spec, full, best, bound, _share_of(deadline, LAST_FULL_SHARE))
    bound = max(bound, best.objective)
    status = "optimal" if _proven(best, bound, tolerance) else "feasible"
    return replace(best, bound=bound, solver={"name": full.solver_name, "status": status})


def _exchanged(
    spec: _Spec, configs: Mapping[str, Sequence[Config]], gpus: Mapping[str, int], full: _PoolSizing, best: _Solved, deadline: float
) -> _Solved:
    """The better of :func:`~daskpipe.plan.exchange.exchange_gpus` from ``best`` and from the LP's
    GPUs rounded down; a model's polish is its own pool-sizing MILP on its GPUs. A model whose GPUs
    did not change keeps its pipelines."""
    kept = {mp.name: mp for mp in best.models}
    starts = {mp.name: Share(tuple(_physical_gpus(mp).get(g, 0) for g in gpus), mp.throughput, ()) for mp in best.models}
    lp_floor = {m: Share(tuple(math.floor(full.relaxed_gpus[m].get(g, 0.0) + 1e-6) for g in gpus), 0.0, ()) for m in configs}

    def polish(model: str, allocation: tuple[int, ...], until: float) -> Share | None:
        mine = {g: n for g, n in zip(gpus, allocation) if n > 0}
        usable = [c for c in configs[model] if all(g in mine for g, _ in c.resources)]
        if not usable:
            return None
        sizing = _PoolSizing(spec, {model: usable}, mine)
        solved = sizing.solve(spec, POLISH_SHARE * (until - time.perf_counter()), start=None, bounded=False)
        if solved is None:
            return None
        pipelines = tuple((c, tuple(n)) for c, n in zip(usable, sizing.sizes(model)) if min(n) > 0)
        return Share(allocation, solved.models[0].throughput, pipelines)

    plans = []
    for start in (starts, lp_floor):
        exchanged = exchange_gpus(configs, spec.weights, gpus, start, _share_of(deadline, 0.5), polish)
        models = tuple(
            kept[m] if exchanged[m] is starts[m] else _model_plan(spec, m, [_pipeline(c, n) for c, n in exchanged[m].pipelines])
            for m in configs
        )
        plans.append(_Solved(min(mp.throughput / spec.weights[mp.name] for mp in models), models, {}))
    return _better(*plans)


EXCHANGE_SHARE = 0.3
"""Share of the time left that the GPU exchange may take (it usually stops well before)."""

POLISH_SHARE = 0.25
"""Share of the exchange's time left that one model's polishing MILP may take."""


def _solve_full(spec: _Spec, full: _PoolSizing, best: _Solved, bound: float, deadline: float) -> tuple[_Solved, float]:
    """The full MILP from ``best`` until ``deadline``: the better plan, and the lower bound."""
    solved = full.solve(spec, deadline - time.perf_counter(), start=best, bounded=True)
    if solved is not None and solved.bound is not None:
        bound = min(bound, solved.bound)
    return _better(best, solved), bound


def _water_fill(spec: _Spec, chosen: Mapping[str, Config], gpus: Mapping[str, int]) -> _Solved:
    """A quick plan: each model on its one cheapest configuration at the LP's prices; one vGPU at a
    time goes to the slowest pool of the model furthest behind (min throughput / weight) while
    GPUs of its type are left, so every model gets pools in proportion and few GPUs idle."""
    free = dict(gpus)
    pools = {m: [0] * c.num_parts for m, c in chosen.items()}
    stuck: set[str] = set()

    def throughput(m: str) -> float:
        return min(n * x for n, x in zip(pools[m], chosen[m].vgpu_throughput))

    while len(stuck) < len(chosen):
        m = min((m for m in chosen if m not in stuck), key=lambda m: throughput(m) / spec.weights[m])
        c = chosen[m]
        d = min(range(c.num_parts), key=lambda d: pools[m][d] * c.vgpu_throughput[d])
        gpu, v = c.resources[d]
        on_resource = sum(n for n, r in zip(pools[m], c.resources) if r == (gpu, v))
        if on_resource % v == 0:  # the next vGPU needs another physical GPU
            if free[gpu] == 0:
                stuck.add(m)
                continue
            free[gpu] -= 1
        pools[m][d] += 1
    models = tuple(_model_plan(spec, m, [_pipeline(c, pools[m])] if min(pools[m]) > 0 else []) for m, c in chosen.items())
    return _Solved(min(mp.throughput / spec.weights[mp.name] for mp in models), models, {})


def _search_levels(
    spec: _Spec,
    configs: Mapping[str, Sequence[Config]],
    gpus: Mapping[str, int],
    prices: Mapping[str, float],
    best: _Solved,
    bound: float,
    deadline: float,
) -> tuple[_Solved, float]:
    """Bisect on the max-min level z between the best plan and the bound (a Lagrangian bound on the
    GPU counts, with the LP's prices mu).

    At a level z every model m solves its own MILP: reach w_m z req/s with the fewest priced GPUs,
    C_m(z) = min mu . a_m. Any plan at z has sum_m mu . a_m <= mu . N, so sum_m C_m(z) > mu . N
    (with the MILPs' lower bounds for C_m) proves that no plan reaches z: z becomes the bound. Else
    each model's cheapest allocation is a column, and a small MILP picks one column per model
    within the GPU counts, a plan that may beat the best so far.
    """
    covers = _Covers(spec, configs, gpus, prices)
    capacity = sum(prices[gpu] * count for gpu, count in gpus.items())
    high = bound  # where the search looks below: the bound, or a level no plan of the columns reached
    resolution = spec.options.gap * bound  # levels closer than this to the best plan are not worth a try
    while high - best.objective > resolution and time.perf_counter() < deadline:
        level = (best.objective + high) / 2
        need = covers.least_cost(level, deadline)
        if need is None:  # out of time before every model was priced
            break
        if need > capacity * (1 + 1e-6):
            bound = high = level
            continue
        picked = covers.pick(deadline)
        if picked is not None and picked.objective > best.objective:
            best = picked
        if picked is None or picked.objective < level:
            high = level
    return best, bound


class _Covers:
    """Per model, the MILP of :func:`_search_levels`: reach a level at the fewest priced GPUs; the
    allocations they find are the columns that :meth:`pick` combines."""

    def __init__(self, spec: _Spec, configs: Mapping[str, Sequence[Config]], gpus: Mapping[str, int], prices: Mapping[str, float]):
        import mip

        self.spec, self.gpus = spec, gpus
        self.sizings, self.levels = {}, {}
        self.columns: dict[str, list[tuple[ModelPlan, dict[str, int]]]] = {m: [] for m in configs}
        for m, cs in configs.items():
            sizing = _PoolSizing(spec, {m: cs}, gpus)
            sizing.model.objective = mip.minimize(mip.xsum(prices[g] * y for (_, g, _), y in sizing.physical.items()))
            sizing.model.max_mip_gap = spec.options.gap / 4  # the models' lower bounds must sum to well within the plan's gap
            self.levels[m] = sizing.model.add_constr(sizing.z >= 0)
            self.sizings[m] = sizing

    def least_cost(self, level: float, deadline: float) -> float | None:
        """A lower bound on sum_m C_m(level) (inf if a model cannot reach it); ``None`` past the deadline."""
        import mip

        total = 0.0
        for i, (m, sizing) in enumerate(self.sizings.items()):
            seconds = (deadline - time.perf_counter()) / (len(self.sizings) - i)
            if seconds <= 0:
                return None
            self.levels[m].rhs = level
            status = sizing.model.optimize(max_seconds=seconds)
            if status in (mip.OptimizationStatus.INFEASIBLE, mip.OptimizationStatus.INT_INFEASIBLE):
                return math.inf
            total += float(sizing.model.objective_bound)
            if status in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
                pipelines = [_pipeline(c, sizes) for c, sizes in zip(sizing.configs[m], sizing.sizes(m)) if min(sizes) > 0]
                used: dict[str, int] = {}
                for (_, gpu, _), y in sizing.physical.items():
                    used[gpu] = used.get(gpu, 0) + round(y.x or 0)
                self.columns[m].append((_model_plan(self.spec, m, pipelines), used))
        return total

    def pick(self, deadline: float) -> _Solved | None:
        """One column per model, within the GPU counts, at the highest max-min (``None``: no such choice found)."""
        import mip

        if not all(self.columns.values()):
            return None
        model = new_model(self.spec.options.solver)
        model.verbose = 0
        z = model.add_var(lb=0)
        chosen = {m: [model.add_var(var_type=mip.BINARY) for _ in cols] for m, cols in self.columns.items()}
        for m, cols in self.columns.items():
            model += mip.xsum(chosen[m]) == 1
            model += self.spec.weights[m] * z <= mip.xsum(b * plan.throughput for b, (plan, _) in zip(chosen[m], cols))
        for gpu, count in self.gpus.items():
            model += mip.xsum(b * used.get(gpu, 0) for m, cols in self.columns.items() for b, (_, used) in zip(chosen[m], cols)) <= count
        model.objective = mip.maximize(z)
        status = model.optimize(max_seconds=max(deadline - time.perf_counter(), 0.1))
        if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
            return None
        models = tuple(next(plan for b, (plan, _) in zip(chosen[m], cols) if (b.x or 0) > 0.5) for m, cols in self.columns.items())
        return _Solved(min(mp.throughput / self.spec.weights[mp.name] for mp in models), models, {})


def _search_allocations(
    spec: _Spec,
    configs: Mapping[str, Sequence[Config]],
    gpus: Mapping[str, int],
    full: _PoolSizing,
    best: _Solved,
    bound: float,
    deadline: float,
) -> tuple[_Solved, float]:
    """:func:`~daskpipe.plan.allocations.search_levels` between ``best`` and ``bound``, each model
    valued by the greedy of the GPU exchange and its own pool-sizing MILP; its master's cuts start
    at the LP's GPUs per model rounded down and up, and at the whole inventory."""
    types = list(gpus)
    oracles = {m: _ModelOracle(spec, m, cs, gpus) for m, cs in configs.items()}
    starts = {}
    for m in configs:
        relaxed = [full.relaxed_gpus[m].get(g, 0.0) for g in types]
        starts[m] = [
            tuple(math.floor(x + 1e-6) for x in relaxed),
            tuple(min(math.ceil(x - 1e-6), gpus[g]) for x, g in zip(relaxed, types)),
            tuple(gpus[g] for g in types),
        ]
    held = {mp.name: (tuple(_physical_gpus(mp).get(g, 0) for g in types), mp) for mp in best.models}
    found = search_levels(
        oracles,
        gpus,
        starts,
        held,
        objective=best.objective,
        bound=bound,
        tolerance=spec.options.gap,
        deadline=deadline,
        new_model=_master_model,
    )
    if found.models is not None and found.objective > best.objective:
        best = _Solved(found.objective, tuple(found.models[m] for m in configs), {})
    return best, min(bound, found.bound)


RELAXED_SECONDS = 10.0
"""Time limit of one model's LP relaxation (milliseconds as a rule); one that hits it gives no cut."""


def _master_model() -> Any:
    """The masters of the level search run on HiGHS where it is usable: CBC took 2 s a master
    (feasibility over whole GPUs per model) where HiGHS takes 0.01-0.15 s (20 models, 100 GPUs)."""
    try:
        return new_model("highs")
    except PlanError:
        return new_model("cbc")


class _ModelOracle:
    """One model's pool-sizing MILP on a given allocation (its GPU rows' right-hand sides), for
    :func:`~daskpipe.plan.allocations.search_levels`; values are throughput / weight."""

    def __init__(self, spec: _Spec, model: str, configs: Sequence[Config], gpus: Mapping[str, int]):
        import mip

        self.spec, self.name, self.types = spec, model, list(gpus)
        self.sizing = _PoolSizing(spec, {model: configs}, gpus)
        self.sizing.model.objective = mip.maximize(self.sizing.z)
        self.sizing.model.max_mip_gap = 1e-6
        self.valuation = Valuation(configs, self.types)

    def _allot(self, gpus: Allocation) -> None:
        for g, n in zip(self.types, gpus):
            self.sizing.gpu_rows[g].rhs = n

    def relaxed(self, gpus: Allocation) -> tuple[float, tuple[float, ...]] | None:
        import mip

        self._allot(gpus)
        with _c_stdout_silenced() if self.sizing.solver_name == "CBC" else nullcontext():
            # a time limit left from an earlier MILP solve would cut the LP short: give it its own
            status = self.sizing.model.optimize(relax=True, max_seconds=RELAXED_SECONDS)
        if status != mip.OptimizationStatus.OPTIMAL:
            return None
        duals = tuple(max(float(self.sizing.gpu_rows[g].pi or 0.0), 0.0) for g in self.types)
        return float(self.sizing.model.objective_value), duals

    def greedy(self, gpus: Allocation) -> Valued:
        share = self.valuation(gpus)
        plan = _model_plan(self.spec, self.name, [_pipeline(c, n) for c, n in share.pipelines])
        return Valued(share.throughput / self.spec.weights[self.name], math.inf, plan)

    def exact(self, gpus: Allocation, seconds: float) -> Valued:
        import mip

        self._allot(gpus)
        quick = self.greedy(gpus).plan
        if quick is not None and quick.pipelines:  # a start gives CBC a bound to prune with at once
            self.sizing.model.start = self.sizing.start_from(_Solved(quick.throughput / quick.weight, (quick,), {}))
        status = self.sizing.model.optimize(max_seconds=seconds)
        if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
            return Valued(0.0, math.inf, None)  # z = 0 is always feasible: out of time, and no bound to trust
        upper = float(self.sizing.model.objective_bound) * (1 + 1e-9)
        if not math.isfinite(upper):
            upper = math.inf
        cs = self.sizing.configs[self.name]
        plan = _model_plan(self.spec, self.name, [_pipeline(c, n) for c, n in zip(cs, self.sizing.sizes(self.name)) if min(n) > 0])
        return Valued(plan.throughput / self.spec.weights[self.name], max(upper, plan.throughput / self.spec.weights[self.name]), plan)


def _proven(plan: _Solved, bound: float, tolerance: float) -> bool:
    return (relative_gap(plan.objective, bound) or 0.0) <= tolerance + 1e-9


def _better(a: _Solved, b: _Solved | None) -> _Solved:
    """The plan with the higher objective; ``a`` on a tie."""
    return b if b is not None and b.objective > a.objective else a


class _PoolSizing:
    """The pool-sizing MILP over given configurations.

    x_c <= n_{c,d} X_{c,d} for every partition d of configuration c; the vGPUs on (type k, slices v)
    of a model fit in v y_{m,k,v} for integer physical GPUs y, and sum_{m,v} y_{m,k,v} <= N_k.
    With one pipeline per route, a binary u_c opens configuration c (n_{c,d} <= u_c * bound) and
    the configurations of one route share a single opening.
    """

    def __init__(self, spec: _Spec, configs: Mapping[str, Sequence[Config]], gpus: Mapping[str, int]):
        import mip

        self.configs = configs
        self.model = model = new_model(spec.options.solver)
        self.solver_name = "HiGHS" if model.solver_name.lower() == "highs" else "CBC"
        model.verbose = 0
        if model.solver_name.lower() == "cbc":
            model.cuts = 0  # CBC's cut rounds cost more than they prune here: 2.7x less CPU on the 16 bench cases
        self.z = model.add_var(lb=0)
        self.flows: dict[str, list[mip.Var]] = {}
        self.route_opening: dict[Config, mip.Var] = {}
        self.counts: dict[str, list[list[mip.Var]]] = {}
        usage: dict[tuple[str, str, int], list[mip.Var]] = {}
        for m, cs in configs.items():
            self.flows[m], self.counts[m] = [], []
            routes: dict[tuple[str, ...], list[mip.Var]] = {}
            shared = Counter(_route(c) for c in cs)
            for c in cs:
                x = model.add_var(lb=0)
                # a route that only one configuration takes needs no opening: it carries one pipeline anyway
                opened = model.add_var(var_type=mip.BINARY) if spec.options.one_pipeline_per_route and shared[_route(c)] > 1 else None
                if opened is not None:
                    routes.setdefault(_route(c), []).append(opened)
                    self.route_opening[c] = opened
                # no pool needs more vGPUs than it takes to match the smallest pool the cluster allows
                ceiling = min(gpus[gpu] * v * throughput for (gpu, v), throughput in zip(c.resources, c.vgpu_throughput))
                ns = []
                for (gpu, v), throughput in zip(c.resources, c.vgpu_throughput):
                    most = math.ceil(ceiling / throughput - 1e-9)
                    n = model.add_var(var_type=mip.INTEGER, lb=0, ub=most)
                    model += x <= throughput * n
                    if opened is not None:
                        model += n <= most * opened
                    usage.setdefault((m, gpu, v), []).append(n)
                    ns.append(n)
                self.flows[m].append(x)
                self.counts[m].append(ns)
            model += spec.weights[m] * self.z <= mip.xsum(self.flows[m])
            for opened_of_route in routes.values():
                model += mip.xsum(opened_of_route) <= 1
        self.physical: dict[tuple[str, str, int], mip.Var] = {}
        for (m, gpu, v), ns in usage.items():
            self.physical[(m, gpu, v)] = y = model.add_var(var_type=mip.INTEGER, lb=0, ub=gpus[gpu])
            model += mip.xsum(ns) <= v * y
        self.gpu_rows = {
            gpu: model.add_constr(mip.xsum(y for (_, g, _), y in self.physical.items() if g == gpu) <= count) for gpu, count in gpus.items()
        }
        # max-min first; a tiny bonus on total weighted throughput then gives GPUs the max-min leaves
        # over to the models' pools, so a cluster's spare capacity becomes queueing slack, not idle
        spare = SPARE_CAPACITY_BONUS / len(configs)
        self.objective = self.z + mip.xsum(spare / spec.weights[m] * x for m, xs in self.flows.items() for x in xs)
        model.objective = mip.maximize(self.objective)
        model.max_mip_gap = spec.options.gap / 2  # the solver's gap counts the spare bonus too: stop with room to spare
        self.prices: dict[str, float] = {}
        self.relaxed_gpus: dict[str, dict[str, float]] = {}  # the LP's GPUs per model and type

    def relaxation_bound(self) -> float:
        """The LP relaxation's max-min (an upper bound on every plan's objective); it also records
        the duals of the GPU counts as :attr:`prices` for :meth:`shortlist`."""
        import mip

        self.model.objective = mip.maximize(self.z)
        with _c_stdout_silenced() if self.solver_name == "CBC" else nullcontext():
            status = self.model.optimize(relax=True)
        if status != mip.OptimizationStatus.OPTIMAL:
            raise PlanError(f"the LP relaxation of the pool-sizing MILP ended {status.name.lower()}")
        bound = float(self.model.objective_value)
        self.prices = {gpu: max(float(row.pi or 0.0), 0.0) for gpu, row in self.gpu_rows.items()}
        self.relaxed_gpus = {m: {} for m in self.configs}
        for (m, gpu, _), y in self.physical.items():
            self.relaxed_gpus[m][gpu] = self.relaxed_gpus[m].get(gpu, 0.0) + float(y.x or 0.0)
        self.model.objective = mip.maximize(self.objective)
        return bound

    def ranked(self, model: str) -> list[int]:
        """``model``'s configurations, those that cost the fewest priced GPUs per req/s first."""
        cs = self.configs[model]
        cost = [sum(self.prices[gpu] / (v * x) for (gpu, v), x in zip(c.resources, c.vgpu_throughput)) for c in cs]
        return sorted(range(len(cs)), key=lambda i: (cost[i], cs[i].total_latency_us))

    def cheapest(self) -> dict[str, Config]:
        return {m: cs[self.ranked(m)[0]] for m, cs in self.configs.items()}

    def shortlist(self, size: int, keep: _Solved | None) -> dict[str, list[Config]]:
        """Per model, the ``size`` cheapest configurations at the LP's prices (its choices among
        them), plus those ``keep``'s pipelines run on."""
        kept = {(mp.name, i) for mp in keep.models for _, i, _ in self._covered(mp)} if keep is not None else set()
        out = {}
        for m, cs in self.configs.items():
            cheapest = set(self.ranked(m)[:size])
            out[m] = [c for i, c in enumerate(cs) if i in cheapest or (m, i) in kept]
        return out

    def solve(self, spec: _Spec, seconds: float, *, start: _Solved | None, bounded: bool) -> _Solved | None:
        """The MILP's best plan within ``seconds`` (``None`` if it found none); with ``bounded`` it
        carries the solver's bound B on max-min + bonus, as a bound on the max-min: every model's
        flow is at least w_m z, so the bonus is at least SPARE_CAPACITY_BONUS z, and z <= B / (1 + it)."""
        import mip

        if seconds <= 0:
            return None
        if start is not None:
            self.model.start = self.start_from(start)
        status = self.model.optimize(max_seconds=seconds)
        if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
            return None
        models = []
        for m, cs in self.configs.items():
            pipelines = [_pipeline(c, sizes) for c, sizes in zip(cs, self.sizes(m)) if min(sizes) > 0]
            models.append(_model_plan(spec, m, pipelines))
        objective = min(mp.throughput / spec.weights[mp.name] for mp in models)
        bound = float(self.model.objective_bound) / (1 + SPARE_CAPACITY_BONUS) if bounded else None
        return _Solved(objective, tuple(models), {}, bound)

    def sizes(self, model: str) -> list[list[int]]:
        """vGPUs of every pool of every configuration of ``model``, as solved."""
        return [[round(n.x or 0) for n in ns] for ns in self.counts[model]]

    def _covered(self, plan: ModelPlan) -> list[tuple[Pipeline, int, list[int]]]:
        """(pipeline, index of a configuration that covers it, the pipeline's partition for each of
        that configuration's pools) for each of ``plan``'s pipelines that one covers."""
        out = []
        for pipeline in plan.pipelines:
            for i, c in enumerate(self.configs[plan.name]):
                pairing = _pairing(c, pipeline)
                if pairing is not None:
                    out.append((pipeline, i, pairing))
                    break
        return out

    def start_from(self, plan: _Solved) -> list[tuple[Any, float]]:
        """``plan``'s pools as a MIP start: each of its pipelines on the configuration it used, or on
        one that covers it (pruning kept one with the same resources and no lower throughputs)."""
        values: dict[Any, float] = {self.z: plan.objective}
        slices: dict[tuple[str, str, int], int] = {}
        for mp in plan.models:
            cs = self.configs[mp.name]
            for pipeline, used, pairing in self._covered(mp):
                values[self.flows[mp.name][used]] = pipeline.throughput
                for (gpu, v), n, d in zip(cs[used].resources, self.counts[mp.name][used], pairing):
                    vgpus = pipeline.partitions[d].vgpus
                    values[n] = vgpus
                    slices[(mp.name, gpu, v)] = slices.get((mp.name, gpu, v), 0) + vgpus
                if cs[used] in self.route_opening:
                    values[self.route_opening[cs[used]]] = 1
        for key, n in slices.items():
            values[self.physical[key]] = math.ceil(n / key[2])
        return list(values.items())


@contextmanager
def _c_stdout_silenced() -> Iterator[None]:
    """CBC's LP solves (Clp) print to the process's stdout whatever python-mip's ``verbose`` says."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _route(config: Config) -> tuple[str, ...]:
    """The GPU types a configuration's requests pass through, in order."""
    return tuple(gpu for gpu, _ in config.resources)


def _pairing(config: Config, pipeline: Pipeline) -> list[int] | None:
    """For each pool of ``config``, the partition of ``pipeline`` it can take over with the same
    vGPUs (same resource, at least its throughput); ``None`` if the resources differ or it is slower."""
    mine = pool_order(config.resources, config.vgpu_throughput)
    resources = [(p.gpu, p.slices) for p in pipeline.partitions]
    theirs = pool_order(resources, [pipeline.throughput / p.vgpus for p in pipeline.partitions])
    if [config.resources[d] for d in mine] != [resources[d] for d in theirs]:
        return None
    pairing = [0] * len(mine)
    for d, e in zip(mine, theirs):
        if config.vgpu_throughput[d] * pipeline.partitions[e].vgpus < pipeline.throughput * (1 - 1e-9):
            return None
        pairing[d] = e
    return pairing


def new_model(choice: str, *, sense: str = "MAX") -> Any:
    """A python-mip model (``sense`` ``MAX`` or ``MIN``) on CBC unless HiGHS is asked for: on the
    pool-sizing MILPs CBC solves faster (docs/plan.md). ``auto`` takes HiGHS where CBC's library
    does not load (python-mip 2 reads it from cbcbox)."""
    import mip

    if choice == "cbc":
        return mip_model(sense=sense, solver_name=mip.CBC)
    for solver in (mip.CBC, mip.HIGHS) if choice == "auto" else (mip.HIGHS,):
        try:
            return mip_model(sense=sense, solver_name=solver)
        except Exception as exc:  # python-mip raises bare Exceptions (or a NameError) when a solver's library is missing or broken
            problem = f"{type(exc).__name__}: {exc}"
    if choice == "auto":
        raise PlanError(
            f"no MILP solver is usable: CBC's library does not load, and HiGHS's neither ({problem}); reinstall mip or install highspy"
        )
    raise PlanError(f"solver 'highs' is not usable ({problem}); install highspy or use solver 'cbc'")


# -- plan assembly ---------------------------------------------------------------------------


def _pipeline(config: Config, vgpus: Sequence[int]) -> Pipeline:
    """A configuration with pools of ``vgpus``; its throughput is what its smallest pool sustains."""
    parts = tuple(
        Partition((start, end), gpu, v, n, lat, tr)
        for (gpu, v), start, end, n, lat, tr in zip(
            config.resources, config.bounds, config.bounds[1:], vgpus, config.latency_us, config.transfer_us
        )
    )
    throughput = min(n * x for n, x in zip(vgpus, config.vgpu_throughput))
    return Pipeline(config.batch_size, throughput, parts)


def _model_plan(spec: _Spec, model: str, pipelines: Sequence[Pipeline]) -> ModelPlan:
    ordered = tuple(sorted(pipelines, key=lambda p: -p.throughput))
    return ModelPlan(model, spec.slo_us[model], spec.weights[model], sum(p.throughput for p in ordered), ordered)


def _find(models: Sequence[ModelPlan], name: str) -> ModelPlan | None:
    return next((m for m in models if m.name == name), None)


def _physical_gpus(model: ModelPlan) -> dict[str, int]:
    """Whole GPUs a model's pools occupy, per type (slices of one size share GPUs)."""
    slices: dict[tuple[str, int], int] = {}
    for p in model.pipelines:
        for part in p.partitions:
            slices[(part.gpu, part.slices)] = slices.get((part.gpu, part.slices), 0) + part.vgpus
    out: dict[str, int] = {}
    for (gpu, v), n in slices.items():
        out[gpu] = out.get(gpu, 0) + math.ceil(n / v)
    return out
