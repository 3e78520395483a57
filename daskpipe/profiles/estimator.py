"""Analytic latency estimates for GPU types nobody has profiled here.

Each block is run once per batch size on the ``meta`` device (shapes only, no arithmetic) under
``FlopCounterMode``; every aten call is recorded with its FLOPs and the bytes it reads and writes.
An op's latency on a 1/v MPS slice is a roofline with a launch overhead:

    t = launch_us + max(flops / (peak / v * eff * util), bytes / (bandwidth / v * mem_eff))

where ``util = min(1, output_elements / (saturation * SMs))`` models a small batch that cannot
fill the GPU, and the v slices run at once, each with 1/v of the SMs and of the memory bandwidth.
``util`` counts the SMs of the whole GPU, not of the slice: in the published MPS tables v busy
slices at batch 1 give no more total throughput than one whole GPU (T4: 2.03x the latency at
v=2), so a smaller slice does not make small kernels more efficient; the v co-runners' contention
(bandwidth, L2, power cap) takes the gain. Leave-one-model-out error drops by a few points with it.
As in TensorRT, elementwise epilogues (batch norm, activations, residual adds) and concatenations
are fused into their producer and cost nothing; views are free.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from daskpipe.profiles.catalog import GPUSpec, load_catalog
from daskpipe.profiles.fx import BlockedModel, example_batch, segment_model
from daskpipe.profiles.model import Profile, ProfileError
from daskpipe.profiles.prepartition import greedy_blocks
from daskpipe.profiles.profiler import SLO_FACTOR, normalise_batch_sizes

Precision = Literal["tf32", "fp32", "fp16"]
FREE_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "t",
        "transpose",
        "permute",
        "expand",
        "detach",
        "alias",
        "empty",
        "squeeze",
        "unsqueeze",
        "flatten",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "contiguous",
        "clone",
        "cat",
        "dropout",
        "lift_fresh",
    }
)
FUSED_OPS = frozenset(
    {
        "relu",
        "relu_",
        "add",
        "add_",
        "mul",
        "mul_",
        "sub",
        "div",
        "sigmoid",
        "hardtanh",
        "hardtanh_",
        "hardswish",
        "hardswish_",
        "silu",
        "silu_",
        "gelu",
        "clamp",
        "clamp_min",
        "rsqrt",
        "_native_batch_norm_legit_no_training",
        "native_batch_norm",
        "batch_norm",
        "leaky_relu",
    }
)


LAUNCH_US = 5.0  # per-kernel launch and TensorRT layer overhead, fixed (see daskpipe.profiles.accuracy)


@dataclass(frozen=True)
class Constants:
    """The estimator's constants; compute ``efficiency`` is per GPU type (``default_efficiency`` otherwise)."""

    launch_us: float  # per kernel
    saturation: float  # output elements per SM that keep it busy
    default_efficiency: float  # fraction of the datasheet compute peak reached
    memory_efficiency: float = 0.7  # fraction of the datasheet bandwidth a streaming kernel reaches (not fitted)
    efficiency: Mapping[str, float] = field(default_factory=dict)

    def efficiency_of(self, gpu: str) -> float:
        return float(self.efficiency.get(gpu, self.default_efficiency))


# Fitted on the published tables of the four models in daskpipe.profiles.zoo (in-sample for them):
# `daskpipe profile estimator-error --profiles ../shared/ppipe` prints these as in_sample.constants.
# GPU types without a fit use the median efficiency, which is a guess: see docs/profiles.md.
CALIBRATED = Constants(
    launch_us=LAUNCH_US,
    saturation=2048.0,
    default_efficiency=0.160,
    efficiency={"L4": 0.0874, "P4": 0.1848, "T4": 0.1359, "V100": 0.3286},
)


@dataclass(frozen=True)
class OpCosts:
    """Per-op work of one block at one batch size (arrays of equal length; only ops that cost time)."""

    flops: np.ndarray
    bytes: np.ndarray
    outputs: np.ndarray  # output elements: the op's parallelism

    @property
    def total_flops(self) -> float:
        return float(self.flops.sum())


