"""Deploy-time profiling: every (GPU type, slices) kind measured where it lives, all kinds at once.

For each model, ``deploy`` cuts the blocks once on the client (where the estimator's per-segment
costs balance, so no device is needed and every kind times the same blocks), then runs one
profiling task per kind among the real slots, on a worker of that kind (on a CPU kind, on every
worker of it on that host at once, as they serve: :class:`Probe`). Kinds on different
physical GPUs run at once; kinds on the same GPU (slots of one ``<server>/<TYPE>-<index>``) run
one after another, so that they do not disturb each other. Kinds that no real worker has
(emulated GPUs) are estimated, calibrated on the measured GPU kinds
(:func:`~daskpipe.profiles.estimator.estimate_kinds`). A kind whose profiling fails or runs past
the timeout is excluded, with its reason. Measured tables are looked up in, and written to, the
client's profile store (:mod:`daskpipe.profiles.store`); workers never see the store.
"""

from __future__ import annotations

import logging
import numbers
import os
import platform
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from distributed import Client
from torch import nn

from daskpipe.config import setting
from daskpipe.profiles.fx import BlockedModel
from daskpipe.profiles.model import ESTIMATED, MEASURED, Profile, ProfileError, kind_label
from daskpipe.profiles.profiler import SLO_FACTOR, normalise_batch_sizes, profile_blocks
from daskpipe.profiles.store import MeasurementKey, ProfileStore, check_table, model_fingerprint
from daskpipe.runtime.errors import DeployError, check_count
from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.messages import WorkerSlot
from daskpipe.runtime.worker.stage import CUDA_GRAPHS_CONFIG

logger = logging.getLogger(__name__)

Kind = tuple[str, int]
PROFILE_KEY_PREFIX = "daskpipe-profile-"
"""Every profiling task's key starts with this (then the model and the kind)."""
CUT_REFERENCE_GPU = "L4"
"""Blocks are cut by estimated cost on this GPU type (PPipe's SLO reference) on every cluster, whatever
its GPU types and the order its workers registered in: the same model, example and block count give
the same blocks everywhere, which the profile store's keys rely on."""


@dataclass(frozen=True)
class ProfilingOptions:
    """How ``deploy`` profiles the models it is not given profiles of; a bad field fails here, named.

    ``num_blocks``: most blocks a model is cut into (fewer where its graph has fewer segments).
    ``leaf_modules``: submodules (qualified names such as ``roi_heads``, or class names) kept whole
    inside a block, as those fx cannot trace are (docs/deploying.md, "What models can be served").
    ``batch_sizes``: the batch sizes timed; an int ``B`` means 1..B. ``store``: a folder of
    measured tables (docs/profiles.md): each kind found there is not profiled again, each kind
    measured is added; default: the Dask config key ``daskpipe.profile-store``; neither: nothing
    is kept. Only the client reads it. ``timeout_s``: most seconds profiling one model may take; a
    kind not measured by then is left out of the deploy, as is a kind whose profiling fails.
    """

    num_blocks: int = 10
    batch_sizes: int | Sequence[int] = (1, 2, 4, 8)
    store: str | os.PathLike | None = None
    timeout_s: float | None = None
    leaf_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_count("num_blocks", self.num_blocks)
        if isinstance(self.leaf_modules, str) or not all(isinstance(name, str) for name in self.leaf_modules):
            raise DeployError(f"leaf_modules must be a tuple of module names, got {self.leaf_modules!r}")
        sizes = [self.batch_sizes] if isinstance(self.batch_sizes, numbers.Integral) else self.batch_sizes
        if isinstance(self.batch_sizes, (str, bytes)) or not hasattr(sizes, "__iter__") or not list(sizes):
            raise DeployError(f"batch_sizes must be an integer >= 1 or a sequence of them, got {self.batch_sizes!r}")
        for size in sizes:
            check_count("each of batch_sizes", size)
        if self.store is not None and not isinstance(self.store, (str, os.PathLike)):
            raise DeployError(f"store must be a folder path or None, got {type(self.store).__name__}")
        timeout = self.timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0):
            raise DeployError(f"timeout_s must be > 0 seconds, got {self.timeout_s!r}")


