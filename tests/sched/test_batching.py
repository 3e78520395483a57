"""Timeout and eager baselines share Symphony's machinery; only the exec bound differs."""

from __future__ import annotations

import pytest

from daskpipe.sched.api import Dispatch, Request, Slot
from daskpipe.sched.batching import EagerDispatcher, ShepherdDispatcher, TimeoutDispatcher

GPUS = [Slot("g0", "X"), Slot("g1", "X")]


def latency(_model: str, batch: int) -> float:
    return 0.001 * batch + 0.005


def submit_all(d, times, slo=1.0):
    out = []
    for i, t in enumerate(times):
        out += [(t, a) for a in d.submit(Request(i, "m", t, t + slo), t)]
    return out


def test_timeout_fires_after_max_wait():
    d = TimeoutDispatcher({"m": 1.0}, GPUS, latency, max_wait_s=0.010, max_batch=8)
    assert submit_all(d, [0.0, 0.002, 0.004]) == []
    assert d.next_wake() == pytest.approx(0.010)  # the oldest request's arrival + timeout
    (dispatch,) = d.wake(0.010)
    assert [r.id for r in dispatch.requests] == [0, 1, 2] and dispatch.hops[0].compute.start == 0.010


def test_timeout_sends_a_full_batch_at_once():
    d = TimeoutDispatcher({"m": 1.0}, GPUS, latency, max_wait_s=0.5, max_batch=4)
    actions = submit_all(d, [0.0, 0.001, 0.002, 0.003, 0.004])
    dispatches = [(t, a) for t, a in actions if isinstance(a, Dispatch)]
    assert len(dispatches) == 1 and dispatches[0][0] == 0.003 and dispatches[0][1].batch_size == 4
    assert d.queued == 1


def test_eager_dispatches_when_a_gpu_is_idle():
    d = EagerDispatcher({"m": 1.0}, GPUS, latency)
    actions = submit_all(d, [0.0, 0.001, 0.002])
    assert [(t, a.batch_size, a.hops[0].slot) for t, a in actions] == [(0.0, 1, "g0"), (0.001, 1, "g1")]
    assert d.next_wake() == pytest.approx(0.006)  # GPU timer: g0 frees, the waiting request goes
    (dispatch,) = d.wake(0.006)
    assert dispatch.hops[0].slot == "g0" and [r.id for r in dispatch.requests] == [2]


def test_timeout_never_waits_past_the_deadline():
    d = TimeoutDispatcher({"m": 0.020}, GPUS, latency, max_wait_s=1.0, max_batch=8)
    submit_all(d, [0.0], slo=0.020)
    assert d.next_wake() == pytest.approx(0.020 - 0.006)  # latest start of a batch of 1


@pytest.mark.parametrize("wait", [-1.0, float("nan"), "1"])
def test_bad_timeout(wait):
    with pytest.raises(ValueError, match="max_wait_s"):
        TimeoutDispatcher({"m": 1.0}, GPUS, latency, max_wait_s=wait)


def test_timeout_per_model():
    d = TimeoutDispatcher({"a": 1.0, "b": 1.0}, GPUS, latency, max_wait_s={"a": 0.010, "b": 0.030}, max_batch=8)
    d.submit(Request("a0", "a", 0.0, 1.0), 0.0)
    d.submit(Request("b0", "b", 0.0, 1.0), 0.0)
    assert d.next_wake() == pytest.approx(0.010)
    (first,) = d.wake(0.010)
    assert first.model == "a" and d.next_wake() == pytest.approx(0.030)


def test_timeout_per_model_must_name_every_model():
    with pytest.raises(ValueError, match=r"no timeout for model\(s\) \['b'\]"):
        TimeoutDispatcher({"a": 1.0, "b": 1.0}, GPUS, latency, max_wait_s={"a": 0.01})


@pytest.mark.parametrize("cls, first", [(EagerDispatcher, "urgent"), (ShepherdDispatcher, "large")])
def test_a_freed_gpu_takes_the_most_urgent_or_the_largest_batch(cls, first):
    """Both GPUs busy; then one small urgent batch and one large relaxed one wait: eager (Clockwork,
    Symphony's rule) gives the freed GPU the most urgent, Shepherd the largest."""
    d = cls({"busy": 1.0, "urgent": 0.05, "large": 1.0}, GPUS, latency)
    d.submit(Request("x0", "busy", 0.0, 1.0), 0.0)
    d.submit(Request("x1", "busy", 0.0005, 1.0005), 0.0005)
    d.submit(Request("u0", "urgent", 0.001, 0.051), 0.001)
    for i in range(3):
        d.submit(Request(f"l{i}", "large", 0.001, 1.001), 0.001)
    (dispatch,) = d.wake(0.006)  # g0 frees (g1 at 0.0065)
    assert dispatch.model == first
