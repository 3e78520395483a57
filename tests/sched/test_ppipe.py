"""PPipe's data plane: probe (Fig. 5), Algorithm 1's three steps, settings, feedback, no lost request."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan
from daskpipe.sched.api import Dispatch, Drop, Feedback, Placement, Request, Slot
from daskpipe.sched.drive import Outcome, drive, exact_feedback, poisson_arrivals, synthetic_plan, synthetic_profile
from daskpipe.sched.placement import place
from daskpipe.sched.ppipe import PPipeDispatcher, PPipeSettings
from daskpipe.sched.timeline import make_timeline
from tests.sched.helpers import BOUNDARY, BW_GBPS, MS, fig5, model, profile, req, split, whole


def dispatcher(plan: ModelPlan, placement: Placement | None = None, slo_ms: float = 200.0, **settings) -> PPipeDispatcher:
    """Batches wait as in the paper (``join_chance=None``) unless a test asks otherwise: these
    tests build batches from requests submitted one at a time, with nothing else outstanding."""
    settings.setdefault("join_chance", None)
    if placement is None:
        placement = place(Plan(0.0, (plan,)))["m"]
    return PPipeDispatcher(plan, placement, profile(slo_ms), bw_gbps=BW_GBPS, settings=PPipeSettings(**settings))


# -- probe and reserve (Algorithm 2, Fig. 5) -------------------------------------------------------------
@pytest.mark.parametrize("mode", ["gaps", "append"])
def test_fig5_probe_picks_node2_and_reserves_ul_dl_together(mode):
    plan, placement = fig5()
    d = dispatcher(plan, placement, timeline=mode)
    d.timeline.reserve("node3", 0.0, 0.050)  # node3 is busy: it would finish later
    offer = d.probe(0, 2, now=0.0)
    assert offer.path == ("node1", "node2")
    compute1, ul, dl, compute2 = offer.reservations
    assert (compute1.resource, compute1.start, compute1.end) == ("node1", 0.0, pytest.approx(15 * MS))
    assert (ul.resource, dl.resource) == ("node1/ul", "node2/dl")
    assert (ul.start, ul.end) == (dl.start, dl.end) == (compute1.end, pytest.approx(compute1.end + 2 * MS))
    assert compute2.resource == "node2" and compute2.start == ul.end
    assert offer.finish == compute2.end == pytest.approx((15 + 2 + 30) * MS)
    assert offer.wait == pytest.approx(0.0)
    # probe is stateless; reserve commits
    assert d.timeline.intervals("node1") == []
    d.reserve(offer, dispatch_id=7)
    assert d.timeline.tail("node1/ul") == d.timeline.tail("node2/dl") == ul.end
    after = d.probe(0, 2, now=0.0)  # node2 frees at 47 ms, node3 at 50 ms: node2 again, after the first batch
    assert after.path == ("node1", "node2") and after.hops[1].compute.start == compute2.end


def test_probe_waits_for_a_busy_receiver_downlink():
    plan, placement = fig5()
    d = dispatcher(plan, placement)
    d.timeline.reserve("node2/dl", 0.0, 0.040)  # node2 can receive only from 40 ms
    offer = d.probe(0, 1, now=0.0)
    assert offer.path == ("node1", "node3")
    d.timeline.reserve("node3/dl", 0.0, 0.045)
    offer = d.probe(0, 1, now=0.0)
    assert offer.path == ("node1", "node2") and offer.hops[1].transfer_in[0].start == pytest.approx(0.040)
    assert offer.wait == pytest.approx(0.030)


@pytest.mark.parametrize("mode", ["gaps", "append"])
@pytest.mark.parametrize("uplink_aware", [False, True])
def test_uplink_aware_probe_avoids_a_sender_whose_uplink_is_booked(mode, uplink_aware):
    """Pool 1 = {node1, node4}, pool 2 = {node2}: node1 finishes first but its uplink is booked
    until 40 ms. Algorithm 2 takes node1 and the transfer waits; the artifact's choice takes node4."""
    slots = {f"node{i}": Slot(f"node{i}", "B" if i == 2 else "A", 1, f"node{i}") for i in (1, 2, 4)}
    placement = Placement("m", {(0, 0): ("node1", "node4"), (0, 1): ("node2",)}, slots)
    d = dispatcher(model(split((2, 1))), placement, timeline=mode, uplink_aware=uplink_aware)
    d.timeline.reserve("node4", 0.0, 1 * MS)
    d.timeline.reserve("node1/ul", 0.0, 40 * MS)
    offer = d.probe(0, 2, now=0.0)
    if uplink_aware:
        assert offer.path == ("node4", "node2")
        assert offer.finish == pytest.approx((1 + 15 + 2 + 30) * MS)
    else:
        assert offer.path == ("node1", "node2")
        assert offer.finish == pytest.approx((40 + 2 + 30) * MS)