@dataclass
class ClusterProfile:
    """One model's profile on a cluster, the blocks it describes, and the kinds that failed (kind -> reason)."""

    profile: Profile
    blocked: BlockedModel
    excluded: dict[Kind, str] = field(default_factory=dict)
    profiling_tasks: int = 0


def describe_device(gpu: str, dask_worker: Any = None) -> dict[str, Any]:
    """On a worker (``client.run``): what its ``gpu`` kind's timings depend on, for the store key."""
    if gpu == messages.CPU:
        name = platform.processor() or platform.machine()
        return {"device": name, "driver": "", "torch": torch.__version__, "threads": int(dask_worker.state.nthreads)}
    from daskpipe.runtime.worker.gpu import gpu_backend

    name, driver = gpu_backend().describe(gpu)
    return {
        "device": name,
        "driver": driver,
        "torch": torch.__version__,
        "threads": 0,
        "cuda_graphs": setting(CUDA_GRAPHS_CONFIG),
    }


def measure_kind(blocked: BlockedModel, *, name: str, batch_sizes: Sequence[int], gpu: str, slices: int, slo_us: float | None) -> Profile:
    """On a worker of kind (``gpu``, ``slices``): time ``blocked`` on the device the slot computes on."""
    if gpu == messages.CPU:
        device = "cpu"
    else:
        from daskpipe.runtime.worker.gpu import gpu_backend

        device = gpu_backend().compute_device()
    return profile_blocks(
        blocked,
        name=name,
        batch_sizes=batch_sizes,
        device=device,
        gpu_type=gpu,
        slices=slices,
        slo_us=slo_us,
        cuda_graphs=setting(CUDA_GRAPHS_CONFIG),
    )


