"""Hybrid inference fragments and the devices that produce them (Neurosurgeon-style splits).

A mobile device runs blocks ``[0, k)`` of a model, uploads the feature map at boundary ``k`` and
the server runs ``[k, N)``: a *fragment* ``<k, t, q>`` with the server's time budget ``t`` (SLO
minus device compute minus upload) and request rate ``q``. Devices pick ``k`` as Neurosurgeon
does, minimising device + upload + server latency at batch 1, so fragments of one model land at
different split points as bandwidth varies.

Device model: the two boards of the Graft testbed take their whole-model latencies from its
Table II (Jetson Nano / TX2 at batch 1) and spread them over blocks in proportion to the
estimator's per-block FLOPs (``Profile.meta["block_gflops_batch1"]``); a model Table II lacks
runs at the board's Inception-v3 rate (11.5 GFLOP in 165 / 94 ms). The SLO is 95% of the
device's whole-model latency (Graft §5.1).

Uplink: bandwidth is log-normal, median 40 Mbit/s, sigma 0.9 (roughly 7 to 240 Mbit/s, the spread
of 5G uplink traces such as Raca et al.), plus a fixed one-way network delay of 5 ms. The raw
input travels as fp32 (twice the profile's fp16 ``input_bytes``: 602 KB at 224x224, the paper's
"about 588 KB"); feature maps at the profile's fp16 boundary sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from daskpipe.graft.costs import StageCosts
from daskpipe.profiles.model import Profile, ProfileError

SLO_FRACTION = 0.95  # Graft: SLO = 95% of the on-device whole-model latency
DEFAULT_RATE_RPS = 30.0  # Graft: requests per second per device
RAW_INPUT_FACTOR = 2.0  # the device uploads the fp32 image; profiles count fp16 bytes


@dataclass(frozen=True)
class Fragment:
    """Server-side work of one or more devices: blocks ``[start_block, N)`` of ``model``.

    ``budget_ms`` is the time the server has (SLO minus device compute and upload), ``rate_rps``
    the summed request rate and ``members`` the device ids merged into it.
    """

    model: str
    start_block: int
    budget_ms: float
    rate_rps: float
    members: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.start_block < 0:
            raise ValueError(f"fragment {self.members}: start block must be >= 0, got {self.start_block}")
        if not self.budget_ms > 0 or not math.isfinite(self.budget_ms):
            raise ValueError(f"fragment {self.members}: budget must be a positive number of ms, got {self.budget_ms}")
        if not self.rate_rps > 0:
            raise ValueError(f"fragment {self.members}: rate must be positive, got {self.rate_rps}")
        if not self.members:
            raise ValueError("a fragment needs at least one member device id")


@dataclass(frozen=True)
class DeviceType:
    """A phone-class board: measured whole-model latencies, else a sustained GFLOP/s rate."""

    name: str
    effective_gflops: float
    whole_model_ms: Mapping[str, float] = field(default_factory=dict)

    def block_latency_ms(self, profile: Profile) -> np.ndarray:
        """Per-block latency (ms) of ``profile``'s blocks on this device."""
        gflops = profile.meta.get("block_gflops_batch1")
        if gflops is None or len(gflops) != profile.num_blocks:
            raise ProfileError(
                f"{profile.source}: model {profile.model!r} lacks meta.block_gflops_batch1 (one per block); "
                "estimate it with daskpipe.profiles.estimate_profile to get device latencies"
            )
        gflops = np.asarray(gflops, dtype=float)
        if profile.model in self.whole_model_ms:
            return gflops / gflops.sum() * self.whole_model_ms[profile.model]
        return gflops / self.effective_gflops * 1e3


