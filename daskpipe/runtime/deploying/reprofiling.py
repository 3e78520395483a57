"""Latency tables for the GPU kinds that join a deployment after it was profiled, so that a
re-plan (:mod:`daskpipe.runtime.scheduler.elastic.controller`) can use them: a real kind measured on a worker of it (as
``deploy`` measures, :mod:`daskpipe.runtime.deploying.profiling`) or read from the deployment's profile
store, an emulated kind estimated. Torch stays out of the scheduler: the blocks are unpickled and
timed on the workers (:func:`kind_tables`)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from daskpipe.profiles.model import ESTIMATED, MEASURED, Profile, kind_label
from daskpipe.runtime.scheduler.elastic.state import Deployment, ModelSpec
from daskpipe.runtime.wire.messages import WorkerSlot

if TYPE_CHECKING:
    from distributed import Client, Future


logger = logging.getLogger(__name__)


def kind_tables(
    name: str,
    blocks: list[bytes],
    input_shapes: list[tuple[int, ...]],
    output_shape: tuple[int, ...],
    profile: Profile,
    kinds: list[tuple[str, int]],
    measure: bool,
) -> dict[tuple[str, int], Any]:
    """On a worker: the latency tables of ``kinds`` for the model whose blocks (pickled one by one)
    ``profile`` describes: timed here (``measure``: the one kind of this worker, as ``deploy`` does),
    or estimated, calibrated on the profile's measured tables."""
    import pickle

    from daskpipe.profiles.estimator import estimate_kinds
    from daskpipe.profiles.fx import BlockedModel
    from daskpipe.runtime.deploying.profiling import measure_kind
    from daskpipe.runtime.worker.stage import TRACING

    with TRACING.write_lock():  # unpickling re-traces: no stage of this process may compute meanwhile
        modules = [block for chunk in blocks for block in pickle.loads(chunk)]
    blocked = BlockedModel(
        modules,
        tuple(input_shapes[0]),
        tuple(output_shape),
        [tuple(s) for s in input_shapes[1:]],
        [int(b) for b in profile.boundary_bytes],
        list(profile.meta.get("segment_boundaries", [])),
    )
    top = max(profile.max_batch(*kind) for kind in profile.latency_us)
    if measure:
        ((gpu, slices),) = kinds
        sizes = profile.meta.get("batch_sizes") or list(range(1, top + 1))
        return {
            (gpu, slices): measure_kind(blocked, name=name, batch_sizes=sizes, gpu=gpu, slices=slices, slo_us=profile.slo_us).table(
                gpu, slices
            )
        }
    measured = {kind: table for kind, table in profile.latency_us.items() if profile.origin(*kind) == MEASURED}
    return estimate_kinds(blocked, kinds, name=name, batch_sizes=top, slo_us=profile.slo_us, measured=measured)[0]


def _tables_on(client: Client, name: str, spec: ModelSpec, kinds: list[tuple[str, int]], measure: bool, **where: Any) -> Future:
    """:func:`kind_tables` of ``spec``'s model as a task (``where``: its workers, its key)."""
    return client.submit(
        kind_tables, name, spec.blocks, spec.input_shapes, spec.output_shape, spec.profile, kinds, measure, pure=False, **where
    )


async def profile_missing(
    dep: Deployment, slots: list[WorkerSlot], worker_names: dict[str, str], get_client: Callable[[], Awaitable[Client]]
) -> None:
    """Add to each model's profile in ``dep`` the tables of the (GPU type, slices) kinds of
    ``slots`` it lacks, so that the MILP can use them: a real kind measured on a worker of it
    (it serves nothing yet; kinds of different GPUs at once, of one GPU one after another), or
    read from the deployment's profile store where this scheduler sees that folder; an emulated
    kind estimated. ``worker_names`` (address -> name) tells which workers share a GPU;
    ``get_client`` is awaited only when a table is missing."""
    from daskpipe.profiles.catalog import load_catalog
    from daskpipe.runtime.deploying.profiling import device_of  # torch stays out of the scheduler until a kind joins

    catalog = load_catalog()
    real = {(s.gpu, s.slices) for s in slots if not s.emulated}
    for name, spec in dep.models.items():
        profile = spec.profile
        missing = sorted({(s.gpu, s.slices) for s in slots if s.gpu in catalog or (s.gpu, s.slices) in real} - set(profile.latency_us))
        if not missing:
            continue
        client = await get_client()
        chains: dict[str, list[tuple[tuple[str, int], str]]] = {}
        for kind in (k for k in missing if k in real):
            address = next(s.address for s in slots if (s.gpu, s.slices) == kind and not s.emulated)
            chains.setdefault(device_of(address, worker_names), []).append((kind, address))
        results = await asyncio.gather(*(_measure_chain(client, dep, name, spec, chain) for chain in chains.values()))
        tables = {kind: table for measured in results for kind, table in measured.items()}
        origins = {kind_label(*k): MEASURED for k in tables}
        estimate = [k for k in missing if k not in real]
        if estimate:
            host = next(s.address for s in slots if (s.gpu, s.slices) in estimate)
            try:
                estimated = await _tables_on(client, name, spec, estimate, False, workers=[host])
                tables.update(estimated)
                origins.update({kind_label(*k): ESTIMATED for k in estimated})
            except Exception as exc:
                logger.warning("daskpipe: could not estimate %s for %s on %s (%r); the re-plan leaves them out", estimate, name, host, exc)
        meta = {**profile.meta, "tables": {**profile.meta.get("tables", {}), **origins}}
        spec.profile = replace(profile, latency_us={**profile.latency_us, **tables}, meta=meta)
        logger.info("daskpipe: profiled %s for %s", origins, name)


async def _measure_chain(client: Client, dep: Deployment, name: str, spec: ModelSpec, chain: list[tuple[tuple[str, int], str]]) -> dict:
    """Measure the kinds of one physical GPU one after another; a kind that fails is left out (logged)."""
    from daskpipe.profiles.store import ProfileStore
    from daskpipe.runtime.deploying.profiling import PROFILE_KEY_PREFIX, describe_device, keep_measurement, measurement_key

    profile = spec.profile
    store = (
        ProfileStore(dep.profile_store)
        if dep.profile_store and Path(dep.profile_store).expanduser().is_dir() and profile.meta.get("fingerprint")
        else None
    )
    tables = {}
    for kind, address in chain:
        try:
            key = None
            if store is not None:
                described = (await client.run(describe_device, kind[0], workers=[address]))[address]
                key = measurement_key(
                    profile.meta["fingerprint"], profile.meta["segment_boundaries"], profile.meta["batch_sizes"], kind, described
                )
                found = store.get(key)
                if found is not None:
                    tables[kind] = found
                    continue
            measured = await _tables_on(
                client,
                name,
                spec,
                [kind],
                True,
                workers=[address],
                allow_other_workers=False,
                key=f"{PROFILE_KEY_PREFIX}{name}-{kind[0]}-v{kind[1]}-{uuid.uuid4().hex[:8]}",
            )
            tables.update(measured)
            if store is not None and key is not None:
                keep_measurement(store, key, measured[kind], name)
        except Exception as exc:
            logger.warning(
                "daskpipe: could not profile %s on %s for %s (%r); the re-plan leaves it out", kind_label(*kind), address, name, exc
            )
    return tables
