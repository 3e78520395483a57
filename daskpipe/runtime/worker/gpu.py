"""What GPUs this machine has, and whether the MPS control daemon is up to slice them.

Everything that touches the hardware goes through one seam, :func:`gpu_backend`: NVML for
discovery and torch for the CUDA context. Setting ``DASKPIPE_FAKE_GPUS`` swaps in a fake backend
(the way dask-cuda's ``MockWorker`` does), so the real ``daskpipe worker`` code path runs on a
machine without GPUs, in tests and in subprocesses alike. Nothing here creates a CUDA context in
the calling process except :meth:`GPUBackend.init_device`, which only a worker process calls.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

FAKE_GPUS_ENV = "DASKPIPE_FAKE_GPUS"
MPS_PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
MPS_DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
MPS_DAEMON_COMM = "nvidia-cuda-mps"  # /proc/<pid>/comm keeps 15 characters of nvidia-cuda-mps-control


@dataclass(frozen=True)
class GPU:
    """One physical GPU as NVML reports it; ``type`` is the catalog's name for ``name``."""

    index: int
    name: str
    type: str
    memory_bytes: int
    uuid: str


@dataclass(frozen=True)
class Inventory:
    """The GPUs found, or none and why: a machine without GPUs is an answer, not an error."""

    gpus: tuple[GPU, ...]
    problem: str = ""

    def __bool__(self) -> bool:
        return bool(self.gpus)

    def explain(self) -> str:
        """A sentence for the user: what was found, or why nothing was, and what to do instead."""
        if self.gpus:
            kinds = ", ".join(f"{gpu.index}: {gpu.type} ({gpu.memory_bytes / 2**30:.0f} GiB)" for gpu in self.gpus)
            return f"found {len(self.gpus)} GPU(s): {kinds}"
        reason = f" ({self.problem})" if self.problem else ""
        return f"no GPU found{reason}; to run on this machine anyway, emulate GPUs with `daskpipe worker ADDRESS --emulate L4:2,T4:2`"


class GPUBackend(Protocol):
    """The seam between daskpipe and the hardware."""

    def inventory(self) -> Inventory:
        """List the GPUs without creating a CUDA context."""

    def init_device(self) -> str:
        """Create the CUDA context on the one visible device and return its name (workers only)."""

    def compute_device(self) -> str:
        """The torch device a slot of this backend computes on, e.g. when it is profiled."""

    def describe(self, gpu_type: str) -> tuple[str, str]:
        """The device name and driver version of this worker's ``gpu_type`` GPU (a profile store key)."""


class NvmlBackend:
    """The real hardware: pynvml for discovery, torch for the CUDA context."""

    def inventory(self) -> Inventory:
        try:
            import pynvml
        except ImportError:
            return Inventory((), "nvidia-ml-py is not installed; `pip install nvidia-ml-py`")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            return Inventory((), f"NVML could not start: {error}")
        try:
            gpus = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                name = _text(pynvml.nvmlDeviceGetName(handle))
                gpus.append(
                    GPU(
                        index=index,
                        name=name,
                        type=gpu_type(name),
                        memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    )
                )
        except pynvml.NVMLError as error:
            return Inventory((), f"NVML failed while listing GPUs: {error}")
        finally:
            pynvml.nvmlShutdown()
        return Inventory(tuple(gpus), "" if gpus else "NVML reports 0 devices")

    def init_device(self) -> str:
        import torch

        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
            raise RuntimeError(
                f"CUDA is not available in this worker (CUDA_VISIBLE_DEVICES={visible}); check the "
                "driver and, for sliced GPUs, that the MPS control daemon is running"
            )
        torch.cuda.init()
        torch.empty(1, device="cuda")  # create the context now, not on the first batch
        return torch.cuda.get_device_name(0)

    def compute_device(self) -> str:
        return "cuda"

    def describe(self, gpu_type: str) -> tuple[str, str]:
        import pynvml
        import torch

        pynvml.nvmlInit()
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
        finally:
            pynvml.nvmlShutdown()
        return torch.cuda.get_device_name(0), driver


