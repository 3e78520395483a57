"""Simulate a plan under a workload, and find the highest load it sustains.

Each model of the plan runs in its own engine on its own placed slots, fed at ``load_factor`` times
its reference rate (the plan's throughput for it, PPipe's definition of load factor; give
``SimulationConfig.base_rates`` to feed another plan at the same absolute rates, as the paper does
for baselines).
Models are independent there, as in the paper's simulator: a pooled plan never shares a GPU
between models, and per-model runs leave out NIC sharing between models placed on one server.
A co-located plan (``Partition.device``, docs/colocation.md) does share GPUs between models; its
stages take the plan's interference-model latency next to every co-runner on their GPU (static
interference, as InSS's model assumes), so the models stay independent runs there too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from daskpipe.colocation.execute import colocated_latency, colocated_placements, colocated_profile, is_colocated
from daskpipe.plan.schema import ModelPlan, Plan
from daskpipe.profiles.model import Profile
from daskpipe.sched.api import Dispatch, Placement, Request, Slot
from daskpipe.sched.durations import BatchDurations
from daskpipe.sched.registry import TIMEOUT_S, make_dispatcher, make_shared_dispatcher
from daskpipe.sim.config import SimulationConfig
from daskpipe.sim.engine import Engine, Trace, on_time
from daskpipe.sim.workload import Trace as ArrivalTrace
from daskpipe.sim.workload import arrivals as make_arrivals


class ProfileDurations:
    """The engine's ground truth for a whole plan: each model's
    :class:`~daskpipe.sched.durations.BatchDurations` (the emulated runtime holds its batches by
    the same model), on the slot's (GPU, v) that the dispatch names."""

    def __init__(self, plan: Plan, profiles: Mapping[str, Profile], bw_gbps: float) -> None:
        missing = [m.name for m in plan.models if m.name not in profiles]
        if missing:
            raise ValueError(f"no profile for model(s) {missing} of the plan (have {sorted(profiles)})")
        colocated = is_colocated(plan)
        self.models = {
            m.name: BatchDurations(m, profiles[m.name], bw_gbps=bw_gbps, colocated=colocated_latency(plan, m.name) if colocated else None)
            for m in plan.models
        }

    def compute(self, dispatch: Dispatch, partition: int, slot: Slot) -> float:
        try:
            return self.models[dispatch.model].compute_s(dispatch.pipeline, partition, dispatch.batch_size, slot.gpu, slot.slices)
        except ValueError as exc:
            raise ValueError(f"dispatch {dispatch.id} asks for {exc}") from None

    def transfer(self, dispatch: Dispatch, partition: int) -> float:
        return self.models[dispatch.model].transfer_s(dispatch.pipeline, partition, dispatch.batch_size)

    def partitions(self, model: str, pipeline: int) -> int:
        return self.models[model].partitions(pipeline)


@dataclass
class ModelResult:
    """One model's outcome: every submitted request is on time, late or dropped."""

    model: str
    load_factor: float
    offered_rate: float
    submitted: int
    on_time: int
    late: int
    dropped: dict[str, int]
    p50_ms: float | None  # over completed requests (dropped ones have no latency)
    p99_ms: float | None
    mean_batch_size: float | None  # samples per batch entering the first partition

    @property
    def attainment(self) -> float:
        return self.on_time / self.submitted if self.submitted else 1.0

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["attainment"] = self.attainment
        out["dropped_total"] = self.dropped_total
        return out


