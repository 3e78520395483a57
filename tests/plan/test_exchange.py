from __future__ import annotations

import math
import time

import pytest

from daskpipe.plan.configs import Budget, enumerate_configs, resources_of
from daskpipe.plan.exchange import Share, exchange_gpus

from .helpers import synthetic_profile

GPUS = {"A": 3, "B": 3}


@pytest.fixture
def configs():
    """Model "a" serves 1000 req/s per A GPU and 100 per B; model "b" the other way round."""
    a = synthetic_profile("a", {("A", 1): [500, 500], ("B", 1): [5000, 5000]})
    b = synthetic_profile("b", {("A", 1): [5000, 5000], ("B", 1): [500, 500]})
    budget = Budget(latency_us=1e9, bw_gbps=10.0, gpus_per_server={}, batch_build_rate=None)
    return {p.model: enumerate_configs(p, resources_of(p, list(GPUS)), budget, max_parts=2) for p in (a, b)}


def exchanged(configs, start):
    return exchange_gpus(configs, {"a": 1.0, "b": 1.0}, GPUS, start, time.perf_counter() + 30)


def fits(share: Share) -> bool:
    """The share's pipelines need no more whole GPUs of a type than it holds."""
    used = dict.fromkeys(GPUS, 0)
    for config, vgpus in share.pipelines:
        for (gpu, v), n in zip(config.resources, vgpus):
            used[gpu] += math.ceil(n / v)
    return all(used[g] <= n for g, n in zip(GPUS, share.gpus))


def test_gpus_move_to_the_model_that_serves_most_on_them(configs):
    # "b" starts with nothing; its best is the three B GPUs, and "a" keeps 3000 req/s on the A's
    shares = exchanged(configs, {"a": Share((3, 3), 0.0, ()), "b": Share((0, 0), 0.0, ())})
    assert shares["a"].gpus == (3, 0) and shares["b"].gpus == (0, 3)
    assert shares["a"].throughput == pytest.approx(3000) and shares["b"].throughput == pytest.approx(3000)
    assert all(fits(s) for s in shares.values())


def test_free_gpus_are_handed_out(configs):
    shares = exchanged(configs, {"a": Share((0, 0), 0.0, ()), "b": Share((0, 0), 0.0, ())})
    assert min(s.throughput for s in shares.values()) == pytest.approx(3000)
    assert [sum(col) for col in zip(*(s.gpus for s in shares.values()))] <= list(GPUS.values())


def test_a_model_whose_gpus_stay_keeps_its_share(configs):
    start = {"a": Share((3, 0), 3000.0, ()), "b": Share((0, 3), 3000.0, ())}
    shares = exchanged(configs, start)
    assert shares["a"] is start["a"] and shares["b"] is start["b"]


def test_a_start_over_the_cluster_is_refused(configs):
    with pytest.raises(ValueError, match="more GPUs than the cluster has"):
        exchanged(configs, {"a": Share((3, 3), 0.0, ()), "b": Share((1, 0), 0.0, ())})


def test_a_polish_that_serves_more_is_kept(configs):
    """Stuck at 3000 req/s each, the search asks ``polish`` once per model and share."""
    asked = []

    def polish(model, gpus, deadline):
        asked.append((model, gpus))
        return Share(gpus, 3000.0 + (model == "b"), ()) if model == "b" else None

    start = {"a": Share((3, 0), 0.0, ()), "b": Share((0, 3), 0.0, ())}
    shares = exchange_gpus(configs, {"a": 1.0, "b": 1.0}, GPUS, start, time.perf_counter() + 30, polish)
    assert shares["b"].throughput == pytest.approx(3001) and shares["a"].throughput == pytest.approx(3000)
    assert sorted(asked) == [("a", (3, 0)), ("b", (0, 3))]
