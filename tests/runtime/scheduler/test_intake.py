"""What comes into the scheduler: a client's releases are taken in slices of the event loop, and
a request's deadline counts from the caller's submit, however long the way in took."""

from __future__ import annotations

import asyncio
import time
import uuid

import dask.config
import numpy as np
import pytest
from distributed import Future

from daskpipe.plan.schema import ModelPlan, Partition, Pipeline
from daskpipe.profiles.model import Profile
from daskpipe.runtime.client.service import encode_input
from daskpipe.runtime.errors import DeployError, RequestDropped
from daskpipe.runtime.scheduler.control import ControlPath
from daskpipe.runtime.scheduler.intake import (
    CLOCK_STEP_S,
    LOOP_TURN_S,
    SUBMIT_SLICE,
    SendClocks,
    check_feasible,
    ledger_for,
    sliced_releases,
)
from daskpipe.runtime.scheduler.ledger import Endings
from daskpipe.runtime.wire.messages import ServeSettings
from daskpipe.sched.metrics import ServiceMetrics
from tests.helpers import LoopTurns
from tests.runtime.helpers import deploy_two_stage, frames


def test_a_burst_of_releases_lets_the_event_loop_turn_and_keeps_their_order():
    released: list = []
    turns_during: list[int] = []

    def release(*, keys, client, stimulus_id=None):  # Dask's handler, as slow as a busy scheduler's transitions
        released.extend(keys)
        time.sleep(LOOP_TURN_S / 4)

    async def main() -> None:
        handler = sliced_releases(release)
        turns = LoopTurns()
        turns.start()
        await asyncio.sleep(0)
        before = turns.count
        for i in range(40):  # a message per key, as a client sends them, and one message of many keys
            await handler(keys=[f"k{i}"], client="c")
        await handler(keys=[f"many-{j}" for j in range(8 * SUBMIT_SLICE)], client="c")
        turns_during.append(turns.count - before)
        turns.stop()

    asyncio.run(main())
    assert released == [f"k{i}" for i in range(40)] + [f"many-{j}" for j in range(8 * SUBMIT_SLICE)]
    assert turns_during[0] >= 10, f"the loop turned {turns_during[0]} times in ~{48 * LOOP_TURN_S / 4:.2f} s of releases"


def test_a_malformed_release_reaches_dasks_handler_unchanged():
    seen = []
    asyncio.run(sliced_releases(lambda **kw: seen.append(kw))(keys="not-a-list", client="c"))
    assert seen == [{"keys": "not-a-list", "client": "c"}]


def test_a_submission_that_waited_on_its_way_in_is_charged_what_it_waited_beyond_its_clients_fastest():
    clocks = SendClocks(window_s=10.0)
    skewed = 5.0  # client b's wall clock runs 5 s behind the scheduler's: only the age beyond its fastest counts
    assert clocks.delay("a", time.time() - 0.001, now=0.0) == pytest.approx(0.0, abs=1e-3)
    assert clocks.delay("b", time.time() - skewed - 0.001, now=0.0) == pytest.approx(0.0, abs=1e-3)
    assert clocks.delay("a", time.time() - 0.031, now=1.0) == pytest.approx(0.030, abs=2e-3)
    assert clocks.delay("b", time.time() - skewed - 0.021, now=1.0) == pytest.approx(0.020, abs=2e-3)
    assert clocks.delay("a", None, now=1.0) == 0.0  # an unstamped message counts from its reading
    # a stamp older than the step bound: the client's clock stepped back; its fastest is learnt afresh
    assert clocks.delay("a", time.time() - 2 * CLOCK_STEP_S, now=2.0) == pytest.approx(0.0, abs=1e-3)
    assert clocks.delay("a", time.time() - 2 * CLOCK_STEP_S - 0.010, now=3.0) == pytest.approx(0.010, abs=2e-3)
    # the fastest is remembered for one to two windows, then forgotten: a drifted clock is followed
    assert clocks.delay("b", time.time() - skewed - 0.050, now=12.0) == pytest.approx(0.049, abs=2e-3)
    assert clocks.delay("b", time.time() - skewed - 0.050, now=40.0) == pytest.approx(0.0, abs=1e-3)
    clocks.forget("b")
    assert "b" not in clocks.fastest


def test_a_request_that_spent_its_slo_on_the_way_in_is_dropped_at_once_and_the_others_are_served(emulated_inproc):
    cluster, client = emulated_inproc
    raw = encode_input(frames(1)[0])
    with deploy_two_stage(client, slo_ms=500.0) as svc:
        for x in frames(3):  # the client's fastest way in
            svc.submit("tiny", x).result(timeout=30)
        key = f"stale-{uuid.uuid4().hex}"
        stale = Future(key, client)
        svc._send("tiny", [key], [raw], [1], sent_at=time.time() - 0.6)  # handed over 600 ms ago, for a 500 ms SLO
        with pytest.raises(RequestDropped, match="deadline"):
            stale.result(timeout=10)
        assert svc.submit("tiny", frames(1)[0]).result(timeout=30).shape == (1, 10)
        control = svc.status()["tiny"]["control"]
        assert control["send_p99_ms"] >= 500  # the stale one is among the recent sends


def test_a_bad_key_in_the_schedulers_own_config_refuses_the_model_naming_it():
    """The client checks its own config at deploy; a scheduler in another process has its own."""
    with (
        dask.config.set({"daskpipe.dashboard.update-interval": "soon"}),
        pytest.raises(DeployError, match=r"^the scheduler's Dask config: daskpipe.dashboard.update-interval: 'soon' is not a duration"),
    ):
        ledger_for(
            "m",
            {},
            {},
            [],
            Endings(scheduler=None, slots={}, to_worker=lambda address, message: None, metrics=ServiceMetrics()),
            control=ControlPath(0.001),
            settings=ServeSettings(),
            sample_nbytes=1,
        )


def test_a_lone_request_is_counted_with_its_inputs_way_in_to_the_first_stage():
    """A 10 ms stage whose 1 MB input takes 1 ms at 8 Gbit/s: a lone request takes 11 ms."""
    plan = ModelPlan("m", 20e3, 1.0, 100.0, (Pipeline(1, 100.0, (Partition((0, 1), "A", 1, 1, 10e3),)),))
    profile = Profile(model="m", slo_us=20e3, num_blocks=1, latency_us={("A", 1): np.array([[10e3]])}, boundary_bytes=(), input_bytes=1e6)
    assert check_feasible("m", plan, profile, {0: 0.020}, 0.001, bw_gbps=8.0, time_dilation=1.0) == pytest.approx(0.009)
    with pytest.raises(DeployError, match="a lone request takes 11.0 ms on its fastest pipeline"):
        check_feasible("m", plan, profile, {0: 0.0115}, 0.001, bw_gbps=8.0, time_dilation=1.0)