def test_probe_rejects_bad_arguments():
    plan, placement = fig5()
    d = dispatcher(plan, placement)
    with pytest.raises(ValueError, match="batch sizes 1..4"):
        d.probe(0, 5, 0.0)
    with pytest.raises(ValueError, match="pipelines 0..0"):
        d.probe(1, 1, 0.0)


# -- Algorithm 1 ---------------------------------------------------------------------------------------
def test_batch_shrinks_until_the_head_meets_its_deadline():
    d = dispatcher(model(whole("A")), slo_ms=42.0)  # bs 4 needs 50 ms, bs 3 needs 40 ms
    assert d.submit(req(0, 0.0, 42.0), 0.0) == []
    assert d.next_wake() == pytest.approx(42 * MS - 30 * MS)  # last moment for a batch of 2
    assert d.submit(req(1, 0.0, 42.0), 0.0) == []
    [batch] = d.submit(req(2, 0.0, 42.0), 0.0)
    assert batch.batch_size == 3 and [r.id for r in batch.requests] == [0, 1, 2]
    assert batch.finish == pytest.approx(40 * MS)


def test_wait_until_the_last_moment():
    d = dispatcher(model(whole("A")))
    assert d.submit(req(0, 0.0), 0.0) == []
    wake = d.next_wake()
    assert wake == pytest.approx(200 * MS - 30 * MS)  # deadline - work(|q| + 1)
    assert d.wake(0.1) == []  # early wake: nothing changes
    assert d.next_wake() == wake
    assert d.submit(req(1, 0.15), 0.15) == []
    assert d.next_wake() == pytest.approx(200 * MS - 40 * MS)
    [batch] = d.wake(d.next_wake())
    assert batch.batch_size == 2 and batch.finish <= 200 * MS + 1e-12
    assert d.next_wake() is None and d.queued == 0


def test_drop_at_admission_when_even_an_idle_path_is_too_slow():
    d = dispatcher(model(whole("A")))
    [drop] = d.submit(Request(0, "m", 0.0, 0.005), 0.0)
    assert drop.reason == "deadline" and d.queued == 0
    [drop] = d.submit(Request(1, "m", 0.0, 1.0, size=5), 0.0)
    assert drop.reason == "no-capacity"
    assert d.stats.dropped == {"deadline": 1, "no-capacity": 1}


def test_model_without_pipelines_drops_everything():
    d = PPipeDispatcher(model(), Placement("m", {}, {}), profile(), bw_gbps=BW_GBPS)
    [drop] = d.submit(req(0, 0.0), 0.0)
    assert drop.reason == "no-capacity"


def test_overload_bound_drops_at_once():
    d = dispatcher(model(whole("A", bs=4)), max_queued=2)
    assert d.submit(req(0, 0.0), 0.0) == [] and d.submit(req(1, 0.0), 0.0) == []
    [drop] = d.submit(req(2, 0.0), 0.0)
    assert drop.reason == "overload" and drop.request.id == 2 and d.queued == 2


def test_head_dropped_when_busy_tables_leave_no_batch():
    d = dispatcher(model(whole("A")))
    d.timeline.reserve("A-0/0", 0.0, 0.195)
    [drop] = d.submit(req(0, 0.0), 0.0)
    assert drop.reason == "deadline" and d.queued == 0


def test_a_head_within_its_tolerance_runs_instead_of_being_dropped():
    d = dispatcher(model(whole("A")), lead_batches=None)  # a batch of 1 takes 20 ms; each is sent at once
    d.timeline.reserve("A-0/0", 0.0, 0.175)
    [batch] = d.submit(Request(0, "m", 0.0, 0.200, tolerance=0.030), 0.0)
    assert batch.finish == pytest.approx(0.195)  # in time
    # the slot is busy until 195 ms: 215 ms is past the deadline, within the tolerance
    [batch] = d.submit(Request(1, "m", 0.0, 0.200, tolerance=0.030), 0.0)
    assert batch.finish == pytest.approx(0.215)
    [drop] = d.submit(Request(2, "m", 0.0, 0.200, tolerance=0.030), 0.0)  # 235 ms: past it
    assert drop.reason == "deadline" and d.queued == 0
    [drop] = d.submit(Request(3, "m", 0.0, 0.230), 0.0)  # without a tolerance, 235 ms is a drop
    assert drop.reason == "deadline"
    [batch] = d.submit(Request(4, "m", 0.0, 0.230, tolerance=0.005), 0.0)
    assert batch.finish == pytest.approx(0.235)