class _OpRecorder(FlopCounterMode):
    """FlopCounterMode that also keeps each op's FLOPs, elements moved and output size."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.ops: list[tuple[float, float, float]] = []  # (flops, elements read + written, output elements)

    def _count_flops(self, func_packet, out, args, kwargs):
        name = func_packet.__name__
        if name not in FREE_OPS and name not in FUSED_OPS:
            flops = self.flop_registry[func_packet](*args, **kwargs, out_val=out) if func_packet in self.flop_registry else 0
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            moved = sum(t.numel() for t in inputs + outputs)
            self.ops.append((float(flops), float(moved), float(outputs[0].numel()) if outputs else 0.0))
        return super()._count_flops(func_packet, out, args, kwargs)


def op_costs(block: nn.Module, input_shape: Sequence[int], batches: Iterable[int], precision: Precision = "tf32") -> dict[int, OpCosts]:
    """What ``block`` does to a batch of each size in ``batches`` (per-sample ``input_shape``), op by op.

    Shapes only, on the meta device. A block that reads its data (``torch._assert`` on a value,
    ``.item()``, ``if x.sum() > 0``) cannot run there, and is run for real on a random input
    instead: the counts are the same. When that fails too, :class:`ProfileError` says it is
    data-dependent control flow, and what to do."""
    batches = list(batches)
    try:
        return _record_costs(copy.deepcopy(block).to("meta").eval(), input_shape, batches, precision, "meta")
    except Exception as on_meta:  # a leaf that reads values (NMS, say), or a TorchScript module, which moves to no meta device
        device = next(block.parameters(), torch.empty(0)).device
        try:
            return _record_costs(block.eval(), input_shape, batches, precision, device)
        except Exception as exc:
            raise ProfileError(
                f"the estimator runs the model on the meta device (shapes, no values), and its forward failed there "
                f"({type(on_meta).__name__}: {on_meta}), "
                f"then on a random input ({type(exc).__name__}: {exc}). This is data-dependent control flow: the forward reads a tensor's "
                f"values "
                "(torch._assert or an if on a tensor, .item(), .tolist()). Move such checks out of forward (check inputs before "
                "submitting them), "
                "or measure the profile on the real GPU type instead of estimating it"
            ) from exc


def _record_costs(block: nn.Module, input_shape: Sequence[int], batches: list[int], precision: Precision, device) -> dict[int, OpCosts]:
    """Each batch's op costs. An op's counts are affine in the batch size in nearly every model
    (per-sample work plus its weights), so three recorded sizes, the two smallest and the largest,
    give the rest when the largest is what the two smallest extrapolate to; else each is recorded
    (a model of, say, a batch-by-batch product). A forward of a large model on the meta device
    under the flop counter takes a second of CPU: 16 batch sizes took 16 of them."""
    element_bytes = 2 if precision == "fp16" else 4

    def record(batch: int) -> np.ndarray:
        recorder = _OpRecorder()
        example = (
            torch.empty((batch, *input_shape), device=device) if str(device) == "meta" else example_batch(block, input_shape, batch, device)
        )
        with torch.inference_mode(), recorder:
            block(example)
        return np.asarray(recorder.ops, dtype=float).reshape(-1, 3)

    sizes = sorted(set(batches))
    low, high, top = sizes[0], sizes[:2][-1], sizes[-1]
    recorded = {batch: record(batch) for batch in {low, high, top}}
    if len(sizes) > 3 and recorded[low].shape == recorded[high].shape == recorded[top].shape:
        per_sample = (recorded[high] - recorded[low]) / (high - low)
        if np.allclose(recorded[low] + (top - low) * per_sample, recorded[top], rtol=1e-9, atol=0.0):
            recorded |= {batch: recorded[low] + (batch - low) * per_sample for batch in sizes[2:-1]}
    recorded |= {batch: record(batch) for batch in sizes if batch not in recorded}
    return {batch: OpCosts(flops=ops[:, 0], bytes=ops[:, 1] * element_bytes, outputs=ops[:, 2]) for batch, ops in recorded.items()}


def peak_tflops(spec: GPUSpec, precision: Precision) -> float:
    return {"tf32": spec.tf32_or_fp32_tflops, "fp32": spec.fp32_tflops, "fp16": spec.fp16_tflops}[precision]


def op_latency_us(costs: OpCosts, spec: GPUSpec, slices: int, constants: Constants, precision: Precision = "tf32") -> float:
    """Latency in µs of all ops of ``costs`` on one of ``slices`` equal MPS slices of ``spec``."""
    compute_us, memory_us = roofline_terms(costs, spec, slices, constants.saturation, precision)
    per_op = np.maximum(compute_us / constants.efficiency_of(spec.name), memory_us / constants.memory_efficiency)
    return float(per_op.sum() + constants.launch_us * len(per_op))


def roofline_terms(
    costs: OpCosts, spec: GPUSpec, slices: int, saturation: float, precision: Precision = "tf32"
) -> tuple[np.ndarray, np.ndarray]:
    """Per-op compute time at full efficiency and memory time at full bandwidth, in µs, on a 1/v slice.

    Occupancy is judged against the whole GPU (see the module docstring)."""
    util = np.maximum(np.minimum(1.0, costs.outputs / (saturation * spec.sm_count)), 1e-6)
    flops_per_us = peak_tflops(spec, precision) * 1e6 / slices * util
    bytes_per_us = spec.memory_bandwidth_gbs * 1e3 / slices
    return costs.flops / flops_per_us, costs.bytes / bytes_per_us


def estimate_profile(
    module_or_blocked: nn.Module | BlockedModel,
    example_input: torch.Tensor | None = None,
    *,
    gpus: Iterable[str],
    name: str,
    batch_sizes: int | Sequence[int] = 8,
    slices: Iterable[int] = (1, 2, 3, 4),
    slo_us: float | None = None,
    num_blocks: int = 10,
    precision: Precision = "tf32",
    constants: Constants | None = None,
    catalog: Mapping[str, GPUSpec] | None = None,
) -> Profile:
    """A synthetic profile of ``gpus`` (catalog names), per slice count v with batches 1..B//v.

    GPUs without MPS execution-resource provisioning (pre-Volta, e.g. P4) get only v=1.
    ``constants`` default to ``CALIBRATED`` (fitted to TensorRT TF32 tables).

    A plain module is cut into ``num_blocks`` blocks of equal *estimated* runtime on the first GPU;
    a ``BlockedModel`` keeps its blocks, so the estimate lines up with a measured profile of it.
    Without ``slo_us`` the SLO is 5x the whole model's batch-1 estimate on the first GPU.
    """
    catalog = catalog if catalog is not None else load_catalog()
    constants = constants or CALIBRATED
    gpus = list(gpus)
    unknown = [g for g in gpus if g not in catalog]
    if not gpus or unknown:
        raise ProfileError(f"estimate needs GPU types from the catalog; unknown: {unknown or '(none given)'}; known: {sorted(catalog)}")
    slice_counts = sorted(set(int(v) for v in slices))
    if not slice_counts or slice_counts[0] < 1:
        raise ProfileError(f"slice counts must be integers >= 1, got {slice_counts}")
    max_batch = normalise_batch_sizes(batch_sizes)[-1]
    blocked = (
        module_or_blocked
        if isinstance(module_or_blocked, BlockedModel)
        else cut_by_estimate(module_or_blocked, example_input, num_blocks, catalog[gpus[0]], constants, precision)
    )
    costs = {
        (i, b): block_costs
        for i, block in enumerate(blocked.blocks)
        for b, block_costs in op_costs(block, _block_input(blocked, i), range(1, max_batch + 1), precision).items()
    }
    tables = {}
    for gpu in gpus:
        for v in slice_counts if catalog[gpu].mps_slicing else [1]:
            top = max(1, max_batch // v)
            tables[(gpu, v)] = np.array(
                [
                    [op_latency_us(costs[(i, b)], catalog[gpu], v, constants, precision) for b in range(1, top + 1)]
                    for i in range(blocked.num_blocks)
                ]
            )
    whole_batch1_us = sum(op_latency_us(costs[(i, 1)], catalog[gpus[0]], 1, constants, precision) for i in range(blocked.num_blocks))
    return Profile(
        model=name,
        slo_us=slo_us if slo_us is not None else SLO_FACTOR * whole_batch1_us,
        num_blocks=blocked.num_blocks,
        latency_us=tables,
        boundary_bytes=tuple(float(b) for b in blocked.boundary_bytes),
        input_bytes=float(blocked.input_bytes),
        output_bytes=float(blocked.output_bytes),
        input_shape=blocked.input_shape,
        boundary_shapes=tuple(blocked.boundary_shapes),
        meta={
            "estimator": "daskpipe.profiles.estimator (roofline + launch overhead)",
            "precision": precision,
            "estimated_gpus": gpus,
            "block_gflops_batch1": [costs[(i, 1)].total_flops / 1e9 for i in range(blocked.num_blocks)],
            "segment_boundaries": blocked.segment_boundaries,
        },
    )


def _block_input(blocked: BlockedModel, block: int) -> tuple[int, ...]:
    return blocked.input_shape if block == 0 else blocked.boundary_shapes[block - 1]


def cut_by_estimate(
    module: nn.Module,
    example_input: torch.Tensor | None,
    num_blocks: int,
    spec: GPUSpec,
    constants: Constants = CALIBRATED,
    precision: Precision = "tf32",
    leaf_modules: Iterable[str] = (),
) -> BlockedModel:
    """``module`` cut into ``num_blocks`` blocks of equal estimated batch-1 latency on ``spec``: a
    cut decided without a device, so every kind of a cluster times the same blocks (``leaf_modules``:
    see :func:`~daskpipe.profiles.fx.segment_model`)."""
    if example_input is None:
        raise ProfileError("estimate_profile needs example_input to cut a plain module into blocks")
    segmented = segment_model(module, example_input, leaf_modules)
    if segmented.num_segments < num_blocks:
        raise ProfileError(f"model has only {segmented.num_segments} cut segments; ask for at most that many blocks")
    segments = segmented.segments()
    latency = [
        op_latency_us(op_costs(block, _block_input(segments, i), [1], precision)[1], spec, 1, constants, precision)
        for i, block in enumerate(segments.blocks)
    ]
    return segmented.cut(greedy_blocks(np.asarray(latency), num_blocks))


def efficiency_factors(measured_us: np.ndarray, estimated_us: np.ndarray) -> np.ndarray:
    """Per row (a block, or a whole model): the geometric mean over its columns of measured over
    estimated latency, on a GPU type that was measured.

    The estimator's error is mostly the model's own: how far its op mix (grouped and depthwise
    convolutions, small feature maps, odd kernel sizes) stays from the roofline. That shortfall
    carries from one GPU type to another, while the datasheet ratio between the types is what the
    roofline already models; so scaling another type's estimate by these factors removes most of
    the error (``daskpipe profile estimator-error --calibrate``: median 45% -> 13% on the PPipe tables).
    """
    measured_us, estimated_us = np.atleast_2d(measured_us), np.atleast_2d(estimated_us)
    usable = (measured_us > 0) & (estimated_us > 0)
    logs = np.where(usable, np.log(np.where(usable, measured_us, 1.0) / np.where(usable, estimated_us, 1.0)), 0.0)
    counts = usable.sum(axis=1)
    return np.exp(np.divide(logs.sum(axis=1), counts, out=np.zeros(len(counts)), where=counts > 0))


def estimate_kinds(
    blocked: BlockedModel,
    kinds: Iterable[tuple[str, int]],
    *,
    name: str,
    batch_sizes: int,
    slo_us: float | None = None,
    measured: Mapping[tuple[str, int], np.ndarray] | None = None,
) -> tuple[dict[tuple[str, int], np.ndarray], dict]:
    """Estimated tables of the (GPU type, slices) ``kinds`` for ``blocked``, calibrated when possible.

    ``measured`` holds tables of the same blocks measured on other kinds; those of catalog GPU
    types give each block its :func:`efficiency_factors`, which scale the estimates. Returns the
    tables and what was done, for the profile's ``meta["calibration"]``.
    """
    kinds = sorted(set(kinds))
    catalog = load_catalog()
    measured = measured or {}
    references = sorted(k for k in measured if k[0] in catalog)
    estimated = estimate_profile(
        blocked,
        gpus=sorted({g for g, _ in [*kinds, *references]}),
        name=name,
        batch_sizes=batch_sizes,
        slices=sorted({v for _, v in [*kinds, *references]}),
        slo_us=slo_us,
    )
    tables = {k: t for k, t in estimated.latency_us.items() if k in kinds}
    references = [k for k in references if k in estimated.latency_us]  # e.g. no P4 table at v > 1
    if not references:
        return tables, {"calibrated_on": []}
    pairs = [(measured[k], estimated.latency_us[k]) for k in references]
    widths = [min(m.shape[1], e.shape[1]) for m, e in pairs]
    factors = efficiency_factors(
        np.hstack([m[:, :w] for (m, _), w in zip(pairs, widths)]), np.hstack([e[:, :w] for (_, e), w in zip(pairs, widths)])
    )
    calibrated = {k: t * factors[:, None] for k, t in tables.items()}
    return calibrated, {"calibrated_on": [f"{g}/{v}" for g, v in references], "block_factors": [round(float(f), 4) for f in factors]}


def mape(predicted: Sequence[float], measured: Sequence[float]) -> tuple[float, float]:
    """Mean and median absolute percentage error."""
    errors = [abs(p - m) / m * 100 for p, m in zip(predicted, measured) if m > 0]
    if not errors:
        return math.nan, math.nan
    return float(np.mean(errors)), float(np.median(errors))
