"""The data-plane registry: every name builds a dispatcher, each with the Dispatcher calls executors make."""

from __future__ import annotations

import pytest

from daskpipe.plan.shared import SharedGroup, shared_plan
from daskpipe.sched.api import Dispatch, Dispatcher, Drop, Placement, PoolsFixed, Request, Slot
from daskpipe.sched.registry import (
    DATAPLANES,
    MULTIPLEXING,
    add_shared_model,
    add_shared_slot,
    known,
    make_dispatcher,
    make_shared_dispatcher,
    register,
    remove_shared_model,
)
from tests.sched.helpers import linear, two_kind_pool
from tests.sim.helpers import toy_plan, toy_profile


def toy_dispatcher(name: str) -> Dispatcher:
    plan = toy_plan()
    slots = {"a0": Slot("a0", "A", 1, "s0"), "b0": Slot("b0", "B", 1, "s1")}
    return make_dispatcher(name, plan.model("toy"), Placement("toy", {(0, 0): ("a0",), (0, 1): ("b0",)}, slots), toy_profile(), bw_gbps=1.0)


@pytest.mark.parametrize("name", DATAPLANES)
def test_each_name_dispatches_numbering_from_continue_ids(name):
    dispatcher = toy_dispatcher(name)
    dispatcher.continue_ids(1000)
    actions = []
    for i in range(4):
        actions += dispatcher.submit(Request(i, "toy", 0.0, 0.05), 0.0)
    while (wake := dispatcher.next_wake()) is not None and not any(isinstance(a, Dispatch) for a in actions):
        actions += dispatcher.wake(wake)
    dispatches = [a for a in actions if isinstance(a, Dispatch)]
    assert dispatches and all(d.id >= 1000 for d in dispatches)
    assert all(d.hops[0].partition == 0 for d in dispatches)


@pytest.mark.parametrize("name", DATAPLANES)
def test_a_dispatcher_with_fixed_pools_says_so_and_refuses_pool_changes(name):
    dispatcher = toy_dispatcher(name)
    if dispatcher.supports_pools:
        assert dispatcher.remove_slot("b0", 0.0) == [] and dispatcher.add_slot(Slot("b0", "B", 1, "s1"), 0, 1, 0.0) == []
    else:
        with pytest.raises(PoolsFixed, match="cannot take slot 'b0' out of its pools"):
            dispatcher.remove_slot("b0", 0.0)
        with pytest.raises(PoolsFixed, match="cannot add slot 'b0'"):
            dispatcher.add_slot(Slot("b0", "B", 1, "s1"), 0, 1, 0.0)


def test_unknown_names_list_the_known_ones_and_extras_register():
    with pytest.raises(
        ValueError, match="unknown data plane 'magic'; known: ppipe, ppipe-two-pass, deferred, eager, timeout, reactive, hybrid"
    ):
        toy_dispatcher("magic")
    with pytest.raises(ValueError, match="built-in"):
        register("ppipe", lambda *a, **k: None)
    built = []
    register("recorder", lambda model, placement, profile, *, bw_gbps: built.append(bw_gbps) or toy_dispatcher("ppipe"))
    assert "recorder" in known() and isinstance(toy_dispatcher("recorder"), Dispatcher) and built == [1.0]


def test_a_dispatcher_that_cannot_take_over_says_so():
    class Minimal(Dispatcher):
        def submit(self, request, now):
            return []

        def wake(self, now):
            return []

        def next_wake(self):
            return None

    with pytest.raises(NotImplementedError, match="Minimal cannot take over"):
        Minimal().continue_ids(5)


@pytest.mark.parametrize("name", MULTIPLEXING)
def test_a_shared_dispatcher_runs_every_model_on_every_slot_timed_by_its_kind(name):
    plan, profiles, slots = two_kind_pool()
    dispatcher = make_shared_dispatcher(name, {m.name: (m, profiles[m.name]) for m in plan.models}, slots, timeout_s=0.001)
    actions = []
    for i in range(40):  # more than one slot can take at once: both models on both slots
        actions += dispatcher.submit(Request(i, "ab"[i % 2], 0.0, 0.1), 0.0)
    while (wake := dispatcher.next_wake()) is not None:
        actions += dispatcher.wake(wake)
    dispatches = [a for a in actions if isinstance(a, Dispatch)]
    assert sum(len(d.requests) for d in dispatches) == 40
    assert {d.model for d in dispatches} == {"a", "b"} and {d.hops[0].slot for d in dispatches} == {"l4", "t4"}
    for d in dispatches:  # the plan's pipeline of the slot's kind, and the kind's own latency
        pipeline = plan.model(d.model).pipelines[d.pipeline]
        assert pipeline.partitions[0].gpu == {"l4": "L4", "t4": "T4"}[d.hops[0].slot]
        compute = d.hops[0].compute
        assert compute.end - compute.start == pytest.approx(profiles[d.model].latency(pipeline.partitions[0].gpu, 1, d.batch_size) / 1e6)


