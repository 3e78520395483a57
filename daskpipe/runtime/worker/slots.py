"""One Dask worker per GPU x MPS slice, each named and resourced so the dispatcher knows its pool.

The contract with the rest of the runtime: every daskpipe worker carries the Dask resources
``{"daskpipe.slot": 1, "daskpipe.gpu.<TYPE>": 1, "daskpipe.slices.<v>": 1}`` (plus
``"daskpipe.emulated": 1`` when emulated) and is named ``"<server>/<TYPE>-<gpu index>/<slice>"``;
slots with the same server share a NIC. A slot's CUDA environment is decided here, before its
process exists, and put in its Nanny's ``env`` (dask-cuda's rule: no CUDA context in the parent).
:func:`worker_specs` is the one validator, shared by ``daskpipe worker`` and the emulated cluster.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from daskpipe.runtime.worker.gpu import GPU, discover_gpus, gpu_backend, gpu_type, mps_status

logger = logging.getLogger(__name__)

SLOT_RESOURCE = "daskpipe.slot"
EMULATED_RESOURCE = "daskpipe.emulated"
MAX_SLICES = 48  # MPS clients per device on Volta and newer
SLOT_PLUGIN_NAME = "daskpipe-slot"


def gpu_resource(gpu_type: str) -> str:
    return f"daskpipe.gpu.{gpu_type}"


def slices_resource(slices: int) -> str:
    return f"daskpipe.slices.{slices}"


@dataclass(frozen=True)
class SlotSpec:
    """One Dask worker: a 1/``slices`` MPS share of GPU ``gpu_index`` (of ``gpu_type``) on ``server``.

    ``uuid`` and ``memory_bytes`` describe a real GPU; an emulated slot has no ``uuid`` and gets no
    CUDA environment, since its stages run on the CPU.
    """

    server: str
    gpu_type: str
    gpu_index: int
    slice_index: int
    slices: int
    emulated: bool
    memory_bytes: int | None = None
    uuid: str | None = None

    @property
    def name(self) -> str:
        return f"{self.server}/{self.gpu_type}-{self.gpu_index}/{self.slice_index}"

    @property
    def resources(self) -> dict[str, float]:
        resources: dict[str, float] = {SLOT_RESOURCE: 1, gpu_resource(self.gpu_type): 1, slices_resource(self.slices): 1}
        if self.emulated:
            resources[EMULATED_RESOURCE] = 1
        return resources

    @property
    def env(self) -> dict[str, str]:
        """The CUDA variables of this slot's process; they must be set before CUDA starts there.

        The GPU is named by UUID because NVML numbers devices by PCI bus while CUDA, by default,
        numbers the fastest first: on a mixed node the two orders differ.
        """
        if self.emulated:
            return {}
        env = {"CUDA_VISIBLE_DEVICES": self.uuid or str(self.gpu_index)}
        if self.slices > 1:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 // self.slices)
            if self.memory_bytes:
                env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={self.memory_bytes // self.slices // 2**20}MB"
        return env

    def worker_options(self) -> dict[str, Any]:
        """Keyword arguments for a ``Worker`` (``env`` is added by the caller for a ``Nanny``)."""
        return {"name": self.name, "resources": self.resources, "plugins": (SlotSetup(self),)}


class SlotSetup(WorkerPlugin):
    """Makes the slot known in its worker and, on a real GPU, creates the CUDA context at start.

    Stages find their slot as ``get_worker().plugins["daskpipe-slot"].slot``. Creating the context
    here, not on the first batch, keeps start-up cost off the first request's latency, and a GPU
    that CUDA cannot see fails the worker at start with the reason.
    """

    name = SLOT_PLUGIN_NAME
    idempotent = True

    def __init__(self, slot: SlotSpec):
        self.slot = slot
        self.device_name: str | None = None

    def setup(self, worker: Any) -> None:
        if self.slot.emulated:
            return
        self.device_name = gpu_backend().init_device()
        if gpu_type(self.device_name) != self.slot.gpu_type:
            raise RuntimeError(
                f"worker {self.slot.name} advertises GPU type {self.slot.gpu_type} but CUDA gave it a {self.device_name} "
                f"(CUDA_VISIBLE_DEVICES={self.slot.env.get('CUDA_VISIBLE_DEVICES')}); the dispatcher would plan "
                "with the wrong latencies"
            )
        logger.info("worker %s runs on %s (CUDA context created)", self.slot.name, self.device_name)


class WorkerSpecError(ValueError):
    """The GPUs, slices or emulation asked for cannot be served on this machine; says how to fix it."""


def parse_pairs(text: str, separator: str, *, option: str) -> dict[str, int]:
    """``"L4:2,T4:6"`` (separator ``":"``) -> ``{"L4": 2, "T4": 6}``; counts must be positive.

    >>> parse_pairs("L4=2,T4=1", "=", option="--slices")
    {'L4': 2, 'T4': 1}
    """
    pairs: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition(separator)
        if not sep or not key.strip() or not value.strip().isdigit() or int(value) < 1:
            raise WorkerSpecError(
                f"{option} takes TYPE{separator}COUNT pairs with COUNT >= 1, like 'L4{separator}2,T4{separator}1'; got {item!r}"
            )
        pairs[key.strip()] = int(value)
    if not pairs:
        raise WorkerSpecError(f"{option} is empty; give TYPE{separator}COUNT pairs like 'L4{separator}2'")
    return pairs


def parse_slices(text: str) -> int | dict[str, int]:
    """``--slices`` value: one count for every GPU (``"2"``) or per type (``"L4=2,T4=1"``)."""
    text = text.strip()
    return positive_int(int(text), "--slices") if text.isdigit() else parse_pairs(text, "=", option="--slices")


def worker_specs(
    *,
    slices: int | Mapping[str, int] = 1,
    emulate: Mapping[str, int] | None = None,
    server: str | None = None,
) -> list[SlotSpec]:
    """The slots this machine should run: every GPU (or emulated GPU) cut into its MPS slices.

    Parameters
    ----------
    slices : int or mapping, default 1
        MPS slices per GPU, for all GPUs (``2``) or per GPU type (``{"L4": 2, "T4": 1}``; types
        not named get 1). Each slice is one worker with ``100 // v`` percent of the GPU's threads.
    emulate : mapping, optional
        Emulate GPUs instead of detecting them, e.g. ``{"L4": 2, "T4": 6}``: stages run on the CPU
        and are held to the type's profiled latency. Types must be in the GPU catalog.
    server : str, optional
        The node's name in worker names (slots of one server share a NIC); the host name by default.

    Raises
    ------
    WorkerSpecError
        No GPU was found (and nothing is emulated), a slice count is out of range or names a type
        this machine lacks, an emulated type is not in the catalog, or slices > 1 are asked for on
        real GPUs while the MPS control daemon is not running.
    """
    server = server or socket.gethostname()
    if "/" in server:
        raise WorkerSpecError(f"server name {server!r} may not contain '/'; it is the first part of worker names")
    gpus = _emulated_gpus(emulate) if emulate else _detected_gpus()
    per_type = _slices_per_type(slices, {gpu.type for gpu in gpus})
    specs = [
        SlotSpec(
            server=server,
            gpu_type=gpu.type,
            gpu_index=gpu.index,
            slice_index=slice_index,
            slices=per_type.get(gpu.type, 1),
            emulated=bool(emulate),
            memory_bytes=gpu.memory_bytes,
            uuid=None if emulate else gpu.uuid,
        )
        for gpu in gpus
        for slice_index in range(per_type.get(gpu.type, 1))
    ]
    if not emulate and any(spec.slices > 1 for spec in specs):
        status = mps_status()
        if not status.running:
            raise WorkerSpecError(status.explain())
    return specs


def _detected_gpus() -> tuple[GPU, ...]:
    inventory = discover_gpus()
    if not inventory:
        raise WorkerSpecError(inventory.explain())
    return inventory.gpus


def _emulated_gpus(emulate: Mapping[str, int]) -> tuple[GPU, ...]:
    from daskpipe.profiles.catalog import load_catalog

    catalog = load_catalog()
    unknown = sorted(set(emulate) - set(catalog))
    if unknown:
        raise WorkerSpecError(f"cannot emulate unknown GPU type(s) {', '.join(unknown)}; the catalog has {', '.join(sorted(catalog))}")
    kinds = [gpu_type for gpu_type, count in emulate.items() for _ in range(positive_int(count, f"emulate[{gpu_type!r}]"))]
    return tuple(
        GPU(index, f"emulated {kind}", kind, int(catalog[kind].memory_gb * 2**30), f"emulated-{index}") for index, kind in enumerate(kinds)
    )


def _slices_per_type(slices: int | Mapping[str, int], present: set[str]) -> dict[str, int]:
    if isinstance(slices, int):
        return {gpu_type: _slice_count(slices, "slices") for gpu_type in present}
    missing = sorted(set(slices) - present)
    if missing:
        raise WorkerSpecError(
            f"--slices names GPU type(s) {', '.join(missing)} that this machine does not have "
            f"(it has {', '.join(sorted(present)) or 'none'})"
        )
    return {gpu_type: _slice_count(count, f"slices[{gpu_type!r}]") for gpu_type, count in slices.items()}


def _slice_count(value: int, what: str) -> int:
    if not 1 <= positive_int(value, what) <= MAX_SLICES:
        raise WorkerSpecError(f"{what} must be between 1 and {MAX_SLICES} (MPS clients per GPU), got {value}")
    return value


def positive_int(value: int, what: str) -> int:
    """``value`` if it is an integer >= 1; otherwise a :class:`WorkerSpecError` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WorkerSpecError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def check_memory_limit(value: str | int | float) -> str | int | float:
    """``value`` if Dask reads it as a memory limit ("auto", bytes, "4GB", a fraction <= 1 of the
    machine's); otherwise a :class:`WorkerSpecError` naming ``memory_limit``."""
    import logging

    from distributed.worker_memory import parse_memory_limit

    if value == "auto":
        return value
    try:
        parsed = parse_memory_limit(value, 1, logger=logging.getLogger(__name__))
    except (ValueError, TypeError) as error:
        raise WorkerSpecError(
            f"memory_limit must be bytes, a size like 4GB, a fraction of the machine's memory or 'auto', got {value!r} ({error})"
        ) from None
    if isinstance(value, bool) or parsed is not None and parsed < 0:
        raise WorkerSpecError(f"memory_limit must be bytes, a size like 4GB, a fraction of the machine's memory or 'auto', got {value!r}")
    return value