def test_a_batch_past_its_deadline_takes_what_its_tolerance_allows_and_never_waits():
    d = dispatcher(model(whole("A")))  # batches of 1..4 take 20, 30, 40, 50 ms
    for i in range(3):
        assert d.submit(Request(i, "m", 0.0, 0.200, tolerance=0.100), 0.0) == []
    assert d.next_wake() == pytest.approx(0.200 - 0.050)  # waiting for a fourth
    d.timeline.reserve("A-0/0", 0.0, 0.190)  # the slot turns out busy: no batch finishes by 200 ms
    [batch] = d.wake(d.next_wake())
    assert [r.id for r in batch.requests] == [0, 1, 2] and batch.finish == pytest.approx(0.230)
    assert d.queued == 0 and d.stats.dropped == {}


def test_pipeline_chosen_by_waiting_time():
    plan = model(whole("A"), whole("A"))
    d = dispatcher(plan)
    a0, a1 = d.placement.pools[(0, 0)][0], d.placement.pools[(1, 0)][0]
    d.timeline.reserve(a0, 0.0, 0.030)
    for i in range(4):
        actions = d.submit(req(i, 0.0), 0.0)
    [batch] = actions
    assert batch.pipeline == 1 and batch.hops[0].slot == a1
    for i in range(4, 8):  # now pipeline 1 is busy till 50 ms, pipeline 0 till 30 ms: 0 waits less
        actions = d.submit(req(i, 0.0), 0.0)
    [batch] = actions
    assert batch.pipeline == 0 and batch.hops[0].compute.start == pytest.approx(0.030)


def test_sizes_count_samples_and_requests_are_never_split():
    d = dispatcher(model(whole("A", bs=4)))
    assert d.submit(req(0, 0.0, size=3), 0.0) == []
    [batch] = d.submit(req(1, 0.0, size=2), 0.0)  # 5 samples queued, 3 + 2 > 4: the head goes alone...
    assert [r.id for r in batch.requests] == [0] and batch.batch_size == 3
    assert d.queued == 1  # ...and the second waits for company


def test_two_pass_admission_drops_on_first_look():
    plan = model(whole("A"))
    d = dispatcher(plan, slo_ms=42.0, two_pass_admission=True)  # only bs 4 is tried first, and misses
    [drop] = d.submit(req(0, 0.0, 42.0), 0.0)
    assert drop.reason == "deadline"
    assert dispatcher(plan, slo_ms=42.0).submit(req(0, 0.0, 42.0), 0.0) == []  # paper: waits with bs 3


def test_bs1_penalty_steers_away_from_batch_one_pipelines_that_miss():
    plan = model(whole("B", bs=1), whole("A", bs=4))
    for penalty, expected in ((False, 0), (True, 1)):
        d = dispatcher(plan, slo_ms=60.0, bs1_penalty=penalty)
        b = d.placement.pools[(0, 0)][0]
        d.timeline.reserve(b, 0.0, 0.025)  # the bs-1 pipeline would miss: 25 + 40 > 60 ms
        a = d.placement.pools[(1, 0)][0]
        d.timeline.reserve(a, 0.0, 0.030)  # and waits less than the bs-4 one
        assert d._choose(1, 0.060, 0.0)[0].index == expected


def test_drain_drops_everything_queued():
    d = dispatcher(model(whole("A")))
    d.submit(req(0, 0.0), 0.0)
    d.submit(req(1, 0.0), 0.0)
    drops = d.drain(0.01)
    assert [x.reason for x in drops] == ["shutdown", "shutdown"] and d.queued == 0 and d.next_wake() is None


