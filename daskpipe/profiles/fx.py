"""Cut an ``nn.Module`` into runnable blocks with torch.fx.

A pipeline stage receives exactly one feature map from the stage before it, so a model can only be
cut where a single tensor is live: between ResNet bottlenecks, between Inception modules, never
inside a residual branch. ``segment_model`` finds every such cut point in the traced graph; the
stretches between consecutive cut points are *segments*, the finest unit the profiler times.
``cut_model`` groups segments into blocks (``boundaries`` as returned by ``greedy_blocks``) and
builds one ``GraphModule`` per block that holds only its own parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

FP16_BYTES = 2


class SegmentationError(ValueError):
    """The model cannot be traced or cut as asked; the message says why and what to do."""


@dataclass(frozen=True)
class CutPoint:
    """A position in the node order where exactly one tensor crosses: the cut's feature map."""

    position: int  # index into the compute nodes: the cut lies just before nodes[position]
    value: fx.Node  # the one tensor live across the cut
    shape: tuple[int, ...]  # per-sample shape (batch dimension dropped)

    @property
    def fp16_bytes(self) -> int:
        return math.prod(self.shape) * FP16_BYTES


class SegmentedModel:
    """A traced model with its single-tensor cut points; segment ``i`` runs cuts[i] -> cuts[i + 1]."""

    def __init__(self, traced: fx.GraphModule, nodes: list[fx.Node], cuts: list[CutPoint]):
        self.traced = traced
        self.nodes = nodes
        self.cuts = cuts

    @property
    def num_segments(self) -> int:
        return len(self.cuts) - 1

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.cuts[0].shape

    @property
    def cut_shapes(self) -> list[tuple[int, ...]]:
        """Per-sample shape of the tensor at each cut, the model input first and its output last."""
        return [cut.shape for cut in self.cuts]

    @property
    def cut_bytes(self) -> list[int]:
        """fp16 bytes per sample of the tensor at each cut, the model input first and its output last."""
        return [cut.fp16_bytes for cut in self.cuts]

    def cut(self, boundaries: Sequence[int]) -> BlockedModel:
        """Blocks made of segments ``[boundaries[k], boundaries[k + 1])``."""
        bounds = list(boundaries)
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != self.num_segments:
            raise SegmentationError(f"block boundaries must start at 0 and end at the segment count {self.num_segments}, got {bounds}")
        if any(b >= a for a, b in zip(bounds[1:], bounds)):
            raise SegmentationError(f"block boundaries must be strictly increasing, got {bounds}")
        blocks: list[nn.Module] = [self._block(self.cuts[a], self.cuts[b]) for a, b in zip(bounds, bounds[1:])]
        inner = [self.cuts[b] for b in bounds[1:-1]]
        return BlockedModel(
            blocks=blocks,
            input_shape=self.input_shape,
            output_shape=self.cuts[-1].shape,
            boundary_shapes=[cut.shape for cut in inner],
            boundary_bytes=[cut.fp16_bytes for cut in inner],
            segment_boundaries=bounds,
        )

    def segments(self) -> BlockedModel:
        """Every segment as its own block (what the profiler times to pre-partition)."""
        return self.cut(range(self.num_segments + 1))

    def _block(self, start: CutPoint, end: CutPoint) -> fx.GraphModule:
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {start.value: graph.placeholder("x")}

        def lookup(node: fx.Node) -> fx.Node:
            if node not in env:  # parameters and buffers are copied into every block that reads them
                if node.op != "get_attr":
                    raise SegmentationError(f"node {node.name!r} is used across a cut point; this is a bug in the cut search")
                env[node] = graph.node_copy(node)
            return env[node]

        for node in self.nodes[start.position : end.position]:
            env[node] = graph.node_copy(node, lookup)
        graph.output(lookup(end.value))
        block = fx.GraphModule(self.traced, graph, class_name="Block")
        block.graph.eliminate_dead_code()
        block.graph.lint()
        block.recompile()
        return block


