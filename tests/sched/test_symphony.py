"""Symphony's deferred batching: the paper's worked example (§3.3, Figs. 4-5), batch for batch."""

from __future__ import annotations

import pytest

from daskpipe.sched.api import Dispatch, Drop, Request, Slot
from daskpipe.sched.batching import EagerDispatcher
from daskpipe.sched.symphony import DeferredDispatcher, DeferredSettings
from daskpipe.sim.engine import Engine, ReservedDurations

SLO = 12.0
GPUS = [Slot(f"gpu{i}", "X") for i in (1, 2, 3)]


def latency(_model: str, batch: int) -> float:
    return batch + 5.0  # l(b) = b + 5: alpha 1, beta 5


def run_example(dispatcher, removed=(), last=59):
    """Replays R_i at 0.75 (i - 1) through the simulator; returns (start, gpu, ids) and drops."""
    engine = Engine({"m": dispatcher}, {s.id: s for s in GPUS}, ReservedDurations())
    engine.add_arrivals(Request(i, "m", 0.75 * (i - 1), 0.75 * (i - 1) + SLO) for i in range(1, last + 1) if i not in removed)
    trace = engine.run()
    batches = [(start, slot, batch) for _, slot, batch, _, start, _ in trace.computes]
    ids = {d.hops[0].compute.start: [r.id for r in d.requests] for _, d in trace.dispatches}
    drops = sorted(rid for rid, r in trace.requests.items() if r.dropped)
    return [(start, slot, ids[start]) for start, slot, _ in sorted(batches)], drops, trace


def batches_of(i: int) -> list[int]:
    return list(range(i, i + 4))


class EagerFromR16(EagerDispatcher):
    """The paper's Fig. 5a: the staggered (deferred) schedule up to R15, eager from R16 on."""

    def _exec_bound(self, model, samples, deadline):
        if model.queue.at(0).arrival < 11.25:
            return DeferredDispatcher._exec_bound(self, model, samples, deadline)
        return super()._exec_bound(model, samples, deadline)


def test_first_batch_window():
    d = DeferredDispatcher({"m": SLO}, GPUS, latency)
    actions = []
    for i in range(1, 4):
        actions += d.submit(Request(i, "m", 0.75 * (i - 1), 0.75 * (i - 1) + SLO), 0.75 * (i - 1))
    assert actions == [] and d.next_wake() == pytest.approx(12 - 9)  # frontrun of b=3 is d - l(4)
    (dispatch,) = d.submit(Request(4, "m", 2.25, 14.25), 2.25)  # frontrun d - l(5) = 2 <= 2.25 <= latest 3
    assert isinstance(dispatch, Dispatch) and [r.id for r in dispatch.requests] == [1, 2, 3, 4]
    assert dispatch.hops[0].compute.start == 2.25 and dispatch.hops[0].compute.end == 11.25


def test_deferred_staggers():
    schedule, drops, _ = run_example(DeferredDispatcher({"m": SLO}, GPUS, latency))
    expected = [(2.25 + 3 * k, f"gpu{k % 3 + 1}", batches_of(1 + 4 * k)) for k in range(14)]
    assert schedule[:14] == expected
    assert drops == []


def test_deferred_recovers_after_missing_requests():
    schedule, drops, _ = run_example(DeferredDispatcher({"m": SLO}, GPUS, latency), removed=(13, 14, 15))
    assert schedule[:3] == [(2.25, "gpu1", [1, 2, 3, 4]), (5.25, "gpu2", [5, 6, 7, 8]), (8.25, "gpu3", [9, 10, 11, 12])]
    # Fig. 5b: the GPUs idle briefly and the staggered pattern comes back, shifted to x.5
    assert schedule[3:11] == [(13.5 + 3 * k, f"gpu{k % 3 + 1}", batches_of(16 + 4 * k)) for k in range(8)]
    assert drops == []


def test_eager_degrades_after_missing_requests():
    schedule, drops, _ = run_example(EagerFromR16({"m": SLO}, GPUS, latency), removed=(13, 14, 15))
    # Fig. 5a: R16 alone at 11.25, two batches of 4, R25 alone at 18, only 2 of R26-R32 at 23.25
    assert schedule[3:11] == [
        (11.25, "gpu1", [16]),
        (14.25, "gpu2", [17, 18, 19, 20]),
        (17.25, "gpu1", [21, 22, 23, 24]),
        (18.0, "gpu3", [25]),
        (23.25, "gpu2", [26, 27]),
        (24.0, "gpu3", [28, 29, 30]),
        (26.25, "gpu1", [31, 32, 33]),
        (30.25, "gpu2", [34]),
    ]
    assert drops[:5] == [35, 37, 38, 40, 41]  # "drop R35, R37, R38, and so on"


