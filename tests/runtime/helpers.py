"""Models, hand-made plans and serving runs shared by the runtime tests.

The plans are made by hand so each test knows its pipeline (two stages on two emulated pools,
batch 4) and its capacity exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from distributed import Client, wait
from torch import nn

import daskpipe
from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan
from daskpipe.profiles.fx import segment_model
from daskpipe.profiles.model import Profile
from daskpipe.runtime.scheduler.plugin import DaskpipeSchedulerPlugin
from daskpipe.sched.api import Placement
from daskpipe.sched.ppipe import PPipeDispatcher, PPipeSettings
from daskpipe.sched.registry import register
from tests.helpers import paced, wait_until
from tests.runtime.fifo import FifoDispatcher

INPUT = (3, 16, 16)
LARGE_INPUT = (3, 96, 96)
"""A sample of 110,592 bytes: an input over 64 KiB travels as a Dask frame of its own."""
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


def example(shape: tuple[int, ...] = INPUT) -> torch.Tensor:
    return torch.randn(1, *shape)


def two_stage(
    name: str = "tiny",
    *,
    stage_ms: tuple[float, float] = (4.0, 6.0),
    slo_ms: float = 500.0,
    gpus: tuple[str, str] = ("L4", "T4"),
    input_shape: tuple[int, ...] = INPUT,
    model: nn.Module | None = None,
    batch: int = BATCH,
    vgpus: int = 1,
) -> tuple[Profile, Plan]:
    """A profile and a plan of ``model`` (:func:`tiny_model`'s by default): blocks [0, 1) on
    ``vgpus`` ``gpus[0]`` slots, [1, 2) on ``vgpus`` ``gpus[1]`` slots, at ``batch``; its first block
    is its first two segments.

    Block ``i`` takes ``stage_ms[i] * (1 + (b - 1) / batch)`` ms at batch ``b`` on either GPU type.
    """
    segmented = segment_model(model if model is not None else tiny_model(), example(input_shape))
    bounds = [0, 2, segmented.num_segments]
    blocked = segmented.cut(bounds)
    per_block = np.array([[ms * 1e3 * (1 + (b - 1) / batch) for b in range(1, batch + 1)] for ms in stage_ms])
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
    return profile, two_pool_plan(profile, 1, gpus, batch, vgpus)


def two_pool_plan(profile: Profile, boundary: int, gpus: tuple[str, str] = ("L4", "T4"), batch: int = BATCH, vgpus: int = 1) -> Plan:
    """One pipeline of ``profile``'s model at ``batch``: blocks [0, boundary) on ``vgpus`` ``gpus[0]``
    slots, the rest on ``vgpus`` ``gpus[1]`` slots."""
    spans = [(0, boundary), (boundary, profile.num_blocks)]
    latency = [profile.latency(gpu, 1, batch, start, end) for gpu, (start, end) in zip(gpus, spans)]
    throughput = vgpus * batch / (max(latency) * 1e-6)
    partitions = tuple(Partition(blocks=span, gpu=gpu, slices=1, vgpus=vgpus, latency_us=us) for span, gpu, us in zip(spans, gpus, latency))
    pipeline = Pipeline(batch_size=batch, throughput=throughput, partitions=partitions)
    model = ModelPlan(name=profile.model, slo_us=profile.slo_us, weight=1.0, throughput=throughput, pipelines=(pipeline,))
    return Plan(objective=throughput, models=(model,))


PAPER_PPIPE = "ppipe-paper"
"""PPipe whose batches short of their size always wait for their last moment (``join_chance=None``),
as the paper's do: for tests that need requests to stay queued, or a lone one sent late."""


def paper_ppipe(model_plan: ModelPlan, placement: Placement, profile: Profile, *, bw_gbps: float) -> PPipeDispatcher:
    return PPipeDispatcher(model_plan, placement, profile, bw_gbps=bw_gbps, settings=PPipeSettings(join_chance=None))


def with_test_dispatcher(client: Client, scheduler) -> None:
    """Install the plugin from the client, and register the tests' FIFO dispatcher as "fifo" and
    the paper's PPipe as :data:`PAPER_PPIPE` (the scheduler runs in this process)."""
    client.register_plugin(DaskpipeSchedulerPlugin())
    register("fifo", FifoDispatcher)
    register(PAPER_PPIPE, paper_ppipe)


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


def frames(n: int, seed: int = 1, shape: tuple[int, ...] = INPUT) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, *shape, generator=generator) for _ in range(n)]


