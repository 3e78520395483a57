"""Stage workers' environment: no glibc malloc setting (Dask's default halves torch), torch on the
worker's threads, and a deploy-time warning with the fix for a worker that has it wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import dask.config
import pytest
import torch
from distributed import Client, LocalCluster, wait
from torch import nn

import daskpipe
from daskpipe.config import ConfigError
from daskpipe.runtime.cluster import EmulatedCluster
from daskpipe.runtime.worker.environ import (
    ALLOCATOR_VARIABLES,
    SWITCH_INTERVAL_CONFIG,
    WorkerEnvironment,
    compute_thread_setup,
    environments,
    probe_worker,
    shorten_switch_interval,
    stage_worker_environ,
)

DASK_DEFAULT = "65536"  # distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_

pytestmark = pytest.mark.spawn  # what a Nanny hands its worker is the point here


@pytest.fixture
def clean_environ(monkeypatch):
    """Whatever the Nannies of a test write into this process's environment is undone after it."""
    for name in ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _report(**changes) -> WorkerEnvironment:
    fields = {"name": "w", "address": "tcp://127.0.0.1:1", "environ": {}, "nthreads": 1, "torch_threads": 1, "cpus": 2}
    return WorkerEnvironment(**{**fields, **changes})


def test_warnings_name_what_slows_torch_and_the_fix():
    assert _report().warnings() == []
    [allocator] = _report(environ={"MALLOC_TRIM_THRESHOLD_": DASK_DEFAULT}).warnings()
    assert "MALLOC_TRIM_THRESHOLD_=65536" in allocator and "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_: null" in allocator
    assert "daskpipe worker" in allocator
    [tunables] = _report(environ={"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}).warnings()
    assert "glibc.malloc.trim_threshold" in tunables
    [threads] = _report(nthreads=2, torch_threads=1, environ={"OMP_THREAD_LIMIT": "1"}).warnings()
    assert "1 torch thread(s) of the 2" in threads and "OMP_THREAD_LIMIT=1" in threads
    assert _report(nthreads=2, torch_threads=None).warnings() == [], "no compute thread yet: nothing to check"
    [cores] = _report(nthreads=4, torch_threads=4, cpus=2).warnings()
    assert "--nthreads 2" in cores


def test_compute_thread_setup_sets_torch_threads_on_that_thread_only():
    before = torch.get_num_threads()
    with ThreadPoolExecutor(1, initializer=compute_thread_setup, initargs=(2,)) as compute:
        assert compute.submit(torch.get_num_threads).result() == 2
    assert torch.get_num_threads() == before


def test_emulated_workers_start_without_allocator_settings(clean_environ):
    """Even when an earlier Nanny left Dask's value in this process's environment."""
    clean_environ.setenv("MALLOC_TRIM_THRESHOLD_", DASK_DEFAULT)
    with EmulatedCluster({"T4": 1}, nthreads=2, dashboard_address=None) as cluster, Client(cluster) as client:
        [report] = environments(client.run(probe_worker))
    assert not set(ALLOCATOR_VARIABLES) & set(report.environ) and report.warnings() == []
    assert report.nthreads == 2


def test_daskpipe_worker_drops_the_allocator_setting_of_its_shell():
    with LocalCluster(n_workers=0, processes=False, protocol="tcp", dashboard_address=None) as cluster, Client(cluster) as client:
        env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": DASK_DEFAULT}
        process = subprocess.Popen(
            [sys.executable, "-c", "from daskpipe.cli import main; main()", "worker", cluster.scheduler_address, "--emulate", "T4:1"],
            env=env,
        )
        try:
            client.wait_for_workers(1, timeout=60)
            [report] = environments(client.run(probe_worker))
        finally:
            process.terminate()
            process.wait(30)
    assert report.warnings() == [] and "MALLOC_TRIM_THRESHOLD_" not in report.environ


def test_deploy_warns_about_a_worker_with_dasks_default_allocator_setting(clean_environ):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=None) as cluster, Client(cluster) as client:
        with pytest.warns(RuntimeWarning, match="MALLOC_TRIM_THRESHOLD_=65536, which halves torch's CPU throughput"):
            daskpipe.deploy(client, {"tiny": model}, example_inputs={"tiny": torch.randn(1, 8)}, slo_ms={"tiny": 1000.0}).close()


def test_a_slot_computes_on_the_threads_its_worker_was_given(clean_environ):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    with (
        stage_worker_environ(),
        LocalCluster(n_workers=1, threads_per_worker=2, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        [before] = environments(client.run(probe_worker))
        [switch_before] = client.run(sys.getswitchinterval).values()
        with daskpipe.deploy(client, {"tiny": model}, example_inputs={"tiny": torch.randn(1, 8)}, slo_ms={"tiny": 1000.0}) as service:
            assert service.profiles["tiny"].meta["cpu_threads"] == 2, "profiled as it serves"
            wait(service.map("tiny", [torch.randn(1, 8)] * 4))  # the slot's compute thread starts with its first batch
            [after] = environments(client.run(probe_worker))
            [switch_after] = client.run(sys.getswitchinterval).values()
    assert before.torch_threads is None, "no compute thread before the first batch"
    assert after.torch_threads == 2 and before.environ.get("OMP_NUM_THREADS") == "1", "Dask's OMP_NUM_THREADS=1 stays for its task threads"
    assert switch_before == 0.005 and switch_after == pytest.approx(0.0005), (
        "the event loop waits at most 0.5 ms for the compute thread's GIL"
    )


@pytest.fixture
def switch_interval():
    saved = sys.getswitchinterval()
    yield
    sys.setswitchinterval(saved)


def test_the_switch_interval_is_configurable_and_a_bad_one_is_refused_changing_nothing(switch_interval):
    sys.setswitchinterval(0.005)
    with dask.config.set({SWITCH_INTERVAL_CONFIG: None}):
        assert shorten_switch_interval() == 0.005, "null leaves Python's"
    for bad in ("fast", 0, True, 1.0):
        with dask.config.set({SWITCH_INTERVAL_CONFIG: bad}), pytest.raises(ConfigError, match=f"^{SWITCH_INTERVAL_CONFIG}: "):
            shorten_switch_interval()
        assert sys.getswitchinterval() == 0.005
    with dask.config.set({SWITCH_INTERVAL_CONFIG: 0.0002}):
        assert shorten_switch_interval() == pytest.approx(0.0002) == sys.getswitchinterval()
