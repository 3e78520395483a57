"""Where a plan's stages go: the GPUs the planner may use and the slots each pool takes.

Torch-free, so that the scheduler's re-planner (:mod:`daskpipe.runtime.scheduler.elastic.controller`) places stages
without importing what the client needs to cut models.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from daskpipe.plan.schema import Plan
from daskpipe.runtime.errors import DeployError
from daskpipe.runtime.wire.messages import WorkerSlot


def physical_gpus(slots: list[WorkerSlot]) -> dict[str, int]:
    """Whole GPUs per type, from slots that are slices of them."""
    per_kind = Counter((s.gpu, s.slices) for s in slots)
    gpus: dict[str, int] = defaultdict(int)
    for (gpu, v), count in per_kind.items():
        gpus[gpu] += math.ceil(count / v)
    return dict(gpus)


def gpus_per_server(slots: list[WorkerSlot]) -> dict[str, int]:
    """The most whole GPUs of each type that one server holds."""
    per_server: dict[tuple[str, str], int] = Counter()
    for s in slots:
        per_server[(s.gpu, s.server)] += 1
    most: dict[str, int] = {}
    for (gpu, _), count in per_server.items():
        v = next(s.slices for s in slots if s.gpu == gpu)
        most[gpu] = max(most.get(gpu, 1), math.ceil(count / v))
    return most


class FreeSlots:
    """The slots not taken yet, per (GPU type, slices), in (server, address) order: pools fill servers in turn."""

    def __init__(self, slots: list[WorkerSlot]):
        self._free: dict[tuple[str, int], list[WorkerSlot]] = defaultdict(list)
        for s in sorted(slots, key=lambda s: (s.server, s.address)):
            self._free[(s.gpu, s.slices)].append(s)

    def take(self, gpu: str, slices: int, count: int, taker: str) -> list[WorkerSlot]:
        """``count`` free slots of the kind for ``taker`` (named in the error when too few are left)."""
        pool = self._free[(gpu, slices)]
        if len(pool) < count:
            raise DeployError(
                f"{taker} needs {count} free {gpu}/v{slices} slots, the cluster has {len(pool)} left; re-plan for this cluster"
            )
        taken, pool[:] = pool[:count], pool[count:]
        return taken


def place(plan: Plan, names: list[str], slots: list[WorkerSlot]) -> dict[str, list[tuple[int, int, WorkerSlot]]]:
    """Pick the slots of every pool: ``vgpus`` free slots of the pool's (GPU type, slices)."""
    free = FreeSlots(slots)
    placed: dict[str, list[tuple[int, int, WorkerSlot]]] = {}
    for name in names:
        rows: list[tuple[int, int, WorkerSlot]] = []
        for p, pipeline in enumerate(plan.model(name).pipelines):
            for q, part in enumerate(pipeline.partitions):
                taken = free.take(part.gpu, part.slices, part.vgpus, f"{name!r} pipeline {p} partition {q}")
                rows.extend((p, q, slot) for slot in taken)
        placed[name] = rows
    return placed
