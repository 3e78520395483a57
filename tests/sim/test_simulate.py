"""simulate / find_max_load / the CLI on the toy plan (and on real profiles when present)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from daskpipe.sched.registry import DATAPLANES
from daskpipe.sim.cli import simulate as simulate_cli
from daskpipe.sim.config import SimulationConfig
from daskpipe.sim.simulate import find_max_load, simulate

from .helpers import batching_plan


@pytest.mark.parametrize("dataplane", ["deferred", "eager", "timeout"])
def test_every_request_is_accounted_for(toy, dataplane):
    plan, profiles = toy
    result = simulate(plan, profiles, SimulationConfig(dataplane=dataplane, duration=0.5, seed=2), load_factor=1.5)
    r = result.models["toy"]
    assert r.submitted == pytest.approx(750, rel=0.15)
    assert r.on_time + r.late + r.dropped_total == r.submitted
    assert 0 < result.utilization["A"] <= 1 and 0 < result.utilization["B"] <= 1


def test_runs_are_deterministic_under_a_seed(toy):
    plan, profiles = toy
    runs = [
        simulate(plan, profiles, SimulationConfig(dataplane="deferred", arrivals="bursty", duration=0.5, seed=s)).to_dict()
        for s in (4, 4, 5)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_utilization_counts_slices_and_idle_inventory(toy):
    plan, profiles = toy
    result = simulate(plan, profiles, SimulationConfig(dataplane="deferred", duration=0.5), load_factor=1.0)
    # the plan places 2 of the 4 B GPUs: utilisation over the inventory is half that over the placed ones
    assert result.utilization["B"] == pytest.approx(result.utilization_placed["B"] / 2)


def test_find_max_load_is_the_edge_of_the_grid(toy):
    plan, profiles = toy
    config = SimulationConfig(dataplane="deferred", duration=0.5, seed=3)
    found = find_max_load(plan, profiles, config, max_load=3.0)
    lf = found.max_load_factor["toy"]
    assert 0 < lf < 3.0 and round(lf / 0.05, 6).is_integer()
    assert found.models["toy"].attainment >= 0.99
    assert simulate(plan, profiles, config, load_factor=lf + 0.05).models["toy"].attainment < 0.99


def test_bad_arguments(toy):
    plan, profiles = toy
    with pytest.raises(
        ValueError, match="unknown data plane 'magic'; known: ppipe, ppipe-two-pass, deferred, eager, timeout, reactive, hybrid"
    ):
        simulate(plan, profiles, SimulationConfig(dataplane="magic"))
    with pytest.raises(ValueError, match="load_factor"):
        simulate(plan, profiles, load_factor=-1)
    with pytest.raises(ValueError, match="no profile"):
        simulate(plan, {}, SimulationConfig(dataplane="deferred", duration=0.1))


def test_cli_writes_the_contract(tmp_path, toy):
    plan, profiles = toy
    plan.save(tmp_path / "plan.json")
    (tmp_path / "profiles").mkdir()
    profiles["toy"].save(tmp_path / "profiles" / "toy.json")
    out = tmp_path / "out.json"
    args = [
        "--plan",
        str(tmp_path / "plan.json"),
        "--profiles",
        str(tmp_path / "profiles"),
        "--dataplane",
        "timeout",
        "--timeout-ms",
        "1",
        "--max-batch",
        "2",
        "--duration",
        "0.3",
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(simulate_cli, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert {"attainment", "dropped", "late", "p99_ms", "mean_batch_size"} <= set(data["models"]["toy"]) and set(data["utilization"]) == {
        "A",
        "B",
    }
    assert data["models"]["toy"]["mean_batch_size"] <= 2
    report = tmp_path / "report.html"
    result = CliRunner().invoke(
        simulate_cli, args[:-2] + ["--find-max-load", "--max-load", "0.2", "--json", str(out), "--report", str(report)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["models"]["toy"]["max_load_factor"] == pytest.approx(0.2)
    html = report.read_text()
    assert all(page in html for page in ("Plan", "SLOs", "GPUs", "Batches and queues")) and '"toy"' in html
    bad = CliRunner().invoke(
        simulate_cli, ["--plan", str(tmp_path / "profiles" / "toy.json"), "--profiles", str(tmp_path), "--json", str(out)]
    )
    assert bad.exit_code != 0 and "expected 'daskpipe-plan/1'" in bad.output


@pytest.mark.shared
def test_fcn_golden_cluster_holds_high_load(ppipe_dir):
    """PPipe's golden case (FCN on 4 V100 + 12 P4, 6 Gb/s): its plan with its data plane keeps
    >= 99% attainment at LF 0.9 (the paper: up to 0.95)."""
    from daskpipe.plan.milp import make_plan
    from daskpipe.plan.options import PlannerOptions
    from daskpipe.profiles.loader import load_profiles

    profiles = load_profiles(ppipe_dir, ["fcn"])
    options = PlannerOptions(bw_gbps=6.0, margin=0.4, max_parts=2, time_limit=30)
    plan = make_plan(profiles, {"V100": 4, "P4": 12}, gpus_per_server={"V100": 2, "P4": 1}, options=options)
    result = simulate(plan, profiles, SimulationConfig(dataplane="ppipe", duration=1.0), load_factor=0.9)
    (r,) = result.models.values()
    assert r.attainment >= 0.99 and r.on_time + r.late + r.dropped_total == r.submitted


@pytest.mark.parametrize("dataplane", ["ppipe", "reactive"])
def test_planned_and_staged_dataplanes_run_on_the_toy_plan(toy, dataplane):
    pytest.importorskip(f"daskpipe.sched.{dataplane}")
    plan, profiles = toy
    result = simulate(plan, profiles, SimulationConfig(dataplane=dataplane, duration=0.5, seed=2), load_factor=0.8)
    r = result.models["toy"]
    assert r.on_time + r.late + r.dropped_total == r.submitted > 0
    assert r.attainment > 0.9


def test_a_model_without_pipelines_has_its_requests_refused(toy):
    from daskpipe.plan.schema import ModelPlan, Plan

    plan, profiles = toy
    starved = Plan(1.0, plan.models + (ModelPlan("none", 50_000.0, 1.0, 0.0, ()),), cluster=plan.cluster)
    profiles = dict(profiles, none=profiles["toy"])
    result = simulate(starved, profiles, SimulationConfig(dataplane="deferred", duration=0.2, base_rates={"toy": 1000.0, "none": 500.0}))
    r = result.models["none"]
    assert r.submitted > 0 and r.dropped == {"no-capacity": r.submitted} and r.attainment == 0.0


def test_cli_latency_noise_and_dispatch_policy(tmp_path):
    plan, profiles = batching_plan()
    plan.save(tmp_path / "plan.json")
    profiles["g"].save(tmp_path / "g.json")
    (tmp_path / "ratios.txt").write_text("# measured / profiled\n1.1\n\n1.3  # a slow one\n")
    out = tmp_path / "out.json"
    base = [
        "--plan",
        str(tmp_path / "plan.json"),
        "--profiles",
        str(tmp_path / "g.json"),
        "--load-factor",
        "0.2",
        "--duration",
        "5",
        "--json",
        str(out),
        "--latency-ratios",
        str(tmp_path / "ratios.txt"),
    ]
    attainment = {}
    for quantile in ("0.95", "off"):
        result = CliRunner().invoke(simulate_cli, base + ["--slack-quantile", quantile])
        assert result.exit_code == 0, result.output
        attainment[quantile] = json.loads(out.read_text())["models"]["g"]["attainment"]
    assert attainment["0.95"] > attainment["off"]
    for args, message in [
        (["--slack-quantile", "1.5"], "slack_quantile"),
        (["--slack-quantile", "high"], "neither a number nor 'off'"),
        (["--slack-quantile", "off", "--dataplane", "eager"], "only the ppipe data plane"),
    ]:
        result = CliRunner().invoke(simulate_cli, base + args)
        assert result.exit_code == 2 and message in result.output, result.output
    (tmp_path / "ratios.txt").write_text("1.1\nfast\n")
    result = CliRunner().invoke(simulate_cli, base)
    assert result.exit_code == 2 and "line 2" in result.output
    (tmp_path / "ratios.txt").write_text("# nothing measured\n")
    result = CliRunner().invoke(simulate_cli, base)
    assert result.exit_code == 1 and "latency_ratios is empty" in result.output


@pytest.mark.parametrize("dataplane", DATAPLANES)
def test_every_data_plane_holds_70_percent_of_the_plans_capacity(dataplane):
    """The runtime's test plan (tests/runtime/scheduler/test_plugin.py), simulated with each registered data plane."""
    from tests.runtime.helpers import two_stage

    profile, plan = two_stage(slo_ms=60.0, stage_ms=(5.0, 5.0))
    result = simulate(plan, {"tiny": profile}, SimulationConfig(dataplane=dataplane, duration=5.0, bw_gbps=10.0), load_factor=0.7)
    tiny = result.models["tiny"]
    assert result.dataplane == dataplane and tiny.submitted > 0.7 * plan.model("tiny").throughput * 5.0 * 0.9
    assert tiny.attainment >= 0.99, tiny


