"""FragmentDispatcher: requests go to their entry's pipelines, and entries share the shared stage's timeline."""

from __future__ import annotations

import pytest

from daskpipe.graft import Fragment
from daskpipe.plan.schema import Plan, PlanError
from daskpipe.runtime.client.hybrid import hybrid_plan
from daskpipe.runtime.errors import DeployError
from daskpipe.sched.api import Dispatch, Feedback, Placement, Request, Slot
from daskpipe.sched.hybrid import FragmentDispatcher
from daskpipe.sched.ppipe import PPipeSettings
from tests.graft.helpers import BUDGET_MS, serving_plan


@pytest.fixture
def hybrid(model_and_profile):
    return hybrid_plan(*serving_plan(), model_and_profile[2], offered_slices=[1, 2])


def make_dispatcher(hybrid, profile, settings: PPipeSettings | None = None) -> FragmentDispatcher:
    """One slot per plan stage (slot ``s<i>`` runs stage ``i``)."""
    slots = {f"s{i}": Slot(f"s{i}", "V100", hybrid.slices[i], "node-0") for i in set(hybrid.stage_of.values())}
    pools = {pool: (f"s{i}",) for pool, i in hybrid.stage_of.items()}
    return FragmentDispatcher(hybrid.plan.model("tiny"), Placement("tiny", pools, slots), profile, bw_gbps=10.0, settings=settings)


def submit_full_batch(dispatcher: FragmentDispatcher, hybrid, block: int, now: float) -> Dispatch:
    pipeline = next(p for p in hybrid.plan.model("tiny").pipelines if p.entry_block == block)
    actions = []
    for i in range(pipeline.batch_size):
        actions += dispatcher.submit(Request(f"b{block}-{i}", "tiny", now, now + BUDGET_MS / 1e3, start_block=block), now)
    [dispatch] = actions
    return dispatch


def test_each_entry_dispatches_on_its_own_pipelines_and_shares_the_shared_slot(hybrid, model_and_profile) -> None:
    dispatcher = make_dispatcher(hybrid, model_and_profile[2])
    pipelines = hybrid.plan.model("tiny").pipelines
    dispatches = [submit_full_batch(dispatcher, hybrid, block, 0.0) for block in (2, 0, 1)]
    assert len({d.id for d in dispatches}) == 3
    for block, d in zip((2, 0, 1), dispatches):
        assert pipelines[d.pipeline].entry_block == block == dispatcher.entry_of(d.id)
        assert all(r.id.startswith(f"b{block}-") and r.start_block == block for r in d.requests)  # a retry re-enters there
    [shared] = hybrid.shared
    on_shared = [hop.compute for d in dispatches for hop in d.hops if hop.slot == f"s{shared}"]
    assert len(on_shared) == 3
    intervals = dispatcher.timeline.intervals(f"s{shared}")
    assert len(intervals) == 3 and all(a[1] <= b[0] + 1e-12 for a, b in zip(intervals, intervals[1:]))  # planned once each, never twice


def test_merged_feedback_frees_the_time_the_merge_saved(hybrid, model_and_profile) -> None:
    dispatcher = make_dispatcher(hybrid, model_and_profile[2])
    [shared] = hybrid.shared
    first, second = (submit_full_batch(dispatcher, hybrid, block, 0.0) for block in (0, 1))
    hops = [next(h for h in d.hops if h.slot == f"s{shared}") for d in (first, second)]
    planned_tail = dispatcher.timeline.tail(f"s{shared}")
    assert planned_tail == pytest.approx(hops[1].compute.end)
    merged = (hops[0].compute.start, hops[0].compute.start + 0.6 * (planned_tail - hops[0].compute.start))
    for d, hop in zip((first, second), hops):
        dispatcher.feedback(Feedback(d.id, hop.partition, "compute", *merged), merged[1])
    assert dispatcher.timeline.tail(f"s{shared}") == pytest.approx(merged[1])


