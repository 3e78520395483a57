"""Stage actors: placed, started, connected and retired the same way for ``deploy``, elastic re-plans and hybrid plans.

A plan becomes a list of :class:`StageLaunch` descriptions (:func:`ppipe_launches` for a PPipe plan,
``runtime.hybrid`` for a Graft plan); :func:`start_stages` starts them all. It runs on the event
loop of the client that starts them: ``deploy``'s (through ``client.sync``) or the scheduler's own
asynchronous client (a re-plan), so every Dask call in it is awaited. Torch-free at import, so that
the scheduler loads it before any model does; the stage classes come with the launches.
"""

from __future__ import annotations

import asyncio
import pickle
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from distributed import wait

from daskpipe.plan.schema import Plan
from daskpipe.runtime.deploying.placement import place
from daskpipe.runtime.errors import DeployError
from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.messages import WorkerSlot

if TYPE_CHECKING:
    from distributed import Client, Future

START_TIMEOUT_S = 300.0
"""Longest wait for every stage actor to load its blocks: a stage not up by then fails the start."""
WORKER_CHECK_S = 1.0
"""How often a start checks that the workers of its stages not up yet are still in the cluster:
Dask keeps a task pinned to a worker that left waiting for that worker, so such a start would
otherwise wait its whole timeout (60 s of no capacity after a re-plan raced a second kill)."""


@dataclass(frozen=True)
class StageLaunch:
    """One stage actor to start: blocks ``[blocks[0], blocks[1])`` of ``model`` on ``slot``.

    ``pool`` names the stages that serve the same blocks (``(pipeline, partition)`` of a PPipe
    plan, ``(stage index,)`` of a Graft plan); the stage opens streams to every slot of the pools
    in ``feeds``. ``serves`` are the plan's ``(pipeline, partition)`` rows the stage stands for (a
    shared Graft stage stands in several pipelines).
    """

    model: str
    partition: int
    blocks: tuple[int, int]
    slot: WorkerSlot
    input_shape: tuple[int, ...]
    input_dtype: str  # a torch dtype name
    stage_class: type  # ``Stage`` or a subclass
    pool: tuple[int, ...]
    feeds: tuple[tuple[int, ...], ...]
    serves: tuple[tuple[int, int], ...]
    options: Mapping[str, Any] = field(default_factory=dict)  # the stage class's own keywords

    def submit(self, client: Client, blocks: Sequence[Future]) -> Future:
        """Submit the actor pinned to its slot; ``blocks`` are the model's scattered per-block pickles."""
        start, end = self.blocks
        return client.submit(
            self.stage_class,
            self.model,
            self.partition,
            list(blocks[start:end]),
            input_shape=self.input_shape,
            input_dtype=self.input_dtype,
            device="cpu" if self.slot.gpu == messages.CPU or self.slot.emulated else messages.GPU_DEVICE,
            emulated=self.slot.emulated,
            actor=True,
            workers=[self.slot.address],
            allow_other_workers=False,
            pure=False,
            key=f"daskpipe-stage-{self.model}-{'-'.join(map(str, self.pool))}-{uuid.uuid4().hex[:8]}",
            **self.options,
        )

    def describe(self) -> str:
        return f"{self.model!r} blocks [{self.blocks[0]}, {self.blocks[1]}) on {self.slot.address}"


@dataclass
class StartedStages:
    """What :func:`start_stages` made: the actors' futures (holding them keeps the stages alive)
    and, per model, the plugin's stage rows ``[pipeline, partition, address, key]``."""

    futures: list[Future]
    rows: dict[str, list[list]]


def pickle_blocks(blocks: Sequence[Any]) -> list[bytes]:
    """A model's torch.fx blocks pickled one by one: every stage and every re-plan takes slices of these bytes."""
    return [pickle.dumps(blocks[i : i + 1]) for i in range(len(blocks))]


def ppipe_launches(
    plan: Plan,
    slots: list[WorkerSlot],
    input_shapes: Mapping[str, Sequence[Sequence[int]]],
    input_dtypes: Mapping[str, str],
) -> list[StageLaunch]:
    """The stages of the models of ``input_shapes`` (block i's per-sample input shape, per model) on ``slots``."""
    return plan_launches(plan, place(plan, list(input_shapes), slots), input_shapes, input_dtypes)


def plan_launches(
    plan: Plan,
    placed: Mapping[str, Sequence[tuple[int, int, WorkerSlot]]],
    input_shapes: Mapping[str, Sequence[Sequence[int]]],
    input_dtypes: Mapping[str, str],
) -> list[StageLaunch]:
    """The stages of ``plan``'s pools on the slots ``placed`` gives them (model -> (pipeline,
    partition, slot) rows): :func:`~daskpipe.runtime.deploying.placement.place`'s, or a shared pool's."""
    from daskpipe.runtime.worker.stage import FEATURE_MAP_DTYPE, Stage

    launches = []
    for name, placements in placed.items():
        pipelines = plan.model(name).pipelines
        for p, q, slot in placements:
            start, end = pipelines[p].partitions[q].blocks
            launches.append(
                StageLaunch(
                    model=name,
                    partition=q,
                    blocks=(start, end),
                    slot=slot,
                    input_shape=tuple(input_shapes[name][start]),
                    input_dtype=input_dtypes[name] if start == 0 else str(FEATURE_MAP_DTYPE).removeprefix("torch."),
                    stage_class=Stage,
                    pool=(p, q),
                    feeds=((p, q + 1),) if q + 1 < len(pipelines[p].partitions) else (),
                    serves=((p, q),),
                    options={"max_batch": pipelines[p].batch_size},
                )
            )
    return launches


