"""The process environment of stage workers: glibc's allocator on its own thresholds, and torch
computing on the threads the worker was given.

Dask's Nanny puts the ``distributed.nanny.pre-spawn-environ`` config into ``os.environ`` just
before it spawns a worker process, with defaults made for NumPy tasks: ``MALLOC_TRIM_THRESHOLD_=65536``
(freed memory goes back to the OS at once) and ``OMP_NUM_THREADS=1``. Setting any glibc malloc
threshold turns off glibc's adaptive mmap threshold, so every large tensor torch allocates comes
fresh from the kernel: about 20,000 page faults and 37 ms of system time per resnet18 forward on
one thread, which halves its throughput. A large trim threshold alone does not help (the mmap
threshold then stays at 128 KiB); leaving the variables unset does. glibc reads them when the
process starts, so a worker's own ``env`` is too late: the Nanny's pre-spawn config must leave them
out, and the parent process must not hand down a value an earlier Nanny wrote into its environment.

``OMP_NUM_THREADS=1`` stays: Dask's task threads should not each start OpenMP threads. A slot's
compute thread sets torch's thread count itself (:func:`compute_thread_setup`), from the worker's
``nthreads``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import dask.config
from dask.system import CPU_COUNT

from daskpipe.config import setting

logger = logging.getLogger(__name__)

PRE_SPAWN_ENVIRON = "distributed.nanny.pre-spawn-environ"
ALLOCATOR_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
"""glibc malloc settings; any one of them set turns off glibc's adaptive mmap threshold."""
ALLOCATOR_TUNABLES = ("glibc.malloc.trim_threshold", "glibc.malloc.mmap_threshold", "glibc.malloc.top_pad", "glibc.malloc.mmap_max")
"""The same settings spelled as ``GLIBC_TUNABLES``."""
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OMP_THREAD_LIMIT", "MKL_NUM_THREADS")
REPORTED_VARIABLES = (*ALLOCATOR_VARIABLES, "GLIBC_TUNABLES", *THREAD_VARIABLES)

PR_SET_TIMERSLACK = 29
"""``prctl``'s option that sets the calling thread's timer slack (nanoseconds), from ``<linux/prctl.h>``."""

_COMPUTE_THREADS: weakref.WeakKeyDictionary[threading.Thread, int] = weakref.WeakKeyDictionary()
"""Torch threads of each slot compute thread of this process, as torch reported them once set."""


@contextmanager
def stage_worker_environ() -> Iterator[None]:
    """Nannies created inside start (and restart) their workers without glibc malloc settings.

    The Nanny reads its pre-spawn config when it is created and spawns from this process's
    environment, into which every earlier Nanny wrote its own pre-spawn values: so the config is
    set for the Nannies created here, and the allocator variables leave this environment for good
    (:func:`drop_allocator_settings`; a later Dask Nanny writes its own values again).
    """
    import distributed  # noqa: F401  (loads its config defaults first: loaded inside the set, they would go at its exit)

    drop_allocator_settings()
    with dask.config.set({f"{PRE_SPAWN_ENVIRON}.{name}": None for name in ALLOCATOR_VARIABLES}):
        yield


def drop_allocator_settings() -> None:
    """Take the glibc malloc settings out of this process's environment, so that no process it starts
    from now on inherits them (this process's own allocator is set up already)."""
    for name in ALLOCATOR_VARIABLES:
        inherited = os.environ.pop(name, None)
        if inherited is not None:
            logger.info("daskpipe: not handing %s=%s down to stage workers: it halves torch's throughput", name, inherited)


SWITCH_INTERVAL_CONFIG = "daskpipe.gil-switch-interval"
"""Dask config key (``DASK_DASKPIPE__GIL_SWITCH_INTERVAL``): seconds a thread may hold the GIL while
another waits for it, in a worker hosting a stage; ``null`` leaves Python's (5 ms)."""


def shorten_switch_interval() -> float:
    """Set this process's GIL switch interval to :data:`SWITCH_INTERVAL_CONFIG`; returns it.

    A slot's compute thread runs eager torch, whose Python between kernel launches holds the GIL
    for milliseconds per forward on a fast GPU (py-spy of a worker serving resnet50 on an H200: most
    of its samples in ``Conv2d._conv_forward`` and ``batch_norm``), and the worker's event loop,
    which takes the next batch and sends this one's outputs on, waits for it up to Python's switch
    interval, 5 ms by default: a 2 ms timer on a loop beside a thread running Python fired 5.4 ms
    late at p50 at 5 ms, 0.8 ms at 0.5 ms.
    """
    interval = setting(SWITCH_INTERVAL_CONFIG)
    if interval is None:
        return sys.getswitchinterval()
    sys.setswitchinterval(interval)
    return sys.getswitchinterval()