def test_plain_eager_sends_singletons_while_gpus_idle():
    schedule, _, _ = run_example(EagerDispatcher({"m": SLO}, GPUS, latency), last=12)
    assert schedule[:3] == [(0.0, "gpu1", [1]), (0.75, "gpu2", [2]), (1.5, "gpu3", [3])]


def test_earliest_free_choice_spreads_over_gpus():
    d = DeferredDispatcher({"m": SLO}, GPUS, latency, settings=DeferredSettings(gpu_choice="earliest-free"))
    schedule, drops, _ = run_example(d, removed=(13, 14, 15))
    # GPU2 has been idle since 14.25 and GPU1 since 11.25; earliest-free takes GPU1 first, as lowest id does
    assert [s[1] for s in schedule[3:6]] == ["gpu1", "gpu2", "gpu3"] and drops == []


def test_no_request_is_lost_under_overload():
    d = DeferredDispatcher({"m": SLO}, GPUS[:1], latency)
    _, drops, trace = run_example(d, last=40)
    done = [r for r in trace.requests.values() if r.finish is not None]
    assert len(done) + len(drops) == 40 and drops
    assert all(r.finish <= r.deadline for r in done)  # deferred never dispatches a late batch


def test_window_drop_keeps_batches_large():
    head = DeferredDispatcher({"m": SLO}, GPUS[:1], latency)
    window = DeferredDispatcher({"m": SLO}, GPUS[:1], latency, settings=DeferredSettings(drop_policy="window", target_batch=4))
    sizes = {}
    for name, d in (("head", head), ("window", window)):
        schedule, _, _ = run_example(d, last=40)
        sizes[name] = [len(ids) for _, _, ids in schedule]
    assert min(sizes["window"][1:]) >= 4 > min(sizes["head"][1:])


def test_multiple_models_share_the_gpus():
    d = DeferredDispatcher({"a": SLO, "b": SLO}, GPUS, latency)
    engine = Engine({"a": d, "b": d}, {s.id: s for s in GPUS}, ReservedDurations())
    reqs = sorted(
        (Request((m, i), m, 0.75 * i + off, 0.75 * i + off + SLO) for m, off in (("a", 0.0), ("b", 0.3)) for i in range(40)),
        key=lambda r: r.arrival,
    )
    engine.add_arrivals(reqs)
    trace = engine.run()
    models_per_gpu = {}
    for model, slot, *_ in trace.computes:
        models_per_gpu.setdefault(slot, set()).add(model)
    assert any(len(m) == 2 for m in models_per_gpu.values())
    assert all(r.finish is not None or r.dropped for r in trace.requests.values())


def test_a_freed_gpu_takes_the_most_urgent_schedulable_batch_and_one_whose_window_passes_on_busy_gpus_drops():
    """Alg. 1 over several models on one GPU: a lone request's window is ``[d - l(2), d - l(1)]``,
    alpha (1) wide. ``w`` holds the GPU until 10; ``x`` (window [9, 10]) and ``y`` ([9.5, 10.5])
    wait for it, and at 10 it takes ``x``, the smaller latest (OnGpuTimer); ``y``'s window passes
    while ``x`` runs and it is dropped (its head cannot finish even alone), not run late; ``z``
    (window [17.5, 18.5]) is not sent to the GPU idle since 16 before its window opens.
    This is why Alg. 1 loses to eager where GPUs are few for many models: an alpha-wide window
    that comes due while every GPU runs other models' batches is lost (no GPU was idle before it
    here, so sending a batch early could not save it: the next test)."""

    def lat(model: str, batch: int) -> float:
        return 10.0 * batch if model == "w" else batch + 5.0

    slos = {"w": 100.0, "x": 16.0, "y": 16.5, "z": 24.5}
    d = DeferredDispatcher(slos, GPUS[:1], lat, max_batch={"w": 1, "x": 4, "y": 4, "z": 4})
    engine = Engine({m: d for m in "wxyz"}, {GPUS[0].id: GPUS[0]}, ReservedDurations())
    engine.add_arrivals(Request(m, m, 0.0, slo) for m, slo in slos.items())
    trace = engine.run()
    assert [(d.model, d.hops[0].compute.start) for _, d in trace.dispatches] == [("w", 0.0), ("x", 10.0), ("z", 17.5)]
    assert trace.requests["y"].dropped == "deadline" and trace.requests["z"].finish == pytest.approx(23.5)


