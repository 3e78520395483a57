"""The control path's measured delays: what counts as one, and the margin and tolerance planned from them."""

from __future__ import annotations

import pytest

from daskpipe.runtime.scheduler.control import HORIZON_S, MIN_BATCHES, MIN_MARGIN_S, RECOMPUTE_EVERY, WINDOW, ControlPath, control_path
from daskpipe.runtime.scheduler.ledger import Flight, LateLegs

MS = 1e-3


def two_stage_flight(first_start: float = 0.0, second_start: float = 0.010) -> Flight:
    """A batch planned on two stages: 0-10 ms and 10-20 ms, no transfer."""
    return Flight(keys=["k"], addresses=frozenset({"a", "b"}), planned=[(0, first_start, 0.0), (1, second_start, 0.0)])


def test_a_stage_late_on_the_path_counts_and_one_late_behind_its_slots_batch_before_does_not():
    flight = two_stage_flight()
    flight.ran = {0: (0.002, 0.012), 1: (0.015, 0.025)}
    dispatch, hops = flight.control_delays()
    assert dispatch == pytest.approx(0.002) and hops == [pytest.approx(0.003)]  # 15 ms against the first's end at 12 ms

    behind = two_stage_flight()
    behind.ran = {0: (0.030, 0.040), 1: (0.045, 0.055)}
    behind.slot_free = {0: 0.0295, 1: 0.044}  # each slot was still computing an overrunning batch until then
    dispatch, hops = behind.control_delays()
    assert dispatch == pytest.approx(0.0005) and hops == [pytest.approx(0.001)]


def test_a_flight_reports_no_delays_until_every_hop_has_run():
    flight = two_stage_flight()
    flight.ran = {0: (0.0, 0.010)}
    assert flight.control_delays() is None


def test_a_late_batch_says_which_leg_lost_its_time():
    flight = two_stage_flight()
    flight.spans = [0.010, 0.010]
    flight.ran = {0: (0.002, 0.015), 1: (0.016, 0.026)}  # 2 ms to start, 3 ms over its compute, 1 ms to hop
    flight.slot_free = {0: 0.001}  # its slot ended the batch before 1 ms after the planned start
    legs = flight.legs(done=0.0275)
    assert legs == pytest.approx({"behind": 0.001, "dispatch": 0.001, "hops": 0.001, "compute": 0.003, "done": 0.0015})
    assert two_stage_flight().legs(done=1.0) is None  # nothing has run yet

    late = LateLegs()
    late.add(legs, late_requests=3)
    late.add({**legs, "compute": -0.001}, late_requests=1)  # a stage faster than planned counts below zero
    summary = late.summary()
    assert summary["requests"] == 4 and summary["batches"] == 2
    assert summary["mean_ms"]["compute"] == pytest.approx(1.0) and summary["max_ms"]["compute"] == pytest.approx(3.0)
    assert summary["mean_ms"]["done"] == pytest.approx(1.5) and LateLegs().summary()["mean_ms"] == {}


def record(path: ControlPath, totals_ms: list[float]) -> None:
    for i, total in enumerate(totals_ms):
        path.record(i * 0.01, total * MS, [], 0.0)  # the whole delay on the dispatch


def test_the_margin_is_the_high_percentile_and_the_tolerance_reaches_down_to_the_median():
    path = ControlPath(seed_s=0.001)
    assert path.margin_s == MIN_MARGIN_S and path.tolerance_s == 0  # until measured: the seed, no tolerance
    record(path, [1.0] * (MIN_BATCHES - 1))
    assert path.tolerance_s == 0
    totals = [1.0 + (i % 10) for i in range(10 * RECOMPUTE_EVERY)]  # 1..10 ms, median 5.5 ms, p99 10 ms
    record(path, totals)
    assert path.margin_s == pytest.approx(10 * MS, rel=0.02)
    assert path.typical_s == pytest.approx(5.5 * MS, rel=0.1)
    assert path.tolerance_s == pytest.approx(path.margin_s - path.typical_s)
    summary = path.summary()
    assert summary["tolerance_ms"] == pytest.approx(path.tolerance_s * 1e3)


