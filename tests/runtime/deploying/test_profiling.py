"""Deploy-time profiling: one task per kind on a worker of that kind, all at once, and the profile store."""

from __future__ import annotations

import re
import time

import pytest
import torch
from distributed import get_task_stream

import daskpipe
from daskpipe.profiles.store import MIN_LATENCY_US, ProfileStore
from daskpipe.runtime.client.service import inventory
from daskpipe.runtime.deploying.profiling import PROFILE_KEY_PREFIX, ProfilingOptions, profile_on_cluster
from daskpipe.runtime.errors import DeployError
from tests.profiles.helpers import BAD_ENTRIES
from tests.runtime.helpers import example, tiny_model

pytestmark = pytest.mark.timeout(120)


def profiling_tasks(stream) -> list[dict]:
    return [t for t in stream.data if str(t["key"]).startswith(PROFILE_KEY_PREFIX)]


def compute_window(task: dict) -> tuple[float, float]:
    (window,) = [s for s in task["startstops"] if s["action"] == "compute"]
    return window["start"], window["stop"]


def test_each_kind_is_profiled_once_on_its_own_worker_all_at_once_and_the_plan_says_measured(fake_gpu_cluster):
    cluster, client = fake_gpu_cluster
    slots = inventory(client)
    kind_of = {s.address: (s.gpu, s.slices) for s in slots}
    assert set(kind_of.values()) == {("L4", 2), ("T4", 1), ("A10", 1)}
    with get_task_stream(client) as stream:
        svc = daskpipe.deploy(
            client,
            {"tiny": tiny_model()},
            example_inputs={"tiny": example()},
            slo_ms={"tiny": 500.0},
            profiling=ProfilingOptions(num_blocks=2, batch_sizes=(1, 32, 64, 128)),
        )
    with svc:
        tasks = profiling_tasks(stream)
        ran_on = sorted((kind_of[t["worker"]], str(t["key"]).split("-v")[0].rsplit("-", 1)[1]) for t in tasks)
        assert ran_on == [(("L4", 2), "L4"), (("T4", 1), "T4")], "one task per real kind, on a worker of that kind"
        (a_start, a_stop), (b_start, b_stop) = (compute_window(t) for t in tasks)
        assert a_start < b_stop and b_start < a_stop, "kinds on different GPUs are profiled at the same time"
        profile = svc.profiles["tiny"]
        assert (profile.origin("L4", 2), profile.origin("T4", 1), profile.origin("A10", 1)) == ("measured", "measured", "estimated")
        assert profile.meta["calibration"]["calibrated_on"] == ["L4/2", "T4/1"]
        parts = [q for m in svc.plan.models for p in m.pipelines for q in p.partitions]
        assert parts and all(q.table == profile.origin(q.gpu, q.slices) for q in parts)
        assert [q["table"] for m in svc.plan.to_dict()["models"] for p in m["pipelines"] for q in p["partitions"]] == [
            q.table for q in parts
        ]
        x = example()
        with torch.inference_mode():
            torch.testing.assert_close(
                svc.submit("tiny", x).result(timeout=30), tiny_model()(x), atol=1e-4, rtol=1e-4
            )  # and it serves, the fake GPUs computing on the host


def test_emulated_kinds_are_estimated_and_marked(emulated_inproc):
    cluster, client = emulated_inproc
    with get_task_stream(client) as stream:
        result = profile_on_cluster(client, inventory(client), "tiny", tiny_model(), example(), slo_us=None, num_blocks=2, batch_sizes=4)
    assert not profiling_tasks(stream) and result.profiling_tasks == 0
    assert {result.profile.origin(g, v) for g, v in result.profile.latency_us} == {"estimated"}


def test_the_store_serves_a_second_profile_and_a_changed_weight_or_input_shape_misses(cpu_cluster, tmp_path):
    cluster, client = cpu_cluster
    store = ProfileStore(tmp_path / "store")
    slots = inventory(client)

    def profiled(model, x):
        with get_task_stream(client) as stream:
            result = profile_on_cluster(client, slots, "tiny", model, x, slo_us=None, num_blocks=2, batch_sizes=2, store=store)
        assert result.profiling_tasks == len(profiling_tasks(stream))
        return result

    first = profiled(tiny_model(), example())
    assert first.profiling_tasks == 1 and len(store) == 1
    again = profiled(tiny_model(), example())
    assert again.profiling_tasks == 0, "the same model, input and cluster: no profiling"
    assert (again.profile.table("cpu", 1) == first.profile.table("cpu", 1)).all() and again.profile.origin("cpu", 1) == "measured"
    changed = tiny_model()
    with torch.no_grad():
        changed.head[0].weight[0, 0, 0, 0] += 1.0
    assert profiled(changed, example()).profiling_tasks == 1, "a changed weight misses"
    assert profiled(tiny_model(), torch.randn(1, 3, 20, 20)).profiling_tasks == 1, "a changed input shape misses"
    assert len(store) == 3