async def start_stages(
    client: Client, launches: Sequence[StageLaunch], blocks: Mapping[str, list[bytes]], timeout: float = START_TIMEOUT_S
) -> StartedStages:
    """Start every launch, its streams to the pools it feeds open; all of them or none.

    Each model's per-block pickles are scattered once (not embedded in every stage's task, a large
    graph through the scheduler), under keys of this start's own, and released once the stages
    hold them: under their content's hash, a start after one whose blocks died with their worker
    reused the lost keys, and its stages waited out the whole timeout (`bench chaos --fault flap`:
    60 s of an empty plan, 2000 requests dropped as no-capacity). A stage that cannot
    start fails the whole start with a :class:`DeployError` naming it and its cause, and every
    stage started is released.
    """
    futures: list[Future] = []
    scattered: dict[str, list[Future]] = {}
    try:
        for name in dict.fromkeys(launch.model for launch in launches):
            scattered[name] = await client.scatter(blocks[name], hash=False)
        futures = [launch.submit(client, scattered[launch.model]) for launch in launches]
        await _started(client, launches, futures, timeout)
        for launch, future in zip(launches, futures):
            if future.status != "finished":
                raise DeployError(f"stage actor {future.key} ({launch.describe()}) could not start: {await future.exception()!r}")
        addresses: dict[tuple[str, tuple[int, ...]], list[str]] = defaultdict(list)
        for launch in launches:
            addresses[(launch.model, launch.pool)].append(launch.slot.address)
        await asyncio.gather(
            *(
                client.run(connect_stage, future.key, peers, workers=[launch.slot.address])
                for launch, future in zip(launches, futures)
                if (peers := [a for pool in launch.feeds for a in addresses[(launch.model, pool)]])
            )
        )
    except BaseException:
        release(futures)
        raise
    finally:  # the started stages hold their blocks now
        release(block for model_blocks in scattered.values() for block in model_blocks)
    rows: dict[str, list[list]] = defaultdict(list)
    for launch, future in zip(launches, futures):
        rows[launch.model].extend([p, q, launch.slot.address, future.key] for p, q in launch.serves)
    return StartedStages(futures, dict(rows))


async def _started(client: Client, launches: Sequence[StageLaunch], futures: Sequence[Future], timeout: float) -> None:
    """Wait until every stage's future is done; fail as soon as a stage's worker has left."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await wait_through(client, futures, max(0.0, min(WORKER_CHECK_S, deadline - time.monotonic())))
            return
        except TimeoutError:
            pending = [launch for launch, future in zip(launches, futures) if not future.done()]
        workers = (await client.scheduler.identity())["workers"]
        gone = [launch.describe() for launch in pending if launch.slot.address not in workers]
        if gone:
            raise DeployError(f"{len(gone)} stage actors cannot start, their workers left the cluster: {'; '.join(gone)}")
        if time.monotonic() >= deadline:
            late = [launch.describe() for launch in pending]
            raise DeployError(f"{len(late)} stage actors did not start within {timeout:g}s: {'; '.join(late)}")


async def connect_stage(key: str, peers: list[str], dask_worker: Any) -> None:
    """On the stage's worker: open its streams to the pools it feeds. The stage is looked up by
    key, not through an ``Actor`` handle, whose future would belong to whatever client
    ``get_client`` finds in the scheduler's process (a handle released later would release the
    stage with it)."""
    await dask_worker.state.actors[key].connect(peers)


def wait_through(client: Client, futures: Sequence[Future], timeout: float | None) -> Any:
    """``distributed.wait`` on ``client``'s own event loop (an awaitable there, as in
    :func:`start_stages`). Dask's ``wait`` waits through the process's newest client: with a
    second one in the process (a monitoring client, say) it blocked the caller's loop on the
    other client's, and these futures, resolved by the blocked loop, never finished in time."""
    with client.as_current():
        return wait(futures, timeout=timeout)


def release(futures: Iterable[Future]) -> None:
    """Release what a failed start or deploy made (scattered data, stage actors) now: the error's
    traceback holds the frames that hold these futures, for as long as the caller keeps the error."""
    for future in futures:
        future.release()


# -- retiring stages (on the scheduler) ------------------------------------------------------------
def hand_over(scheduler: Any, old_keys: Iterable[str], new_keys: list[str], own: dict[str, Future], own_client: str | None) -> None:
    """The clients that held the old stages (``deploy``'s) hold the new ones, which ``own`` (the
    scheduler client's futures, by key) then lets go: a service whose client leaves is closed with
    its stages, as before a re-plan."""
    owners = {cs.client_key for key in old_keys if (ts := scheduler.tasks.get(key)) is not None for cs in ts.who_wants or ()} - {own_client}
    for owner in owners:
        scheduler.client_desires_keys(keys=new_keys, client=owner)
    if owners:
        release(future for key in new_keys if (future := own.pop(key, None)) is not None)


def retire_stages(scheduler: Any, keys: Iterable[str], own: dict[str, Future]) -> None:
    """Forget stage actors no plan uses, whichever client started them: ``own`` (the scheduler
    client's futures, by key) or any other that still wants them (``deploy``'s)."""
    for key in keys:
        future = own.pop(key, None)
        if future is not None:
            future.release()
        ts = scheduler.tasks.get(key)
        if ts is not None:
            for cs in list(ts.who_wants or ()):
                scheduler.client_releases_keys(keys=[key], client=cs.client_key, stimulus_id=f"daskpipe-replan-{time.time()}")
