"""``daskpipe worker``: parsing, slot specs, GPU/MPS discovery, and the real CLI against a scheduler.

The hardware is faked at one seam, ``DASKPIPE_FAKE_GPUS`` (see daskpipe.runtime.worker.gpu); the MPS daemon
is "running" when its control pipe exists, which a test can create for real in a temp directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import dask.config
import pytest
from click.testing import CliRunner
from distributed import Client, LocalCluster

from daskpipe.cli import main
from daskpipe.runtime.worker import gpu
from daskpipe.runtime.worker.slots import DaskpipeWorker, SlotSpec, WorkerSpecError, parse_pairs, parse_slices, worker_specs

FAKE_GPUS = "NVIDIA L4=23034,Tesla T4=15360"
DASKPIPE = [sys.executable, "-c", "from daskpipe.cli import main; main()"]  # the console script's code


@pytest.fixture
def fake_gpus(monkeypatch):
    monkeypatch.setenv(gpu.FAKE_GPUS_ENV, FAKE_GPUS)


@pytest.fixture
def mps_pipe(tmp_path, monkeypatch):
    """A pipe directory with a control pipe, as ``nvidia-cuda-mps-control -d`` leaves it."""
    os.mkfifo(tmp_path / "control")
    monkeypatch.setenv(gpu.MPS_PIPE_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def no_mps(tmp_path, monkeypatch):
    monkeypatch.setenv(gpu.MPS_PIPE_ENV, str(tmp_path))


# -- parsing ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [("2", 2), ("1", 1), ("L4=2", {"L4": 2}), ("L4=2, T4=1", {"L4": 2, "T4": 1})],
)
def test_parse_slices(text, expected):
    assert parse_slices(text) == expected


@pytest.mark.parametrize("text", ["L4", "L4=0", "L4=x", "=2", ",", "L4:2"])
def test_parse_slices_rejects_with_example(text):
    with pytest.raises(WorkerSpecError, match="like 'L4=2"):
        parse_slices(text)


def test_parse_emulate_pairs():
    assert parse_pairs("L4:2,T4:6", ":", option="--emulate") == {"L4": 2, "T4": 6}


# -- slot specs -------------------------------------------------------------------------------


def test_emulated_specs_follow_the_contract():
    specs = worker_specs(emulate={"L4": 1, "T4": 2}, slices={"T4": 2}, server="edge")
    assert [s.name for s in specs] == ["edge/L4-0/0", "edge/T4-1/0", "edge/T4-1/1", "edge/T4-2/0", "edge/T4-2/1"]
    assert specs[0].resources == {
        "daskpipe.slot": 1,
        "daskpipe.gpu.L4": 1,
        "daskpipe.slices.1": 1,
        "daskpipe.emulated": 1,
    }
    assert specs[1].resources["daskpipe.slices.2"] == 1
    assert all(s.env == {} for s in specs), "emulated slots must not touch CUDA"


def test_real_specs_set_cuda_env_before_start(fake_gpus, mps_pipe):
    specs = worker_specs(slices={"L4": 4}, server="gpu-a")
    l4 = [s for s in specs if s.gpu_type == "L4"]
    (t4,) = [s for s in specs if s.gpu_type == "T4"]
    assert [s.name for s in l4] == [f"gpu-a/L4-0/{i}" for i in range(4)]
    assert l4[0].env == {
        "CUDA_VISIBLE_DEVICES": "GPU-fake-0",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={23034 // 4}MB",
    }
    assert t4.env == {"CUDA_VISIBLE_DEVICES": "GPU-fake-1"}
    assert "daskpipe.emulated" not in t4.resources


def test_slices_need_the_mps_daemon(fake_gpus, no_mps):
    with pytest.raises(WorkerSpecError, match="nvidia-cuda-mps-control -d"):
        worker_specs(slices=2)
    assert len(worker_specs(slices=1)) == 2, "whole GPUs need no MPS"


def test_no_gpu_is_a_clear_answer(monkeypatch):
    monkeypatch.setenv(gpu.FAKE_GPUS_ENV, "")
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_init=True))
    inventory = gpu.discover_gpus()
    assert not inventory and "NVML could not start" in inventory.problem
    with pytest.raises(WorkerSpecError, match="no GPU found.*--emulate"):
        worker_specs()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"emulate": {"L5": 1}}, "unknown GPU type.*L5.*catalog has"),
        ({"emulate": {"L4": 0}}, "integer >= 1"),
        ({"emulate": {"L4": 1}, "slices": 49}, "between 1 and 48"),
        ({"emulate": {"L4": 1}, "slices": {"T4": 2}}, "does not have"),
        ({"emulate": {"L4": 1}, "server": "a/b"}, "may not contain '/'"),
    ],
)
def test_bad_specs_say_how_to_fix(kwargs, match):
    with pytest.raises(WorkerSpecError, match=match):
        worker_specs(**kwargs)


# -- discovery --------------------------------------------------------------------------------


def _fake_pynvml(*, fail_init: bool = False) -> types.ModuleType:
    """The subset of pynvml that NvmlBackend calls, answering for one L4 and one T4."""

    class NVMLError(Exception):
        pass

    devices = [("NVIDIA L4", 23034 * 2**20, "GPU-aaaa"), (b"Tesla T4", 15360 * 2**20, b"GPU-bbbb")]

    def init():
        if fail_init:
            raise NVMLError("NVML Shared Library Not Found")

    module = types.ModuleType("pynvml")
    module.NVMLError = NVMLError
    module.nvmlInit = init
    module.nvmlShutdown = lambda: None
    module.nvmlDeviceGetCount = lambda: len(devices)
    module.nvmlDeviceGetHandleByIndex = lambda i: devices[i]
    module.nvmlDeviceGetName = lambda h: h[0]
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=h[1])
    module.nvmlDeviceGetUUID = lambda h: h[2]
    return module


def test_nvml_discovery_normalises_types(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    inventory = gpu.NvmlBackend().inventory()
    assert [(g.index, g.type, g.uuid) for g in inventory.gpus] == [(0, "L4", "GPU-aaaa"), (1, "T4", "GPU-bbbb")]
    assert inventory.gpus[1].memory_bytes == 15360 * 2**20
    assert "found 2 GPU(s)" in inventory.explain()


def test_mps_status_reads_the_pipe_directory(mps_pipe, tmp_path_factory):
    assert gpu.mps_status().running
    empty = tmp_path_factory.mktemp("no-mps")
    status = gpu.mps_status(str(empty))
    assert not status.running and str(empty) in status.explain()


def test_mps_daemon_found_by_process_name(tmp_path):
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "comm").write_text("nvidia-cuda-mps\n")
    (tmp_path / "17").mkdir()
    (tmp_path / "17" / "comm").write_text("python\n")
    assert gpu._mps_daemon_pids(tmp_path) == (4242,)


def test_fake_backend_checks_the_visible_device(fake_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-fake-1")
    assert gpu.gpu_backend().init_device() == "Tesla T4"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with pytest.raises(RuntimeError, match="names no GPU"):
        gpu.gpu_backend().init_device()


# -- the real CLI -----------------------------------------------------------------------------


def _describe_worker(dask_worker):
    cuda = {k: v for k, v in os.environ.items() if k.startswith("CUDA_VISIBLE") or k.startswith("CUDA_MPS_A")}
    plugin = dask_worker.plugins["daskpipe-slot"]
    return dask_worker.name, dict(dask_worker.state.total_resources), cuda, plugin.device_name


def test_cli_starts_a_worker_per_gpu_slice(mps_pipe):
    """Two nodes against one scheduler: one with (faked) real GPUs sliced by MPS, one emulating."""
    with LocalCluster(n_workers=0, processes=False, protocol="tcp", dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            nodes = [
                (["--slices", "L4=2", "--server", "gpu-a"], {gpu.FAKE_GPUS_ENV: FAKE_GPUS, gpu.MPS_PIPE_ENV: str(mps_pipe)}),
                (["--emulate", "L4:1,T4:1", "--server", "laptop"], {gpu.FAKE_GPUS_ENV: ""}),
            ]
            processes = [
                subprocess.Popen([*DASKPIPE, "worker", cluster.scheduler_address, *args], env={**os.environ, **env}) for args, env in nodes
            ]
            try:
                client.wait_for_workers(5, timeout=90)
                reports = client.run(_describe_worker)
            finally:
                for process in processes:
                    process.terminate()
                assert [process.wait(30) for process in processes] == [0, 0], "SIGTERM should close the workers cleanly"
    by_name = {name: (resources, cuda, device) for name, resources, cuda, device in reports.values()}
    assert sorted(by_name) == ["gpu-a/L4-0/0", "gpu-a/L4-0/1", "gpu-a/T4-1/0", "laptop/L4-0/0", "laptop/T4-1/0"]
    resources, cuda, device = by_name["gpu-a/L4-0/1"]
    assert resources == {"daskpipe.slot": 1, "daskpipe.gpu.L4": 1, "daskpipe.slices.2": 1}
    assert cuda == {"CUDA_VISIBLE_DEVICES": "GPU-fake-0", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
    assert device == "NVIDIA L4", "the worker created its device context at start"
    assert by_name["gpu-a/T4-1/0"][1] == {"CUDA_VISIBLE_DEVICES": "GPU-fake-1"}
    resources, cuda, device = by_name["laptop/T4-1/0"]
    assert resources["daskpipe.emulated"] == 1 and cuda == {} and device is None


def test_cli_worker_explains_missing_mps(no_mps, monkeypatch):
    monkeypatch.setenv(gpu.FAKE_GPUS_ENV, FAKE_GPUS)
    result = CliRunner().invoke(main, ["worker", "tcp://127.0.0.1:1", "--slices", "2"])
    assert result.exit_code == 1
    assert "MPS control daemon is not running" in result.output and "nvidia-cuda-mps-control -d" in result.output


def test_cli_worker_rejects_bad_emulate():
    result = CliRunner().invoke(main, ["worker", "tcp://127.0.0.1:1", "--emulate", "L4=2"])
    assert result.exit_code == 2 and "TYPE:COUNT" in result.output


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            ["worker", "tcp://127.0.0.1:1", "--emulate", "L4:1", "--memory-limit", "banana"],
            "Invalid value for '--memory-limit': memory_limit must be bytes, a size like 4GB, a fraction of the machine's memory or "
            "'auto', got 'banana'",
        ),
        (["worker", "tcp://127.0.0.1:1", "--emulate", "L4:1", "--memory-limit", "-5"], "Invalid value for '--memory-limit'"),
        (["worker", "tcp://127.0.0.1:1", "--emulate", "L4:1", "--nthreads", "0"], "Invalid value for '--nthreads'"),
        (
            ["worker", "tcp://127.0.0.1:1", "--emulate", "L4:1", "--slices", "0"],
            "Invalid value for '--slices': --slices must be an integer >= 1, got 0",
        ),
        (["demo", "--duration", "-1"], "Invalid value for '--duration'"),
    ],
)
def test_cli_malformed_values_exit_2_naming_the_option(arguments, message):
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code == 2 and message in result.output, result.output


def test_cli_worker_refuses_a_bad_config_key_naming_it_before_starting():
    with dask.config.set({"daskpipe.gil-switch-interval": -1}):
        result = CliRunner().invoke(main, ["worker", "tcp://127.0.0.1:1", "--emulate", "L4:1"])
    assert result.exit_code == 1 and "daskpipe.gil-switch-interval: -1 is less than the minimum" in result.output, result.output


def test_a_bad_memory_limit_from_python_names_the_argument():
    with pytest.raises(WorkerSpecError, match="memory_limit must be bytes, .* got 'banana'"):
        DaskpipeWorker("tcp://127.0.0.1:1", emulate={"L4": 1}, memory_limit="banana")


def test_slot_spec_pickles_into_the_worker():
    import pickle

    spec = SlotSpec("s", "L4", 0, 0, 1, emulated=True)
    assert pickle.loads(pickle.dumps(spec.worker_options()["plugins"][0])).slot == spec


def test_slot_setup_refuses_a_device_of_another_type(fake_gpus, monkeypatch):
    from daskpipe.runtime.worker.slots import SlotSetup

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-fake-1")  # the T4
    l4 = SlotSpec("gpu-a", "L4", 0, 0, 1, emulated=False, uuid="GPU-fake-0")
    with pytest.raises(RuntimeError, match="advertises GPU type L4 but CUDA gave it a Tesla T4"):
        SlotSetup(l4).setup(worker=None)