_INCEPTION_V3_GFLOP = 11.5  # 2 x 5.7 GMAC at 299x299
# Graft Table II; its "Mob" is DeepLabV3-MobileNetV3-Large, which mobilenet_v3_large stands in for
JETSON_NANO = DeviceType(
    "jetson-nano", _INCEPTION_V3_GFLOP / 0.165, {"inception_v3": 165.0, "resnet101": 226.0, "vgg11": 147.0, "mobilenet_v3_large": 84.0}
)
JETSON_TX2 = DeviceType(
    "jetson-tx2", _INCEPTION_V3_GFLOP / 0.094, {"inception_v3": 94.0, "resnet101": 114.0, "vgg11": 77.0, "mobilenet_v3_large": 67.0}
)


@dataclass(frozen=True)
class Uplink:
    """The device-to-server link: log-normal bandwidth in Mbit/s plus a fixed one-way delay."""

    median_mbps: float = 40.0
    sigma: float = 0.9
    delay_ms: float = 5.0

    def sample_mbps(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return self.median_mbps * np.exp(self.sigma * rng.standard_normal(size))

    def transfer_ms(self, num_bytes: float, mbps: float) -> float:
        return self.delay_ms + num_bytes * 8 / (mbps * 1e6) * 1e3


@dataclass(frozen=True)
class Split:
    """Neurosurgeon's choice for one device: first server block ``start_block`` (N = all local)."""

    start_block: int
    device_ms: float
    upload_ms: float
    server_ms: float  # batch 1 on a whole GPU
    slo_ms: float

    @property
    def budget_ms(self) -> float:
        return self.slo_ms - self.device_ms - self.upload_ms


def neurosurgeon_split(costs: StageCosts, device: DeviceType, mbps: float, uplink: Uplink) -> Split:
    """The split point minimising device + upload + server latency (batch 1, whole GPU).

    Split ``k = 0`` offloads everything (uploads the input); ``k = N`` runs all on the device.
    """
    profile = costs.profile
    device_blocks = device.block_latency_ms(profile)
    device_prefix = np.concatenate([[0.0], np.cumsum(device_blocks)])
    slo_ms = SLO_FRACTION * float(device_prefix[-1])
    upload_bytes = [RAW_INPUT_FACTOR * profile.input_bytes, *profile.boundary_bytes]
    candidates = [
        Split(k, float(device_prefix[k]), uplink.transfer_ms(upload_bytes[k], mbps), costs.suffix_batch1_ms(k), slo_ms)
        for k in range(profile.num_blocks)
    ]
    candidates.append(Split(profile.num_blocks, float(device_prefix[-1]), 0.0, 0.0, slo_ms))
    return min(candidates, key=lambda s: s.device_ms + s.upload_ms + s.server_ms)


def sample_fragments(
    costs: StageCosts,
    *,
    num_devices: int,
    device_mix: Sequence[tuple[DeviceType, float]] = ((JETSON_NANO, 0.75), (JETSON_TX2, 0.25)),
    uplink: Uplink = Uplink(),
    rate_rps: float = DEFAULT_RATE_RPS,
    rng: np.random.Generator,
) -> list[Fragment]:
    """One fragment per device that offloads, with devices drawn from ``device_mix`` (type, weight).

    A device whose best split runs everything locally, or leaves the server less than twice its
    batch-1 latency (no feasible plan under Graft's queueing rule), sends nothing and is skipped.
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    types, weights = zip(*device_mix)
    probabilities = np.asarray(weights, dtype=float) / float(np.sum(weights))
    chosen = rng.choice(len(types), size=num_devices, p=probabilities)
    bandwidths = uplink.sample_mbps(rng, num_devices)
    fragments = []
    for i, (type_index, mbps) in enumerate(zip(chosen, bandwidths)):
        split = neurosurgeon_split(costs, types[type_index], float(mbps), uplink)
        if split.start_block < costs.num_blocks and split.budget_ms > 2 * split.server_ms:
            fragments.append(
                Fragment(costs.profile.model, split.start_block, split.budget_ms, rate_rps, (f"{types[type_index].name}-{i}",))
            )
    return fragments