def reference(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The unpartitioned model, with the fp16 hand-over at the stage boundary."""
    model = tiny_model()
    with torch.inference_mode():
        return [model.tail(model.head(x).half().float()) for x in xs]


def counted(svc, model: str, ended: int, timeout: float = 10.0) -> dict:
    """``svc.status()[model]`` once the scheduler has counted ``ended`` requests as ended (completed,
    dropped or failed): a last stage's worker resolves the futures, and its completion reaches the
    scheduler just after, so a future in hand may not be counted yet."""

    def status() -> dict | None:
        now = svc.status()[model]
        return now if now["completed"] + sum(now["dropped"].values()) + now["failed"] >= ended else None

    return wait_until(status, timeout=timeout, what=f"the scheduler to count {ended} requests of {model} as ended")


def deploy_two_stage(client, *, k: float = 1.0, dispatcher: str = "ppipe", input_shape: tuple[int, ...] = INPUT, **plan_args):
    profile, plan = two_stage(input_shape=input_shape, **plan_args)
    return daskpipe.deploy(
        client,
        {"tiny": tiny_model()},
        example_inputs={"tiny": example(input_shape)},
        plan=plan,
        profiles={"tiny": profile},
        time_dilation=k,
        dispatcher=dispatcher,
    )


def serve_at_load_factor(protocol: str, k: float, security=None) -> None:
    """A real LocalCluster with processes: two emulated pools, PPipe's dispatcher, 0.7 of the plan's capacity.

    A few requests warm the path first (the first batches through fresh worker processes meet
    one-time costs of Dask and torch); attainment counts the Poisson run that follows. The
    feature maps must have travelled between the workers over the cluster's protocol.
    """
    from daskpipe.runtime.cluster import EmulatedCluster
    from daskpipe.runtime.worker.stage import feature_map_peers

    with (
        EmulatedCluster({"L4": 1, "T4": 1}, processes=True, protocol=protocol, dashboard_address=None, security=security) as cluster,
        Client(cluster) as client,
    ):
        with_test_dispatcher(client, cluster.scheduler)
        with deploy_two_stage(client, k=k, slo_ms=50.0, dispatcher="ppipe") as svc:
            wait(svc.map("tiny", frames(12, seed=2)), timeout=60)
            before = counted(svc, "tiny", 12)
            capacity = svc.plan.model("tiny").throughput / k
            xs = frames(100)  # 99% of 100 allows one late request, as of 150: two thirds of the wall time
            inputs = iter(xs)
            futures = paced(lambda: svc.submit("tiny", next(inputs)), 0.7 * capacity, count=len(xs))
            wait(futures, timeout=60)
            for out, ref in zip(client.gather(futures), reference(xs)):
                torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
            after = counted(svc, "tiny", 12 + len(xs))
            submitted, completed, on_time = (after[c] - before[c] for c in ("submitted", "completed", "on_time"))
            assert submitted == completed == len(xs)
            assert on_time / submitted >= 0.99, after
            assert after["batches"] - before["batches"] < len(xs)  # it batched
            scheme = cluster.scheduler_address.split("://")[0]
            peers = client.run(lambda dask_worker: feature_map_peers(dask_worker))
            assert any(peers.values()) and all(a.startswith(f"{scheme}://") for addresses in peers.values() for a in addresses), peers


def request_outcomes(scheduler, model: str = "tiny") -> dict[str, float]:
    """``/metrics``' requests_total of ``model`` by outcome, its drops of every reason summed as
    "dropped", and each reason's as "dropped/<reason>"."""
    from daskpipe.dashboard.prometheus import DaskpipeCollector

    families = {family.name: family for family in DaskpipeCollector(scheduler).collect()}
    outcomes = {
        sample.labels["outcome"]: sample.value for sample in families["dask_daskpipe_requests"].samples if sample.labels["model"] == model
    }
    drops = {
        f"dropped/{sample.labels['reason']}": sample.value
        for sample in families["dask_daskpipe_requests_dropped"].samples
        if sample.labels["model"] == model
    }
    return {**outcomes, "dropped": sum(drops.values()), **drops}
