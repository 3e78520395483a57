"""Models, hand-made plans and clusters for the runtime tests.

The plans are made by hand so each test knows its pipeline (two stages on two emulated pools,
batch 4) and its capacity exactly; one test goes through the real profiler and planner.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster
from torch import nn

from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan
from daskpipe.profiles.fx import segment_model
from daskpipe.profiles.model import Profile
from daskpipe.runtime.plugin import DaskpipeSchedulerPlugin
from daskpipe.sched.registry import register
from tests.runtime.fifo import FifoDispatcher

INPUT = (3, 16, 16)
BATCH = 4


class TinyCNN(nn.Module):
    """Two convolutional stages; an input scaled past fp16's range fails stage 2's assertion."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.tail = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(x)
        torch._assert(y.abs().max() < 1e4, "poisoned input")
        return self.tail(y)


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyCNN().eval()


def example() -> torch.Tensor:
    return torch.randn(1, *INPUT)


def two_stage(
    name: str = "tiny", *, stage_ms: tuple[float, float] = (4.0, 6.0), slo_ms: float = 500.0, gpus: tuple[str, str] = ("L4", "T4")
) -> tuple[Profile, Plan]:
    """A profile and a plan: blocks [0, 1) on one ``gpus[0]`` slot, [1, 2) on one ``gpus[1]`` slot, batch 4.

    Block ``i`` takes ``stage_ms[i] * (1 + (b - 1) / 4)`` ms at batch ``b`` on either GPU type.
    """
    segmented = segment_model(tiny_model(), example())
    bounds = [0, 2, segmented.num_segments]
    blocked = segmented.cut(bounds)
    per_block = np.array([[ms * 1e3 * (1 + (b - 1) / BATCH) for b in range(1, BATCH + 1)] for ms in stage_ms])
    profile = Profile(
        model=name,
        slo_us=slo_ms * 1e3,
        num_blocks=2,
        latency_us={(gpu, 1): per_block for gpu in gpus},
        boundary_bytes=tuple(float(b) for b in blocked.boundary_bytes),
        input_shape=blocked.input_shape,
        boundary_shapes=tuple(blocked.boundary_shapes),
        meta={"segment_boundaries": bounds},
    )
    at_batch = per_block[:, BATCH - 1]
    throughput = BATCH / (at_batch.max() * 1e-6)
    partitions = tuple(Partition(blocks=(i, i + 1), gpu=gpus[i], slices=1, vgpus=1, latency_us=float(at_batch[i])) for i in range(2))
    pipeline = Pipeline(batch_size=BATCH, throughput=throughput, partitions=partitions)
    plan = Plan(
        objective=throughput, models=(ModelPlan(name=name, slo_us=slo_ms * 1e3, weight=1.0, throughput=throughput, pipelines=(pipeline,)),)
    )
    return profile, plan


def open_loop(submit: Callable[[], Any], rate: float, seconds: float, seed: int = 0) -> list:
    """Call ``submit`` at Poisson times of ``rate`` per second for ``seconds`` (open loop: no call
    waits for an earlier one to end); what the calls returned."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, size=int(rate * seconds * 2) + 10)
    due = time.monotonic() + np.cumsum(gaps)
    out = []
    for at in due[due < due[0] - gaps[0] + seconds]:
        time.sleep(max(0.0, at - time.monotonic()))
        out.append(submit())
    return out


def with_test_dispatcher(client: Client, scheduler) -> None:
    """Install the plugin from the client, and register the tests' FIFO dispatcher as "fifo" (the
    scheduler runs in this process)."""
    client.register_plugin(DaskpipeSchedulerPlugin())
    register("fifo", FifoDispatcher)


@pytest.fixture(scope="module")
def cpu_cluster():
    """Two plain CPU workers in this process, with the plugin and the FIFO test dispatcher."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        with_test_dispatcher(client, cluster.scheduler)
        yield cluster, client


def tls_security(directory: Path):
    """A throwaway CA and one certificate (with its key) for every party, written to ``directory``:
    the ``Security`` that makes scheduler, workers and clients speak ``tls://`` and refuse plain TCP."""
    import trustme
    from distributed.security import Security

    ca = trustme.CA()
    ca_file, cert_file = directory / "ca.pem", directory / "node.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(str(cert_file))
    cert = str(cert_file)
    return Security(tls_ca_file=str(ca_file), tls_scheduler_cert=cert, tls_worker_cert=cert, tls_client_cert=cert, require_encryption=True)


@pytest.fixture(scope="module", params=["tcp", "tls"])
def emulated_inproc(request, tmp_path_factory):
    """One emulated L4 and one emulated T4 slot in this process, with the FIFO test dispatcher;
    once over TCP and once over TLS with certificates (every comm: client, scheduler, worker to worker)."""
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

    from daskpipe.runtime import gpu
    from daskpipe.runtime.worker import worker_specs

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
