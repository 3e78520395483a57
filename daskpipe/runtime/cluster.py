"""A LocalCluster of emulated GPU workers, for tests, examples and ``daskpipe demo``.

Its workers are the slots :func:`daskpipe.runtime.worker.slots.worker_specs` describes for emulated
GPUs, so they carry the same names and resources as ``daskpipe worker --emulate`` on a real node;
code tested here meets the same contract on a GPU cluster.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Mapping
from typing import Any

import dask
from dask.utils import parse_timedelta
from distributed import LocalCluster

from daskpipe.runtime.wire.protocols import resolve_protocol
from daskpipe.runtime.worker.environ import stage_worker_environ
from daskpipe.runtime.worker.slots import SlotSpec, WorkerSpecError, equal_memory_share, positive_int, worker_specs

#: How long a slot's worker may be gone before its Nanny is closed for good (Dask's default is 15 s).
RESTART_GRACE_S = 120.0


def emulated_slots(gpus: Mapping[str, int], *, slices: int | Mapping[str, int] = 1, servers: int = 1) -> list[SlotSpec]:
    """The slots of ``gpus`` dealt onto ``servers`` nodes named ``node-0``, ``node-1``, ...

    Consecutive GPUs share a node (as in a rack of same-size machines), ``ceil(total / servers)``
    per node, so the dispatcher sees which transfers cross a NIC.
    """
    positive_int(servers, "servers")
    if not gpus:
        raise WorkerSpecError("gpus must name at least one GPU, like {'L4': 2, 'T4': 4}")
    kinds = [gpu_type for gpu_type, count in gpus.items() for _ in range(positive_int(count, f"gpus[{gpu_type!r}]"))]
    per_server = math.ceil(len(kinds) / servers)
    slots: list[SlotSpec] = []
    for server_index in range(servers):
        chunk = kinds[server_index * per_server : (server_index + 1) * per_server]
        if not chunk:
            break
        counts = {gpu_type: chunk.count(gpu_type) for gpu_type in dict.fromkeys(chunk)}
        node_slices = slices if isinstance(slices, int) else {k: v for k, v in slices.items() if k in counts}
        slots.extend(worker_specs(slices=node_slices, emulate=counts, server=f"node-{server_index}"))
    return slots


class EmulatedCluster(LocalCluster):
    """A ``LocalCluster`` whose workers are emulated GPU slots following daskpipe's worker contract.

    Its scheduler preloads ``daskpipe`` (as ``dask scheduler --preload daskpipe`` does), so the
    scheduler plugin is there before the first client connects. Its worker processes start
    without the glibc malloc settings Dask's Nanny would give them, which halve torch's throughput
    (:mod:`daskpipe.runtime.worker.environ`).

    Parameters
    ----------
    gpus : mapping
        Emulated GPUs by catalog type, e.g. ``{"L4": 2, "T4": 4}``.
    slices : int or mapping, default 1
        MPS slices per GPU, for all types or per type (``{"T4": 2}``); one worker per slice.
    servers : int, default 1
        Nodes to spread the GPUs over (``node-0`` ...); slots of one node share a NIC.
    processes : bool, default True
        One process per slot (a ``Nanny``), as on a real node; ``False`` runs the workers in this
        process, which starts faster.
    protocol : str, default "tcp"
        ``"tcp"``, ``"tls"``, ``"ucx"`` or ``"inproc"``; ``"ucx"`` falls back to ``"tcp"`` with a
        warning when distributed-ucxx is not installed.
    dashboard_address : str or None, default ":8787"
        Where the scheduler's dashboard listens; ``None`` for none.
    nthreads : int, default 1
        Threads per slot worker.
    **kwargs
        Passed to ``LocalCluster`` (``memory_limit`` is per slot and defaults to an equal share of
        the machine's, or none for workers in this process, which all see its whole memory).

    Raises
    ------
    WorkerSpecError
        ``gpus`` names a type the catalog lacks, or ``slices``/``servers`` are out of range; also
        from ``scale(n)`` beyond the slots, since a generic worker would have no GPU type.
    """

    def __init__(
        self,
        gpus: Mapping[str, int],
        *,
        slices: int | Mapping[str, int] = 1,
        servers: int = 1,
        processes: bool = True,
        protocol: str = "tcp",
        dashboard_address: str | None = ":8787",
        nthreads: int = 1,
        **kwargs: Any,
    ):
        self.slots = emulated_slots(gpus, slices=slices, servers=servers)
        # in one process, each worker would hold the whole process's memory against its share, and pause
        kwargs.setdefault("memory_limit", equal_memory_share(len(self.slots)) if processes else 0)
        scheduler_kwargs = dict(kwargs.pop("scheduler_kwargs", None) or {})
        preload = scheduler_kwargs.get("preload", ())
        scheduler_kwargs["preload"] = ["daskpipe", *([preload] if isinstance(preload, str) else preload)]
        super().__init__(
            n_workers=0,
            threads_per_worker=nthreads,
            processes=processes,
            protocol=resolve_protocol(protocol),
            dashboard_address=dashboard_address,
            scheduler_kwargs=scheduler_kwargs,
            **kwargs,
        )

    def new_worker_spec(self) -> dict[str, Any]:
        """Scaling up would add workers without a GPU type; refuse, and say how to add GPUs."""
        raise WorkerSpecError(
            "an EmulatedCluster's workers are fixed by its gpus=...; to add emulated GPUs, run "
            f"`daskpipe worker {self.scheduler_address} --emulate T4:1 --server node-N`"
        )

    async def _start(self) -> None:
        """Add the slot workers to the spec before SpecCluster brings the spec up."""
        base = self.new_spec
        for slot in self.slots:
            self.worker_spec[slot.name] = {"cls": base["cls"], "options": {**base["options"], **slot.worker_options()}}
        await super()._start()

    def _update_worker_status(self, op: str, msg: Any) -> None:
        """Give a killed slot's Nanny :data:`RESTART_GRACE_S` to bring its worker back.

        SpecCluster closes the Nanny of a worker that has not come back within
        ``distributed.deploy.lost-worker-timeout``; a worker importing torch on a loaded machine
        can take longer than its 15 s, and the slot would then be gone for good. A longer setting wins.
        """
        configured = parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout"))
        with dask.config.set({"distributed.deploy.lost-worker-timeout": max(configured, RESTART_GRACE_S)}):
            super()._update_worker_status(op, msg)

    async def _correct_state_internal(self) -> None:
        """SpecCluster creates the workers' Nannies here: without glibc malloc settings
        (:func:`~daskpipe.runtime.worker.environ.stage_worker_environ`), so torch runs at full speed."""
        with stage_worker_environ():
            await super()._correct_state_internal()


def inject_mps_fault(client: Any, gpu: str) -> list[str]:
    """Emulate an MPS fatal fault on ``gpu`` (``"<server>/<TYPE>-<index>"``, e.g. ``"node-0/T4-1"``).

    MPS delivers a fatal fault to every client on the GPU, so every slice's worker process of that
    GPU exits at once; their Nannies start them again, as after a real fault once the MPS server
    has recovered. Returns the names of the workers hit. Only emulated GPUs can be faulted.
    """
    workers = client.scheduler_info(n_workers=-1)["workers"]
    hit = {address: info for address, info in workers.items() if str(info["name"]).rpartition("/")[0] == gpu}
    if not hit:
        names = sorted({str(info["name"]).rpartition("/")[0] for info in workers.values()})
        raise ValueError(f"no worker runs on GPU {gpu!r}; the cluster's GPUs are {', '.join(names)}")
    if any("daskpipe.emulated" not in info["resources"] for info in hit.values()):
        raise ValueError(f"GPU {gpu!r} is real; faults are injected only into emulated GPUs")
    client.run(_exit_soon, workers=list(hit))
    return sorted(str(info["name"]) for info in hit.values())


async def _exit_soon() -> None:
    """In the worker: die like an MPS client that received a fatal fault, after replying to the call."""
    asyncio.get_running_loop().call_later(0.1, os._exit, 1)


emulated_cluster = EmulatedCluster  # the function-style spelling, as in ``with emulated_cluster({...}) as cluster``