@pytest.mark.parametrize("spoil", BAD_ENTRIES.values(), ids=BAD_ENTRIES)
def test_a_bad_store_entry_is_moved_aside_and_its_kind_measured_again(cpu_cluster, tmp_path, spoil):
    cluster, client = cpu_cluster
    store = ProfileStore(tmp_path)
    slots = inventory(client)

    def profiled():
        return profile_on_cluster(client, slots, "tiny", tiny_model(), example(), slo_us=None, num_blocks=2, batch_sizes=2, store=store)

    first = profiled()
    (entry,) = tmp_path.glob("*.json")
    spoil(entry)
    again = profiled()
    assert again.profiling_tasks >= 1, "measured again (twice when a busy machine spoiled a timing), not planned on the bad entry"
    table = again.profile.table("cpu", 1)
    assert table.shape == first.profile.table("cpu", 1).shape and table.min() >= MIN_LATENCY_US
    assert len(list(tmp_path.glob("*.rejected"))) == 1 and not list(tmp_path.glob("*.tmp"))
    assert entry.is_file() and profiled().profiling_tasks == 0, "the new entry serves the next deploy"


def test_a_table_timed_on_a_busy_machine_is_said_and_not_stored(cpu_cluster, tmp_path, monkeypatch, caplog):
    from daskpipe.profiles import profiler

    cluster, client = cpu_cluster
    monkeypatch.setattr(profiler, "BUSY_CPU_SHARE", 1.01)  # no thread is on its CPU 101% of the time: every timing is busy
    store = ProfileStore(tmp_path)
    slots = inventory(client)
    result = profile_on_cluster(client, slots, "tiny", tiny_model(), example(), slo_us=None, num_blocks=2, batch_sizes=2, store=store)
    assert "the machine was busy while profiling" in result.profile.meta["measurements"]["cpu/1"]["timing"]["warning"]
    assert "the table is inflated" in caplog.text and len(store) == 0, "an inflated table is not kept for the next deploy"


def test_the_cpu_worker_processes_of_a_host_time_their_kind_together_and_the_table_is_their_median():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, Client(cluster) as client:
        slots = inventory(client)
        with get_task_stream(client) as stream:
            # 64x64 images: each worker's timing lasts long enough (~0.1 s) that the two processes'
            # start skew on a loaded machine (its tasks of 16x16 images once missed by 1 ms) stays inside it
            result = profile_on_cluster(client, slots, "tiny", tiny_model(), example((3, 64, 64)), slo_us=None, num_blocks=2, batch_sizes=4)
        tasks = profiling_tasks(stream)
        assert sorted(t["worker"] for t in tasks) == sorted(s.address for s in slots), "every CPU worker of the kind"
        (a_start, a_stop), (b_start, b_stop) = (compute_window(t) for t in tasks)
        assert a_start < b_stop and b_start < a_stop, "at the same time, as they serve"
        profile = result.profile
        assert profile.meta["timed_together"] == 2 and profile.meta["measurements"]["cpu/1"]["timed_together"] == 2
        table = profile.table("cpu", 1)
        assert table.shape == (profile.num_blocks, 4) and (table > 0).all()


def test_a_kind_timed_on_several_workers_keeps_the_median_of_each_cell():
    import numpy as np

    from daskpipe.profiles.model import Profile
    from daskpipe.runtime.deploying.profiling import median_profile

    def timed(scale: float) -> Profile:
        return Profile(
            model="m", slo_us=1e5, num_blocks=2, latency_us={("cpu", 1): np.array([[1.0, 2.0], [3.0, 4.0]]) * scale}, boundary_bytes=(8.0,)
        )

    merged = median_profile([timed(1.0), timed(1.5), timed(0.9)], ("cpu", 1))
    np.testing.assert_allclose(merged.table("cpu", 1), [[1.0, 2.0], [3.0, 4.0]])
    assert merged.meta["timed_together"] == 3
    alone = timed(2.0)
    assert median_profile([alone], ("cpu", 1)) is alone


def test_a_kind_that_cannot_be_profiled_is_excluded_with_the_reason(fake_gpu_cluster, monkeypatch, caplog):
    cluster, client = fake_gpu_cluster
    from daskpipe.runtime.worker import gpu

    monkeypatch.setattr(gpu.FakeBackend, "compute_device", lambda self: "cuda:7")  # a device no worker has
    result = profile_on_cluster(client, inventory(client), "tiny", tiny_model(), example(), slo_us=None, num_blocks=2, batch_sizes=2)
    assert sorted(result.excluded) == [("L4", 2), ("T4", 1)]
    assert all(reason.startswith("profiling failed on ") for reason in result.excluded.values())
    assert sorted(result.profile.meta["excluded"]) == ["L4/2", "T4/1"] and "is excluded from the deploy" in caplog.text
    assert list(result.profile.latency_us) == [("A10", 1)] and result.profile.origin("A10", 1) == "estimated"


