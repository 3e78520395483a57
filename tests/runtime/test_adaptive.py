"""Load-proportional autoscaling: Dask's Adaptive follows the daskpipe plugin's advice, by GPU type."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from distributed import Client, wait

import daskpipe
from daskpipe.profiles.small_model import estimated_profile, small_cnn
from daskpipe.runtime.adaptive import DaskpipeAdaptive, add_emulated_gpus
from daskpipe.runtime.cluster import EmulatedCluster
from daskpipe.runtime.scheduler.elastic.state import ElasticSettings
from daskpipe.runtime.scheduler.plugin import plugin_of
from daskpipe.runtime.worker.slots import WorkerSpecError
from tests.helpers import paced, wait_until
from tests.runtime.helpers import counted

K = 2000.0  # time dilation: three T4 serve about 110 requests/s


@pytest.mark.timeout(300)
def test_adaptive_drains_idle_gpus_at_low_load_and_adds_gpus_of_the_served_type_under_overload():
    model, x = small_cnn(), torch.randn(1, 3, 32, 32)
    estimated = estimated_profile(model, x, gpus=("T4",), name="cnn")
    profile = replace(estimated, slo_us=4 * estimated.slo_us)
    settings = ElasticSettings(debounce_s=0.3, load_window_s=3.0, scale_cooldown_s=3.0, idle_grace_s=1.0)
    with EmulatedCluster({"T4": 3}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        svc = daskpipe.deploy(
            client, {"cnn": model}, example_inputs={"cnn": x}, profiles={"cnn": profile}, time_dilation=K, elastic=settings
        )
        plugin = plugin_of(cluster.scheduler)
        capacity = svc.plan.model("cnn").throughput / K
        assert sum(q.vgpus for p in svc.plan.model("cnn").pipelines for q in p.partitions) == 3
        adaptive = cluster.adapt(Adaptive=DaskpipeAdaptive, minimum=1, maximum=4, interval="500ms", wait_count=1)
        with svc:
            futures = []

            def workers_after_a_second_at(load: float) -> int:
                futures.extend(paced(lambda: svc.submit("cnn", x), load * capacity, seconds=1.0, poisson=False))
                return len(cluster.scheduler.workers)

            # low load: two of the three T4 are surplus; they are planned out, then retired
            wait_until(lambda: workers_after_a_second_at(0.05) == 1, timeout=60, interval=0, what="the surplus T4 retired")
            assert sum(q.vgpus for p in svc.plan.model("cnn").pipelines for q in p.partitions) == 1
            served_by = {a for _, _, a in plugin.models.ledgers["cnn"].stages}
            assert served_by == set(cluster.scheduler.workers)  # the one left is the one serving

            # overload of the one left: more T4 are asked for, join, and are planned in
            wait_until(lambda: workers_after_a_second_at(0.8) >= 2, timeout=90, interval=0, what="more T4 to join")
            assert {s.gpu for s in plugin.models.slots.values()} == {"T4"}
            wait_until(
                lambda: sum(q.vgpus for p in svc.plan.model("cnn").pipelines for q in p.partitions) >= 2,
                timeout=60,
                interval=0.2,
                what="the joined T4 planned in",
            )
            assert any(entry[1]["status"] == "up" for entry in adaptive.log) and any(entry[1]["status"] == "down" for entry in adaptive.log)
            adaptive.stop()
            wait(futures, timeout=60)
            status = counted(svc, "cnn", len(futures))
            ended = status["completed"] + sum(status["dropped"].values()) + status["failed"]
            assert ended == status["submitted"] == len(futures)  # nothing lost through the scaling
            assert set(status["dropped"]) <= {"deadline", "overload"}


def test_adding_emulated_gpus_refuses_a_bad_count():
    with EmulatedCluster({"T4": 1}, processes=False, dashboard_address=None) as cluster:
        with pytest.raises(WorkerSpecError, match="count >= 1"):
            add_emulated_gpus(cluster, {"A10": 0})
        with pytest.raises(WorkerSpecError):
            add_emulated_gpus(cluster, {"NOPE-GPU": 1})
