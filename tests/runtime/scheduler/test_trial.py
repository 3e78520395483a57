"""A deploy's trial of its control path (daskpipe/runtime/scheduler/trial.py): a tight SLO is decided on
the tail of real batches sent along the model's routes, a loose one on the pings alone."""

from __future__ import annotations

import re

import pytest
from distributed import Client, wait

import daskpipe
from daskpipe.runtime.client.futures import HELD
from daskpipe.runtime.cluster import EmulatedCluster
from daskpipe.runtime.errors import DeployError
from daskpipe.runtime.scheduler.trial import MIN_BATCHES, TRIAL_BATCHES, TRIAL_BYTES, TRIAL_RATE_MAX, TRIAL_SECONDS, trial_batches
from daskpipe.runtime.wire.inputs import TRIAL_KEY_PREFIX
from tests.runtime.helpers import example, frames, tiny_model, two_stage


@pytest.fixture(scope="module")
def cluster_client():
    with EmulatedCluster({"L4": 1, "T4": 1}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        yield cluster, client


def deploy(client, slo_ms: float):
    profile, plan = two_stage(stage_ms=(0.5, 0.5), slo_ms=slo_ms)
    return daskpipe.deploy(client, {"tiny": tiny_model()}, example_inputs={"tiny": example()}, plan=plan, profiles={"tiny": profile})


def test_a_loose_slo_is_decided_on_the_pings_alone(cluster_client):
    _, client = cluster_client
    with deploy(client, slo_ms=5000.0) as svc:
        assert svc.status()["tiny"]["control"]["batches"] == 0  # no trial: nothing ran before the first request


@pytest.mark.parametrize("slo_ms", [10.0, 200.0])
def test_a_tight_slo_is_served_on_the_trials_measured_tail_or_refused_by_it(cluster_client, slo_ms):
    """Both SLOs leave a lone request (1 ms) less headroom than a trial is skipped for, so the
    deploy sends its trial. Accepted, its margin is the p99 of every one of the trial's batches
    (the slow ones too: the gray watch leaves trial batches alone) and none of them counts as a
    request; refused (the machine is busy: 10 ms may be), the smallest SLO it names is over the SLO
    asked. 200 ms is accepted on any machine this suite runs on."""
    _, client = cluster_client
    try:
        svc = deploy(client, slo_ms=slo_ms)
    except DeployError as exc:
        smallest = re.search(r"the smallest SLO it can serve is ([0-9.]+) ms", str(exc))
        assert slo_ms < 200.0 and smallest and float(smallest.group(1)) > slo_ms, str(exc)
        assert f"a trial of {TRIAL_BATCHES} batches" in str(exc)
        return
    with svc:
        status = svc.status()["tiny"]
        control = status["control"]
        assert control["batches"] == TRIAL_BATCHES and status["submitted"] == status["completed"] == 0, status
        assert min(control["total_p99_ms"], control["cap_ms"]) <= control["margin_ms"] * 1.001 <= control["cap_ms"] * 1.001, control
        done = svc.map("tiny", frames(8))  # and it serves
        wait(done, timeout=30)
        assert all(f.status == "finished" for f in done)


def test_a_trial_of_large_inputs_or_slow_stages_sends_fewer_batches_never_under_what_a_percentile_needs():
    class Sized:
        def __init__(self, nbytes: int) -> None:
            self.sample_nbytes = nbytes

    assert trial_batches(Sized(64), TRIAL_RATE_MAX) == TRIAL_BATCHES
    assert MIN_BATCHES < trial_batches(Sized(602_112), TRIAL_RATE_MAX) < TRIAL_BATCHES  # a 3x224x224 float image
    assert trial_batches(Sized(6_291_456), TRIAL_RATE_MAX) == MIN_BATCHES  # a 3x512x1024 float frame
    assert trial_batches(Sized(64), 50.0) == 50.0 * TRIAL_SECONDS  # stages of tens of milliseconds: a trial of seconds
    assert trial_batches(Sized(64), 5.0) == MIN_BATCHES  # stages of 100 ms: no fewer than a percentile needs


def test_a_trial_of_fetched_inputs_takes_the_served_path_and_leaves_nothing_held(cluster_client):
    """Samples of 786 KB are fetched from their client when served, so the trial's first stages
    fetch theirs from the deploying client too: the trial sends every batch its rate allows (200
    in its 2 s), where sending them through the scheduler would have stopped at the 85 that
    TRIAL_BYTES lets through; afterwards the client holds no trial input, and the model serves."""
    _, client = cluster_client
    shape = (3, 256, 256)
    profile, plan = two_stage(stage_ms=(5.0, 5.0), slo_ms=200.0, input_shape=shape)
    sample_nbytes = 4 * 3 * 256 * 256
    relayed = TRIAL_BYTES // sample_nbytes
    with daskpipe.deploy(
        client, {"tiny": tiny_model()}, example_inputs={"tiny": example(shape)}, plan=plan, profiles={"tiny": profile}
    ) as svc:
        control = svc.status()["tiny"]["control"]
        assert control["batches"] > relayed, control
        assert not [key for key in HELD.get(client, {}) if key.startswith(TRIAL_KEY_PREFIX)]
        done = svc.map("tiny", frames(4, shape=shape))
        wait(done, timeout=30)
        assert all(f.status == "finished" for f in done)