def profile_on_cluster(
    client: Client,
    slots: list[WorkerSlot],
    name: str,
    module: nn.Module,
    example: Any,
    *,
    slo_us: float | None,
    num_blocks: int,
    batch_sizes: int | Sequence[int],
    store: ProfileStore | None = None,
    timeout_s: float | None = None,
    leaf_modules: Sequence[str] = (),
) -> ClusterProfile:
    """``name``'s profile on every kind of ``slots``: measured (or read from ``store``) where a real
    worker has the kind, estimated where none has; see the module docstring. ``module`` itself is
    not changed (:func:`~daskpipe.profiles.fx.served_copy`)."""
    from daskpipe.profiles.catalog import load_catalog
    from daskpipe.profiles.estimator import cut_by_estimate, estimate_kinds
    from daskpipe.profiles.fx import segment_model, served_copy

    module = served_copy(module)
    catalog = load_catalog()
    probes = _probes(client, slots)
    segmented = segment_model(module, example, leaf_modules)
    num_blocks = min(num_blocks, segmented.num_segments)
    blocked = cut_by_estimate(module, example, num_blocks, catalog[CUT_REFERENCE_GPU], leaf_modules=leaf_modules)
    sizes = normalise_batch_sizes(batch_sizes)
    fingerprint = model_fingerprint(module, example) if store is not None else None
    keys: dict[Kind, MeasurementKey] = {}
    tables: dict[Kind, np.ndarray] = {}
    origin: dict[str, str] = {}
    measurements: dict[str, dict] = {}
    if store is not None and fingerprint:
        keys = {
            kind: measurement_key(
                fingerprint,
                blocked.segment_boundaries,
                sizes,
                kind,
                client.run(describe_device, kind[0], workers=[probe.address])[probe.address],
                together=len(probe.together),
            )
            for kind, probe in probes.items()
        }
        for kind, key in keys.items():
            found = store.get(key)
            if found is not None:
                tables[kind] = found
                measurements[kind_label(*kind)] = {
                    "worker": probes[kind].address,
                    "device": key.device,
                    "cpu_threads": key.threads or None,
                    "store": str(store.path(key)),
                }
    to_measure = {kind: where for kind, where in probes.items() if kind not in tables}
    measured, excluded = _measure(client, to_measure, name, blocked, sizes, slo_us, timeout_s) if to_measure else ({}, {})
    noisy = {kind: to_measure[kind] for kind, profile in measured.items() if kind in keys and _unstorable(profile.table(*kind), keys[kind])}
    if noisy:  # a busy machine can spoil one timing; the store would refuse such a table on reading it back
        measured.update(_measure(client, noisy, name, blocked, sizes, slo_us, timeout_s)[0])
    for kind, profile in measured.items():
        tables[kind] = profile.table(*kind)
        timing = profile.meta.get("timing", {})
        measurements[kind_label(*kind)] = {
            "worker": probes[kind].address,
            "timed_together": len(probes[kind].together),
            "device": profile.meta["device"],
            "cpu_threads": profile.meta["cpu_threads"],
            "timing": timing,
        }
        if "warning" in timing:  # an inflated table: said, and not kept for the next deploy
            logger.warning("daskpipe: %s on %s: %s", name, kind_label(*kind), timing["warning"])
            from rich.console import Console

            Console(stderr=True).print(f"daskpipe: {name} on {kind_label(*kind)}: {timing['warning']}")
        elif store is not None and kind in keys and (stored := keep_measurement(store, keys[kind], tables[kind], name)):
            measurements[kind_label(*kind)]["store"] = str(stored)
    origin.update({kind_label(*k): MEASURED for k in tables})
    for kind, reason in excluded.items():
        logger.warning("daskpipe: %s on %s is excluded from the deploy: %s", name, kind_label(*kind), reason)
    real = {(s.gpu, s.slices) for s in slots if not s.emulated}
    unmeasured = sorted({(s.gpu, s.slices) for s in slots} - real)
    if not tables and not unmeasured:
        raise DeployError(
            f"profiling {name!r} failed on every kind of the cluster: "
            + "; ".join(f"{kind_label(*k)}: {r}" for k, r in sorted(excluded.items()))
        )
    slo = slo_us if slo_us is not None else _default_slo(tables)
    calibration: dict = {}
    if unmeasured:
        unknown = [kind_label(*k) for k in unmeasured if k[0] not in catalog]
        if unknown:
            raise DeployError(f"emulated kinds {unknown} are not in the GPU catalog, so {name!r} cannot be estimated for them")
        estimated, calibration = estimate_kinds(blocked, unmeasured, name=name, batch_sizes=sizes[-1], slo_us=slo, measured=tables)
        tables.update(estimated)
        origin.update({kind_label(*k): ESTIMATED for k in estimated})
        slo = slo if slo is not None else _default_slo(estimated)
    if slo is None:  # neither measured nor estimated tables
        raise DeployError(f"no latency table of {name!r} could be measured or estimated for {[kind_label(*k) for k in unmeasured]}")
    profile = Profile(
        model=name,
        slo_us=slo,
        num_blocks=blocked.num_blocks,
        latency_us=tables,
        boundary_bytes=tuple(float(b) for b in blocked.boundary_bytes),
        input_bytes=float(blocked.input_bytes),
        output_bytes=float(blocked.output_bytes),
        input_shape=blocked.input_shape,
        boundary_shapes=tuple(blocked.boundary_shapes),
        meta={
            **next(
                (p.meta for p in measured.values()),
                {"cpu_threads": next((m["cpu_threads"] for m in measurements.values() if m["cpu_threads"]), None)},
            ),
            "segment_boundaries": blocked.segment_boundaries,
            "batch_sizes": sizes,
            **({"fingerprint": fingerprint} if fingerprint else {}),
            "cut": f"equal estimated batch-1 cost on {CUT_REFERENCE_GPU}",
            **({"leaf_modules": segmented.leaves} if segmented.leaves else {}),
            "tables": origin,
            "measurements": measurements,
            **({"calibration": calibration} if unmeasured else {}),
            **({"excluded": {kind_label(*k): r for k, r in excluded.items()}} if excluded else {}),
        },
    )
    tasks = sum(len(probe.together) for probe in [*to_measure.values(), *noisy.values()])
    return ClusterProfile(profile, blocked, excluded, profiling_tasks=tasks)