def test_bad_inputs_are_refused():
    plan, placement = fig5()
    d = dispatcher(plan, placement)
    with pytest.raises(ValueError, match="for model 'other'"):
        d.submit(Request(0, "other", 0.0, 1.0), 0.0)
    with pytest.raises(ValueError, match="size"):
        d.submit(Request(0, "m", 0.0, 1.0, size=0), 0.0)
    for tolerance in (-0.001, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="tolerance"):
            d.submit(Request(0, "m", 0.0, 1.0, tolerance=tolerance), 0.0)
    wrong = Placement("m", {(0, 0): ("node2",), (0, 1): ("node3",)}, placement.slots)
    with pytest.raises(ValueError, match="needs A/v1"):
        PPipeDispatcher(plan, wrong, profile(), bw_gbps=BW_GBPS)
    with pytest.raises(ValueError, match="no slots for pool"):
        PPipeDispatcher(plan, Placement("m", {(0, 0): ("node1",)}, placement.slots), profile(), bw_gbps=BW_GBPS)
    with pytest.raises(ValueError, match="bw_gbps"):
        PPipeDispatcher(plan, placement, profile(), bw_gbps=0)
    with pytest.raises(ValueError, match="timeline"):
        PPipeSettings(timeline="lanes")
    with pytest.raises(ValueError, match="shared timeline is 'append'"):
        PPipeDispatcher(plan, placement, profile(), bw_gbps=BW_GBPS, timeline=make_timeline("append"))
    with pytest.raises(ValueError, match="max_queued"):
        PPipeSettings(max_queued=0)


# -- feedback --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["gaps", "append"])
def test_late_feedback_shifts_later_reservations(mode):
    d = dispatcher(model(whole("A", bs=1)), timeline=mode)
    [first] = d.submit(req(0, 0.0), 0.0)
    [second] = d.submit(req(1, 0.0), 0.0)
    slot = first.hops[0].slot
    assert second.hops[0].compute.start == pytest.approx(first.finish)
    d.feedback(Feedback(first.id, 0, "compute", 0.0, first.finish + 0.005), first.finish + 0.005)
    assert d.timeline.tail(slot) == pytest.approx(second.finish + 0.005)
    [third] = d.submit(req(2, 0.025), 0.025)
    assert third.hops[0].compute.start == pytest.approx(second.finish + 0.005)
    # early feedback frees time for what comes next
    start = third.hops[0].compute.start
    d.feedback(Feedback(third.id, 0, "compute", start, start + 0.001), start + 0.0005)
    assert d.timeline.tail(slot) == pytest.approx(start + 0.001)


def test_feedback_rejects_nonsense():
    d = dispatcher(model(whole("A", bs=1)))
    [batch] = d.submit(req(0, 0.0), 0.0)
    with pytest.raises(ValueError, match="partition 3"):
        d.feedback(Feedback(batch.id, 3, "compute", 0.0, 0.01), 0.01)
    with pytest.raises(ValueError, match="has none"):
        d.feedback(Feedback(batch.id, 0, "transfer", 0.0, 0.01), 0.01)
    with pytest.raises(ValueError, match="kind"):
        d.feedback(Feedback(batch.id, 0, "network", 0.0, 0.01), 0.01)  # type: ignore[arg-type]
    assert d.feedback(Feedback(999, 0, "compute", 0.0, 0.01), 0.01) == []  # unknown dispatch: ignored


# -- slack-aware dispatch -----------------------------------------------------------------------------------
def run_full_batches(d: PPipeDispatcher, ratios: list[float]) -> None:
    """One full batch of 4 a second, each computing ``ratio`` x its reservation, with its feedback."""
    for k, ratio in enumerate(ratios):
        now = float(k)
        [batch] = [action for i in range(4) for action in d.submit(req(10 * k + i, now), now)]
        hop = batch.hops[0]
        d.feedback(
            Feedback(batch.id, 0, "compute", hop.compute.start, hop.compute.start + ratio * (hop.compute.end - hop.compute.start)),
            now + 0.5,
        )


def test_variance_moves_the_last_moment_earlier_not_the_reservations():
    d = dispatcher(model(whole("A")), latency_window=20, latency_min_samples=20)
    run_full_batches(d, [1.0, 1.0, 1.0, 1.5] * 5)  # p95 of the measured ratio: 1.5; its median: 1.0
    assert d.probe(0, 4, 30.0).hops[0].compute.end - 30.0 == pytest.approx(50 * MS)  # reserved as profiled
    assert d.submit(req(0, 30.0), 30.0) == []
    assert d.next_wake() == pytest.approx(30.0 + (200 - 1.5 * 30) * MS)  # deadline - p95 work(|q| + 1)
    [batch] = d.wake(d.next_wake())
    assert batch.batch_size == 1 and batch.finish == pytest.approx(30.0 + (200 - 45 + 20) * MS)


def test_a_stage_measured_slower_is_reserved_longer():
    d = dispatcher(model(whole("A")), latency_window=20, latency_min_samples=20)
    run_full_batches(d, [1.3] * 20)
    assert d.probe(0, 4, 30.0).hops[0].compute.end - 30.0 == pytest.approx(1.3 * 50 * MS)
    assert d.submit(req(0, 30.0), 30.0) == []
    assert d.next_wake() == pytest.approx(30.0 + (200 - 1.3 * 30) * MS)


