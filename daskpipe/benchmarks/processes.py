"""A cluster of its own processes for the benchmarks that measure the serving path: ``dask
scheduler --preload daskpipe`` and ``daskpipe worker --emulate``, as their commands start them on a
real cluster. In a ``LocalCluster`` the scheduler shares the client's process and event loop, so a
client's own work (making futures, answering its first stages' fetches of large inputs) is charged
to the scheduler's loop, which a deployment keeps apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator, Mapping

from daskpipe.benchmarks.serve import READY_S

QUIET_ENV = {"DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__GIL__ENABLED": "false"}
"""Set for the cluster's processes: Dask's GIL monitor samples every thread, on what is measured."""


@contextmanager
def cluster_processes(gpus: Mapping[str, int], *, slices: Mapping[str, int] | None = None) -> Iterator[str]:
    """A scheduler process and a worker process of ``gpus`` emulated GPUs (``slices`` MPS slices per
    type, one slot each) on one node; the scheduler's address once its file is written (the
    workers connect on their own: wait for them)."""
    env = {**os.environ, **QUIET_ENV}
    with tempfile.TemporaryDirectory() as folder:
        scheduler_file = os.path.join(folder, "scheduler.json")
        bin_dir = os.path.dirname(sys.executable)
        started = [
            subprocess.Popen(
                [
                    os.path.join(bin_dir, "dask"),
                    "scheduler",
                    "--preload",
                    "daskpipe",
                    "--scheduler-file",
                    scheduler_file,
                    "--port",
                    "0",
                    "--dashboard-address",
                    ":0",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        ]
        try:
            deadline = time.monotonic() + READY_S
            while not os.path.exists(scheduler_file):
                if time.monotonic() > deadline or started[0].poll() is not None:
                    raise RuntimeError("the scheduler did not start")
                time.sleep(0.1)
            time.sleep(0.2)  # the file is written whole before its rename; read it once it is there
            with open(scheduler_file) as f:
                address = json.load(f)["address"]
            worker = [os.path.join(bin_dir, "daskpipe"), "worker", address, "--emulate", ",".join(f"{g}:{n}" for g, n in gpus.items())]
            if slices:
                worker += ["--slices", ",".join(f"{g}={n}" for g, n in slices.items())]
            started.append(subprocess.Popen([*worker, "--server", "node-0"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            yield address
        finally:
            for process in reversed(started):
                process.terminate()
            for process in reversed(started):
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()


def cpu_s(pid: int) -> float:
    """CPU seconds (user and system) of process ``pid`` and its children so far."""
    import psutil

    process = psutil.Process(pid)
    times = [process.cpu_times(), *(child.cpu_times() for child in process.children(recursive=True))]
    return sum(t.user + t.system for t in times)