def run_out(dispatcher, actions: list, until: float = float("inf")) -> list:
    while (wake := dispatcher.next_wake()) is not None and wake <= until:
        actions += dispatcher.wake(wake)
    return actions


@pytest.mark.parametrize("name", MULTIPLEXING)
def test_models_join_and_leave_a_shared_pool_while_it_serves(name):
    """ "c" joins a pool serving "a" and "b" and runs on both slots at its own kind's latency; "a"
    leaves with requests queued: they end dropped as "shutdown", later ones are refused, and the
    others keep their queues and the slots."""
    plan, profiles, slots = two_kind_pool()
    dispatcher = make_shared_dispatcher(name, {m.name: (m, profiles[m.name]) for m in plan.models}, slots, timeout_s=0.001)
    profiles["c"] = linear("c", 1.5, 3.0, 25.0)
    grown = shared_plan(profiles, [SharedGroup(("a", "b", "c"), {("T4", 1): 1, ("L4", 1): 1})])
    add_shared_model(dispatcher, "c", grown.model("c"), profiles["c"], slots)
    with pytest.raises(ValueError, match="model 'c' is served by this pool already"):
        add_shared_model(dispatcher, "c", grown.model("c"), profiles["c"], slots)
    burst = [Request(i, "abcc"[i % 4], 0.0, 0.1) for i in range(120)]  # more of c than one slot runs in time
    actions = run_out(dispatcher, [a for r in burst for a in dispatcher.submit(r, 0.0)])
    dispatches = [a for a in actions if isinstance(a, Dispatch)]
    assert sum(len(d.requests) for d in dispatches) + sum(isinstance(a, Drop) for a in actions) == len(burst) and {
        d.hops[0].slot for d in dispatches if d.model == "c"
    } == {"l4", "t4"}
    for d in (d for d in dispatches if d.model == "c"):
        gpu = grown.model("c").pipelines[d.pipeline].partitions[0].gpu
        assert gpu == {"l4": "L4", "t4": "T4"}[d.hops[0].slot]
        assert d.hops[0].compute.end - d.hops[0].compute.start == pytest.approx(profiles["c"].latency(gpu, 1, d.batch_size) / 1e6)
    queued = [a for i in range(100, 130) for a in dispatcher.submit(Request(i, "abc"[(i - 100) % 3], 1.0, 1.5), 1.0)]
    left = remove_shared_model(dispatcher, "a", 1.0)
    assert left and all(isinstance(a, Drop) and a.reason == "shutdown" and a.request.model == "a" for a in left)
    with pytest.raises(ValueError, match="for model 'a', which this dispatcher does not serve"):
        dispatcher.submit(Request(99, "a", 1.0, 1.5), 1.0)
    rest = run_out(dispatcher, queued)
    served = {r.id for a in rest if isinstance(a, Dispatch) for r in a.requests}
    dropped_a = {a.request.id for a in left}
    assert served | dropped_a | {a.request.id for a in rest if isinstance(a, Drop)} == set(range(100, 130))
    assert {i for i in range(100, 130) if (i - 100) % 3} <= served, "b and c are served on"
    with pytest.raises(ValueError, match="not served by this dispatcher"):
        remove_shared_model(dispatcher, "a", 2.0)


@pytest.mark.parametrize("name", MULTIPLEXING)
def test_a_slot_of_a_kind_the_pool_has_joins_it_for_every_model(name):
    """A pool of one T4 and one L4 gets a second T4 while a burst is queued: the new slot takes
    batches at once, timed as the T4 runs them, and runs each model once it is the only slot; a slot of a kind the plan has no
    pipeline for, one already in, and a model placed on part of the pool are refused by name."""
    plan, profiles, slots = two_kind_pool()
    dispatcher = make_shared_dispatcher(name, {m.name: (m, profiles[m.name]) for m in plan.models}, slots, timeout_s=0.001)
    burst = [Request(i, "ab"[i % 2], 0.0, 0.1) for i in range(60)]
    actions = [a for r in burst for a in dispatcher.submit(r, 0.0)]
    second = Slot("t4b", "T4", 1, "s2")
    actions += add_shared_slot(dispatcher, second, 0.0)
    actions = run_out(dispatcher, actions)
    dispatches = [a for a in actions if isinstance(a, Dispatch)]
    assert sum(len(d.requests) for d in dispatches) + sum(isinstance(a, Drop) for a in actions) == len(burst)
    dispatcher.remove_slot("t4", 0.5)
    dispatcher.remove_slot("l4", 0.5)
    alone = run_out(dispatcher, [a for i in (100, 101) for a in dispatcher.submit(Request(i, "ab"[i % 2], 0.5, 0.6), 0.5)])
    on_new = [d for d in dispatches + alone if isinstance(d, Dispatch) and d.hops[0].slot == "t4b"]
    assert len(on_new) > 2 and {d.model for d in alone if isinstance(d, Dispatch)} == {"a", "b"}
    for d in on_new:
        assert plan.model(d.model).pipelines[d.pipeline].partitions[0].gpu == "T4"
        assert d.hops[0].compute.end - d.hops[0].compute.start == pytest.approx(profiles[d.model].latency("T4", 1, d.batch_size) / 1e6)
    with pytest.raises(ValueError, match="slot 't4b' is in this shared pool already"):
        add_shared_slot(dispatcher, second, 1.0)
    with pytest.raises(ValueError, match=r"models \['a', 'b'\] have no pipeline on \('A100', 1\), the kind of slot 'x'"):
        add_shared_slot(dispatcher, Slot("x", "A100", 1, "s3"), 1.0)
    assert add_shared_slot(dispatcher, Slot("x", "T4", 1, "s3"), 1.0) == []  # the refusal left nothing behind
    profiles["c"] = linear("c", 1.5, 3.0, 25.0)
    grown = shared_plan(profiles, [SharedGroup(("a", "b", "c"), {("T4", 1): 3, ("L4", 1): 1})])
    with pytest.raises(ValueError, match=r"model 'c' must join on every slot of its shared pool that is in, \['t4b', 'x'\], and on no"):
        add_shared_model(dispatcher, "c", grown.model("c"), profiles["c"], slots)  # t4 and l4 are out: they need no stage
    add_shared_model(dispatcher, "c", grown.model("c"), profiles["c"], [Slot("t4b", "T4", 1, "s2"), Slot("x", "T4", 1, "s3")])


