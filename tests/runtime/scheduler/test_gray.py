"""Gray failures: stalled and slow slots are suspected, routed around and re-admitted; no result
comes later than the late limit (daskpipe/runtime/scheduler/gray.py and the plugin's watch)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import dask.config
import pytest
import torch
from distributed import Client, wait

import daskpipe
from daskpipe.config import ConfigError
from daskpipe.dashboard.prometheus import DaskpipeCollector
from daskpipe.plan.schema import Plan
from daskpipe.runtime.cluster import EmulatedCluster
from daskpipe.runtime.errors import RequestDropped, RequestFailed
from daskpipe.runtime.scheduler.gray import GrayPolicy, SlowSlots, Watchlist, isolation_split
from daskpipe.runtime.scheduler.plugin import plugin_of
from daskpipe.runtime.worker.stage import slow_down
from daskpipe.sched.api import Dispatch, Feedback, Request, Slot
from daskpipe.sched.placement import place
from daskpipe.sched.registry import make_dispatcher
from daskpipe.sim.engine import Engine
from daskpipe.sim.simulate import ProfileDurations
from tests.helpers import paced, wait_until
from tests.runtime.helpers import INPUT, TinyCNN, example, frames, reference, tiny_model, two_stage
from tests.sim.helpers import batching_plan

SLO_MS = 400.0
STAGE_MS = (20.0, 20.0)


def test_the_policy_reads_dask_config_and_names_a_bad_knob():
    with dask.config.set({"daskpipe.gray.readmit-ratio": 2.5, "daskpipe.gray.slow-batches": 5}):
        policy = GrayPolicy.from_config()
    assert policy.readmit_ratio == 2.5 and policy.slow_batches == 5 and policy.suspect_factor == GrayPolicy().suspect_factor
    with (
        dask.config.set({"daskpipe.gray.late-limit-slos": 0.5}),
        pytest.raises(ConfigError, match=r"daskpipe.gray.late-limit-slos: 0.5 is less than the minimum of 1"),
    ):
        GrayPolicy.from_config()
    with (
        dask.config.set({"daskpipe.gray.suspect-after": 3}),
        pytest.raises(ConfigError, match=r"daskpipe.gray: Additional properties are not allowed \('suspect-after' was unexpected\)"),
    ):
        GrayPolicy.from_config()
    with pytest.raises(ConfigError, match=r"daskpipe.gray.isolation-burst: -1 is less than the minimum of 0"):
        GrayPolicy(isolation_burst=-1)  # made in code, checked as the config key is
    assert GrayPolicy(suspect_factor=2, overdue_floor_slos=0.25).hop_bound(0.1, 0.002, 0.4) == pytest.approx(0.2 + 0.1)


def test_the_watchlist_gives_what_is_due_earliest_first():
    watch = Watchlist()
    for due, item in ((3.0, "c"), (1.0, "a"), (2.0, "b"), (1.0, "a2")):
        watch.push(due, item)
    assert watch.next_due == 1.0
    assert watch.due(2.0) == ["a", "a2", "b"] and watch.due(2.5) == [] and len(watch) == 1


@pytest.fixture(scope="module")
def pools_of_two():
    """Two emulated L4 and two emulated T4 slots in this process."""
    with EmulatedCluster({"L4": 2, "T4": 2}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        yield cluster, client


def deploy_pools_of_two(client):
    """``two_stage``'s plan with two slots in each pool: one slot of a pool can fail while the other serves."""
    profile, plan = two_stage(stage_ms=STAGE_MS, slo_ms=SLO_MS)
    model = plan.models[0]
    pipeline = replace(model.pipelines[0], partitions=tuple(replace(q, vgpus=2) for q in model.pipelines[0].partitions))
    plan = Plan(objective=plan.objective, models=(replace(model, pipelines=(pipeline,)),))
    return daskpipe.deploy(client, {"tiny": tiny_model()}, example_inputs={"tiny": example()}, plan=plan, profiles={"tiny": profile})