def compute_thread_setup(nthreads: int) -> None:
    """The initializer of a slot's compute thread: torch computes there on the worker's ``nthreads``.

    Torch's thread count is per thread under OpenMP: a thread that does not set it computes with
    ``OMP_NUM_THREADS``, which Dask's Nanny sets to 1. On Linux the thread's timer slack is 1 us,
    not the default 50 us, so that the sleep of an emulated GPU's hold wakes when it asked to.
    """
    import torch

    torch.set_num_threads(nthreads)
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    _COMPUTE_THREADS[threading.current_thread()] = torch.get_num_threads()


@dataclass(frozen=True)
class WorkerEnvironment:
    """What a worker reports of the conditions its torch computes under.

    ``torch_threads`` is what torch gave the slot's compute thread(s) once set up, ``None`` before
    the slot's first batch started one; ``cpus`` the cores its process may use.
    """

    name: str
    address: str
    environ: Mapping[str, str]
    nthreads: int
    torch_threads: int | None
    cpus: int

    def warnings(self) -> list[str]:
        """What in this environment slows torch down, each with its fix."""
        found = []
        worker = f"worker {self.name} ({self.address})"
        for name in ALLOCATOR_VARIABLES:
            if name in self.environ:
                found.append(
                    f"{worker} runs with {name}={self.environ[name]}, which halves torch's CPU throughput "
                    "(glibc's adaptive mmap threshold is off, so each large tensor is fresh pages from the kernel). "
                    f"Start it with `daskpipe worker`, or set `{PRE_SPAWN_ENVIRON}.{name}: null` in the Dask config of the "
                    f"process that starts the workers and unset {name} in its environment (docs/deploying.md)"
                )
        tunables = [t for t in ALLOCATOR_TUNABLES if t in self.environ.get("GLIBC_TUNABLES", "")]
        if tunables:
            found.append(
                f"{worker} runs with GLIBC_TUNABLES setting {', '.join(tunables)}, which halves torch's CPU throughput; "
                "start it without them (docs/deploying.md)"
            )
        if self.torch_threads is not None and self.torch_threads < self.nthreads:
            limits = ", ".join(f"{k}={self.environ[k]}" for k in THREAD_VARIABLES if k in self.environ) or "no OMP_* variables"
            found.append(
                f"{worker} computes on {self.torch_threads} torch thread(s) of the {self.nthreads} it was given ({limits}); "
                "lift the limit in its environment or start it with that many threads"
            )
        if self.nthreads > self.cpus:
            found.append(
                f"{worker} was given {self.nthreads} threads but its process may use {self.cpus} core(s): torch's threads "
                f"will wait on each other; start it with --nthreads {self.cpus}"
            )
        return found


def probe_worker(dask_worker: Any) -> dict[str, Any]:
    """``client.run`` target: this worker's :class:`WorkerEnvironment` fields (plain data, for any client)."""
    computing = list(_COMPUTE_THREADS.values())
    return {
        "name": str(dask_worker.name),
        "address": dask_worker.address,
        "environ": {k: os.environ[k] for k in REPORTED_VARIABLES if k in os.environ},
        "nthreads": dask_worker.state.nthreads,
        "torch_threads": min(computing) if computing else None,
        "cpus": CPU_COUNT,
    }


def environments(probed: Mapping[str, Any]) -> list[WorkerEnvironment]:
    """The reports of ``client.run(probe_worker, on_error="ignore")``, in address order."""
    return [WorkerEnvironment(**probed[address]) for address in sorted(probed)]


def warn_slow_workers(client: Any, workers: Sequence[str] | None = None) -> list[str] | Awaitable[list[str]]:
    """Warn (``warnings.warn`` and the log) about each of ``workers`` (default: all) whose environment
    slows torch, naming the fix; the warnings. A worker that cannot answer is left out. Awaitable
    with an asynchronous client, as ``client.run`` is."""
    probed = client.run(probe_worker, workers=list(workers) if workers is not None else None, on_error="ignore")
    if client.asynchronous:
        return _announce_when_probed(probed)
    return announce(environments(probed))


async def _announce_when_probed(probed: Awaitable[Mapping[str, Any]]) -> list[str]:
    return announce(environments(await probed))


def announce(reports: Sequence[WorkerEnvironment]) -> list[str]:
    """Warn about every problem in ``reports``; the warnings."""
    found = [message for report in reports for message in report.warnings()]
    for message in found:
        logger.warning("daskpipe: %s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return found