@dataclass
class SimResult:
    dataplane: str
    arrivals: str
    duration: float
    seed: int
    models: dict[str, ModelResult]
    utilization: dict[str, float]  # GPU type -> busy fraction over the cluster's GPUs of that type
    utilization_placed: dict[str, float]  # ... over the GPUs the plan places
    max_load_factor: dict[str, float] = field(default_factory=dict)  # with find_max_load
    runs: dict[str, tuple[Placement, Trace]] = field(default_factory=dict, repr=False)  # the reported run of each model

    def to_dict(self) -> dict[str, Any]:
        return {
            "dataplane": self.dataplane,
            "arrivals": self.arrivals,
            "duration": self.duration,
            "seed": self.seed,
            "models": {name: r.to_dict() for name, r in self.models.items()},
            "utilization": self.utilization,
            "utilization_placed": self.utilization_placed,
            "max_load_factor": self.max_load_factor,
        }


def model_result(trace: Trace, model: str, load_factor: float, offered_rate: float) -> ModelResult:
    """Per-model figures from an engine trace."""
    records = [r for r in trace.requests.values() if r.model == model]
    dropped: dict[str, int] = {}
    latencies = []
    good = late = 0
    for r in records:
        if r.dropped is not None:
            dropped[r.dropped] = dropped.get(r.dropped, 0) + 1
            continue
        latencies.append(r.finish - r.arrival)
        if on_time(r):
            good += 1
        else:
            late += 1
    first = [d.batch_size for _, d in trace.dispatches if d.model == model and d.hops[0].partition == 0]
    p50, p99 = (float(x * 1e3) for x in np.percentile(latencies, [50, 99])) if latencies else (None, None)
    return ModelResult(
        model, load_factor, offered_rate, len(records), good, late, dropped, p50, p99, float(np.mean(first)) if first else None
    )


@dataclass
class _Setup:
    """Everything a run needs that does not depend on the load factor: the config, with what it
    leaves to the plan resolved."""

    plan: Plan
    profiles: Mapping[str, Profile]
    placements: Mapping[str, Placement]
    bw_gbps: float
    base_rates: Mapping[str, float]
    arrivals: str | ArrivalTrace
    config: SimulationConfig


def _prepare(plan: Plan, profiles: Mapping[str, Profile], config: SimulationConfig) -> _Setup:
    """Resolve ``config`` against ``plan`` and ``profiles`` once, checking what the plan decides."""
    if not isinstance(config, SimulationConfig):
        raise TypeError(f"config must be a SimulationConfig, got {type(config).__name__}")
    arrivals = config.arrivals
    if isinstance(arrivals, str) and arrivals not in ("poisson", "bursty"):
        from daskpipe.sim.workload import load_trace

        arrivals = load_trace(arrivals)
    missing = [m.name for m in plan.models if m.name not in profiles]
    if missing:
        raise ValueError(f"no profile for model(s) {missing} of the plan (have {sorted(profiles)})")
    bw = config.bw_gbps if config.bw_gbps is not None else plan.cluster.get("bw_gbps")
    if bw is None:
        raise ValueError("the plan records no cluster bandwidth; pass bw_gbps")
    placements = config.placements
    if is_colocated(plan):  # dispatchers plan with the co-located latencies; one slot per share
        profiles = {name: colocated_profile(profile, plan) for name, profile in profiles.items()}
        placements = placements if placements is not None else colocated_placements(plan)
    if placements is None:
        from daskpipe.sched.placement import place

        placements = place(plan, gpus_per_server=config.gpus_per_server)
    rates = {m.name: m.throughput for m in plan.models}
    if config.base_rates is not None:
        unknown = [m for m in rates if m not in config.base_rates]
        if unknown:
            raise ValueError(f"base_rates lacks model(s) {unknown}")
        rates = {m: float(config.base_rates[m]) for m in rates}
    for name, rate in rates.items():
        if not (rate >= 0 and math.isfinite(rate)):
            raise ValueError(f"model {name!r}: reference rate must be a non-negative number, got {rate!r}")
    return _Setup(plan, profiles, placements, float(bw), rates, arrivals, config)


