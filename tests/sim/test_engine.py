"""The executor: FIFO slots, NIC FIFOs, feedback, and the books always balance."""

from __future__ import annotations

import pytest

from daskpipe.sched.api import Dispatch, Dispatcher, Drop, Hop, Request, Reservation, Slot
from daskpipe.sched.placement import place
from daskpipe.sched.symphony import DeferredDispatcher
from daskpipe.sim.engine import Engine, ReservedDurations
from daskpipe.sim.simulate import ProfileDurations


class Scripted(Dispatcher):
    """Dispatches each arriving request at once along a fixed route; records feedback."""

    def __init__(self, route):
        self.route, self.feedbacks, self.ids = route, [], 0

    def submit(self, request, now):
        self.ids += 1
        return [Dispatch(self.ids, request.model, 0, 1, [request], self.route(now))]

    def wake(self, now):
        return []

    def next_wake(self):
        return None

    def feedback(self, fb, now):
        self.feedbacks.append(fb)
        return []


def two_hop(now):
    transfer = (Reservation("s0/ul", now + 0.001, now + 0.002), Reservation("s1/dl", now + 0.001, now + 0.002))
    return (Hop(0, "a0", Reservation("a0", now, now + 0.001)), Hop(1, "b0", Reservation("b0", now + 0.002, now + 0.004), transfer))


def test_transfers_share_the_sender_uplink_and_slots_run_fifo(toy):
    plan, profiles = toy
    slots = {"a0": Slot("a0", "A", 1, "s0"), "b0": Slot("b0", "B", 1, "s1"), "b1": Slot("b1", "B", 1, "s1")}
    scripted = Scripted(two_hop)
    engine = Engine({"toy": scripted}, slots, ProfileDurations(plan, profiles, 1.0))
    engine.add_arrivals(Request(i, "toy", 0.0, 1.0) for i in range(2))
    trace = engine.run()
    computes = sorted((slot, part, round(s, 6), round(e, 6)) for _, slot, _, part, s, e in trace.computes)
    # a0 runs both batches back to back (1 ms each), each 1 ms transfer waits for the uplink, b0 runs FIFO
    assert computes == [("a0", 0, 0.0, 0.001), ("a0", 0, 0.001, 0.002), ("b0", 1, 0.002, 0.004), ("b0", 1, 0.004, 0.006)]
    transfers = sorted((round(f.start, 6), round(f.end, 6)) for f in scripted.feedbacks if f.kind == "transfer")
    assert transfers == [(0.001, 0.002), (0.002, 0.003)]
    assert {r.finish for r in trace.requests.values()} == {0.004, 0.006}


def test_same_server_hops_need_no_transfer(toy):
    plan, profiles = toy
    slots = {"a0": Slot("a0", "A", 1, "s0"), "b0": Slot("b0", "B", 1, "s0")}
    engine = Engine({"toy": Scripted(two_hop)}, slots, ProfileDurations(plan, profiles, 1.0))
    engine.add_arrivals([Request(0, "toy", 0.0, 1.0)])
    trace = engine.run()
    assert trace.requests[0].finish == pytest.approx(0.002 + 0.002)  # waits for its planned start only


def test_dispatch_errors_are_reported(toy):
    plan, profiles = toy
    slots = {"a0": Slot("a0", "A", 1, "s0")}
    bad = Scripted(lambda now: (Hop(0, "nowhere", Reservation("nowhere", now, now + 1)),))
    engine = Engine({"toy": bad}, slots, ProfileDurations(plan, profiles, 1.0))
    engine.add_arrivals([Request(0, "toy", 0.0, 1.0)])
    with pytest.raises(ValueError, match="unknown slot"):
        engine.run()


def test_a_dispatcher_that_loses_requests_is_caught():
    class Forgetful(Scripted):
        def submit(self, request, now):
            return []

    engine = Engine({"m": Forgetful(None)}, {"g": Slot("g", "X")}, ReservedDurations())
    engine.add_arrivals([Request(0, "m", 0.0, 1.0)])
    with pytest.raises(RuntimeError, match="neither completed nor dropped"):
        engine.run()