def test_a_capped_margin_leaves_a_tolerance_no_wider_than_itself():
    path = ControlPath(seed_s=0.0, cap_s=3 * MS)
    record(path, [5.0] * (5 * RECOMPUTE_EVERY))  # every batch slower than the cap
    assert path.margin_s == 3 * MS and path.typical_s == 3 * MS and path.tolerance_s == 0


def test_a_model_of_few_batches_per_horizon_plans_with_its_measured_delays_not_the_seed():
    """A batch every HORIZON_S / 5 seconds: never MIN_BATCHES in one horizon, yet measured."""
    path = ControlPath(seed_s=2 * MS)
    every = HORIZON_S / 5
    for i in range(MIN_BATCHES):
        path.record(i * every, 3 * MS, [], 0.0)
    assert path.margin_s == pytest.approx(3 * MS)


def test_a_stall_is_forgotten_once_later_batches_replace_it_at_any_rate():
    path = ControlPath(seed_s=1 * MS)
    every = HORIZON_S / 5
    stalled = [30.0] * RECOMPUTE_EVERY
    for i, total in enumerate(stalled + [2.0] * MIN_BATCHES):
        path.record(i * every, total * MS, [], 0.0)
    assert path.margin_s == pytest.approx(2 * MS), "the stall's batches are out of the horizon and MIN_BATCHES later ones are in"


def test_a_deferred_plane_plans_for_its_rare_tail_over_many_batches_where_eager_plans_for_its_recent_p99():
    """Deferred batches leave at their last moment: one slow batch in 500, 40 ms against 5 ms,
    would make 0.2% of them late, a fifth of a 99% target. Its margin covers that batch until
    WINDOW later ones replace it; eager's, whose batches keep their SLO's slack, is the p99 of
    the horizon's and forgets it once it is older."""
    deferred, eager = control_path(1 * MS, "deferred"), control_path(1 * MS, "eager")
    every = 4 * HORIZON_S / WINDOW  # a batch every 40 ms: a horizon holds a quarter of the window
    totals = [40.0 if i % 500 == 0 else 5.0 for i in range(WINDOW)]
    for path in (deferred, eager):
        for i, total in enumerate(totals):
            path.record(i * every, total * MS, [], 0.0)
    assert deferred.margin_s == pytest.approx(40 * MS, rel=0.1)
    assert eager.margin_s == pytest.approx(5 * MS)
    for i in range(WINDOW, 2 * WINDOW):
        deferred.record(i * every, 5 * MS, [], 0.0)
    assert deferred.margin_s == pytest.approx(5 * MS)


@pytest.mark.parametrize("relayed, margin_ms", [(False, 3.0), (True, 5.0)])
def test_the_way_back_counts_once_from_the_last_stage_and_twice_through_the_scheduler(relayed, margin_ms):
    """The last stage's worker tells its client beside the completion (one message's delay); a
    client it could not tell hears from the scheduler after the completion (one more)."""
    path = ControlPath(seed_s=0.0)
    for i in range(2 * RECOMPUTE_EVERY):
        path.record(i * 0.01, 1.0 * MS, [], 2.0 * MS, relayed)
    assert path.margin_s == pytest.approx(margin_ms * MS)


def test_the_way_back_shows_the_workers_part_apart_from_the_wire_and_within_the_whole():
    path = ControlPath(seed_s=0.0)
    path.record(0.0, 1.0 * MS, [], 2.0 * MS, False, done_worker_s=0.5 * MS)
    path.record(0.01, 1.0 * MS, [], 2.0 * MS, False, done_worker_s=3.0 * MS)  # another clock: capped at the whole
    path.record(0.02, 1.0 * MS, [], 2.0 * MS, False)  # a worker that did not say
    summary = path.summary()
    assert list(path.parts["done_worker"]) == pytest.approx([0.5 * MS, 2.0 * MS])
    assert list(path.parts["done_wire"]) == pytest.approx([1.5 * MS, 0.0])
    assert summary["done_p50_ms"] == pytest.approx(2.0) and summary["total_p50_ms"] == pytest.approx(3.0), (
        "the parts add nothing to the path"
    )
    assert summary["done_worker_p99_ms"] <= summary["done_p99_ms"]
