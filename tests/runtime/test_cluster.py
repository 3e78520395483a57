"""EmulatedCluster: workers that follow daskpipe's contract, on TCP and (when installed) UCX."""

from __future__ import annotations

import os

import dask
import pytest
from distributed import Client

from daskpipe.runtime.cluster import EmulatedCluster, emulated_slots, inject_mps_fault
from daskpipe.runtime.wire import protocols
from daskpipe.runtime.wire.protocols import resolve_protocol, ucx_available
from daskpipe.runtime.worker.slots import WorkerSpecError
from tests.helpers import wait_until


def _workers(client: Client) -> dict[str, dict[str, float]]:
    return {w["name"]: w["resources"] for w in client.scheduler_info(n_workers=-1)["workers"].values()}


def test_slots_are_dealt_onto_servers():
    slots = emulated_slots({"L4": 2, "T4": 3}, slices={"T4": 2}, servers=2)
    assert [s.name for s in slots] == [
        "node-0/L4-0/0",
        "node-0/L4-1/0",
        "node-0/T4-2/0",
        "node-0/T4-2/1",
        "node-1/T4-0/0",
        "node-1/T4-0/1",
        "node-1/T4-1/0",
        "node-1/T4-1/1",
    ]


@pytest.mark.parametrize(
    "gpus, kwargs, match",
    [({}, {}, "at least one GPU"), ({"L4": 1}, {"servers": 0}, "servers"), ({"X9": 1}, {}, "unknown GPU type")],
)
def test_bad_cluster_specs(gpus, kwargs, match):
    with pytest.raises(WorkerSpecError, match=match):
        emulated_slots(gpus, **kwargs)


def test_in_process_cluster_follows_the_contract():
    with EmulatedCluster({"L4": 1, "T4": 1}, slices={"T4": 2}, processes=False, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            workers = _workers(client)
            assert sorted(workers) == ["node-0/L4-0/0", "node-0/T4-1/0", "node-0/T4-1/1"]
            assert workers["node-0/T4-1/1"] == {
                "daskpipe.slot": 1,
                "daskpipe.gpu.T4": 1,
                "daskpipe.slices.2": 1,
                "daskpipe.emulated": 1,
            }
            slots = client.run(lambda dask_worker: dask_worker.plugins["daskpipe-slot"].slot.name)
            assert sorted(slots.values()) == sorted(workers)
            with pytest.raises(WorkerSpecError, match="--emulate"):
                cluster.scale(4)
            cluster.scale(3)  # no change: allowed


def test_unknown_protocol_is_refused():
    with pytest.raises(ValueError, match="protocol must be one of"):
        resolve_protocol("udp")


def test_ucx_falls_back_to_tcp_with_a_message(monkeypatch):
    monkeypatch.setattr(protocols, "ucx_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="distributed-ucxx.*falling back to tcp"):
        assert resolve_protocol("ucx") == "tcp"
    with pytest.warns(RuntimeWarning, match="falling back"):
        with EmulatedCluster({"L4": 1}, processes=False, protocol="ucx", dashboard_address=None) as cluster:
            assert cluster.scheduler_address.startswith("tcp://")


@pytest.mark.heavy
@pytest.mark.skipif(not ucx_available(), reason="distributed-ucxx is not installed (pip install 'daskpipe[ucx]')")
def test_ucx_cluster_moves_data_worker_to_worker():
    import numpy as np

    with EmulatedCluster({"L4": 1, "T4": 1}, protocol="ucx", dashboard_address=None) as cluster:
        assert cluster.scheduler_address.startswith("ucx://")
        with Client(cluster) as client:
            by_name = {w["name"]: address for address, w in client.scheduler_info()["workers"].items()}
            ones = client.submit(np.ones, 1_000_000, workers=[by_name["node-0/L4-0/0"]])
            total = client.submit(np.sum, ones, workers=[by_name["node-0/T4-1/0"]])
            assert total.result() == 1_000_000


def test_mps_fault_takes_down_every_slice_of_that_gpu_only():
    """M1: a fatal MPS fault reaches every client on the GPU; the Nannies bring the slices back, even
    where Dask would close a lost worker's Nanny at once (a restart importing torch on a loaded
    machine outlasts its default 15 s)."""
    gives_up_at_once = dask.config.set({"distributed.deploy.lost-worker-timeout": "0s"})
    with gives_up_at_once, EmulatedCluster({"L4": 1, "T4": 1}, slices={"T4": 2}, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            before = _pids(client)
            assert len(set(before.values())) == 3, "each slot runs in its own process"
            assert inject_mps_fault(client, "node-0/T4-1") == ["node-0/T4-1/0", "node-0/T4-1/1"]
            after = _pids(client, changed_from=before, expected=2)
            assert after["node-0/L4-0/0"] == before["node-0/L4-0/0"], "another GPU's worker was hit"
            with pytest.raises(ValueError, match="no worker runs on GPU"):
                inject_mps_fault(client, "node-0/T4-9")


def _pids(client: Client, *, changed_from: dict[str, int] | None = None, expected: int = 0) -> dict[str, int]:
    """Worker name -> pid, once all three workers are up and ``expected`` of them have new pids."""

    def ready() -> dict[str, int] | None:
        try:
            pids = client.run(lambda dask_worker: (dask_worker.name, os.getpid()))
        except Exception:  # a worker left between listing and the call
            pids = {}
        by_name = dict(pids.values())
        fresh = sum(by_name.get(name) != pid for name, pid in (changed_from or {}).items())
        return by_name if len(by_name) == 3 and fresh >= expected else None

    return wait_until(ready, timeout=120, interval=0.2, what=f"the three workers back, {expected} in new processes")