def test_a_model_joining_a_timeout_pool_of_per_model_waits_needs_its_own():
    plan, profiles, slots = two_kind_pool()
    dispatcher = make_shared_dispatcher(
        "timeout", {m.name: (m, profiles[m.name]) for m in plan.models}, slots, timeout_s={"a": 0.001, "b": 0.002}
    )
    profiles["c"] = linear("c", 1.5, 3.0, 25.0)
    grown = shared_plan(profiles, [SharedGroup(("a", "b", "c"), {("T4", 1): 1, ("L4", 1): 1})])
    with pytest.raises(ValueError, match="gives each model its own max_wait_s"):
        add_shared_model(dispatcher, "c", grown.model("c"), profiles["c"], slots)
    add_shared_model(dispatcher, "c", grown.model("c"), profiles["c"], slots, max_wait_s=0.003)  # the failed join left nothing behind
    assert dispatcher.max_wait_s["c"] == 0.003


def test_a_shared_pool_refuses_a_data_plane_that_does_not_multiplex():
    plan, profiles, slots = two_kind_pool()
    with pytest.raises(ValueError, match="data plane 'ppipe' does not share slots between models"):
        make_shared_dispatcher("ppipe", {m.name: (m, profiles[m.name]) for m in plan.models}, slots)


def test_a_shared_dispatcher_takes_a_lost_slot_out_for_every_model_and_back():
    plan, profiles, slots = two_kind_pool()
    dispatcher = make_shared_dispatcher("eager", {m.name: (m, profiles[m.name]) for m in plan.models}, slots)
    assert dispatcher.supports_pools
    assert dispatcher.remove_slot("l4", 0.0) == [] and dispatcher.remove_slot("l4", 0.0) == []  # once per model: one effect
    actions = [a for i in range(10) for a in dispatcher.submit(Request(i, "ab"[i % 2], 0.0, 0.1), 0.0)]
    while (wake := dispatcher.next_wake()) is not None:
        actions += dispatcher.wake(wake)
    assert {a.hops[0].slot for a in actions if isinstance(a, Dispatch)} == {"t4"}
    dispatcher.add_slot(slots[0], 0, 0, 1.0)
    with pytest.raises(ValueError, match="in this dispatcher's pool already"):
        dispatcher.add_slot(slots[0], 0, 0, 1.0)
    later = [a for i in range(10, 14) for a in dispatcher.submit(Request(i, "a", 1.0, 1.1), 1.0)]
    while (wake := dispatcher.next_wake()) is not None:
        later += dispatcher.wake(wake)
    assert "l4" in {a.hops[0].slot for a in later if isinstance(a, Dispatch)}
    dispatcher.remove_slot("l4", 2.0)
    ran = dispatcher.submit(Request(99, "b", 2.0, 2.1), 2.0)  # on t4, which is busy with it then
    dropped = dispatcher.submit(Request(100, "b", 2.0, 2.1), 2.0) + dispatcher.remove_slot("t4", 2.0)
    dropped += dispatcher.submit(Request(101, "a", 2.0, 2.1), 2.0)
    assert [a.hops[0].slot for a in ran if isinstance(a, Dispatch)] == ["t4"]
    assert [(a.request.id, a.reason) for a in dropped if isinstance(a, Drop)] == [(100, "worker-lost"), (101, "no-capacity")]