def test_the_measured_ratios_are_given_as_they_came_and_not_without_measuring():
    d = dispatcher(model(whole("A")), latency_window=3, latency_min_samples=3)
    run_full_batches(d, [1.0, 1.2, 0.9, 1.5])
    assert d.ratio_samples() == {(0, 0): pytest.approx([1.2, 0.9, 1.5])}  # the window's, oldest first
    last_moment = dispatcher(model(whole("A")), slack_quantile=None)
    run_full_batches(last_moment, [1.3] * 3)
    assert last_moment.ratio_samples() == {}


def test_last_moment_dispatch_ignores_the_measures():
    d = dispatcher(model(whole("A")), slack_quantile=None)
    run_full_batches(d, [1.3] * 30)
    assert d.probe(0, 4, 30.0).hops[0].compute.end - 30.0 == pytest.approx(50 * MS)
    assert d.submit(req(0, 30.0), 30.0) == []
    assert d.next_wake() == pytest.approx(30.0 + (200 - 30) * MS)


def synthetic_outcomes(load: float, *variants: PPipeSettings, record: bool = False) -> list[Outcome]:
    """The same 3000 Poisson requests at ``load`` times the synthetic plan's rate (3 L4, 8 P4), once per settings."""
    prof = synthetic_profile()
    plan = synthetic_plan(prof, high=3, low=8, gpus_per_server=2)
    m = plan.models[0]
    requests = list(poisson_arrivals(m.name, m.throughput * load, m.slo_us * 1e-6, 3000, seed=5))
    return [
        drive(PPipeDispatcher(m, place(plan)[m.name], prof, bw_gbps=plan.cluster["bw_gbps"], settings=settings), requests, record=record)
        for settings in variants
    ]


@pytest.mark.parametrize("load", [0.4, 1.5])
def test_with_execution_as_reserved_both_policies_decide_alike(load):
    decided = [
        ([(b.id, b.hops, [r.id for r in b.requests]) for b in out.dispatches], [(x.request.id, x.reason) for x in out.drops])
        for out in synthetic_outcomes(load, PPipeSettings(slack_quantile=0.95), PPipeSettings(slack_quantile=None), record=True)
    ]
    assert decided[0] == decided[1]


# -- at low load, no waiting for nothing (join_chance) ----------------------------------------------------
def test_a_first_stage_starts_once_its_inputs_are_in():
    """Inputs of 1 MB at 8 Gbit/s take 1 ms a sample to come from their clients: a lone request's
    first stage is reserved from 1 ms after its dispatch, and it finishes that much later."""
    plan, placement = fig5()
    d = PPipeDispatcher(plan, placement, replace(profile(), input_bytes=BOUNDARY), bw_gbps=BW_GBPS, settings=PPipeSettings(join_chance=0.5))
    out = drive(d, [req(i, float(i)) for i in range(3)], record=True)
    assert [len(batch.requests) for batch in out.dispatches] == [1] * 3
    for i, batch in enumerate(out.dispatches):
        assert batch.hops[0].compute.start == pytest.approx(i + 1 * MS)
        assert batch.finish - i == pytest.approx(32 * MS)  # 1 ms in, then 10 + 1 + 20 ms as without inputs


def test_lone_requests_on_an_idle_pipeline_go_at_once():
    """Ten requests 1 s apart (SLO 200 ms): nothing was outstanding when any came, so none can
    expect another to join it; each takes its compute (10 + 1 + 20 ms), not its SLO."""
    plan, placement = fig5()
    d = dispatcher(plan, placement, join_chance=0.5)
    out = drive(d, [req(i, float(i)) for i in range(10)], record=True)
    assert [len(batch.requests) for batch in out.dispatches] == [1] * 10
    assert all(batch.finish - r.arrival == pytest.approx(31 * MS) for batch in out.dispatches for r in batch.requests)


def test_a_client_that_sends_once_it_has_its_answer_is_not_kept_waiting():
    """Each request comes just after the last one's work reported done, 32 ms apart: counted over
    all time that is 31 req/s, but none ever came while another was outstanding."""
    plan, placement = fig5()
    d = dispatcher(plan, placement, join_chance=0.5)
    t = 0.0
    for i in range(10):
        assert d.submit(req(i, t), t) == [] and d.next_wake() == t  # once any request of this instant is in
        [batch] = d.wake(t)
        assert batch.finish - t < 0.3 * 200 * MS
        for fb in exact_feedback(batch):
            assert d.feedback(fb, fb.end) == []
        t = batch.finish + MS
    assert d.next_wake() is None and d.queued == 0