def offer(svc, rate: float, seconds: float) -> list[tuple[float, object, list]]:
    """Submit at ``rate`` per second for ``seconds``: (submitted at, future, [ended at]) each."""

    def send() -> tuple[float, object, list]:
        ended: list[float] = []
        future = svc.submit("tiny", torch.randn(1, *INPUT))
        future.add_done_callback(lambda f, ended=ended: ended.append(time.monotonic()))
        return time.monotonic(), future, ended

    sent = paced(send, rate, seconds=seconds, poisson=False)
    wait([f for _, f, _ in sent], timeout=60)
    # Dask runs done-callbacks on a thread of its own: one may not have run yet when wait returns
    wait_until(lambda: all(ended for _, _, ended in sent), timeout=10, what="every request's done-callback")
    return sent


def first_pool_worker(cluster) -> str:
    ledger = plugin_of(cluster.scheduler).models.ledgers["tiny"]
    return sorted(a for p, q, a in ledger.stages if q == 0)[0]


@pytest.mark.parametrize("factor, rule", [(40.0, "twice over"), (3.0, "batches in a row")])
def test_a_stalled_or_slow_slot_is_routed_around_and_readmitted_when_in_line(pools_of_two, factor, rule, caplog):
    cluster, client = pools_of_two
    plugin = plugin_of(cluster.scheduler)
    with deploy_pools_of_two(client) as svc:
        offer(svc, rate=40, seconds=0.5)  # warm
        victim = first_pool_worker(cluster)
        client.run(slow_down, factor, 4.0, workers=[victim])
        sent = offer(svc, rate=40, seconds=2.5)
        status = svc.status()["tiny"]
        assert status["suspected"] >= 1 and victim in status["suspects"], status  # still slow: still suspect
        gauges = {
            tuple(s.labels.values()): s.value
            for family in DaskpipeCollector(cluster.scheduler).collect()
            if family.name.endswith("daskpipe_suspect_slots")
            for s in family.samples
        }
        assert gauges == {("tiny", victim): 1.0}
        assert any(rule in r.getMessage() and victim in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        for _, future, _ in sent:  # every request ends: a result, or dropped saying why
            assert future.status == "finished" or isinstance(future.exception(), RequestDropped), future.exception()
        dropped = [f.exception().reason for _, f, _ in sent if f.status == "error"]
        assert set(dropped) <= {"slow-worker", "deadline"} and len(dropped) <= len(sent) // 10, dropped
        assert all(ended[0] - at <= 2 * SLO_MS * 1e-3 + 0.1 for at, f, ended in sent if f.status == "finished")
        # the slowdown is over: the next probe computes in line
        wait_until(lambda: not svc.status()["tiny"]["suspects"], timeout=10, interval=0.05, what="the slot re-admitted")
        status = svc.status()["tiny"]
        assert not status["suspects"] and status["readmitted"] >= 1, status
        since = time.monotonic()
        offer(svc, rate=60, seconds=1.0)
        assert any(slot == victim and start >= since for slot, start, _ in list(plugin.metrics.busy)), (
            "the re-admitted slot takes batches again"
        )


def test_a_whole_pool_running_slow_shows_in_the_measured_ratios_and_is_not_suspected(pools_of_two):
    # before the tests that stall a slot: a stalled slot finishes the hold it started after its test
    cluster, client = pools_of_two
    with deploy_pools_of_two(client) as svc:
        ledger = plugin_of(cluster.scheduler).models.ledgers["tiny"]
        first_pool = sorted(a for p, q, a in ledger.stages if q == 0)
        client.run(slow_down, 1.5, 30.0, workers=first_pool)  # both slots: the machine, not one slot
        try:
            sent = offer(svc, rate=60, seconds=2.0)
        finally:
            client.run(slow_down, 1.0, 0.001, workers=first_pool)  # back in line for the next test
        status = svc.status()["tiny"]
        assert all(f.status == "finished" for _, f, _ in sent) and status["suspected"] == 0, status
        ratios = status["measured_ratios"]
        assert 1.4 <= ratios["0/0"] <= 1.7 and 0.9 <= ratios["0/1"] <= 1.2, ratios


def test_requests_that_end_late_are_accounted_to_the_leg_that_lost_the_time(pools_of_two):
    cluster, client = pools_of_two
    with deploy_pools_of_two(client) as svc:
        ledger = plugin_of(cluster.scheduler).models.ledgers["tiny"]
        first_pool = sorted(a for p, q, a in ledger.stages if q == 0)
        offer(svc, rate=40, seconds=0.3)  # warm
        client.run(slow_down, 8.0, 30.0, workers=first_pool)  # the whole pool: slow, not suspect
        try:
            offer(svc, rate=40, seconds=1.0)
        finally:
            client.run(slow_down, 1.0, 0.001, workers=first_pool)
        status = svc.status()["tiny"]
        late = status["late"]
        assert late["requests"] == status["completed"] - status["on_time"] > 0, status
        assert max(late["mean_ms"], key=late["mean_ms"].get) == "compute" and late["max_ms"]["compute"] > 100, late
        exported = {
            tuple(s.labels.values()): s.value
            for family in DaskpipeCollector(cluster.scheduler).collect()
            if family.name.endswith("daskpipe_late_leg_seconds")
            for s in family.samples
        }
        assert exported[("tiny", "compute", "max")] == pytest.approx(late["max_ms"]["compute"] * 1e-3)


def test_no_result_comes_later_than_the_late_limit(pools_of_two):
    cluster, client = pools_of_two
    with (
        dask.config.set({"daskpipe.gray.suspect-factor": 1000.0}),
        deploy_pools_of_two(client) as svc,
    ):  # never suspected: the late limit alone
        offer(svc, rate=20, seconds=0.3)
        client.run(slow_down, 60.0, 1.5, workers=[first_pool_worker(cluster)])
        sent = offer(svc, rate=40, seconds=1.0)
        late = [f.exception() for _, f, _ in sent if f.status == "error"]
        assert late and all(e.reason == "deadline" and "2x its SLO after it arrived" in str(e) for e in late), late
        assert all(ended[0] - at <= 2 * SLO_MS * 1e-3 + 0.1 for at, f, ended in sent if f.status == "finished")


def test_the_last_slot_of_a_pool_is_not_suspected_and_the_late_limit_ends_what_it_holds(pools_of_two):
    cluster, client = pools_of_two
    profile, plan = two_stage(stage_ms=STAGE_MS, slo_ms=SLO_MS)  # one slot per pool: nowhere to route around
    with daskpipe.deploy(client, {"tiny": tiny_model()}, example_inputs={"tiny": example()}, plan=plan, profiles={"tiny": profile}) as svc:
        offer(svc, rate=20, seconds=0.3)
        client.run(slow_down, 40.0, 1.0, workers=[first_pool_worker(cluster)])
        stalled = offer(svc, rate=20, seconds=1.0)
        assert svc.status()["tiny"]["suspected"] == 0, svc.status()["tiny"]
        errors = [f.exception() for _, f, _ in stalled if f.status == "error"]
        assert all(isinstance(e, RequestDropped) and e.reason == "deadline" for e in errors), errors
        assert all(ended[0] - at <= 2 * SLO_MS * 1e-3 + 0.1 for at, f, ended in stalled if f.status == "finished")
        after = offer(svc, rate=20, seconds=0.5)  # in line again, it serves
        assert all(f.status == "finished" for _, f, _ in after)


def test_a_new_deployment_numbers_its_batches_past_those_of_a_closed_one(pools_of_two, monkeypatch):
    """Reports carry the model and the batch id: a closed deployment's batch still computing on a
    stalled slot reports later, and must not be read as the new deployment's batch of that id."""
    cluster, client = pools_of_two
    batches = plugin_of(cluster.scheduler).batches
    sent: list[int] = []
    send = batches.send
    monkeypatch.setattr(
        batches, "send", lambda ledger, model, dispatch, flight: (sent.append(dispatch), send(ledger, model, dispatch, flight))
    )
    profile, plan = two_stage(stage_ms=STAGE_MS, slo_ms=SLO_MS)
    for _ in range(2):
        with daskpipe.deploy(
            client, {"tiny": tiny_model()}, example_inputs={"tiny": example()}, plan=plan, profiles={"tiny": profile}
        ) as svc:
            done = offer(svc, rate=40, seconds=0.3)
            assert all(f.status == "finished" for _, f, _ in done)
        sent.append(-1)  # between the deployments
    first, second = sent[: sent.index(-1)], sent[sent.index(-1) + 1 : -1]
    assert first and second and min(second) > max(first), (first, second)


def stage_costs(samples: int) -> list[float]:
    """Two hops of 10 ms at one sample, 18.75 ms at eight (batch cost 1 + (b - 1) / 8)."""
    return [0.010 * (1 + (samples - 1) / 8)] * 2


@pytest.mark.parametrize(
    "left_s, lanes, parts",
    [
        (1.0, 1, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # time for bisection: halves, the least compute
        (0.05, 4, [[i] for i in range(8)]),  # only one more round fits: each alone, two per lane
        (0.05, 1, None),  # the same time on one lane: eight singles one after another do not fit
        (0.005, 8, None),  # not even one pass
    ],
)
def test_a_failed_batch_splits_by_the_time_its_deadlines_leave(left_s, lanes, parts):
    assert isolation_split([1] * 8, left_s, stage_costs, lanes, report_s=0.002) == parts


def test_one_poisoned_input_of_eight_fails_alone_at_an_slo_of_three_pipeline_passes():
    """Pools of four slots each, batches of eight: the retries spread over the pools' slots, each
    request alone when bisection's three more rounds would not fit, and the seven others complete."""
    pass_ms = 2 * 10.0 * (1 + 7 / 8)
    profile, plan = two_stage(stage_ms=(10.0, 10.0), slo_ms=3 * pass_ms, batch=8, vgpus=4)
    with (
        EmulatedCluster({"L4": 4, "T4": 4}, processes=False, dashboard_address=None) as cluster,
        Client(cluster) as client,
        daskpipe.deploy(client, {"tiny": tiny_model()}, example_inputs={"tiny": example()}, plan=plan, profiles={"tiny": profile}) as svc,
    ):
        for _ in range(3):  # warm the stages
            wait(svc.map("tiny", frames(8, seed=5)), timeout=30)
        xs = frames(8)
        batch = svc.map("tiny", xs[:5] + [xs[5] * 1e6] + xs[6:])
        wait(batch, timeout=30)
        failed = [i for i, f in enumerate(batch) if f.status == "error"]
        assert failed == [5], [(i, repr(batch[i].exception())) for i in failed]
        for i, (future, ref) in enumerate(zip(batch, reference(xs))):
            if i != 5:
                torch.testing.assert_close(future.result(), ref, atol=1e-4, rtol=1e-4)
        assert svc.status()["tiny"]["isolated"] in (6, 8)  # bisected when the margin leaves time for it, else each alone


HANG_MARK = 7.0
"""A sample whose every value is this hangs :class:`HangingCNN`'s first stage until :data:`RELEASE`."""
RELEASE = threading.Event()


def hang_on_mark(x: torch.Tensor) -> torch.Tensor:
    """Block the compute thread while a sample of ``x`` is all :data:`HANG_MARK` (until released)."""
    if bool((x.flatten(1) == HANG_MARK).all(dim=1).any()):
        RELEASE.wait(60)
    return x


torch.fx.wrap("hang_on_mark")  # a call of the traced graph, not traced through


class HangingCNN(TinyCNN):
    """:class:`TinyCNN` (the same weights) whose first stage hangs on a marked input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(hang_on_mark(x))


def test_a_stage_hung_on_one_input_fails_only_it_and_its_batch_mates_finish():
    """A batch of four with one input on which the first stage blocks: the batch stalls, its slot
    is suspected, its requests go each alone to the pool's other slots; the marked one hangs a
    second slot and fails alone, naming the hang and the stage, the three others complete; both
    hung slots rejoin their pool once their compute threads return."""
    torch.manual_seed(0)
    model = HangingCNN().eval()
    profile, plan = two_stage(stage_ms=(10.0, 10.0), slo_ms=SLO_MS, batch=4, vgpus=4, model=model)
    RELEASE.clear()
    with (
        EmulatedCluster({"L4": 4, "T4": 4}, processes=False, dashboard_address=None) as cluster,
        Client(cluster) as client,
        daskpipe.deploy(client, {"tiny": model}, example_inputs={"tiny": example()}, plan=plan, profiles={"tiny": profile}) as svc,
    ):
        try:
            for _ in range(3):  # warm the stages
                wait(svc.map("tiny", frames(4, seed=5)), timeout=30)
            xs = frames(4)
            xs[1] = torch.full_like(xs[1], HANG_MARK)
            batch = svc.map("tiny", xs)
            wait(batch, timeout=30)
            failed = [i for i, f in enumerate(batch) if f.status == "error"]
            assert failed == [1], [(i, repr(batch[i].exception())) for i in failed]
            error = batch[1].exception()
            assert isinstance(error, RequestFailed) and "stage 0 of 'tiny' hung on this input" in str(error), repr(error)
            for i, (future, ref) in enumerate(zip(batch, reference(xs))):
                if i != 1:
                    torch.testing.assert_close(future.result(), ref, atol=1e-4, rtol=1e-4)
            status = svc.status()["tiny"]
            assert len(status["suspects"]) == 2 and status["failed"] == 1, status  # both hung slots out of service
            assert status["completed"] == status["submitted"] - 1, status  # nothing else lost
        finally:
            RELEASE.set()
        wait_until(lambda: not svc.status()["tiny"]["suspects"], timeout=10, interval=0.05, what="the hung slots re-admitted")
        after = svc.map("tiny", frames(8, seed=3))
        wait(after, timeout=30)
        assert all(f.status == "finished" for f in after)


class SlowedOn:
    """The simulator's ground truth, but every compute on the ``slowed`` slots takes ``factor`` times as long."""

    def __init__(self, durations: ProfileDurations, slowed: set[str], factor: float) -> None:
        self.durations, self.slowed, self.factor = durations, slowed, factor

    def compute(self, dispatch: Dispatch, partition: int, slot: Slot) -> float:
        return self.durations.compute(dispatch, partition, slot) * (self.factor if slot.id in self.slowed else 1.0)

    def transfer(self, dispatch: Dispatch, partition: int) -> float:
        return self.durations.transfer(dispatch, partition)

    def partitions(self, model: str, pipeline: int) -> int:
        return self.durations.partitions(model, pipeline)


def slow_verdicts(slowed_count: int, factor: float = 4.0) -> tuple[set[str], list[tuple[str, float]]]:
    """The watch's slow rule on the simulator's clock: a pool of three slots serving 2 s of evenly
    spaced arrivals at half its capacity, ``slowed_count`` of them computing ``factor`` times as
    long as profiled. Each compute's feedback, timed by the engine's virtual clock, is told to the
    rule against its dispatch's plan, as the scheduler's watch tells it. The slowed slots, and
    each verdict's (slot, virtual time)."""
    plan, profiles = batching_plan(slots=3)
    (model,) = plan.models
    placement = place(plan)[model.name]
    pool = sorted(placement.pools[(0, 0)])
    slowed = set(pool[:slowed_count])
    dispatcher = make_dispatcher("ppipe", model, placement, profiles[model.name], bw_gbps=10.0)
    rule = SlowSlots(GrayPolicy(), [(0, 0, address) for address in pool])
    planned: dict[int, tuple[str, float]] = {}  # dispatch id -> (its slot, its planned compute in s)
    verdicts: list[tuple[str, float]] = []

    def planning(actions: list) -> list:
        for action in actions:
            if isinstance(action, Dispatch):
                hop = action.hops[0]
                planned[action.id] = (hop.slot, hop.compute.end - hop.compute.start)
        return actions

    submit, wake, feedback = dispatcher.submit, dispatcher.wake, dispatcher.feedback

    def told(fb: Feedback, now: float) -> list:
        if fb.kind == "compute":
            address, planned_s = planned[fb.dispatch]
            if rule.observe(address, fb.end - fb.start, planned_s, out={a for a, _ in verdicts}) is not None:
                verdicts.append((address, now))
        return planning(feedback(fb, now))

    dispatcher.submit = lambda request, now: planning(submit(request, now))
    dispatcher.wake = lambda now: planning(wake(now))
    dispatcher.feedback = told
    engine = Engine({model.name: dispatcher}, placement.slots, SlowedOn(ProfileDurations(plan, profiles, 10.0), slowed, factor))
    rate, slo_s = model.throughput / 2, model.slo_us * 1e-6
    engine.add_arrivals(Request(i, model.name, i / rate, i / rate + slo_s) for i in range(int(2 * rate)))
    engine.run()
    return slowed, verdicts


def test_the_watchs_slow_slot_rule_runs_on_the_simulators_clock():
    """The rule keeps no clock of its own (:class:`SlowSlots`): on the simulator's virtual timeline,
    the one slot of three that computes 4x slower is found once ``slow_batches`` of its batches
    were, within the run, and its pool-mates never; a whole pool 4x slower is the machine (the
    measured ratios follow it), and no slot of it is suspected."""
    slowed, verdicts = slow_verdicts(1)
    assert [address for address, _ in verdicts] == sorted(slowed)
    assert 0 < verdicts[0][1] < 2.0
    assert slow_verdicts(3)[1] == []
