"""Serving Graft plans on daskpipe's runtime: requests that enter a model mid-way (docs/hybrid.md).

:func:`deploy_hybrid` turns a Graft :class:`~daskpipe.graft.planner.ServingPlan` into a daskpipe
``Plan`` with one pipeline per fragment route (``Pipeline.entry_block`` = the fragment's start
block, ``Pipeline.slo_us`` = its budget), places one stage actor per (plan stage, slot) and tells
the scheduler plugin to serve the model with the ``"hybrid"`` dispatcher
(:class:`~daskpipe.sched.hybrid.FragmentDispatcher`). A private stage is an ordinary
:class:`~daskpipe.runtime.worker.stage.Stage`; a stage that several routes go through is a
:class:`SharedStage`, whose batches from different private stages run as one compute call. The
returned :class:`~daskpipe.runtime.client.service.Service` takes ``submit(model, fm, start_block=k)``.

Entries: block 0 takes the example input's dtype; a block ``k > 0`` takes the float16 feature map
of boundary ``k`` (the form stages hand over and devices upload), checked on the client against
the shape the profile records there.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from distributed import Client
from torch import nn

from daskpipe.graft.execute import entry_shape
from daskpipe.graft.fragments import Fragment
from daskpipe.graft.planner import ServingPlan
from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan
from daskpipe.profiles.fx import SegmentationError
from daskpipe.profiles.model import Profile
from daskpipe.runtime.client.arguments import check_example, check_module, check_profile
from daskpipe.runtime.client.service import InputSpec, Service, awaitable_with_asynchronous_client, cut_blocks, inventory, open_stream
from daskpipe.runtime.deploying.deployment import StageLaunch, pickle_blocks, release, start_stages
from daskpipe.runtime.deploying.placement import FreeSlots
from daskpipe.runtime.errors import DeployError, InvalidRequest, check_positive
from daskpipe.runtime.wire.messages import BatchHeader, ServeSettings, WorkerSlot
from daskpipe.runtime.worker.stage import FEATURE_MAP_DTYPE, Stage, decode_inputs, keep_running

RECENT_CALLS = 256
"""Compute calls a shared stage remembers for ``info()``: dispatch ids, their samples, seconds held."""


# -- the plan ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HybridPlan:
    """A ``Plan`` for a ServingPlan, and which of the ServingPlan's stages each partition runs on.

    ``stage_of[(pipeline, partition)]`` is a ServingPlan stage index: partitions with the same
    index are one pool of stage actors (a shared stage appears in several pipelines). ``slices``
    gives the MPS slice count ``v`` each stage's instances run on.
    """

    plan: Plan
    serving: ServingPlan
    stage_of: dict[tuple[int, int], int]
    slices: dict[int, int]

    @property
    def shared(self) -> set[int]:
        """Stages more than one pipeline goes through."""
        users: dict[int, set[int]] = defaultdict(set)
        for (p, _), index in self.stage_of.items():
            users[index].add(p)
        return {index for index, pipelines in users.items() if len(pipelines) > 1}


def slice_for(share: int, offered: Sequence[int]) -> int:
    """The most slices ``v`` among ``offered`` whose 1/v of a GPU still holds ``share`` percent
    (the smallest slot that fits Graft's MPS share); the biggest slot if none does."""
    fitting = [v for v in offered if 100 / v >= share]
    return max(fitting) if fitting else min(offered)


def hybrid_plan(serving: ServingPlan, fragments: Sequence[Fragment], profile: Profile, *, offered_slices: Sequence[int]) -> HybridPlan:
    """One pipeline per distinct route of ``serving``: its stages as partitions (``instances``
    slots of ``1/v`` of the plan's GPU each), entering at the route's first block, with the
    tightest budget and the summed rate of the devices that take it."""
    if profile.model != serving.model:
        raise DeployError(f"the profile is of {profile.model!r}, the plan serves {serving.model!r}")
    offered = sorted(set(offered_slices) & set(profile.slices(serving.gpu)))
    if not offered:
        raise DeployError(
            f"the cluster offers {serving.gpu} slots with v={sorted(set(offered_slices))}; the profile of {profile.model!r} has tables "
            f"for v={profile.slices(serving.gpu)}"
        )
    slices = {i: slice_for(stage.share, offered) for i, stage in enumerate(serving.stages)}
    devices: dict[tuple[int, ...], list[tuple[float, float]]] = defaultdict(list)  # route -> (budget ms, rate) per device
    for fragment in fragments:
        for member in fragment.members:
            route = serving.routes.get(member)
            if route is None:
                raise DeployError(f"the plan for {serving.model!r} has no route for device {member!r}")
            if serving.stages[route[0]].start != fragment.start_block:
                raise DeployError(
                    f"device {member!r} enters at block {fragment.start_block} but its route starts at block "
                    f"{serving.stages[route[0]].start}"
                )
            devices[route].append((fragment.budget_ms, fragment.rate_rps / len(fragment.members)))
    if not devices:
        raise DeployError(f"no fragment of {serving.model!r} to serve")
    pipelines, stage_of = [], {}
    for p, (route, members) in enumerate(sorted(devices.items())):
        stages = [serving.stages[i] for i in route]
        batch = min([s.batch for s in stages] + [profile.max_batch(serving.gpu, slices[i]) for i in route])
        partitions = tuple(
            Partition(
                blocks=(s.start, s.end),
                gpu=serving.gpu,
                slices=slices[i],
                vgpus=s.instances,
                latency_us=profile.latency(serving.gpu, slices[i], batch, s.start, s.end),
            )
            for i, s in zip(route, stages)
        )
        stage_of.update({(p, q): i for q, i in enumerate(route)})
        pipelines.append(
            Pipeline(
                batch_size=batch,
                throughput=sum(r for _, r in members),
                partitions=partitions,
                entry_block=stages[0].start,
                slo_us=min(b for b, _ in members) * 1e3,
            )
        )
    model = ModelPlan(
        name=serving.model,
        slo_us=max(p.slo_us or 0.0 for p in pipelines),  # every hybrid pipeline has its fragments' budget
        weight=1.0,
        throughput=sum(p.throughput for p in pipelines),
        pipelines=tuple(pipelines),
    )
    plan = Plan(objective=model.throughput, models=(model,), strategy="graft", settings={"gpu_share_percent": serving.gpu_share})
    return HybridPlan(plan, serving, stage_of, slices)


# -- the client's check ------------------------------------------------------------------------
@dataclass(frozen=True)
class EntrySpec(InputSpec):
    """What a request entering at ``start_block`` > 0 must be: boundary ``k``'s float16 feature map."""

    start_block: int = 0

    def admit(self, model: str, x: Any) -> tuple[int, bytes]:
        try:
            return super().admit(model, x)
        except InvalidRequest as exc:
            raise InvalidRequest(
                f"{exc} (a request entering at block {self.start_block} carries the {FEATURE_MAP_DTYPE} feature map "
                f"that blocks [0, {self.start_block}) make; did the device split at another block?)"
            ) from None


# -- the shared stage --------------------------------------------------------------------------
class SharedStage(Stage):
    """A stage that several private stages feed: batches that wait for its slot run as ONE call.

    While the slot computes a batch, the batches that reach the stage queue here; when it frees,
    they are concatenated (in arrival order, up to ``max_batch`` samples, a batch never split)
    and computed together, then each constituent batch goes on (or is stored) with its own keys,
    and each reports the merged run's interval as its compute feedback. An emulated shared stage
    holds the merged batch for ``latency_s[samples - 1]`` (its profiled, dilated latency), not
    for the constituents' separate holds.
    """

    def __init__(
        self, model: str, partition: int, modules: bytes | Sequence[bytes], *, max_batch: int, latency_s: Sequence[float], **kwargs: Any
    ):
        if max_batch < 1 or len(latency_s) < max_batch:
            raise ValueError(
                f"a shared stage needs max_batch >= 1 and a latency for every batch size up to it, got {max_batch} and {len(latency_s)}"
            )
        super().__init__(model, partition, modules, max_batch=max_batch, **kwargs)
        self.max_batch = max_batch
        self._latency_s = tuple(float(t) for t in latency_s)
        self._waiting: deque[tuple[BatchHeader, Any, float | None]] = deque()
        self._draining = False
        self.merged_calls = 0
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_CALLS)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "max_batch": self.max_batch, "merged_calls": self.merged_calls, "recent": list(self.recent)}

    def run(self, batch: BatchHeader, data: torch.Tensor | Sequence[bytes], received_at: float | None = None) -> None:
        self._waiting.append((batch, data, received_at))
        if self._draining:  # the running drain takes it with the next merged call
            return
        self._draining = True
        keep_running(self.worker, self._drain())

    async def _drain(self) -> None:
        try:
            while self._waiting:
                await self._run_merged(self._take())
        finally:
            self._draining = False

    def _take(self) -> list[tuple[BatchHeader, Any, float | None]]:
        group = [self._waiting.popleft()]
        samples = sum(group[0][0]["sizes"])
        while self._waiting and samples + sum(self._waiting[0][0]["sizes"]) <= self.max_batch:
            samples += sum(self._waiting[0][0]["sizes"])
            group.append(self._waiting.popleft())
        return group

    async def _run_merged(self, group: list[tuple[BatchHeader, Any, float | None]]) -> None:
        counts = [sum(batch["sizes"]) for batch, _, _ in group]
        try:
            merged = torch.cat([self._as_tensor(data) for _, data, _ in group])
            hold = self._latency_s[min(sum(counts), len(self._latency_s)) - 1]
            output, start, end, overrun = await self._compute_held(merged, [size for batch, _, _ in group for size in batch["sizes"]], hold)
        except Exception as exc:  # fails the merged call's batches only, each with the cause
            for batch, _, _ in group:
                self._fail(batch, exc)
            return
        self.batches += 1
        self.merged_calls += len(group) > 1
        self.recent.append({"dispatches": [batch["dispatch"] for batch, _, _ in group], "samples": counts, "held_s": end - start})
        outputs = iter(output)  # one per request, in the group's order
        for batch, _, received_at in group:
            own = [next(outputs) for _ in batch["sizes"]]
            forwarded = len(batch["route"]) > 1
            self._deliver(
                batch,
                torch.cat(own).to(FEATURE_MAP_DTYPE) if forwarded else own,
                batch["route"][0]["partition"],
                (start, end),
                received_at,
                overrun,
            )

    def _as_tensor(self, data: torch.Tensor | Sequence[bytes]) -> torch.Tensor:
        """A batch's input: a previous stage's feature map, or entering requests' raw bytes."""
        x = data if isinstance(data, torch.Tensor) else decode_inputs(data, self._input_dtype, self._input_shape)
        return x.to(self._dtype)