def test_requests_that_come_while_others_are_outstanding_make_a_batch_wait_for_more():
    """One request that comes while another runs is a chance meeting; two in 2 ms are a rate."""
    d = dispatcher(model(whole("A")), join_chance=0.5)
    for i in range(2):
        assert d.submit(req(i, i * MS), i * MS) == []
        [batch] = d.wake(i * MS)
        assert batch.requests[0].id == i and batch.finish == pytest.approx((20 + 20 * i) * MS)
    assert d.submit(req(2, 2 * MS), 2 * MS) == []
    assert d.next_wake() == pytest.approx((2 + 200 - 30) * MS)  # its last moment for a batch of 2


def test_a_burst_of_a_full_batch_at_one_instant_goes_as_one_batch():
    d = dispatcher(model(whole("A")), join_chance=0.5)
    for i in range(3):
        assert d.submit(req(i, 0.0), 0.0) == []
    [batch] = d.submit(req(3, 0.0), 0.0)
    assert [r.id for r in batch.requests] == [0, 1, 2, 3]


@pytest.mark.parametrize("load", [0.4, 0.9])
def test_under_load_batches_wait_as_the_papers(load):
    """The next request is all but sure to come before a batch's last moment: the batches are the
    paper's but for the first ones of the run."""
    measured, paper = synthetic_outcomes(load, PPipeSettings(), PPipeSettings(join_chance=None))
    assert measured.dropped == paper.dropped == {} and measured.late == paper.late == 0
    assert measured.dispatched / measured.batches == pytest.approx(paper.dispatched / paper.batches, rel=0.02)


def test_join_settings_are_checked():
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match="join_chance"):
            PPipeSettings(join_chance=bad)
    with pytest.raises(ValueError, match="arrival_window_slos"):
        PPipeSettings(arrival_window_slos=0.0)
    assert PPipeSettings().join_chance == 0.5 and PPipeSettings.artifact().join_chance is None


def test_slack_settings_are_checked():
    with pytest.raises(ValueError, match="slack_quantile"):
        PPipeSettings(slack_quantile=1.0)
    with pytest.raises(ValueError, match="latency_min_samples"):
        PPipeSettings(latency_window=10, latency_min_samples=20)
    assert PPipeSettings.artifact().slack_quantile is None


# -- end to end: nothing lost, deadlines met when execution follows the reservations --------------------
def _check_run(d: PPipeDispatcher, requests: list[Request], **kwargs) -> None:
    out = drive(d, requests, record=True, **kwargs)
    dispatched = [r.id for batch in out.dispatches for r in batch.requests]
    dropped = [x.request.id for x in out.drops]
    assert sorted(dispatched + dropped) == [r.id for r in requests]  # every request ends exactly once
    assert out.late == 0
    for batch in out.dispatches:
        assert batch.batch_size == sum(r.size for r in batch.requests) <= d.model.pipelines[batch.pipeline].batch_size
        assert all(batch.finish <= r.deadline for r in batch.requests)
        for prev, hop in zip(batch.hops, batch.hops[1:]):
            ul, dl = hop.transfer_in
            assert ul.start == dl.start >= prev.compute.end and hop.compute.start >= ul.end
    for resource in {h.slot for b in out.dispatches for h in b.hops}:
        spans = d.timeline.intervals(resource)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize(
    "settings",
    [
        dict(timeline="gaps", uplink_aware=False),
        dict(timeline="append"),
        dict(timeline="append", two_pass_admission=True, bs1_penalty=True, reevaluate_on_arrival=True),
    ],
    ids=["paper", "append", "artifact"],
)
@pytest.mark.parametrize("load", [0.7, 1.5])
def test_nothing_lost_and_deadlines_met(settings, load):
    prof = synthetic_profile()
    plan = synthetic_plan(prof, high=3, low=8, gpus_per_server=2)
    m = plan.models[0]
    d = PPipeDispatcher(m, place(plan)[m.name], prof, bw_gbps=plan.cluster["bw_gbps"], settings=PPipeSettings(**settings))
    requests = list(poisson_arrivals(m.name, m.throughput * load, m.slo_us * 1e-6, 3000, seed=1))
    _check_run(d, requests)
    assert not d._live and d.queued == 0  # every dispatch's feedback came back: nothing kept
    if load > 1:
        assert d.stats.dropped.get("deadline", 0) > 0