def _default_slo(tables: dict[Kind, np.ndarray]) -> float | None:
    """PPipe's rule, on the slowest whole-GPU kind (any kind where none is whole): every type can serve alone."""
    whole = [t for (_, v), t in tables.items() if v == 1] or list(tables.values())
    return SLO_FACTOR * max(float(t[:, 0].sum()) for t in whole) if whole else None


@dataclass(frozen=True)
class Probe:
    """Where a kind is profiled: the worker whose table it keeps, its physical device, and the
    workers timed at once with it (itself included). CPU workers of a kind on one host are all
    timed together: they share the host's memory bandwidth and caches while they serve, and a
    table timed on one of them alone ran 10-15% faster than serving did (resnet18, two 1-thread
    workers on 2 cores). A GPU kind is timed on one worker, and so are workers in one process
    (``inproc://``): timed at once, they would measure each other's hold on the GIL."""

    address: str
    device: str
    together: tuple[str, ...]


def _probes(client: Client, slots: list[WorkerSlot]) -> dict[Kind, Probe]:
    """Per kind of the real slots: where it is profiled (:class:`Probe`).

    Workers are picked so that kinds sit on different devices where the cluster allows it."""
    from distributed.comm import get_address_host

    names = {a: str(info.get("name", a)) for a, info in client.scheduler_info(n_workers=-1)["workers"].items()}
    by_kind: dict[Kind, list[WorkerSlot]] = {}
    for slot in sorted((s for s in slots if not s.emulated), key=lambda s: s.address):
        by_kind.setdefault((slot.gpu, slot.slices), []).append(slot)
    taken: set[str] = set()
    probes = {}
    for kind, candidates in sorted(by_kind.items()):
        devices = [(s.address, device_of(s.address, names)) for s in candidates]
        address, device = next(((a, d) for a, d in devices if d not in taken), devices[0])
        taken.add(device)
        host = get_address_host(address)
        together = (
            tuple(s.address for s in candidates if get_address_host(s.address) == host and not s.address.startswith("inproc://"))
            if kind[0] == messages.CPU and not address.startswith("inproc://")
            else (address,)
        )
        probes[kind] = Probe(address, device, together)
    return probes


def median_profile(profiles: list[Profile], kind: Kind) -> Profile:
    """The first of ``profiles`` (one kind timed on several workers at once) with the cell-wise
    median of their tables, and how many were timed together in its meta."""
    first = profiles[0]
    if len(profiles) == 1:
        return first
    table = np.median(np.stack([p.table(*kind) for p in profiles]), axis=0)
    return replace(first, latency_us={**first.latency_us, kind: table}, meta={**first.meta, "timed_together": len(profiles)})


def device_of(address: str, names: dict[str, str]) -> str:
    """``<server>/<TYPE>-<index>`` of a daskpipe worker (named ``.../<slice>``); a plain worker is its own device."""
    name = names.get(address, address)
    return name.rpartition("/")[0] if name.count("/") >= 2 else address


def measurement_key(
    fingerprint: str, boundaries: Sequence[int], sizes: Sequence[int], kind: Kind, described: dict[str, Any], *, together: int = 1
) -> MeasurementKey:
    """The store key of ``kind``'s table, ``described`` by :func:`describe_device` on a worker of
    it, timed on ``together`` workers at once (:class:`Probe`)."""
    return MeasurementKey(fingerprint, tuple(boundaries), tuple(sizes), kind[0], kind[1], **described, together=together)