@pytest.mark.parametrize("cover", [True, False])
def test_a_batch_goes_early_on_an_idle_gpu_where_waiting_would_leave_a_window_without_one(cover):
    """Three lone requests at 0 with windows [5, 6] and two GPUs (l(b) = b + 5): Alg. 1 sends two
    at 5, busy until 11, and the third's window passes. Covering windows, the dispatcher sees at 0
    that the GPUs as planned start only two of the three in time, and sends the most urgent at
    once; then, counting a request that model may send meanwhile (window [5, 6] too), the next;
    the third goes in its window, on the GPU the first frees at 6, and all three end by 12."""
    d = DeferredDispatcher({m: SLO for m in "abc"}, GPUS[:2], latency, settings=DeferredSettings(cover_windows=cover))
    engine = Engine({m: d for m in "abc"}, {s.id: s for s in GPUS[:2]}, ReservedDurations())
    engine.add_arrivals(Request(m, m, 0.0, SLO) for m in "abc")
    trace = engine.run()
    starts = sorted(d.hops[0].compute.start for _, d in trace.dispatches)
    if cover:
        assert starts == [0.0, 0.0, 6.0] and all(r.finish <= SLO for r in trace.requests.values())
    else:
        assert starts == [5.0, 5.0] and [m for m, r in trace.requests.items() if r.dropped] == ["c"]


def test_windows_the_gpus_cover_send_nothing_early():
    """With a GPU for each waiting model, covering windows changes nothing: Alg. 1's schedule."""
    schedules = []
    for cover in (True, False):
        d = DeferredDispatcher({m: SLO for m in "abc"}, GPUS, latency, settings=DeferredSettings(cover_windows=cover))
        engine = Engine({m: d for m in "abc"}, {s.id: s for s in GPUS}, ReservedDurations())
        arrivals = [(10.0 * i + 0.1 * k, m) for i in range(20) for k, m in enumerate("abc")]
        engine.add_arrivals(Request((m, t), m, t, t + SLO) for t, m in arrivals)
        schedules.append([(d.model, d.hops[0].compute.start, len(d.requests)) for _, d in engine.run().dispatches])
    assert schedules[0] == schedules[1] and schedules[0][0] == ("a", 5.0, 1)  # deferred to its frontrun, d - l(2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"models": {}}, "at least one model"),
        ({"slots": []}, "at least one slot"),
        ({"slots": [GPUS[0], GPUS[0]]}, "unique"),
        ({"models": {"m": -1.0}}, "SLO"),
        ({"max_batch": 0}, "max_batch"),
        ({"latency": lambda m, b: 0.0}, "latency at batch 1"),
        ({"settings": "x"}, None),
    ],
)
def test_bad_inputs_are_rejected(kwargs, message):
    args = {"models": {"m": SLO}, "slots": GPUS, "latency": latency}
    args.update(kwargs)
    settings = args.pop("settings", None)
    if message is None:
        with pytest.raises(ValueError, match="gpu_choice"):
            DeferredSettings(gpu_choice=settings)
        return
    with pytest.raises(ValueError, match=message):
        DeferredDispatcher(args.pop("models"), args.pop("slots"), args.pop("latency"), **args)


def test_unknown_model_and_oversized_requests():
    d = DeferredDispatcher({"m": SLO}, GPUS, latency, max_batch=4)
    with pytest.raises(ValueError, match="does not serve"):
        d.submit(Request(1, "other", 0.0, SLO), 0.0)
    (drop,) = d.submit(Request(2, "m", 0.0, SLO, size=5), 0.0)
    assert isinstance(drop, Drop) and drop.reason == "no-capacity"


def test_drain_drops_everything_queued():
    d = DeferredDispatcher({"m": SLO}, GPUS, latency)
    d.submit(Request(1, "m", 0.0, SLO), 0.0)
    drops = d.drain(0.1)
    assert [x.request.id for x in drops] == [1] and d.queued == 0 and d.next_wake() is None


def test_out_of_order_deadlines_are_served_earliest_first():
    d = DeferredDispatcher({"m": SLO}, GPUS[:1], latency, max_batch=3)
    assert d.submit(Request("late", "m", 0.0, 30.0), 0.0) == []
    assert d.submit(Request("later", "m", 0.0, 40.0), 0.0) == []  # frontrun 30 - l(3) = 22
    (first,) = d.submit(Request("urgent", "m", 0.0, 8.0), 0.0)  # a full batch (3) goes at once
    assert [r.id for r in first.requests] == ["urgent", "late", "later"]


