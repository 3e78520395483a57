"""The dispatcher's wake-up: fires once, never before the time it was armed for, and follows re-arming and cancelling."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

import daskpipe.runtime.scheduler.timer as timer
from daskpipe.runtime.scheduler.timer import Wakeup


@pytest.fixture(params=["timerfd", "call_at"])
def kind(request, monkeypatch):
    """Both ways a wake-up is kept: Linux's timerfd, and the event loop's own timer elsewhere."""
    if request.param == "call_at":
        monkeypatch.setattr(timer.sys, "platform", "darwin")
    return request.param


def run(coroutine_function):
    return asyncio.run(coroutine_function())


def fired_at(wakeup_calls: list[float]):
    def callback():
        wakeup_calls.append(time.monotonic())

    return callback


def test_a_wakeup_fires_once_and_not_before_its_time(kind):
    async def main():
        calls: list[float] = []
        wakeup = Wakeup(fired_at(calls))
        at = time.monotonic() + 0.02
        wakeup.arm(at)
        assert wakeup.at == at
        await asyncio.sleep(0.1)
        wakeup.close()
        return calls, at, wakeup.at

    calls, at, pending = run(main)
    assert len(calls) == 1 and calls[0] >= at
    assert pending == float("inf")  # nothing pending once it fired


def test_rearming_moves_the_wakeup_earlier_or_later_and_cancel_drops_it(kind):
    async def main():
        calls: list[float] = []
        wakeup = Wakeup(fired_at(calls))
        now = time.monotonic()
        wakeup.arm(now + 0.2)
        wakeup.arm(now + 0.02)  # earlier: fires then, not at 0.2 s
        await asyncio.sleep(0.1)
        earlier = list(calls)
        now = time.monotonic()
        wakeup.arm(now + 0.02)
        wakeup.arm(now + 0.15)  # later: the 0.02 s one is gone
        await asyncio.sleep(0.08)
        before_later = len(calls)
        await asyncio.sleep(0.15)
        later = calls[before_later:]
        wakeup.arm(time.monotonic() + 0.02)
        wakeup.cancel()
        await asyncio.sleep(0.08)
        wakeup.close()
        return earlier, before_later, later, now, len(calls)

    earlier, before_later, later, now, total = run(main)
    assert len(earlier) == 1
    assert before_later == 1 and len(later) == 1 and later[0] >= now + 0.15
    assert total == 2  # the cancelled one never fired


def test_a_time_already_past_fires_on_the_next_loop_turn(kind):
    async def main():
        calls: list[float] = []
        wakeup = Wakeup(fired_at(calls))
        wakeup.arm(time.monotonic() - 1.0)
        assert not calls  # never inside arm: the caller may be mid-way through its own state change
        await asyncio.sleep(0.02)
        wakeup.close()
        return calls

    assert len(run(main)) == 1


def test_a_wakeup_follows_its_caller_to_a_new_event_loop(kind):
    calls: list[float] = []
    wakeup = Wakeup(fired_at(calls))

    async def arm_and_wait():
        wakeup.arm(time.monotonic() + 0.01)
        await asyncio.sleep(0.05)

    run(arm_and_wait)  # the first loop closes with the wake-up's timer still registered on it
    run(arm_and_wait)
    wakeup.close()
    assert len(calls) == 2


def test_a_closed_wakeup_never_fires_and_gives_its_timer_back(kind):
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def main():
        calls: list[float] = []
        before = open_fds()
        wakeups = [Wakeup(fired_at(calls)) for _ in range(20)]
        for wakeup in wakeups:
            wakeup.arm(time.monotonic() + 0.02)
        held = open_fds() - before
        for wakeup in wakeups:
            wakeup.close()
        await asyncio.sleep(0.08)
        return calls, held, open_fds() - before

    calls, held, left = run(main)
    assert not calls
    assert held == (20 if kind == "timerfd" else 0) and left == 0
