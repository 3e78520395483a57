"""Clusters for the runtime tests (their models and plans are in ``tests/runtime/helpers.py``)."""

from __future__ import annotations

import gc

import pytest
from distributed import Client, LocalCluster

from daskpipe.runtime.gctune import CPYTHON_THRESHOLDS
from tests.runtime.helpers import tls_security, with_test_dispatcher


@pytest.fixture
def default_thresholds():
    """CPython's own GC thresholds in this process for the test, whatever an earlier test raised them to."""
    saved = gc.get_threshold()
    gc.set_threshold(*CPYTHON_THRESHOLDS)
    yield
    gc.set_threshold(*saved)


@pytest.fixture(scope="module")
def cpu_cluster():
    """Two plain CPU workers in this process, with the plugin and the FIFO test dispatcher."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        with_test_dispatcher(client, cluster.scheduler)
        yield cluster, client


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test on ``emulated_inproc`` runs over TCP and over TLS, or over the protocols its
    ``protocols`` marker names: a check of what the scheduler or a stage does with a message, not of
    how it travels, runs over TCP alone (TLS wraps the same comms: tests/runtime/test_tls.py)."""
    if "emulated_inproc" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("protocols")
        metafunc.parametrize("emulated_inproc", marker.args if marker else ["tcp", "tls"], indirect=True, scope="module")


@pytest.fixture(scope="module")
def emulated_inproc(request, tmp_path_factory):
    """One emulated L4 and one emulated T4 slot in this process, with the FIFO test dispatcher, over
    ``request.param``: TCP, or TLS with certificates (every comm: client, scheduler, worker to worker)."""
    from daskpipe.runtime.cluster import EmulatedCluster

    security = tls_security(tmp_path_factory.mktemp("tls")) if request.param == "tls" else None
    with (
        EmulatedCluster({"L4": 1, "T4": 1}, processes=False, dashboard_address=None, protocol=request.param, security=security) as cluster,
        Client(cluster) as client,
    ):
        with_test_dispatcher(client, cluster.scheduler)
        yield cluster, client


@pytest.fixture
def fake_gpu_cluster(monkeypatch, tmp_path):
    """Real (not emulated) daskpipe slots in this process, their GPUs faked at the ``DASKPIPE_FAKE_GPUS``
    seam: an L4 cut into two MPS slices and a whole T4, on one server: two GPU types, two slice sizes;
    and one emulated A10 on another server.

    The workers carry the names and resources ``daskpipe worker`` gives them; the CUDA set-up
    (per-process variables) is what an in-process worker cannot have, and the fake GPUs compute on the host."""
    import os

    from distributed import Worker

    from daskpipe.runtime.worker import gpu
    from daskpipe.runtime.worker.slots import worker_specs

    monkeypatch.setenv(gpu.FAKE_GPUS_ENV, "NVIDIA L4=23034,Tesla T4=15360")
    os.mkfifo(tmp_path / "control")  # the MPS daemon's control pipe: slices > 1 need it
    monkeypatch.setenv(gpu.MPS_PIPE_ENV, str(tmp_path))
    slots = worker_specs(slices={"L4": 2}, server="gpu-a") + worker_specs(emulate={"A10": 1}, server="laptop")
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster:
        for slot in slots:
            cluster.worker_spec[slot.name] = {"cls": Worker, "options": {"nthreads": 1, "name": slot.name, "resources": slot.resources}}
        cluster.scale(len(slots))
        with Client(cluster) as client:
            client.wait_for_workers(len(slots))
            yield cluster, client