def _unstorable(table: np.ndarray, key: MeasurementKey) -> str | None:
    """Why the store would refuse ``table`` when reading it back, or ``None``: what it keeps, it serves."""
    try:
        check_table(table, key, "the new measurement")
    except ProfileError as exc:
        return str(exc)
    return None


def keep_measurement(store: ProfileStore, key: MeasurementKey, table: np.ndarray, model: str) -> Path | None:
    """Write a new table of ``model`` under ``key``, unless the store would refuse it on reading it
    back (a timing a busy machine spoiled): that one is planned on where it was measured, said, and
    not kept. Returns the entry's path, or ``None``."""
    if fault := _unstorable(table, key):
        logger.warning("daskpipe: %s on %s: not kept for the next deploy: %s", model, kind_label(key.gpu, key.slices), fault)
        return None
    return store.put(key, table, {"model": model, "measured_at": time.time()})


def _measure(
    client: Client,
    probes: dict[Kind, Probe],
    name: str,
    blocked: BlockedModel,
    sizes: list[int],
    slo_us: float | None,
    timeout_s: float | None,
) -> tuple[dict[Kind, Profile], dict[Kind, str]]:
    """One task per kind on each worker it is timed on; per physical device one after another, devices at once."""
    from daskpipe.progress import progress_rows
    from daskpipe.runtime.deploying.deployment import wait_through

    chains: dict[str, list[Kind]] = {}
    for kind, probe in sorted(probes.items()):
        chains.setdefault(probe.device, []).append(kind)
    scattered = client.scatter(blocked, workers=sorted({a for p in probes.values() for a in p.together}), broadcast=True, hash=False)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    measured: dict[Kind, Profile] = {}
    excluded: dict[Kind, str] = {}

    def run_chain(kinds: list[Kind], update) -> None:
        for kind in kinds:
            label = kind_label(*kind)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                excluded[kind] = f"not profiled within timeout_s={timeout_s:g}"
                update(label, f"excluded: {excluded[kind]}", True)
                continue
            probe = probes[kind]
            update(
                label, f"profiling on {probe.address}" + (f" and {len(probe.together) - 1} more at once" if len(probe.together) > 1 else "")
            )
            token = uuid.uuid4().hex[:8]
            futures = [
                client.submit(
                    measure_kind,
                    scattered,
                    name=name,
                    batch_sizes=sizes,
                    gpu=kind[0],
                    slices=kind[1],
                    slo_us=slo_us,
                    workers=[address],
                    allow_other_workers=False,
                    pure=False,
                    key=f"{PROFILE_KEY_PREFIX}{name}-{kind[0]}-v{kind[1]}-{token}-{i}",
                )
                for i, address in enumerate(probe.together)
            ]
            try:
                wait_through(client, futures, left)
                measured[kind] = median_profile(client.gather(futures), kind)
                update(label, "measured", True)
            except (TimeoutError, FutureTimeout):
                client.cancel(futures)
                excluded[kind] = f"profiling took longer than timeout_s={timeout_s:g}"
                update(label, f"excluded: {excluded[kind]}", True)
            except Exception as exc:  # the kind's worker could not run the model: exclude the kind, keep the deploy
                failed = next((f for f in futures if f.status == "error"), futures[0])
                excluded[kind] = f"profiling failed on {probe.together[futures.index(failed)]}: {type(exc).__name__}: {exc}"
                update(label, f"excluded: {excluded[kind]}", True)

    try:
        with progress_rows(f"profiling {name}", [kind_label(*k) for k in sorted(probes)]) as update:
            with ThreadPoolExecutor(max_workers=len(chains), thread_name_prefix="daskpipe-profile") as pool:
                for done in [pool.submit(run_chain, kinds, update) for kinds in chains.values()]:
                    done.result()
    finally:  # released now, not when an error's traceback (which holds this frame) goes
        scattered.release()
    if excluded:
        from rich.console import Console

        for kind, reason in sorted(excluded.items()):
            Console(stderr=True).print(f"daskpipe: {name} on {kind_label(*kind)} is excluded from the deploy: {reason}")
    return measured, excluded