# -- deploy ------------------------------------------------------------------------------------
@awaitable_with_asynchronous_client
def deploy_hybrid(
    client: Client,
    module: nn.Module,
    *,
    serving: ServingPlan,
    fragments: Sequence[Fragment],
    profile: Profile,
    example_input: torch.Tensor,
    time_dilation: float = 1.0,
    bw_gbps: float = 10.0,
) -> Service:
    """Serve Graft's ``serving`` plan of ``module`` for ``fragments`` on ``client``'s cluster.

    ``profile`` must carry ``meta.segment_boundaries`` (the blocks are rebuilt from it) and
    tables for the plan's GPU on the cluster's slice counts; ``example_input`` (block 0's batched
    input) fixes the raw input's dtype. Raises :class:`DeployError` when the cluster cannot hold
    the plan.
    """
    check_module("module", module)
    if not isinstance(serving, ServingPlan):
        raise DeployError(f"serving must be a graft ServingPlan, got {type(serving).__name__}")
    if isinstance(fragments, (str, bytes)) or not isinstance(fragments, Sequence) or not all(isinstance(f, Fragment) for f in fragments):
        raise DeployError(f"fragments must be a sequence of graft Fragments, got {type(fragments).__name__}")
    check_profile("profile", profile)
    check_example("example_input", example_input)
    check_positive("time_dilation", time_dilation)
    check_positive("bw_gbps", bw_gbps, " Gbit/s")
    name = serving.model
    slots = inventory(client)
    hybrid = hybrid_plan(serving, fragments, profile, offered_slices=[s.slices for s in slots if s.gpu == serving.gpu])
    try:
        blocked = cut_blocks(name, module, example_input, profile)
    except SegmentationError as exc:
        raise DeployError(f"model {name!r} cannot be cut into the profile's blocks: {exc}") from exc
    launches = hybrid_launches(hybrid, slots, profile, example_input.dtype, time_dilation)
    started = client.sync(start_stages, client, launches, {name: pickle_blocks(blocked.blocks)})
    largest: dict[int, int] = {}
    for pipeline in hybrid.plan.model(name).pipelines:
        largest[pipeline.entry_block] = max(largest.get(pipeline.entry_block, 0), pipeline.batch_size)
    specs = {name: InputSpec(tuple(blocked.input_shape), example_input.dtype, largest[0])} if 0 in largest else {}
    entries = {(name, k): EntrySpec(entry_shape(profile, k), FEATURE_MAP_DTYPE, most, start_block=k) for k, most in largest.items() if k}
    sample_nbytes = specs[name].sample_nbytes if specs else 0  # the scheduler re-checks block-0 payloads only
    stream = open_stream(client)  # before serving: the trial's first stages fetch large samples from this client
    try:
        with stream.trial_inputs(sample_nbytes) as trial:
            client.sync(
                client.scheduler.daskpipe_serve,
                model=name,
                plan=hybrid.plan.to_dict(),
                profile=profile.to_dict(),
                stages=started.rows[name],
                serving=ServeSettings(dispatcher="hybrid", time_dilation=float(time_dilation), bw_gbps=float(bw_gbps)).to_wire(),
                sample_nbytes=sample_nbytes,
                **trial,
            )
    except Exception:
        release(started.futures)
        client.sync(stream.close)
        raise
    return Service(client, hybrid.plan, {name: profile}, specs, started.futures, float(time_dilation), entries=entries, stream=stream)