def test_a_short_entry_waits_for_its_batch_then_goes_at_its_last_moment(hybrid, model_and_profile) -> None:
    """The paper's rule (``join_chance=None``) holds a lone request for its batch's last moment; the
    default sends it at once, as no other request is expected before then (docs/dataplane.md)."""
    paper = make_dispatcher(hybrid, model_and_profile[2], PPipeSettings(join_chance=None))
    assert paper.submit(Request("lone", "tiny", 0.0, BUDGET_MS / 1e3, start_block=1), 0.0) == []
    assert paper.queued == 1
    wake = paper.next_wake()
    assert 0.0 < wake < BUDGET_MS / 1e3
    [dispatch] = paper.wake(wake)
    assert [r.id for r in dispatch.requests] == ["lone"] and paper.entry_of(dispatch.id) == 1
    default = make_dispatcher(hybrid, model_and_profile[2])
    assert default.submit(Request("lone", "tiny", 0.0, BUDGET_MS / 1e3, start_block=1), 0.0) == []
    assert default.next_wake() == 0.0  # at the end of this instant, so that a burst fills one batch
    [dispatch] = default.wake(0.0)
    assert [r.id for r in dispatch.requests] == ["lone"]


def test_a_lost_private_slot_stops_its_entry_only(hybrid, model_and_profile) -> None:
    dispatcher = make_dispatcher(hybrid, model_and_profile[2])
    private_of_1 = next(i for (p, q), i in hybrid.stage_of.items() if q == 0 and hybrid.plan.model("tiny").pipelines[p].entry_block == 1)
    assert dispatcher.remove_slot(f"s{private_of_1}", 0.0) == []
    [drop] = dispatcher.submit(Request("r1", "tiny", 0.0, 1.0, start_block=1), 0.0)
    assert drop.reason == "no-capacity" and drop.request.start_block == 1
    assert submit_full_batch(dispatcher, hybrid, 0, 0.0).requests[0].start_block == 0
    with pytest.raises(ValueError, match="not a slot"):
        dispatcher.remove_slot(f"s{private_of_1}", 0.0)


def test_an_entry_the_plan_lacks_is_refused(hybrid, model_and_profile) -> None:
    dispatcher = make_dispatcher(hybrid, model_and_profile[2])
    with pytest.raises(ValueError, match=r"enters 'tiny' at block 3; the plan has entries \[0, 1, 2\]"):
        dispatcher.submit(Request("r", "tiny", 0.0, 1.0, start_block=3), 0.0)


def test_entry_blocks_and_budgets_survive_the_plan_file(hybrid, tmp_path) -> None:
    path = tmp_path / "plan.json"
    hybrid.plan.save(path)
    loaded = Plan.load(path)
    assert loaded == hybrid.plan
    assert loaded.model("tiny").entry_slo_us() == {0: BUDGET_MS * 1e3, 1: BUDGET_MS * 1e3, 2: BUDGET_MS * 1e3}
    data = hybrid.plan.to_dict()
    data["models"][0]["pipelines"][0]["entry_block"] = 1  # its partitions start at block 0
    with pytest.raises(PlanError, match=r"partitions\[0\] must start at block 1 \(its entry_block\)"):
        Plan.from_dict(data)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda fragments, offered: ([Fragment("tiny", 0, 50.0, 1.0, ("stranger",))], offered), "no route for device 'stranger'"),
        (
            lambda fragments, offered: ([Fragment("tiny", 1, 50.0, 1.0, ("dev0",))], offered),
            "device 'dev0' enters at block 1 but its route starts at block 0",
        ),
        (lambda fragments, offered: (fragments, [4]), r"slots with v=\[4\]; the profile of 'tiny' has tables for v=\[1, 2\]"),
    ],
)
def test_a_plan_the_cluster_or_devices_do_not_match_is_refused(model_and_profile, change, message) -> None:
    serving, fragments = serving_plan()
    fragments, offered = change(fragments, [1, 2])
    with pytest.raises(DeployError, match=message):
        hybrid_plan(serving, fragments, model_and_profile[2], offered_slices=offered)
