"""Load-proportional autoscaling of a daskpipe service through Dask's ``Adaptive``.

Deferred batching keeps batches large, so the GPUs a load does not need stay idle (Symphony): the
busy share of each GPU type and the share of requests served badly are clean signals. The
scheduler plugin turns them into advice (:meth:`daskpipe.runtime.scheduler.elastic.controller.Elastic.scaling`): how
many more slots of which GPU type are wanted, and which workers hold no stage and can go (a
surplus GPU type is first drained by a re-plan without its extra slots). :class:`DaskpipeAdaptive`
feeds that advice to ``Adaptive``: its ``target`` is the workers there are, plus those wanted,
minus those that can go; ``workers_to_close`` names only workers without a stage, so a worker
holding a live stage actor is never retired; ``scale_up`` asks the cluster for the wanted GPU
types (a generic ``scale(n)`` would start workers without a GPU type)::

    cluster = EmulatedCluster({"T4": 2})
    svc = daskpipe.deploy(Client(cluster), ...)
    cluster.adapt(Adaptive=DaskpipeAdaptive, minimum=1, maximum=8, interval="1s")
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Mapping

from distributed.deploy.adaptive import Adaptive

from daskpipe.runtime.worker.slots import WorkerSpecError, worker_specs

logger = logging.getLogger(__name__)

GrowFn = Callable[[Any, Mapping[str, int]], object]
"""``grow(cluster, {gpu type: slots})``: start that many more workers of each GPU type (what it
returns is awaited when awaitable, else ignored)."""


def add_emulated_gpus(cluster: Any, gpus: Mapping[str, int]) -> list[str]:
    """Add emulated GPUs (``{"A10": 2}``) to an ``EmulatedCluster`` as a new node; returns the new
    worker names. The workers start in the background (``client.wait_for_workers`` waits)."""
    if not gpus or any(n < 1 for n in gpus.values()):
        raise WorkerSpecError(f"gpus must give each GPU type a count >= 1, like {{'A10': 2}}; got {dict(gpus)!r}")
    taken = {str(name).split("/")[0] for name in cluster.worker_spec}
    server = next(f"node-{i}" for i in range(len(taken) + 1) if f"node-{i}" not in taken)
    base = cluster.new_spec
    names = []
    for slot in worker_specs(emulate=dict(gpus), server=server):
        cluster.worker_spec[slot.name] = {"cls": base["cls"], "options": {**base["options"], **slot.worker_options()}}
        names.append(slot.name)
    cluster.scale(len(cluster.worker_spec))  # starts the specs that have no worker yet
    logger.info("daskpipe: adding %s on %s", dict(gpus), server)
    return names


class DaskpipeAdaptive(Adaptive):
    """``Adaptive`` driven by the daskpipe plugin's scaling advice (see the module docstring).

    ``grow(cluster, {gpu type: slots})`` starts workers of a GPU type; the default adds emulated
    GPUs to an ``EmulatedCluster`` (:func:`add_emulated_gpus`). For a real cluster pass a function
    that asks the resource manager for nodes of that type running ``daskpipe worker``.
    """

    def __init__(self, cluster: Any = None, *, grow: GrowFn = add_emulated_gpus, **kwargs: Any):
        self.grow = grow
        self.advice: dict[str, Any] = {"wanted": {}, "closable": [], "leaving": []}
        super().__init__(cluster, **kwargs)

    async def target(self) -> int:
        """The workers there are, plus the slots wanted, minus the workers without a stage."""
        advice = await self.scheduler.daskpipe_scaling()
        if advice is None:
            raise RuntimeError("the scheduler has no daskpipe plugin: start it with `dask scheduler --preload daskpipe`")
        self.advice = advice
        return len(self.plan) + sum(advice["wanted"].values()) - len(advice["closable"])

    async def workers_to_close(self, target: int) -> list[str]:
        """Only workers that hold no stage (the plugin drains a surplus GPU type by re-planning first)."""
        return list(self.advice["closable"])[: max(0, len(self.plan) - target)]

    # distributed's AdaptiveCore annotates scale_up(workers: Iterable) but calls it with the target count n
    async def scale_up(self, n: int) -> None:  # type: ignore[override]
        """Start the wanted slots, the most wanted type first, up to ``n`` workers in all (the target,
        which Adaptive holds within its ``maximum``): a bad rate near 1 wants many more than that."""
        room = n - len(self.plan)
        wanted: dict[str, int] = {}
        for gpu, count in sorted(self.advice["wanted"].items(), key=lambda item: -item[1]):
            if (take := min(count, room - sum(wanted.values()))) > 0:
                wanted[gpu] = take
        if not wanted:
            return
        logger.info("daskpipe: scaling up by %s (target %d workers)", wanted, n)
        started = self.grow(self.cluster, wanted)
        if inspect.isawaitable(started):
            await started