def test_double_drop_is_caught():
    class DoubleDrop(Scripted):
        def submit(self, request, now):
            return [Drop(request, "deadline"), Drop(request, "deadline")]

    engine = Engine({"m": DoubleDrop(None)}, {"g": Slot("g", "X")}, ReservedDurations())
    engine.add_arrivals([Request(0, "m", 0.0, 1.0)])
    with pytest.raises(RuntimeError, match="already"):
        engine.run()


def test_deferred_on_a_two_partition_plan_books_transfers(toy):
    plan, profiles = toy
    placement = place(plan)["toy"]
    d = DeferredDispatcher.for_plan(plan.models[0], placement, profiles["toy"], bw_gbps=1.0)
    engine = Engine({"toy": d}, placement.slots, ProfileDurations(plan, profiles, 1.0))
    engine.add_arrivals(Request(i, "toy", i * 0.002, i * 0.002 + 0.05) for i in range(200))
    trace = engine.run()
    dispatches = [x for _, x in trace.dispatches]
    assert all(len(x.hops) == 2 and x.hops[1].transfer_in is not None for x in dispatches)
    assert sum(len(x.requests) for x in dispatches) + sum(r.dropped is not None for r in trace.requests.values()) == 200
    assert all(r.finish <= r.deadline for r in trace.requests.values() if r.finish is not None)


def test_noise_changes_durations_but_not_the_books(toy):
    plan, profiles = toy
    placement = place(plan)["toy"]
    finishes = []
    for noise in (0.0, 0.3):
        d = DeferredDispatcher.for_plan(plan.models[0], placement, profiles["toy"], bw_gbps=1.0)
        engine = Engine({"toy": d}, placement.slots, ProfileDurations(plan, profiles, 1.0), noise=noise, seed=3)
        engine.add_arrivals(Request(i, "toy", i * 0.002, i * 0.002 + 0.05) for i in range(50))
        trace = engine.run()
        finishes.append([r.finish for r in trace.requests.values()])
        assert all(r.finish is not None or r.dropped for r in trace.requests.values())
    assert finishes[0] != finishes[1]


def test_latency_ratios_scale_computes_and_are_fed_back(toy):
    """Each compute takes its profiled time x a ratio drawn from the list; transfers keep theirs."""
    plan, profiles = toy
    slots = {"a0": Slot("a0", "A", 1, "s0"), "b0": Slot("b0", "B", 1, "s1"), "b1": Slot("b1", "B", 1, "s1")}
    feedbacks = []
    for seed in (5, 5):
        scripted = Scripted(lambda now: two_hop(now + 0.01 * scripted.ids))  # batches far apart: no queueing
        engine = Engine({"toy": scripted}, slots, ProfileDurations(plan, profiles, 1.0), latency_ratios=[1.25, 2.0], seed=seed)
        engine.add_arrivals(Request(i, "toy", 0.0, 1.0) for i in range(20))
        engine.run()
        feedbacks.append(scripted.feedbacks)
    assert feedbacks[0] == feedbacks[1]  # seeded
    computes = [(f.partition, round((f.end - f.start) * 1e3, 6)) for f in feedbacks[0] if f.kind == "compute"]
    assert {c for c in computes if c[0] == 0} == {(0, 1.25), (0, 2.0)} and {c for c in computes if c[0] == 1} == {(1, 2.5), (1, 4.0)}
    assert {round((f.end - f.start) * 1e3, 6) for f in feedbacks[0] if f.kind == "transfer"} == {1.0}


@pytest.mark.parametrize("ratios", [[], [1.0, 0.0], [float("nan")]])
def test_latency_ratios_must_be_positive_numbers(ratios):
    with pytest.raises(ValueError, match="ratio"):
        Engine({}, {}, ReservedDurations(), latency_ratios=ratios)