def _run_model(setup: _Setup, index: int, model_plan: ModelPlan, load_factor: float) -> tuple[ModelResult, Trace, Placement]:
    rate = load_factor * setup.base_rates[model_plan.name]
    placement = setup.placements.get(model_plan.name) or Placement(model_plan.name, {}, {})
    if rate <= 0:
        return ModelResult(model_plan.name, load_factor, rate, 0, 0, 0, {}, None, None, None), Trace(), placement
    profile = setup.profiles[model_plan.name]
    config = setup.config
    rng = np.random.default_rng([config.seed, index])
    times = make_arrivals(setup.arrivals, rate, config.duration, rng, cv=config.bursty_cv)
    if not model_plan.pipelines:  # the plan gives it nothing: every request is refused
        dropped = {"no-capacity": len(times)} if len(times) else {}
        return ModelResult(model_plan.name, load_factor, rate, len(times), 0, 0, dropped, None, None, None), Trace(), placement
    slo = model_plan.slo_us / 1e6
    dispatcher = make_dispatcher(
        config.dataplane,
        model_plan,
        placement,
        profile,
        bw_gbps=setup.bw_gbps,
        settings=config.settings,
        max_batch=config.max_batch,
        timeout_s=config.timeout_s,
    )
    engine = Engine(
        {model_plan.name: dispatcher},
        placement.slots,
        ProfileDurations(setup.plan, setup.profiles, setup.bw_gbps),
        noise=config.noise,
        latency_ratios=config.latency_ratios,
        seed=config.seed * 1000 + index,
        horizon=config.duration,
    )
    engine.add_arrivals(Request(i, model_plan.name, float(t), float(t) + slo) for i, t in enumerate(times))
    trace = engine.run()
    return model_result(trace, model_plan.name, load_factor, rate), trace, placement


def _utilization(
    plan: Plan, busy: Mapping[str, float], slots: Mapping[str, Slot], duration: float
) -> tuple[dict[str, float], dict[str, float]]:
    """Busy fraction per GPU type; a 1/v slice's busy second counts 1/v of a GPU-second."""
    work: dict[str, float] = {}
    placed: dict[str, float] = {}
    for slot_id, slot in slots.items():
        work[slot.gpu] = work.get(slot.gpu, 0.0) + busy.get(slot_id, 0.0) / slot.slices
        placed[slot.gpu] = placed.get(slot.gpu, 0.0) + 1.0 / slot.slices
    inventory = {str(k): float(v) for k, v in dict(plan.cluster.get("gpus", {})).items()} or placed
    cluster = {gpu: work.get(gpu, 0.0) / (count * duration) for gpu, count in inventory.items() if count > 0}
    used = {gpu: work.get(gpu, 0.0) / (count * duration) for gpu, count in placed.items()}
    return cluster, used


def simulate(
    plan: Plan, profiles: Mapping[str, Profile], config: SimulationConfig = SimulationConfig(), *, load_factor: float = 0.9
) -> SimResult:
    """Run every model of ``plan`` for ``config.duration`` seconds of arrivals at ``load_factor``.

    Arrivals stop at the duration; the run goes on until every request is completed or dropped;
    utilisation counts busy time within ``[0, duration)``.
    """
    if not (load_factor >= 0 and math.isfinite(load_factor)):
        raise ValueError(f"load_factor must be a non-negative number, got {load_factor!r}")
    setup = _prepare(plan, profiles, config)
    results, busy, slots, runs = {}, {}, {}, {}
    for index, model_plan in enumerate(plan.models):
        result, trace, placement = _run_model(setup, index, model_plan, load_factor)
        results[model_plan.name] = result
        runs[model_plan.name] = (placement, trace)
        busy.update(trace.slot_busy)
        slots.update(placement.slots)
    cluster, used = _utilization(plan, busy, slots, config.duration)
    return SimResult(config.dataplane, _arrivals_name(setup.arrivals), config.duration, config.seed, results, cluster, used, runs=runs)