@dataclass
class BlockedModel:
    """A model as a chain of blocks, each one tensor in and one tensor out; picklable."""

    blocks: list[nn.Module]
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    boundary_shapes: list[tuple[int, ...]]  # per-sample shape leaving block i for block i + 1
    boundary_bytes: list[int]  # fp16 bytes per sample of those tensors
    segment_boundaries: list[int]  # the segment index each block starts at, and the segment count last

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def input_bytes(self) -> int:
        return math.prod(self.input_shape) * FP16_BYTES

    @property
    def output_bytes(self) -> int:
        return math.prod(self.output_shape) * FP16_BYTES

    def run(self, x: torch.Tensor, fp16_boundaries: bool = True, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Blocks ``[start, end)`` in order; with ``fp16_boundaries`` each hand-over goes through fp16, as on the wire."""
        stop = self.num_blocks if end is None else end
        for index in range(start, stop):
            x = self.blocks[index](x)
            if fp16_boundaries and index < stop - 1:
                x = x.to(torch.float16).to(x.dtype)
        return x

    def stage(self, start: int, end: int) -> nn.Sequential:
        """Blocks ``[start, end)`` as one module: a pipeline partition, run where no wire is crossed."""
        if not 0 <= start < end <= self.num_blocks:
            raise SegmentationError(f"a stage needs 0 <= start < end <= {self.num_blocks}, got [{start}, {end})")
        return nn.Sequential(*self.blocks[start:end])

    def to(self, device: str | torch.device) -> BlockedModel:
        for block in self.blocks:
            block.to(device)
        return self


def segment_model(module: nn.Module, example_input: torch.Tensor) -> SegmentedModel:
    """Trace ``module`` and find its single-tensor cut points, using ``example_input`` (batched) for shapes."""
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 1:
        raise SegmentationError("example_input must be a batched tensor, e.g. torch.randn(1, 3, 224, 224)")
    try:
        traced = fx.symbolic_trace(module)
    except Exception as exc:  # fx raises many types (TraceError, TypeError, ...) for untraceable code
        raise SegmentationError(
            f"torch.fx cannot trace {type(module).__name__}: {type(exc).__name__}: {exc}. "
            "Make its forward free of data-dependent control flow, or wrap the offending submodule "
            "as a leaf (fx.Tracer.is_leaf_module)."
        ) from exc
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise SegmentationError(
            f"{type(module).__name__}.forward takes {len(placeholders)} inputs; a pipeline model must take exactly one tensor"
        )
    with torch.inference_mode():
        try:
            ShapeProp(traced).propagate(example_input)
        except Exception as exc:
            raise SegmentationError(
                f"running {type(module).__name__} on an input of shape {tuple(example_input.shape)} failed: {exc}"
            ) from exc
    nodes = [n for n in traced.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    output = next(n for n in traced.graph.nodes if n.op == "output")
    result = output.args[0]
    if not isinstance(result, fx.Node) or not _is_tensor(result):
        raise SegmentationError(f"{type(module).__name__} must return a single tensor to be cut into a pipeline")
    cuts = _find_cuts(placeholders[0], nodes, result, batch=example_input.shape[0])
    return SegmentedModel(traced, nodes, cuts)


def cut_model(module: nn.Module, example_input: torch.Tensor, boundaries: Sequence[int]) -> BlockedModel:
    """``module`` as blocks of segments ``[boundaries[k], boundaries[k + 1])`` (see ``greedy_blocks``)."""
    return segment_model(module, example_input).cut(boundaries)


def _is_tensor(node: fx.Node) -> bool:
    meta = node.meta.get("tensor_meta")
    return meta is not None and hasattr(meta, "shape")


def _find_cuts(placeholder: fx.Node, nodes: list[fx.Node], result: fx.Node, batch: int) -> list[CutPoint]:
    """Cut points by liveness: a value is live at position p when defined before p and used at or after p."""
    end = len(nodes)
    position_of = {placeholder: -1, **{node: i for i, node in enumerate(nodes)}}
    born_at: dict[int, list[fx.Node]] = {}
    last_use: dict[fx.Node, int] = {}
    for value, defined in position_of.items():
        uses = [position_of.get(user, end) for user in value.users]  # the output node counts as position `end`
        if uses:
            last_use[value] = max(uses)
            born_at.setdefault(defined + 1, []).append(value)
    cuts: list[CutPoint] = []
    live: set[fx.Node] = set()
    for position in range(end + 1):
        live.update(born_at.get(position, ()))
        live = {value for value in live if last_use[value] >= position}
        if len(live) != 1:
            continue
        (value,) = live
        if not _is_tensor(value):
            continue
        shape = tuple(int(s) for s in value.meta["tensor_meta"].shape)
        if shape and shape[0] == batch:
            cuts.append(CutPoint(position, value, shape[1:]))
    if not cuts or cuts[0].position != 0 or cuts[-1].position != end or cuts[-1].value is not result:
        raise SegmentationError("the model's input or output is not a single batched tensor; it cannot be cut")
    return cuts