def hybrid_launches(
    hybrid: HybridPlan, slots: list[WorkerSlot], profile: Profile, input_dtype: torch.dtype, time_dilation: float
) -> list[StageLaunch]:
    """One stage per (plan stage, slot): ``instances`` free slots of the plan's GPU with the stage's
    slice count; a shared stage is a :class:`SharedStage` and stands in every pipeline it is part of."""
    gpu, shared, free = hybrid.serving.gpu, hybrid.shared, FreeSlots(slots)
    following: dict[int, set[int]] = defaultdict(set)
    for (p, q), index in hybrid.stage_of.items():
        if (p, q + 1) in hybrid.stage_of:
            following[index].add(hybrid.stage_of[(p, q + 1)])
    launches = []
    for index in sorted(set(hybrid.stage_of.values())):
        stage, v = hybrid.serving.stages[index], hybrid.slices[index]
        serves = tuple(sorted(pq for pq, i in hybrid.stage_of.items() if i == index))
        most = min(stage.batch, profile.max_batch(gpu, v))
        options: dict[str, Any] = {"max_batch": most}
        if index in shared:
            options["latency_s"] = [profile.latency(gpu, v, b, stage.start, stage.end) * 1e-6 * time_dilation for b in range(1, most + 1)]
        dtype = input_dtype if stage.start == 0 else FEATURE_MAP_DTYPE
        for slot in free.take(gpu, v, stage.instances, f"stage {index} (blocks [{stage.start}, {stage.end}), {stage.share}% share)"):
            launches.append(
                StageLaunch(
                    model=hybrid.serving.model,
                    partition=min(q for _, q in serves),  # a shared stage takes each batch's from its route
                    blocks=(stage.start, stage.end),
                    slot=slot,
                    input_shape=entry_shape(profile, stage.start),
                    input_dtype=str(dtype).removeprefix("torch."),
                    stage_class=SharedStage if index in shared else Stage,
                    pool=(index,),
                    feeds=tuple((nxt,) for nxt in sorted(following[index])),
                    serves=serves,
                    options=options,
                )
            )
    return launches
