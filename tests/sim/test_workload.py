"""Arrival processes: rates, burstiness, trace formats and rescaling."""

from __future__ import annotations

import numpy as np
import pytest

from daskpipe.sim.workload import Stream, arrivals, gamma_arrivals, load_trace, poisson_arrivals, stream_requests, trace_arrivals


def cv(times):
    gaps = np.diff(times)
    return gaps.std() / gaps.mean()


def test_poisson_rate_and_dispersion():
    times = poisson_arrivals(2000.0, 5.0, np.random.default_rng(1))
    assert len(times) == pytest.approx(10_000, rel=0.05) and cv(times) == pytest.approx(1.0, abs=0.05)
    assert np.all(np.diff(times) >= 0) and times[-1] < 5.0


def test_bursty_is_over_dispersed_at_the_same_mean_rate():
    times = gamma_arrivals(2000.0, 5.0, np.random.default_rng(1), cv=3.0)
    assert len(times) == pytest.approx(10_000, rel=0.15) and cv(times) == pytest.approx(3.0, rel=0.15)


def test_same_seed_same_arrivals():
    a = arrivals("bursty", 100.0, 2.0, np.random.default_rng(7))
    b = arrivals("bursty", 100.0, 2.0, np.random.default_rng(7))
    assert np.array_equal(a, b)


def test_timestamp_trace_is_rescaled_and_tiled(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("# seconds\n10.0\n10.5\n11.0\n13.0\n")  # 4 arrivals over a 4 s period (one gap closes it)
    trace = load_trace(path)
    times = trace_arrivals(trace, 100.0, 1.0, np.random.default_rng(1))
    assert len(times) == 100
    assert np.allclose(times[:4], [0.0, 0.005, 0.01, 0.03])  # time axis compressed 100x, bursts kept


def test_per_minute_trace(tmp_path):
    path = tmp_path / "m.txt"
    path.write_text("per-minute\n10\n30\n")
    times = trace_arrivals(load_trace(path), 50.0, 2.0, np.random.default_rng(1), bin_s=1.0)
    first, second = (times < 1.0).sum(), (times >= 1.0).sum()
    assert first + second == pytest.approx(100, rel=0.3) and second > 2 * first


@pytest.mark.parametrize(
    "text, message",
    [("", "empty"), ("1.0\nx\n", "expected a number"), ("5\n", "at least 2"), ("per-minute\n0\n", "no requests"), ("3\n3\n", "no rate")],
)
def test_bad_traces(tmp_path, text, message):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_trace(path)


@pytest.mark.parametrize(
    "call",
    [
        lambda r: poisson_arrivals(0.0, 1.0, r),
        lambda r: poisson_arrivals(1.0, -1.0, r),
        lambda r: gamma_arrivals(1.0, 1.0, r, cv=0.0),
        lambda r: arrivals("zipf", 1.0, 1.0, r),
    ],
)
def test_bad_parameters(call):
    with pytest.raises(ValueError):
        call(np.random.default_rng(1))


def test_streams_carry_their_entry_block_and_budget():
    streams = [Stream("phone", "m", 200.0, 0.05, start_block=3), Stream("server", "m", 100.0, 0.2)]
    requests = stream_requests(streams, 2.0, np.random.default_rng(3))
    arrivals_at = [r.arrival for r in requests]
    assert arrivals_at == sorted(arrivals_at)
    by_source = {s.source: [r for r in requests if r.id[0] == s.source] for s in streams}
    assert len(by_source["phone"]) == pytest.approx(400, rel=0.2) and len(by_source["server"]) == pytest.approx(200, rel=0.25)
    assert all(r.start_block == 3 and r.deadline == pytest.approx(r.arrival + 0.05) for r in by_source["phone"])
    assert all(r.start_block == 0 and r.deadline == pytest.approx(r.arrival + 0.2) for r in by_source["server"])


@pytest.mark.parametrize(
    "kwargs, message",
    [({"rate": 0.0}, "rate"), ({"budget_s": 0.0}, "budget_s"), ({"start_block": -1}, "start_block"), ({"start_block": 1.5}, "start_block")],
)
def test_bad_streams(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Stream("s", "m", **{"rate": 1.0, "budget_s": 0.1, **kwargs})