def test_noisy_execution_with_feedback_keeps_every_request():
    prof = synthetic_profile()
    plan = synthetic_plan(prof, high=2, low=6, gpus_per_server=2)
    m = plan.models[0]
    d = PPipeDispatcher(m, place(plan)[m.name], prof, bw_gbps=plan.cluster["bw_gbps"])
    rng = random.Random(3)

    def noisy(batch):  # every stage runs 0.8x-1.2x its plan, in order, after its input arrives
        out, ready = [], batch.hops[0].compute.start
        for hop in batch.hops:
            if hop.transfer_in is not None:
                dur = (hop.transfer_in[0].end - hop.transfer_in[0].start) * rng.uniform(0.8, 1.2)
                start = max(ready, hop.transfer_in[0].start)
                out.append(Feedback(batch.id, hop.partition, "transfer", start, start + dur))
                ready = start + dur
            start = max(ready, hop.compute.start)
            dur = (hop.compute.end - hop.compute.start) * rng.uniform(0.8, 1.2)
            out.append(Feedback(batch.id, hop.partition, "compute", start, start + dur))
            ready = start + dur
        return out

    requests = list(poisson_arrivals(m.name, m.throughput, m.slo_us * 1e-6, 2000, seed=2))
    out = drive(d, requests, record=True, execute=noisy)
    assert out.dispatched + sum(out.dropped.values()) == len(requests)
    assert d.queued == 0


def test_golden_fcn_plan_on_measured_profiles(ppipe_dir):
    """The paper's golden FCN plan (4 V100 + 12 P4, 6 Gbit/s) on the measured profiles: at 80% of
    its throughput PPipe's data plane drops nothing and is never late; the reactive baseline drops."""
    from daskpipe.profiles.loader import load_profiles
    from daskpipe.sched.reactive import ReactiveDispatcher

    profiles = load_profiles(ppipe_dir, ["fcn"])
    name, prof = next(iter(profiles.items()))

    def part(blocks, gpu, v, vgpus, bs):
        return Partition(blocks, gpu, v, vgpus, prof.latency(gpu, v, bs, *blocks))

    pipelines = (
        Pipeline(1, 1051.0, (part((0, 7), "P4", 1, 12, 1), part((7, 10), "V100", 2, 6, 1))),
        Pipeline(2, 162.0, (part((0, 10), "V100", 1, 1, 2),)),
    )
    m = ModelPlan(name, prof.slo_us, 1.0, 1213.0, pipelines)
    plan = Plan(1213.0, (m,), cluster={"gpus": {"V100": 4, "P4": 12}, "gpus_per_server": {"V100": 2, "P4": 1}, "bw_gbps": 6})
    placement = place(plan)[name]
    requests = list(poisson_arrivals(name, 0.8 * m.throughput, m.slo_us * 1e-6, 5000, seed=1))
    d = PPipeDispatcher(m, placement, prof, bw_gbps=6)
    _check_run(d, requests)
    assert not d.stats.dropped
    reactive = ReactiveDispatcher(m, placement, prof, bw_gbps=6)
    out = drive(reactive, requests)
    assert sum(out.dropped.values()) > 0


# -- elasticity ------------------------------------------------------------------------------------------
def test_a_batch_is_sent_one_batch_time_before_its_slot_frees_and_forms_from_what_is_queued_then():
    d = dispatcher(model(whole("A", bs=4)))  # a batch of 4 takes 50 ms
    d.timeline.reserve("A-0/0", 0.0, 0.100)
    assert [a for i in range(8) for a in d.submit(req(i, 0.001 * i), 0.001 * i)] == []  # the slot is booked: they wait here
    assert d.next_wake() == pytest.approx(0.050)  # one batch time before the slot frees
    [batch] = d.wake(d.next_wake())
    assert [r.id for r in batch.requests] == [0, 1, 2, 3] and batch.hops[0].compute.start == pytest.approx(0.100)
    assert d.queued == 4 and d.next_wake() == pytest.approx(0.100)  # the next one goes when this one starts
    [batch] = d.wake(d.next_wake())
    assert [r.id for r in batch.requests] == [4, 5, 6, 7] and batch.hops[0].compute.start == pytest.approx(0.150)
    eager = dispatcher(model(whole("A", bs=4)), lead_batches=None)  # the paper's: each batch is sent when it is full
    eager.timeline.reserve("A-0/0", 0.0, 0.100)
    sent = [a for i in range(8) for a in eager.submit(req(i, 0.001 * i), 0.001 * i)]
    assert [b.hops[0].compute.start for b in sent] == pytest.approx([0.100, 0.150])