def test_a_shared_pool_serves_every_model_in_one_engine():
    from daskpipe.sched.api import Request
    from daskpipe.sim.simulate import simulate_pool
    from tests.sched.helpers import two_kind_pool

    plan, profiles, slots = two_kind_pool()
    requests = [Request(i, "ab"[i % 2], i * 1e-3, i * 1e-3 + 0.03) for i in range(600)]  # 1,000 req/s in all
    trace = simulate_pool(plan, profiles, "deferred", slots, requests)
    assert len(trace.requests) == 600
    assert all(r.finish is not None or r.dropped is not None for r in trace.requests.values())
    assert {(d.model, d.hops[0].slot) for _, d in trace.dispatches} == {(m, s.id) for m in "ab" for s in slots}


def shared_linear_pool(models: int, gpus: int, alpha_ms: float = 1.0, beta_ms: float = 15.0, slo_ms: float = 46.0):
    """``models`` copies of Fig. 6a's profile (l(b) = alpha b + beta, SLO 2 l(8)) sharing ``gpus`` T4s."""
    from daskpipe.plan.shared import SharedGroup, shared_plan
    from daskpipe.sched.api import Slot
    from tests.plan.helpers import linear

    names = tuple(f"m{i}" for i in range(models))
    profiles = {name: linear(name, alpha_ms, beta_ms, slo_ms, kinds=(("T4", 1),)) for name in names}
    plan = shared_plan(profiles, [SharedGroup(names, {("T4", 1): gpus})])
    return plan, profiles, [Slot(f"gpu{i}", "T4", 1, "s") for i in range(gpus)]


