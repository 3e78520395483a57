"""How long a batch of one model really takes: the one duration model of the simulator's ground
truth (``daskpipe.sim.simulate.ProfileDurations``) and of the emulated runtime's hold (an emulated
slot holds each batch this long, ``daskpipe.runtime.scheduler.plugin``).

A partition's compute is its blocks' profiled latency on the slot's (GPU, 1/v slice) at the
batch size, or, for a co-located stage, what the plan's interference model says next to its
co-runners; a feature map crossing a link takes ``batch * boundary bytes * 8 / bw``. A batch
beyond the profiled sizes has no duration: asking for one is an error, in both.
"""

from __future__ import annotations

import math
from typing import Protocol

from daskpipe.plan.schema import ModelPlan
from daskpipe.profiles.model import Profile


class StageLatency(Protocol):
    """Latencies that override the profile's for some stages (co-location's ``ColocatedLatency``)."""

    def latency_us(self, pipeline: int, partition: int, batch: int) -> float | None:
        """µs for a batch of ``batch`` on stage (``pipeline``, ``partition``); ``None``: not overridden."""


class BatchDurations:
    """Seconds a batch of ``model`` takes on each of its stages and links (module docstring).

    ``profile``, ``bw_gbps`` and ``colocated`` are in the caller's time: the runtime passes them
    time-dilated.
    """

    def __init__(self, model: ModelPlan, profile: Profile, *, bw_gbps: float, colocated: StageLatency | None = None) -> None:
        if not (bw_gbps > 0 and math.isfinite(bw_gbps)):
            raise ValueError(f"bw_gbps must be a positive number, got {bw_gbps!r}")
        self.model, self.profile, self.bw_gbps, self.colocated = model, profile, bw_gbps, colocated
        self._cache: dict[tuple[int, int, str, int, int], float] = {}

    def partitions(self, pipeline: int) -> int:
        return len(self.model.pipelines[pipeline].partitions)

    def compute_s(self, pipeline: int, partition: int, batch: int, gpu: str | None = None, slices: int | None = None) -> float:
        """Partition ``partition`` of ``pipeline`` on a (``gpu``, ``slices``) slot (default: the
        plan's for that partition) at batch ``batch``; a ``ValueError`` beyond the profiled sizes."""
        part = self.model.pipelines[pipeline].partitions[partition]
        gpu, slices = (part.gpu if gpu is None else gpu), (part.slices if slices is None else slices)
        key = (pipeline, partition, gpu, slices, batch)
        value = self._cache.get(key)
        if value is None:
            limit = self.profile.max_batch(gpu, slices)
            if not 1 <= batch <= limit:
                raise ValueError(
                    f"a batch of {batch} of {self.model.name!r} on {gpu}/v{slices}, which is profiled for batches 1 to {limit}"
                )
            latency_us = self.colocated.latency_us(pipeline, partition, batch) if self.colocated is not None else None
            if latency_us is None:
                latency_us = self.profile.latency(gpu, slices, batch, *part.blocks)
            value = self._cache[key] = latency_us / 1e6
        return value

    def transfer_s(self, pipeline: int, partition: int, batch: int) -> float:
        """The input of ``batch`` samples into ``partition`` crossing one link: the previous
        partition's feature map, or the requests' own inputs into a first partition."""
        start = self.model.pipelines[pipeline].partitions[partition].blocks[0]
        return batch * self.profile.bytes_into(start) * 8 / (self.bw_gbps * 1e9)