def equal_memory_share(slots: int) -> int:
    """Host memory per slot worker when none is given: an equal share of this machine's."""
    from distributed.system import MEMORY_LIMIT

    return max(MEMORY_LIMIT // max(slots, 1), 2**28)


class DaskpipeWorker:
    """The workers of one machine: a ``Nanny`` per slot, started together and closed together.

    The Python side of ``daskpipe worker``, option for option; ``await DaskpipeWorker(...)`` starts
    them, :meth:`finished` waits until they all stop, :meth:`close` stops them. ``slices``,
    ``emulate`` and ``server`` are those of :func:`worker_specs`; ``nthreads`` and ``memory_limit``
    (``"auto"``: an equal share of host memory) apply to each slot; ``protocol`` defaults to the
    scheduler address's, and ``"ucx"`` falls back to ``"tcp"`` with a warning without distributed-ucxx.
    The worker processes start without glibc malloc settings (:mod:`daskpipe.runtime.worker.environ`).
    """

    def __init__(
        self,
        scheduler_address: str,
        *,
        slices: int | Mapping[str, int] = 1,
        emulate: Mapping[str, int] | None = None,
        server: str | None = None,
        nthreads: int = 1,
        protocol: str | None = None,
        memory_limit: str | int | float = "auto",
        **nanny_kwargs: Any,
    ):
        from distributed import Nanny

        from daskpipe.runtime.wire.protocols import resolve_protocol
        from daskpipe.runtime.worker.environ import stage_worker_environ

        self.slots = worker_specs(slices=slices, emulate=emulate, server=server)
        positive_int(nthreads, "nthreads")
        if check_memory_limit(memory_limit) == "auto":
            memory_limit = equal_memory_share(len(self.slots))
        protocol = resolve_protocol(protocol) if protocol else None
        with stage_worker_environ():
            self.nannies = [
                Nanny(
                    scheduler_address,
                    nthreads=nthreads,
                    memory_limit=memory_limit,
                    protocol=protocol,
                    env=slot.env,
                    **slot.worker_options(),
                    **nanny_kwargs,
                )
                for slot in self.slots
            ]

    async def start(self) -> DaskpipeWorker:
        await asyncio.gather(*self.nannies)
        return self

    def __await__(self):
        return self.start().__await__()

    async def finished(self) -> None:
        await asyncio.gather(*(nanny.finished() for nanny in self.nannies))

    async def close(self, timeout: float = 10, reason: str = "daskpipe-worker-close") -> None:
        await asyncio.gather(*(nanny.close(timeout=timeout, reason=reason) for nanny in self.nannies))