class FakeBackend:
    """GPUs described by ``DASKPIPE_FAKE_GPUS="NVIDIA L4=23034,Tesla T4=15360"`` (NVML name=MiB).

    Discovery and the worker's device check answer from the description; nothing touches CUDA.
    """

    def __init__(self, description: str):
        self.gpus = tuple(_parse_fake_gpu(index, item) for index, item in enumerate(description.split(",")))

    def inventory(self) -> Inventory:
        return Inventory(self.gpus, "" if self.gpus else f"{FAKE_GPUS_ENV} lists no GPUs")

    def init_device(self) -> str:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        matches = [gpu for gpu in self.gpus if visible in (str(gpu.index), gpu.uuid)]
        if len(matches) != 1:
            raise RuntimeError(f"CUDA_VISIBLE_DEVICES={visible!r} names no GPU of {FAKE_GPUS_ENV}")
        return matches[0].name

    def compute_device(self) -> str:
        return "cpu"  # a fake GPU computes on the host

    def describe(self, gpu_type: str) -> tuple[str, str]:
        names = [gpu.name for gpu in self.gpus if gpu.type == gpu_type]
        if not names:
            raise RuntimeError(f"{FAKE_GPUS_ENV} lists no {gpu_type} GPU")
        return names[0], "fake"


def _parse_fake_gpu(index: int, item: str) -> GPU:
    name, sep, mib = item.strip().rpartition("=")
    if not sep or not name or not mib.strip().isdigit():
        raise ValueError(f"{FAKE_GPUS_ENV} entries look like 'NVIDIA L4=23034' (NVML name=MiB), got {item!r}")
    return GPU(index, name, gpu_type(name), int(mib) * 2**20, f"GPU-fake-{index}")


def gpu_backend() -> GPUBackend:
    """The hardware seam: the fake backend when ``DASKPIPE_FAKE_GPUS`` is set, NVML otherwise."""
    description = os.environ.get(FAKE_GPUS_ENV)
    return FakeBackend(description) if description else NvmlBackend()


def discover_gpus() -> Inventory:
    """The GPUs of this machine; an empty :class:`Inventory` with the reason when there are none."""
    return gpu_backend().inventory()


def gpu_type(nvml_name: str) -> str:
    """The catalog's short type (``"L4"``, ``"T4"``) for an NVML device name."""
    from daskpipe.profiles.catalog import normalise_gpu_name

    return normalise_gpu_name(nvml_name)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# -- MPS ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MPSStatus:
    """Whether CUDA clients started now would reach an MPS control daemon, and what was seen."""

    running: bool
    pipe_directory: str
    daemon_pids: tuple[int, ...]

    def explain(self) -> str:
        """Why MPS is (not) usable and, if not, how to make it so."""
        if self.running:
            return f"MPS control daemon is running (pipe directory {self.pipe_directory})"
        if self.daemon_pids:
            return (
                f"an MPS control daemon is running (pid {', '.join(map(str, self.daemon_pids))}) but has no "
                f"control pipe in {self.pipe_directory}; set {MPS_PIPE_ENV} to the pipe directory it was "
                "started with"
            )
        return (
            f"MPS control daemon is not running (no control pipe in {self.pipe_directory}); start it with "
            f"`{MPS_PIPE_ENV}={self.pipe_directory} nvidia-cuda-mps-control -d` (as the user that runs the "
            "workers; set the GPUs to EXCLUSIVE_PROCESS with `nvidia-smi -c EXCLUSIVE_PROCESS` first if you "
            "want only MPS clients on them), or ask for --slices 1"
        )


def mps_status(pipe_directory: str | None = None) -> MPSStatus:
    """Look for the daemon the way CUDA clients find it: its control pipe in the pipe directory.

    The directory comes from ``CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``); a running
    ``nvidia-cuda-mps-control`` process without that pipe means the directories disagree.
    """
    directory = pipe_directory or os.environ.get(MPS_PIPE_ENV) or MPS_DEFAULT_PIPE_DIRECTORY
    return MPSStatus(
        running=(Path(directory) / "control").exists(),
        pipe_directory=directory,
        daemon_pids=_mps_daemon_pids(),
    )


def _mps_daemon_pids(proc: Path = Path("/proc")) -> tuple[int, ...]:
    pids = []
    for comm in proc.glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == MPS_DAEMON_COMM:
                pids.append(int(comm.parent.name))
        except OSError:  # the process ended while we looked
            continue
    return tuple(sorted(pids))
