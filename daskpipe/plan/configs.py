"""Every pipeline configuration that fits a model's SLO budget, enumerated before the MILP runs.

With at most 2-3 partitions over ~10 blocks there are only a few thousand (cut points, GPU type and
slice count per partition, batch size) choices per model. Filtering them by the SLO here and
dropping dominated ones leaves the MILP with nothing to decide but pool sizes, which makes it small
and tight (PPipe's artifact instead encodes partitions as binaries and needs seconds to minutes).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np

from daskpipe.profiles.model import Profile

Resource = tuple[str, int]  # (GPU type, slices v): what one vGPU of a pool is


@dataclass(frozen=True)
class Budget:
    """What the configurations of one model must respect (all times in µs)."""

    latency_us: float  # (1 - margin) * SLO
    bw_gbps: float
    gpus_per_server: Mapping[str, int]
    batch_build_rate: float | None  # req/s that fill a batch (x_np); None: no batch-build estimate
    batch_build_factor: float = 1.3

    def transfer_us(self, nbytes: float, batch: int) -> float:
        """A batch's feature map crossing the network: linear in the batch size."""
        return batch * nbytes * 8 / (self.bw_gbps * 1e9) * 1e6

    def batch_build_us(self, batch: int) -> float:
        if self.batch_build_rate is None:
            return 0.0
        return self.batch_build_factor * (batch - 1) / self.batch_build_rate * 1e6

    def nic_cap(self, nbytes: float, resource: Resource) -> float:
        """Requests/s one vGPU can send or receive when all vGPUs of its server share the NIC."""
        gpu, v = resource
        if nbytes <= 0:
            return math.inf
        return self.bw_gbps * 1e9 / (nbytes * 8) / (v * self.gpus_per_server.get(gpu, 1))


@dataclass(frozen=True)
class Config:
    """One way to serve a model: contiguous partitions, each on a pool of one resource, one batch size."""

    model: str
    bounds: tuple[int, ...]  # block boundaries, first 0, last num_blocks
    resources: tuple[Resource, ...]  # one per partition
    batch_size: int
    latency_us: tuple[float, ...]  # per partition, one batch on one vGPU
    transfer_us: tuple[float, ...]  # per partition, the batch leaving it (0 for the last)
    vgpu_throughput: tuple[float, ...]  # req/s of one vGPU of each partition's pool
    total_latency_us: float  # the input's way in, latencies, transfers and the batch-build estimate

    @property
    def num_parts(self) -> int:
        return len(self.resources)


def resources_of(profile: Profile, gpus: Sequence[str], max_slices: int | None = None) -> list[Resource]:
    """(GPU type, v) pairs the profile has tables for, restricted to the cluster's types."""
    return [(g, v) for g in gpus for v in profile.slices(g) if max_slices is None or v <= max_slices]


def enumerate_configs(
    profile: Profile,
    resources: Sequence[Resource],
    budget: Budget,
    max_parts: int,
) -> list[Config]:
    """All configurations meeting ``budget``, with dominated ones removed."""
    n = profile.num_blocks
    # prefix sums over blocks: cum[r][i, b-1] = latency of blocks [0, i) at batch b; blocks clipped to >= 1 µs as the artifact does
    cum = {
        r: np.vstack([np.zeros(profile.table(*r).shape[1]), np.cumsum(np.clip(profile.table(*r), 1.0, None), axis=0)]) for r in resources
    }
    configs: list[Config] = []
    for parts in range(1, min(max_parts, n) + 1):
        for cuts in itertools.combinations(range(1, n), parts - 1):
            bounds = (0, *cuts, n)
            in_bytes = [profile.bytes_into(start) for start in bounds[:-1]]
            for chain in _chains(resources, parts):
                max_batch = min(cum[r].shape[1] for r in chain)
                for b in range(1, max_batch + 1):
                    config = _config(profile.model, bounds, chain, b, cum, in_bytes, budget)
                    if config is not None:
                        configs.append(config)
    return prune_dominated(configs)


def _chains(resources: Sequence[Resource], parts: int) -> Iterator[tuple[Resource, ...]]:
    """Resource sequences for ``parts`` partitions; neighbours on the same resource would just be one partition."""
    for chain in itertools.product(resources, repeat=parts):
        if all(a != b for a, b in zip(chain, chain[1:])):
            yield chain


def _config(
    model: str,
    bounds: tuple[int, ...],
    chain: tuple[Resource, ...],
    batch: int,
    cum: Mapping[Resource, np.ndarray],
    in_bytes: Sequence[float],
    budget: Budget,
) -> Config | None:
    """``in_bytes[d]``: what partition ``d`` receives per sample, the request's input for the first."""
    latency = tuple(float(cum[r][end, batch - 1] - cum[r][start, batch - 1]) for r, start, end in zip(chain, bounds, bounds[1:]))
    transfer = tuple(budget.transfer_us(nb, batch) for nb in in_bytes[1:]) + (0.0,)
    way_in = budget.transfer_us(in_bytes[0], batch)
    total = way_in + sum(latency) + sum(transfer) + budget.batch_build_us(batch)
    if total > budget.latency_us:
        return None
    throughput = []
    for d, (r, lat) in enumerate(zip(chain, latency)):
        caps = [batch * 1e6 / lat, budget.nic_cap(in_bytes[d], r)]  # receives the input or the previous partition's feature map
        if d < len(chain) - 1:  # sends its own
            caps.append(budget.nic_cap(in_bytes[d + 1], r))
        throughput.append(min(caps))
    return Config(model, bounds, chain, batch, latency, transfer, tuple(throughput), total)


def prune_dominated(configs: Sequence[Config]) -> list[Config]:
    """Drop configurations another one beats on every pool of the same resources.

    A config's cost is only the vGPUs its pools need per req/s (1 / vGPU throughput per pool), so
    among configs whose pools use the same resources (as a multiset: A -> B -> A has two pools on
    A), one whose pools are each at least as fast as their counterparts needs no more GPUs for any
    throughput; ties go to the lower latency. Pools on one resource are paired slowest with slowest.
    """
    groups: dict[tuple[Resource, ...], list[Config]] = {}
    for c in configs:
        groups.setdefault(tuple(sorted(c.resources)), []).append(c)
    kept: list[Config] = []
    for members in groups.values():
        vectors = [np.array(pool_throughputs(c)) for c in members]
        order = sorted(range(len(members)), key=lambda i: (-float(vectors[i].sum()), members[i].total_latency_us))
        front: list[int] = []
        for i in order:
            if not any(np.all(vectors[j] >= vectors[i]) for j in front):
                front.append(i)
        kept.extend(members[i] for i in front)
    return kept


def pool_order(resources: Sequence[Resource], throughputs: Sequence[float]) -> list[int]:
    """Pool indices sorted by (resource, throughput): two pool lists on the same resources pair up
    position by position, slowest with slowest on a resource they use twice."""
    return sorted(range(len(resources)), key=lambda d: (resources[d], throughputs[d]))


def pool_throughputs(config: Config) -> list[float]:
    """Per-vGPU throughput of ``config``'s pools in :func:`pool_order`."""
    return [config.vgpu_throughput[d] for d in pool_order(config.resources, config.vgpu_throughput)]