def test_profiling_past_the_timeout_excludes_the_kind(cpu_cluster):
    cluster, client = cpu_cluster
    convs = torch.nn.Sequential(*(torch.nn.Conv2d(3, 3, 3, padding=1) for _ in range(3))).eval()  # ~0.2 s of timing: more than the limit
    # past the limit while timing, or before it starts (scattering the model took longer, on a busy machine)
    with pytest.raises(DeployError, match="failed on every kind.*cpu/1: (profiling took longer than|not profiled within) timeout_s=0.01"):
        profile_on_cluster(
            client, inventory(client), "convs", convs, torch.randn(1, 3, 64, 64), slo_us=None, num_blocks=2, batch_sizes=8, timeout_s=0.01
        )


def test_a_second_deploy_with_the_store_does_no_profiling_and_plans_on_the_same_tables(cpu_cluster, tmp_path):
    cluster, client = cpu_cluster
    model = torch.nn.Sequential(*(layer for _ in range(4) for layer in (torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU()))).eval()
    x = torch.randn(1, 16, 64, 64)

    def deploy():
        with get_task_stream(client) as stream:
            svc = daskpipe.deploy(
                client,
                {"convs": model},
                example_inputs={"convs": x},
                slo_ms={"convs": 5000},
                profiling=ProfilingOptions(num_blocks=2, batch_sizes=(1, 8, 16), store=tmp_path),
            )
        svc.close()
        return svc.profiles["convs"], len(profiling_tasks(stream))

    (first, first_tasks), (second, second_tasks) = deploy(), deploy()
    assert (first_tasks, second_tasks) == (1, 0)
    assert (second.table("cpu", 1) == first.table("cpu", 1)).all()
    assert "store" in second.meta["measurements"]["cpu/1"]


def test_daskpipe_profile_cluster_fills_the_store_that_deploy_then_reads(cpu_cluster, tmp_path):
    from click.testing import CliRunner

    from daskpipe.cli import main

    cluster, client = cpu_cluster
    args = [
        "profile",
        "cluster",
        cluster.scheduler_address,
        "tests.runtime.helpers:tiny_model",
        "--input-shape",
        "3,16,16",
        "--blocks",
        "2",
        "--batch-sizes",
        "1,2",
        "--store",
        str(tmp_path),
        "--out",
        str(tmp_path / "tiny.profile"),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "cpu/1 measured" in result.output and "1 profiling task(s) now" in result.output
    with get_task_stream(client) as stream:
        again = profile_on_cluster(
            client,
            inventory(client),
            "tiny",
            tiny_model(),
            torch.randn(1, 3, 16, 16),
            slo_us=None,
            num_blocks=2,
            batch_sizes=(1, 2),
            store=ProfileStore(tmp_path),
        )
    assert not profiling_tasks(stream) and again.profile.origin("cpu", 1) == "measured"


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_blocks=0), "num_blocks must be an integer >= 1, got 0"),
        (dict(num_blocks=2.5), "num_blocks must be an integer >= 1, got 2.5"),
        (dict(batch_sizes="8"), "batch_sizes must be an integer >= 1 or a sequence of them, got '8'"),
        (dict(batch_sizes=[1, 0]), "each of batch_sizes must be an integer >= 1, got 0"),
        (dict(store=3), "store must be a folder path or None, got int"),
        (dict(timeout_s=0), "timeout_s must be > 0 seconds, got 0"),
    ],
)
def test_a_bad_profiling_option_is_named(fields, message):
    with pytest.raises(DeployError, match="^" + re.escape(message)):
        ProfilingOptions(**fields)


class SlowerAlone(torch.nn.Module):
    """Forty times slower for one sample than for two: the table a busy machine's spoiled timing gives."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02 if x.shape[0] == 1 else 0.0005)
        return x + 1


def test_a_table_the_store_would_refuse_is_measured_again_and_not_kept(cpu_cluster, tmp_path, caplog):
    cluster, client = cpu_cluster
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), SlowerAlone(), torch.nn.ReLU()).eval()
    store = ProfileStore(tmp_path)
    result = profile_on_cluster(client, inventory(client), "alone", model, example(), slo_us=None, num_blocks=2, batch_sizes=2, store=store)
    assert result.profiling_tasks == 2, "measured again once"
    assert not list(tmp_path.glob("*.json")), "a table the store would refuse on reading is not written"
    assert "not kept for the next deploy" in caplog.text and "not a measurement" in caplog.text