def test_window_target_follows_the_measured_rate():
    """With no fixed target, the window policy sizes its target from the arrival rate."""
    slow = DeferredDispatcher({"m": SLO}, GPUS, latency, settings=DeferredSettings(drop_policy="window"))
    fast = DeferredDispatcher({"m": SLO}, GPUS, latency, settings=DeferredSettings(drop_policy="window", rate_window_s=2.0))
    for d, gap in ((slow, 1.9), (fast, 0.1)):
        for i in range(10):
            d.submit(Request(i, "m", i * gap, i * gap + 100.0), i * gap)
    # l(b) = b + 5, SLO 12: 1 req/s gives (1 + 1/n) l(b) <= 12 up to b = 3, 5 req/s up to b = 5
    assert (slow._target_batch(slow._models["m"]), fast._target_batch(fast._models["m"])) == (3, 5)


@pytest.mark.parametrize("kind", [DeferredDispatcher, EagerDispatcher])
def test_a_head_late_for_its_deadline_but_within_its_tolerance_runs_rather_than_drops(kind):
    """The runtime plans to the SLO less its control path's high percentile; a request that can
    no longer end by that (here l(1) = 6 > 5.5) but can within its tolerance runs at once (a drop
    is a sure miss), and one that cannot even within it is dropped."""

    def first_action(tolerance: float):
        (action,) = kind({"m": SLO}, GPUS[:1], latency, max_batch=4).submit(Request("r", "m", 0.0, 5.5, tolerance=tolerance), now=0.0)
        return action

    tolerated = first_action(1.0)
    assert isinstance(tolerated, Dispatch) and [r.id for r in tolerated.requests] == ["r"]
    assert tolerated.hops[0].compute.start == 0.0
    dropped = first_action(0.4)
    assert isinstance(dropped, Drop) and dropped.reason == "deadline"


def test_a_unit_whose_batch_ran_late_takes_its_next_batch_that_much_later():
    """One GPU, eager: batch 1 [0, 6), batch 2 planned [6, 12) at once on its end. Batch 1 reports
    ending at 8: batch 2 (already sent) ends at 14, so the GPU takes its next batch then, not at 12;
    a batch that ran early frees nothing early."""
    from daskpipe.sched.api import Feedback

    gpu = [Slot("gpu1", "X")]
    d = EagerDispatcher({"m": 100.0}, gpu, latency)
    (first,) = [a for a in d.submit(Request(1, "m", 0.0, 100.0), 0.0) if isinstance(a, Dispatch)]
    d.submit(Request(2, "m", 1.0, 100.0), 1.0)
    (second,) = [a for a in d.wake(6.0) if isinstance(a, Dispatch)]
    assert second.hops[0].compute.start == 6.0 and d.next_wake() is None
    d.submit(Request(3, "m", 7.0, 100.0), 7.0)
    assert d.next_wake() == 12.0
    d.feedback(Feedback(first.id, 0, "compute", 0.0, 8.0), 8.0)
    assert d.next_wake() == 14.0 and not d.wake(12.0), "not at the plan's 12: batch 2 started 2 late"
    (third,) = [a for a in d.wake(14.0) if isinstance(a, Dispatch)]
    assert third.hops[0].compute.start == 14.0 and [r.id for r in third.requests] == [3]
    d.feedback(Feedback(second.id, 0, "compute", 8.0, 13.0), 13.0)  # ended before its corrected 14
    assert third.hops[0].compute.end == 20.0 and d.next_wake() is None


def test_a_units_delays_add_up_once():
    """Batches 0-2 each end 1 past their start's plan (7, 14, 21): the unit's plan moves by 1 per
    batch, and batch 3, sent at 20, ends at 27, not by every earlier delay again."""
    from daskpipe.sched.api import Feedback

    d = EagerDispatcher({"m": 1000.0}, [Slot("gpu1", "X")], latency)
    sent = [a for a in d.submit(Request(0, "m", 0.0, 1000.0), 0.0) if isinstance(a, Dispatch)]
    for i in range(1, 4):
        d.submit(Request(i, "m", 0.5, 1000.0), 0.5)  # one queued at a time: each batch of one
        sent += [a for a in d.wake(d.next_wake()) if isinstance(a, Dispatch)]
        d.feedback(Feedback(sent[-2].id, 0, "compute", 7.0 * (i - 1) + 1.0, 7.0 * i), 7.0 * i)
    assert [a.hops[0].compute.start for a in sent] == [0.0, 6.0, 13.0, 20.0]
    d.submit(Request(4, "m", 21.5, 1000.0), 21.5)
    assert d.next_wake() == 27.0, "batch 3 started 1 late: [21, 27)"