def simulate_pool(
    plan: Plan,
    profiles: Mapping[str, Profile],
    dataplane: str,
    slots: Sequence[Slot],
    requests: Iterable[Request],
    *,
    timeout_s: float | Mapping[str, float] = TIMEOUT_S,
    settings: Any = None,
) -> Trace:
    """``requests`` (in arrival order) served by a shared pool: every model of ``plan`` (a shared
    plan, ``daskpipe.plan.shared``) on every one of ``slots``, with one ``dataplane`` dispatcher
    for all of them (:func:`~daskpipe.sched.registry.make_shared_dispatcher`, as the runtime's
    ``deploy(..., pools=SharedPools())`` builds it). Models share the slots here, so they run in
    one engine, not one each as in :func:`simulate`."""
    bw = float(plan.cluster.get("bw_gbps", 10.0))
    dispatcher = make_shared_dispatcher(
        dataplane, {m.name: (m, profiles[m.name]) for m in plan.models}, slots, timeout_s=timeout_s, settings=settings
    )
    engine = Engine({m.name: dispatcher for m in plan.models}, {s.id: s for s in slots}, ProfileDurations(plan, profiles, bw))
    engine.add_arrivals(requests)
    return engine.run()


def _arrivals_name(arrivals: str | ArrivalTrace) -> str:
    return arrivals if isinstance(arrivals, str) else arrivals.source


def load_grid(step: float, max_load: float) -> list[float]:
    if not (0 < step <= max_load) or not math.isfinite(max_load):
        raise ValueError(f"need 0 < step <= max_load, got step={step!r}, max_load={max_load!r}")
    return [round(step * k, 10) for k in range(1, int(round(max_load / step)) + 1)]


def find_max_load(
    plan: Plan,
    profiles: Mapping[str, Profile],
    config: SimulationConfig = SimulationConfig(),
    *,
    target: float = 0.99,
    step: float = 0.05,
    max_load: float = 1.0,
    progress: Callable[[str, float], None] | None = None,
) -> SimResult:
    """The highest load factor on the ``step`` grid up to ``max_load`` at which each model keeps
    at least ``target`` attainment, per model.

    Assumes attainment does not rise with load, so each model is a bisection on the grid: try
    ``max_load`` first (most plans hold at or near it), then halve the bracket; about
    log2(max_load/step) runs per model instead of one per grid point. A model that fails even at
    ``step`` gets 0. The result's per-model figures and utilisation are those at each model's max
    load (at ``step`` when it is 0). ``config`` is :func:`simulate`'s.
    """
    if not 0 < target <= 1:
        raise ValueError(f"target attainment must be in (0, 1], got {target!r}")
    grid = load_grid(step, max_load)
    setup = _prepare(plan, profiles, config)
    results, best, busy, slots, reported = {}, {}, {}, {}, {}
    for index, model_plan in enumerate(plan.models):
        runs: dict[int, tuple[ModelResult, Trace, Placement]] = {}

        def ok(k: int) -> bool:
            if k not in runs:
                runs[k] = _run_model(setup, index, model_plan, grid[k])
                if progress is not None:
                    progress(model_plan.name, grid[k])
            return runs[k][0].attainment >= target

        good, bad = -1, len(grid)  # invariant: grid[good] passes (or good = -1), grid[bad] fails
        if ok(len(grid) - 1):
            good = len(grid) - 1
        else:
            bad = len(grid) - 1
            while bad - good > 1:
                mid = (good + bad) // 2
                if ok(mid):
                    good = mid
                else:
                    bad = mid
        best[model_plan.name] = grid[good] if good >= 0 else 0.0
        result, trace, placement = runs[max(good, 0)]
        results[model_plan.name] = result
        reported[model_plan.name] = (placement, trace)
        busy.update(trace.slot_busy)
        slots.update(placement.slots)
    cluster, used = _utilization(plan, busy, slots, config.duration)
    return SimResult(config.dataplane, _arrivals_name(setup.arrivals), config.duration, config.seed, results, cluster, used, best, reported)