def poisson_requests(names, rate: float, duration: float, slo_s: float, seed: int = 1):
    import numpy as np

    from daskpipe.sched.api import Request

    rng = np.random.default_rng(seed)
    times = sorted((float(t), name) for name in names for t in np.cumsum(rng.exponential(len(names) / rate, int(2 * rate * duration))))
    return [Request(i, name, t, t + slo_s) for i, (t, name) in enumerate(x for x in times if x[0] < duration)]


def test_a_shared_pool_runs_the_dispatcher_that_a_stand_alone_symphony_run_builds():
    """``simulate_pool`` (the plan's latencies, caps and durations) decides exactly as a
    ``DeferredDispatcher`` built straight from l(b), as ``bench symphony`` builds it: the
    shared-pool path adds nothing of its own to the policy."""
    from daskpipe.sched.symphony import DeferredDispatcher
    from daskpipe.sim.engine import Engine, ReservedDurations
    from daskpipe.sim.simulate import simulate_pool

    plan, profiles, slots = shared_linear_pool(models=3, gpus=2)
    names = [m.name for m in plan.models]
    requests = poisson_requests(names, 600.0, 1.0, 0.046)
    pooled = simulate_pool(plan, profiles, "deferred", slots, requests)
    alone = DeferredDispatcher(
        {name: 0.046 for name in names}, slots, lambda _m, b: (1.0 * b + 15.0) / 1e3, max_batch=plan.models[0].pipelines[0].batch_size
    )
    engine = Engine({name: alone for name in names}, {s.id: s for s in slots}, ReservedDurations())
    engine.add_arrivals(requests)
    direct = engine.run()

    def decisions(trace):
        return [(d.model, d.hops[0].slot, round(d.hops[0].compute.start, 9), tuple(r.id for r in d.requests)) for _, d in trace.dispatches]

    assert decisions(pooled) == decisions(direct) and len(pooled.dispatches) > 100


def test_deferred_batching_beats_eager_on_a_shared_pool_where_batching_pays():
    """Two GPUs a model, beta/alpha 15, at 75% of the pool's bound: deferral keeps the batches
    large (Symphony's staggering) and every request on time, while eager's small batches fall
    behind. (With three models a GPU, as in ``bench multiplex``, no batch forms at any load the
    pool can carry, and deferred's alpha-wide windows lose to eager's slack: docs/batching.md.)"""
    import numpy as np

    from daskpipe.sim.engine import on_time
    from daskpipe.sim.simulate import simulate_pool

    plan, profiles, slots = shared_linear_pool(models=2, gpus=4)
    names = [m.name for m in plan.models]
    bound = len(names) / sum(1 / m.throughput for m in plan.models)
    requests = poisson_requests(names, 0.75 * bound, 2.0, 0.046)
    attainment, batch = {}, {}
    for dataplane in ("deferred", "eager"):
        trace = simulate_pool(plan, profiles, dataplane, slots, requests)
        attainment[dataplane] = sum(on_time(r) for r in trace.requests.values()) / len(requests)
        batch[dataplane] = float(np.mean([d.batch_size for _, d in trace.dispatches]))
    assert attainment["deferred"] >= 0.99 > attainment["eager"], attainment
    assert batch["deferred"] > 1.5 * batch["eager"], batch
