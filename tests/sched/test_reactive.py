"""The reactive per-pool baseline: staged dispatches driven by compute feedback."""

from __future__ import annotations

from dataclasses import replace

import pytest

from daskpipe.plan.schema import Plan
from daskpipe.sched.api import Feedback, Placement
from daskpipe.sched.drive import drive, poisson_arrivals, synthetic_plan, synthetic_profile
from daskpipe.sched.placement import place
from daskpipe.sched.reactive import ReactiveDispatcher, ReactiveSettings
from tests.sched.helpers import BW_GBPS, MS, fig5, model, profile, req, whole


def reactive(plan, placement: Placement | None = None, slo_ms: float = 200.0, **settings) -> ReactiveDispatcher:
    if placement is None:
        placement = place(Plan(0.0, (plan,)))["m"]
    return ReactiveDispatcher(plan, placement, profile(slo_ms), bw_gbps=BW_GBPS, settings=ReactiveSettings(**settings))


def test_batches_move_pool_by_pool_through_feedback():
    plan, placement = fig5()
    d = reactive(plan, placement, first_look_drop=False)
    [first] = d.submit(req(0, 0.0), 0.0)  # node1 is free: sent at once, first partition only
    assert [h.partition for h in first.hops] == [0] and first.hops[0].slot == "node1"
    assert first.hops[0].compute.end == pytest.approx(10 * MS)
    assert d.submit(req(1, 0.001), 0.001) == []  # node1 busy: waits
    assert d.next_wake() == pytest.approx(10 * MS)
    actions = d.feedback(Feedback(first.id, 0, "compute", 0.0, 0.010), 0.010)
    second, third = actions  # request 0 enters pool 2; request 1 gets node1
    assert second.requests[0].id == 0 and second.hops[0].partition == 1 and second.hops[0].slot in ("node2", "node3")
    ul, dl = second.hops[0].transfer_in
    assert ul.resource == "node1/ul" and dl.resource == f"{second.hops[0].slot}/dl"
    assert second.hops[0].compute.start == pytest.approx(0.010 + 1 * MS)
    assert third.requests[0].id == 1 and third.hops[0].partition == 0
    assert d.queued == 0


def test_budget_keeps_downstream_slack_and_first_look_drops():
    plan = model(whole("A", bs=4))
    d = reactive(plan, slo_ms=42.0)  # bs 4 needs 50 ms > 42: first look drops (artifact)
    [drop] = d.submit(req(0, 0.0, 42.0), 0.0)
    assert drop.reason == "deadline"
    d = reactive(plan, slo_ms=42.0, first_look_drop=False)
    [batch] = d.submit(req(0, 0.0, 42.0), 0.0)
    assert batch.batch_size == 1


def test_weighted_round_robin_follows_planned_throughput():
    plan = model(replace(whole("A"), throughput=300.0), replace(whole("B"), throughput=100.0))
    d = reactive(plan, first_look_drop=False)
    pipelines = []
    for i in range(8):
        for action in d.submit(req(i, 0.0), 0.0):
            pipelines.append(action.pipeline)
    assert d.queued + len(pipelines) == 8
    assert d._assigned == [6, 2]


@pytest.mark.parametrize("load", [0.7, 1.5])
def test_nothing_lost(load):
    prof = synthetic_profile()
    plan = synthetic_plan(prof, high=3, low=8, gpus_per_server=2)
    m = plan.models[0]
    d = ReactiveDispatcher(m, place(plan)[m.name], prof, bw_gbps=plan.cluster["bw_gbps"])
    requests = list(poisson_arrivals(m.name, m.throughput * load, m.slo_us * 1e-6, 2000, seed=1))
    out = drive(d, requests, record=True)
    last = {pi: len(p.partitions) - 1 for pi, p in enumerate(m.pipelines)}
    completed = [r.id for b in out.dispatches if b.hops[-1].partition == last[b.pipeline] for r in b.requests]
    dropped = [x.request.id for x in out.drops]
    assert sorted(completed + dropped) == [r.id for r in requests]
    assert d.queued == 0 and not d._inflight


def test_bad_settings():
    with pytest.raises(ValueError, match="first_look_fraction"):
        ReactiveSettings(first_look_fraction=0)
    with pytest.raises(ValueError, match="partition 1"):
        plan, placement = fig5()
        d = reactive(plan, placement)
        [first] = d.submit(req(0, 0.0), 0.0)
        d.feedback(Feedback(first.id, 1, "compute", 0.0, 0.01), 0.01)