def test_a_backlog_keeps_full_batches_and_drops_a_head_that_only_a_smaller_batch_could_serve():
    def run(keep_full: bool) -> tuple[list[int], list[int]]:
        d = dispatcher(model(whole("A", bs=4)), keep_full=keep_full)
        d.timeline.reserve("A-0/0", 0.0, 0.150)
        requests = [Request(0, "m", 0.0, 0.180)] + [req(i, 0.0) for i in range(1, 5)]
        actions = [a for r in requests for a in d.submit(r, 0.0)]
        actions += d.wake(d.next_wake())
        return [len(a.requests) for a in actions if isinstance(a, Dispatch)], [a.request.id for a in actions if isinstance(a, Drop)]

    # request 0 needs its batch done by 180 ms, and the slot frees at 150 ms: a full batch (50 ms) ends at 200
    assert run(keep_full=False) == ([2], [])  # shrunk to 2 samples (30 ms) for it, three left queued
    assert run(keep_full=True) == ([4], [0])  # a full batch of the next four; request 0 is dropped


def test_remove_slot_releases_in_flight_reservations_and_retires_empty_pipelines():
    plan = model(whole("A", bs=1), split((1, 1), bs=1))
    d = dispatcher(plan, lead_batches=None)  # every batch is sent at once, however far ahead its slot is booked
    a_whole, a_split, b_split = d.placement.pools[(0, 0)][0], d.placement.pools[(1, 0)][0], d.placement.pools[(1, 1)][0]
    [first] = d.submit(req(0, 0.0), 0.0)
    [second] = d.submit(req(1, 0.0), 0.0)
    assert {first.pipeline, second.pipeline} == {0, 1}
    split_batch = first if first.pipeline == 1 else second
    assert d.remove_slot(b_split, 0.001) == []
    assert d.timeline.intervals(a_split) == []  # the split batch cannot finish: its reservations went back
    assert d.timeline.intervals(f"{d.placement.slots[a_split].server}/ul") == []
    with pytest.raises(ValueError, match="no slot left"):
        d.probe(1, 1, 0.001)
    [third] = d.submit(req(2, 0.001), 0.001)
    assert third.pipeline == 0 and split_batch.id not in d._live
    with pytest.raises(ValueError, match="not a slot"):
        d.remove_slot(b_split, 0.002)
    [fourth] = d.submit(req(3, 0.002), 0.002)  # batch size 1: sent at once
    assert d.remove_slot(a_whole, 0.003) == [] and fourth.id not in d._live
    [drop] = d.submit(req(4, 0.003), 0.003)  # no pipeline left
    assert drop.reason == "no-capacity"


def test_remove_slot_drops_queued_requests_no_pipeline_can_take():
    d = dispatcher(model(whole("A", bs=4)))
    d.submit(req(0, 0.0), 0.0)
    [drop] = d.remove_slot(d.placement.pools[(0, 0)][0], 0.001)
    assert drop.reason == "worker-lost" and d.queued == 0 and d.next_wake() is None


def test_add_slot_grows_a_pool():
    plan = model(whole("A", bs=1))
    d = dispatcher(plan)
    [first] = d.submit(req(0, 0.0), 0.0)
    assert d.add_slot(Slot("extra", "A", 1, "srv9"), 0, 0, 0.0) == []
    [second] = d.submit(req(1, 0.0), 0.0)
    assert second.hops[0].slot == "extra" and second.hops[0].compute.start == 0.0
    with pytest.raises(ValueError, match="already in pool"):
        d.add_slot(Slot("extra", "A", 1, "srv9"), 0, 0, 0.0)
    with pytest.raises(ValueError, match="needs A/v1"):
        d.add_slot(Slot("b", "B", 1, "srv9"), 0, 0, 0.0)
    with pytest.raises(ValueError, match="no pool"):
        d.add_slot(Slot("c", "A", 1, "srv9"), 0, 1, 0.0)


def test_records_of_dispatches_without_feedback_are_forgotten_after_the_horizon():
    prof = synthetic_profile()
    plan = synthetic_plan(prof, high=3, low=8, gpus_per_server=2)
    m = plan.models[0]
    d = PPipeDispatcher(m, place(plan)[m.name], prof, bw_gbps=plan.cluster["bw_gbps"], settings=PPipeSettings(feedback_horizon_s=0.05))
    out = drive(d, poisson_arrivals(m.name, m.throughput * 0.8, m.slo_us * 1e-6, 5000, seed=4), feedback=False)
    newest = max(h.compute.end for hops, *_ in d._live.values() for h in hops)
    assert out.batches > 10 * len(d._live) and all(hops[-1].compute.end >= newest - 0.05 - m.slo_us * 1e-6 for hops, *_ in d._live.values())
    assert len(d._live_order) == len(d._live)
