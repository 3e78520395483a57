"""From a plan's pools (counts of 1/v slices) to concrete slots on physical GPUs and servers.

The plan says "pool (pipeline 0, partition 1) is 6 slices of 1/2 L4"; the data plane needs to
know which slices share a physical GPU (they were profiled running together) and which share a
server's NIC (transfers contend there). Packing rules, as the artifact counts them:

* a physical GPU is cut into v equal slices and all of them serve one model with that v, so pools
  of one model with the same (GPU type, v) fill GPUs one after the other, and a pool's last GPU
  may carry slices of the model's next such pool;
* physical GPUs of one type are numbered across models in plan order ("L4-0", "L4-1", ...) and
  packed ``gpus_per_server[gpu]`` to a server ("L4-srv0", ...); a server may hold GPUs of two
  models (their dispatchers then share its NIC only if they share a timeline).

Ids are deterministic (``"L4-3/2"``: slice 2 of physical GPU L4-3) but the dispatchers never parse
them: the Dask runtime builds :class:`~daskpipe.sched.api.Placement` from worker addresses.
"""

from __future__ import annotations

from typing import Any, Mapping

from daskpipe.plan.schema import Plan
from daskpipe.sched.api import Placement, Slot


def place(plan: Plan, *, gpus_per_server: Mapping[str, int] | None = None) -> dict[str, Placement]:
    """Concrete slots for every model of ``plan``, keyed by model name.

    ``gpus_per_server`` maps GPU type -> GPUs per server; the default is the plan's
    ``cluster["gpus_per_server"]``, else 1. Raises ``ValueError`` if the plan needs more physical
    GPUs of a type than ``plan.cluster["gpus"]`` lists.
    """
    per_server = _per_server(gpus_per_server if gpus_per_server is not None else plan.cluster.get("gpus_per_server"))
    next_gpu: dict[str, int] = {}  # GPU type -> number of the next free physical GPU
    placements: dict[str, Placement] = {}
    for model in plan.models:
        slots: dict[str, Slot] = {}
        pools: dict[tuple[int, int], tuple[str, ...]] = {}
        open_gpu: dict[tuple[str, int], tuple[str, int]] = {}  # (gpu, v) -> (physical GPU, next free slice)
        for pi, pipeline in enumerate(model.pipelines):
            for di, part in enumerate(pipeline.partitions):
                members: list[str] = []
                key = (part.gpu, part.slices)
                for _ in range(part.vgpus):
                    physical, free_slice = open_gpu.get(key, ("", part.slices))
                    if free_slice == part.slices:  # start a new physical GPU
                        number = next_gpu.get(part.gpu, 0)
                        next_gpu[part.gpu] = number + 1
                        physical, free_slice = f"{part.gpu}-{number}", 0
                        server = f"{part.gpu}-srv{number // per_server.get(part.gpu, 1)}"
                    else:
                        server = slots[f"{physical}/0"].server
                    slot = Slot(id=f"{physical}/{free_slice}", gpu=part.gpu, slices=part.slices, server=server)
                    slots[slot.id] = slot
                    members.append(slot.id)
                    open_gpu[key] = (physical, free_slice + 1)
                pools[(pi, di)] = tuple(members)
        placements[model.name] = Placement(model=model.name, pools=pools, slots=slots)
    _check_inventory(plan.cluster.get("gpus"), next_gpu)
    return placements


def _per_server(value: Any) -> dict[str, int]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"gpus_per_server must map GPU type -> GPUs per server, got {value!r}")
    for gpu, count in value.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"gpus_per_server[{gpu!r}] must be an integer >= 1, got {count!r}")
    return dict(value)


def _check_inventory(inventory: Any, used: Mapping[str, int]) -> None:
    if not isinstance(inventory, Mapping):
        return
    for gpu, count in used.items():
        have = inventory.get(gpu, 0)
        if count > have:
            raise ValueError(f"the plan packs into {count} physical {gpu} GPUs but the cluster lists {have}; re-plan for this cluster")
