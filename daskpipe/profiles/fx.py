"""Cut an ``nn.Module`` into runnable blocks with torch.fx, or keep it whole where it cannot be traced.

A pipeline stage receives exactly one feature map from the stage before it, so a model can only be
cut where a single floating-point tensor is live: between ResNet bottlenecks, between Inception
modules, never inside a residual branch. Values the graph derives from shapes alone (``x.shape[-2:]``
read at the start and used at the end, as segmentation models do) do not stop a cut: they are the
same for every batch of the deployed input shape, so a later block gets them as constants.
``segment_model`` finds every such cut point in the traced graph; the stretches between consecutive
cut points are *segments*, the finest unit the profiler times. ``SegmentedModel.cut`` groups
segments into blocks (``boundaries`` as returned by ``greedy_blocks``) and builds one
``GraphModule`` per block that holds only its own parameters.

The first block takes the model's arguments and the last returns whatever the model returns
(tensors, tuples, lists, dicts). Arguments other than one floating-point tensor (several tensors,
keyword arguments, token ids, masks) travel as one row of bytes per sample (:class:`InputLayout`),
which the first block unpacks (:class:`PackedInputs`). A submodule that fx cannot trace becomes a
leaf, called as it is (the data-dependent heads and post-processing of detection models); a model
that cannot be traced at all (TorchScript, code that iterates over its input) is served whole, as
one block (:class:`UncutModel`), with a warning that says why. ``torch.compile`` d modules are
unwrapped first; the caller's model is never changed: an eval copy is cut.
"""

from __future__ import annotations

import copy
import io
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import fasteners
import torch
from torch import fx, nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_map, tree_unflatten

FP16_BYTES = 2
CONSTANT_TYPES = (int, float, bool, str, type(None), torch.dtype)
"""What a value derived from shapes may be, to cross a cut as a constant (and tuples and lists of them)."""


class SegmentationError(ValueError):
    """The model cannot be traced or cut as asked; the message says why and what to do."""


class UncutWarning(UserWarning):
    """A model is served whole, or in eval mode: the message says why."""


def call_arguments(example: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a request: a tensor is the one positional argument, a tuple the
    positional arguments, a dict the keyword arguments."""
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, tuple):
        return example, {}
    if isinstance(example, Mapping):
        return (), dict(sorted(example.items()))  # keyword arguments: their order is no part of the request
    raise SegmentationError(f"an example input is a batched tensor, a tuple of them or a dict of them, got {type(example).__name__}")


def describe(values: Any) -> str:
    """The shapes and dtypes of the tensors in ``values``, for error messages."""
    leaves = [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in leaves) or "no tensors"


@dataclass(frozen=True)
class InputLayout:
    """A model's arguments, each a batched tensor, and how a batch of them travels as one tensor.

    One floating-point positional tensor travels as it is. Anything else travels packed: per
    sample, the bytes of every argument one after another, a row of ``sample_nbytes`` uint8; the
    first block unpacks it (a stage may hand it over as floats: bytes survive float16 and float32)."""

    spec: TreeSpec  # of (args, kwargs)
    shapes: tuple[tuple[int, ...], ...]  # per-sample shape of each argument, in the spec's order
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def of(cls, example: Any) -> InputLayout:
        leaves, spec = tree_flatten(call_arguments(example))
        if not leaves or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in leaves):
            raise SegmentationError(
                f"every example input must be a batched tensor, e.g. torch.randn(1, 3, 224, 224), got {describe(leaves)}"
            )
        if len({t.shape[0] for t in leaves}) != 1:
            raise SegmentationError(f"the example inputs must hold the same number of samples, got {describe(leaves)}")
        return cls(spec, tuple(tuple(t.shape[1:]) for t in leaves), tuple(t.dtype for t in leaves))

    @property
    def packed(self) -> bool:
        single = tree_flatten(((0,), {}))[1]
        return not (self.spec == single and self.dtypes[0].is_floating_point)

    @property
    def leaf_nbytes(self) -> list[int]:
        return [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in zip(self.shapes, self.dtypes)]

    @property
    def sample_nbytes(self) -> int:
        return sum(self.leaf_nbytes)

    @property
    def wire_shape(self) -> tuple[int, ...]:
        """The per-sample shape of what the first block takes."""
        return (self.sample_nbytes,) if self.packed else self.shapes[0]

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch.uint8 if self.packed else self.dtypes[0]

    def leaves(self, request: Any) -> list[torch.Tensor]:
        """The tensors of ``request``, which must have the example's form (:func:`call_arguments`)."""
        leaves, spec = tree_flatten(call_arguments(request))
        if spec != self.spec:
            raise SegmentationError(f"a request must have the example's form {self.spec}, got {spec}")
        return leaves

    def pack(self, request: Any) -> torch.Tensor:
        """``request`` as the first block takes it."""
        leaves = self.leaves(request)
        if not self.packed:
            return leaves[0]
        return torch.cat([t.contiguous().reshape(t.shape[0], -1).view(torch.uint8) for t in leaves], dim=1)

    def unpack(self, x: torch.Tensor) -> tuple[tuple, dict]:
        """The model's ``(args, kwargs)`` for a batch ``x`` of :attr:`wire_shape`."""
        if not self.packed:
            return (x,), {}
        raw = x if x.dtype == torch.uint8 else x.to(torch.uint8)
        leaves, offset = [], 0
        for shape, dtype, nbytes in zip(self.shapes, self.dtypes, self.leaf_nbytes):
            row = raw[:, offset : offset + nbytes].contiguous().view(-1)  # flat first: a 1-row slice counts as contiguous, strides and all
            leaves.append(row.view(dtype).reshape(-1, *shape))
            offset += nbytes
        return tree_unflatten(leaves, self.spec)

    def zeros(self, batch: int, device: str | torch.device = "cpu") -> tuple[tuple, dict]:
        """``(args, kwargs)`` of ``batch`` samples of zeros."""
        leaves = [torch.zeros((batch, *shape), dtype=dtype, device=device) for shape, dtype in zip(self.shapes, self.dtypes)]
        return tree_unflatten(leaves, self.spec)

    def batch_of(self, example: Any, batch: int) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of ``batch`` copies of ``example``'s first sample."""
        leaves = [t[:1].repeat(batch, *[1] * (t.dim() - 1)) for t in self.leaves(example)]
        return tree_unflatten(leaves, self.spec)


class PackedInputs(nn.Module):
    """The first block of a model whose arguments travel packed: unpacks the batch, then calls ``block``."""

    def __init__(self, layout: InputLayout, block: nn.Module):
        super().__init__()
        self.layout = layout
        self.block = block

    def forward(self, x: torch.Tensor) -> Any:
        args, kwargs = self.layout.unpack(x)
        return self.block(*args, **kwargs)


class WholeModel(nn.Module):
    """A model served as one block; a TorchScript module pickles as its saved archive."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if isinstance(self.module, torch.jit.ScriptModule):
            archive = io.BytesIO()
            torch.jit.save(self.module, archive)
            state["_modules"] = {**state["_modules"], "module": None}
            state["scripted"] = archive.getvalue()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        scripted = state.pop("scripted", None)
        super().__setstate__(state)
        if scripted is not None:
            self._modules["module"] = torch.jit.load(io.BytesIO(scripted))


@dataclass(frozen=True)
class CutPoint:
    """A position in the node order where the model may be cut; ``value`` is the one tensor live
    across it (``None`` at the model's input or output when that is not one tensor)."""

    position: int  # index into the compute nodes: the cut lies just before nodes[position]
    value: fx.Node | None
    shape: tuple[int, ...]  # per-sample shape (batch dimension dropped); a packed input's byte row, an output's element count

    @property
    def fp16_bytes(self) -> int:
        return math.prod(self.shape) * FP16_BYTES


class Segmented:
    """A model's cut points; segment ``i`` runs cuts[i] -> cuts[i + 1]. Subclasses build the blocks."""

    def __init__(self, inputs: InputLayout, cuts: list[CutPoint], leaves: Sequence[str] = ()):
        self.inputs = inputs
        self.cuts = cuts
        self.leaves = list(leaves)  # submodules called as they are (named, or found untraceable)

    @property
    def num_segments(self) -> int:
        return len(self.cuts) - 1

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.cuts[0].shape

    @property
    def cut_shapes(self) -> list[tuple[int, ...]]:
        """Per-sample shape at each cut, the model input first and its output last."""
        return [cut.shape for cut in self.cuts]

    @property
    def cut_bytes(self) -> list[int]:
        """fp16 bytes per sample at each cut, the model input first and its output last."""
        return [cut.fp16_bytes for cut in self.cuts]

    @property
    def code(self) -> str:
        """What the model computes, as text (the profile store's fingerprint hashes it)."""
        raise NotImplementedError

    def cut(self, boundaries: Sequence[int]) -> BlockedModel:
        """Blocks made of segments ``[boundaries[k], boundaries[k + 1])``."""
        bounds = list(boundaries)
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != self.num_segments:
            raise SegmentationError(f"block boundaries must start at 0 and end at the segment count {self.num_segments}, got {bounds}")
        if any(b >= a for a, b in zip(bounds[1:], bounds)):
            raise SegmentationError(f"block boundaries must be strictly increasing, got {bounds}")
        blocks = self._blocks(bounds)
        if self.inputs.packed:
            blocks[0] = PackedInputs(self.inputs, blocks[0])
        inner = [self.cuts[b] for b in bounds[1:-1]]
        return BlockedModel(
            blocks=blocks,
            input_shape=self.input_shape,
            output_shape=self.cuts[-1].shape,
            boundary_shapes=[cut.shape for cut in inner],
            boundary_bytes=[cut.fp16_bytes for cut in inner],
            segment_boundaries=bounds,
            inputs=self.inputs,
        )

    def segments(self) -> BlockedModel:
        """Every segment as its own block (what the profiler times to pre-partition)."""
        return self.cut(range(self.num_segments + 1))

    def _blocks(self, bounds: list[int]) -> list[nn.Module]:
        raise NotImplementedError


class SegmentedModel(Segmented):
    """A traced model with its single-tensor cut points."""

    def __init__(
        self,
        traced: fx.GraphModule,
        nodes: list[fx.Node],
        inputs: InputLayout,
        cuts: list[CutPoint],
        constants: dict[fx.Node, Any],
        leaves: Sequence[str] = (),
    ):
        super().__init__(inputs, cuts, leaves)
        self.traced = traced
        self.nodes = nodes
        self.constants = constants  # shape-derived values, the same for every batch

    @property
    def code(self) -> str:
        return self.traced.code

    def _blocks(self, bounds: list[int]) -> list[nn.Module]:
        last = len(bounds) - 2
        return [self._block(self.cuts[a], self.cuts[b], k == 0, k == last) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]

    def _block(self, start: CutPoint, end: CutPoint, first: bool, last: bool) -> fx.GraphModule:
        graph = fx.Graph()
        env: dict[fx.Node, Any] = {}
        if first:
            for node in self.traced.graph.nodes:
                if node.op == "placeholder":
                    env[node] = graph.node_copy(node)
        else:
            assert start.value is not None, "an inner cut carries one tensor"
            env[start.value] = graph.placeholder("x")

        def lookup(node: fx.Node) -> Any:
            if node not in env:
                if node in self.constants:  # computed in an earlier block from shapes: the same value here
                    return self.constants[node]
                if node.op != "get_attr":
                    raise SegmentationError(f"node {node.name!r} is used across a cut point; this is a bug in the cut search")
                env[node] = graph.node_copy(node)  # parameters and buffers are copied into every block that reads them
            return env[node]

        for node in self.nodes[start.position : end.position]:
            env[node] = graph.node_copy(node, lookup)
        if last:
            (result,) = next(n for n in self.traced.graph.nodes if n.op == "output").args
            graph.output(fx.node.map_arg(result, lookup))
        else:
            assert end.value is not None, "an inner cut carries one tensor"
            graph.output(lookup(end.value))
        block = fx.GraphModule(self.traced, graph, class_name="Block")
        block.graph.eliminate_dead_code()
        block.graph.lint()
        block.recompile()
        return block


class UncutModel(Segmented):
    """A model fx cannot trace, served whole: one segment, one block (``reason`` says why)."""

    def __init__(self, module: nn.Module, inputs: InputLayout, output_shape: tuple[int, ...], reason: str):
        super().__init__(inputs, [CutPoint(0, None, inputs.wire_shape), CutPoint(1, None, output_shape)])
        self.module = module
        self.reason = reason

    @property
    def code(self) -> str:
        return str(self.module.code) if isinstance(self.module, torch.jit.ScriptModule) else repr(self.module)

    def _blocks(self, bounds: list[int]) -> list[nn.Module]:
        return [WholeModel(self.module)]


class Reached(BaseException):
    """The submodule a first block runs the model up to was called (a BaseException: no ``except Exception`` in the model stops it)."""


class RunUpTo(nn.Module):
    """The first block of a :class:`ResumedModel`: the model's forward until it calls submodule
    ``path``, then ``block``, the submodule's first block, on what it was called with."""

    def __init__(self, model: nn.Module, path: str, block: nn.Module):
        super().__init__()
        self.model = model
        self.path = path
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        called: list[tuple[tuple, dict]] = []

        def stop(module: nn.Module, args: tuple, kwargs: dict) -> None:
            called.append((args, kwargs))
            raise Reached()

        handle = self.model.get_submodule(self.path).register_forward_pre_hook(stop, with_kwargs=True)
        try:
            self.model(*args, **kwargs)
        except Reached:
            pass
        finally:
            handle.remove()
        (inner_args, inner_kwargs), *_ = called
        return self.block(*inner_args, **inner_kwargs)


class ResumeAfter(nn.Module):
    """The last block of a :class:`ResumedModel`: ``block``, the submodule's last block, then the
    model's forward on zeros of the requests' form, the submodule's call answered with that output."""

    def __init__(self, model: nn.Module, path: str, block: nn.Module, layout: InputLayout):
        super().__init__()
        self.model = model
        self.path = path
        self.block = block
        self.layout = layout

    def forward(self, x: torch.Tensor) -> Any:
        output = self.block(x)
        submodule = self.model.get_submodule(self.path)
        submodule.forward = lambda *args, **kwargs: output  # this call only: the instance attribute goes in finally
        try:
            args, kwargs = self.layout.zeros(x.shape[0], x.device)
            return self.model(*args, **kwargs)
        finally:
            del submodule.forward


class ResumedModel(Segmented):
    """A model fx cannot trace as a whole, cut inside submodule ``path``, which fx can: its first
    block runs the model's own code up to that submodule, its last block runs the rest of it on
    zeros of the requests' form, with the submodule's output. Right where what follows the
    submodule depends on the input's shapes alone, as a detector's anchors and image sizes do;
    :meth:`serves` checks it on the example."""

    def __init__(self, model: nn.Module, path: str, inner: SegmentedModel, inputs: InputLayout, output_shape: tuple[int, ...]):
        ends = [CutPoint(0, None, inputs.wire_shape), CutPoint(inner.cuts[-1].position, None, output_shape)]
        super().__init__(inputs, [ends[0], *inner.cuts[1:-1], ends[1]], [f"{path}.{leaf}" for leaf in inner.leaves])
        self.model = model
        self.path = path
        self.inner = inner

    @property
    def code(self) -> str:
        return f"{type(self.model).__name__}, cut inside {self.path}:\n{self.inner.code}"

    def _blocks(self, bounds: list[int]) -> list[nn.Module]:
        if len(bounds) == 2:
            return [WholeModel(self.model)]
        blocks = self.inner._blocks(bounds)
        blocks[0] = RunUpTo(self.model, self.path, blocks[0])
        blocks[-1] = ResumeAfter(self.model, self.path, blocks[-1], self.inputs)
        return blocks

    def serves(self, example: Any) -> bool:
        """Two blocks give the model's own output on ``example`` and on a random variation of it."""
        blocked = self.cut([0, 1, self.num_segments])
        varied = tree_map(lambda t: t + torch.randn_like(t) if t.dtype.is_floating_point else t, example)
        with torch.inference_mode():
            for request in (example, varied):
                args, kwargs = call_arguments(request)
                try:
                    torch.testing.assert_close(blocked.run(self.inputs.pack(request), fp16_boundaries=False), self.model(*args, **kwargs))
                except Exception:  # a different output, or one the rest of the model cannot make from zeros
                    return False
        return True


@dataclass
class BlockedModel:
    """A model as a chain of blocks: the first takes the requests' batch, inner boundaries are one
    tensor, the last returns the model's output; picklable."""

    blocks: list[nn.Module]
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    boundary_shapes: list[tuple[int, ...]]  # per-sample shape leaving block i for block i + 1
    boundary_bytes: list[int]  # fp16 bytes per sample of those tensors
    segment_boundaries: list[int]  # the segment index each block starts at, and the segment count last
    inputs: InputLayout | None = None  # the model's arguments; None where only the blocks are known (re-profiling)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def input_bytes(self) -> int:
        return math.prod(self.input_shape) * FP16_BYTES

    @property
    def output_bytes(self) -> int:
        return math.prod(self.output_shape) * FP16_BYTES

    def run(self, x: torch.Tensor, fp16_boundaries: bool = True, start: int = 0, end: int | None = None) -> Any:
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

    def example(self, block: int, batch: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """A batch ``block`` can take: random feature maps; zeros for a packed batch of arguments,
        where random bytes could be a token id out of range."""
        return example_batch(self.blocks[block], self.input_shape if block == 0 else self.boundary_shapes[block - 1], batch, device)


def example_batch(block: nn.Module, shape: Sequence[int], batch: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """See :meth:`BlockedModel.example`."""
    make = torch.zeros if isinstance(block, PackedInputs) else torch.randn
    return make((batch, *shape), device=device)


TRACING = fasteners.ReaderWriterLock()
"""torch.fx tracing patches ``nn.Module.__call__`` for the whole process, so a module called
meanwhile in another thread of it would be traced instead, and fail. Tracing (here, and unpickling a
stage, which re-traces it) takes the write lock; stages of an in-process cluster compute their
batches under the read lock (:mod:`daskpipe.runtime.worker.stage`), together, so a stage hung on an
input holds its own slot only, and a client in that process tracing a model (``Service.add_model``)
or a re-plan preloading stages pauses serving stages for no more than its tracing (but for the
return of a hung one)."""


def served_copy(module: nn.Module) -> nn.Module:
    """What is cut and served: ``module`` itself when in eval mode (tracing only reads it), else an
    eval-mode copy, with a warning; a ``torch.compile`` d module unwrapped to the module it compiles."""
    original = getattr(module, "_orig_mod", module)  # torch.compile's OptimizedModule keeps the module it wraps there
    if not original.training:
        return original  # tracing and cutting read the module, they never change it
    warnings.warn(
        f"{type(original).__name__} is in train mode; an eval-mode copy is served (dropout off, batch norm on its running statistics)",
        UncutWarning,
        stacklevel=2,
    )
    return copy.deepcopy(original).eval()


def segment_model(module: nn.Module, example_input: Any, leaf_modules: Iterable[str] = ()) -> Segmented:
    """``module`` traced and its cut points found, from its first example sample's shapes and dtypes.

    ``example_input`` is a batched tensor, a tuple of them (positional arguments) or a dict of them
    (keyword arguments). ``leaf_modules`` names submodules (qualified names such as ``roi_heads``,
    or class names) to call as they are, uncut; those fx fails to trace are found and added. A
    model that cannot be traced at all comes back as an :class:`UncutModel`, with a warning.
    Raises :class:`SegmentationError` when the model fails on the example, with torch's message."""
    inputs = InputLayout.of(example_input)
    module = served_copy(module)
    if isinstance(module, torch.jit.ScriptModule):
        return untraced(module, inputs, example_input, leaf_modules, "it is a TorchScript module, and torch.fx traces Python code")
    tracer = LeafTracer(leaf_modules)
    try:
        with TRACING.write_lock():
            traced = fx.GraphModule(module, tracer.trace(module), class_name=type(module).__name__)
    except Exception as exc:  # fx raises many types (TraceError, TypeError, ...) for untraceable code
        reason = f"torch.fx cannot trace it: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        return untraced(module, inputs, example_input, leaf_modules, reason)
    one, two = (Propagation(traced).values(*inputs.batch_of(example_input, batch)) for batch in (1, 2))
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    nodes = [n for n in traced.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    constants = {n: one[n] for n in nodes if not _is_tensor(one[n]) and _constant(one[n], two[n])}
    (result,) = next(n for n in traced.graph.nodes if n.op == "output").args
    cuts = _find_cuts(placeholders, nodes, result, constants, one, two, inputs)
    return SegmentedModel(traced, nodes, inputs, cuts, constants, tracer.leaves)


def cut_model(module: nn.Module, example_input: Any, boundaries: Sequence[int], leaf_modules: Iterable[str] = ()) -> BlockedModel:
    """``module`` as blocks of segments ``[boundaries[k], boundaries[k + 1])`` (see ``greedy_blocks``)."""
    return segment_model(module, example_input, leaf_modules).cut(boundaries)


def untraced(module: nn.Module, inputs: InputLayout, example_input: Any, leaf_modules: Iterable[str], reason: str) -> Segmented:
    """``module``, which fx cannot trace as a whole, cut inside the direct submodule with the most
    segments that its forward calls once (:class:`ResumedModel`: a detector's backbone), where
    that serves the model's own outputs; else whole, as one block. The warning says ``reason``."""
    args, kwargs = inputs.batch_of(example_input, 1)
    calls: dict[str, list[tuple[tuple, dict]]] = {}
    with torch.inference_mode():
        output = run_named(module, args, kwargs, calls)
    elements = sum(t.numel() for t in tree_leaves(output) if isinstance(t, torch.Tensor))
    output_shape = (max(elements, 1),)
    name = type(module).__name__
    candidates = []
    for path, made in calls.items():
        if len(made) != 1 or (made[0][0] and made[0][1]):
            continue  # called more than once, or with positional and keyword arguments at once
        ((child_args, child_kwargs),) = made
        inner_leaves = [leaf.removeprefix(f"{path}.") for leaf in leaf_modules]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UncutWarning)
            try:
                inner = segment_model(module.get_submodule(path), child_kwargs or tuple(child_args), inner_leaves)
            except SegmentationError:  # its inputs are not batched tensors, or it fails alone
                continue
        if isinstance(inner, SegmentedModel) and inner.num_segments >= 2:
            candidates.append(ResumedModel(module, path, inner, inputs, output_shape))
    for resumed in sorted(candidates, key=lambda c: -c.num_segments):
        if resumed.serves(example_input):
            warnings.warn(
                f"{name} is cut inside its submodule {resumed.path!r} only, the rest of it runs whole: {reason}", UncutWarning, stacklevel=2
            )
            return resumed
    warnings.warn(f"{name} is served whole, as one block, not cut into a pipeline: {reason}", UncutWarning, stacklevel=2)
    return UncutModel(module, inputs, output_shape, reason)


def run_named(module: nn.Module, args: tuple, kwargs: dict, calls: dict[str, list[tuple[tuple, dict]]] | None = None) -> Any:
    """``module(*args, **kwargs)``, keeping in ``calls`` the arguments of each call of a direct
    submodule; a failure raises :class:`SegmentationError` naming the innermost submodule that was
    running, the inputs' shapes and dtypes, and torch's own message."""
    running: list[str] = []
    names = {m: name for name, m in module.named_modules()} if not isinstance(module, torch.jit.ScriptModule) else {}
    kept = calls if calls is not None else {}

    def enter(m: nn.Module, args: Any, kwargs: Any) -> None:
        running.append(names[m])
        if names[m] and "." not in names[m]:
            kept.setdefault(names[m], []).append((args, kwargs))

    def leave(m: nn.Module, args: Any, output: Any) -> None:
        running.pop()

    handles = [m.register_forward_pre_hook(enter, with_kwargs=True) for m in names] + [m.register_forward_hook(leave) for m in names]
    try:
        return module(*args, **kwargs)
    except Exception as exc:
        where = f" in submodule {running[-1]!r} ({type(module.get_submodule(running[-1])).__name__})" if running and running[-1] else ""
        raise SegmentationError(
            f"running {type(module).__name__} on the example ({describe((args, kwargs))}) failed{where}: {innermost(exc)}"
        ) from exc
    finally:
        for handle in handles:
            handle.remove()


def innermost(exc: BaseException) -> str:
    """``Type: message`` of the deepest cause of ``exc``: torch's own words, not a wrapper's."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"


class LeafTracer(fx.Tracer):
    """fx's tracer that calls the named submodules as they are, and those whose tracing fails."""

    def __init__(self, leaf_modules: Iterable[str]):
        super().__init__()
        self.named = set(leaf_modules)
        self.leaves: list[str] = []  # qualified names of the submodules called as they are

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.named or type(m).__name__ in self.named:
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        name = self.path_of_module(m)
        if self.is_leaf_module(m, name):
            if not super().is_leaf_module(m, name):
                self.leaves.append(name)
            return super().call_module(m, forward, args, kwargs)
        before, depth = list(self.graph.nodes), len(self.module_stack)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:  # its code cannot be traced: run it as it is, uncut
            known = set(before)
            for node in reversed(list(self.graph.nodes)):  # what its partial trace left behind
                if node not in known:
                    self.graph.erase_node(node)
            while len(self.module_stack) > depth:
                self.module_stack.popitem()
            self.leaves.append(name)
            return self.create_proxy("call_module", name, args, kwargs)


class Propagation(fx.Interpreter):
    """Runs a traced model and keeps, per node, a tensor's per-sample meta or a small value; a
    failing node raises :class:`SegmentationError` naming it, its module, its inputs, and torch's message."""

    def values(self, args: tuple, kwargs: dict) -> dict[fx.Node, Any]:
        self.kept: dict[fx.Node, Any] = {}
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        positional = list(args) + [kwargs[n.target] for n in placeholders[len(args) :] if n.target in kwargs]
        with torch.inference_mode():
            try:
                self.run(*positional)
            except SegmentationError as exc:  # raised by run_node; fx's run appended its node dump to the message
                raise SegmentationError(str(exc).split("\n\nWhile executing")[0]) from exc.__cause__
        return self.kept

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except SegmentationError:
            raise
        except Exception as exc:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            stack = n.meta.get("nn_module_stack") or {}
            module = n.target if n.op == "call_module" else next(reversed(stack.values()), ("", None))[0]
            where = f" in module {module!r}" if module else ""
            raise SegmentationError(
                f"running {type(self.module).__name__} on the example failed at node {n.name!r}{where} "
                f"(inputs: {describe((args, kwargs))}): {innermost(exc)}"
            ) from exc
        self.kept[n] = TensorShape(tuple(result.shape), result.dtype) if isinstance(result, torch.Tensor) else _small(result)
        return result


@dataclass(frozen=True)
class TensorShape:
    """A node's tensor, by shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class Opaque:
    """A node's value that is neither a tensor nor a constant (an object holding tensors, say)."""


def _small(value: Any) -> Any:
    """``value`` where it is made of constants only (a torch.Size as a tuple), else :class:`Opaque`."""
    if isinstance(value, CONSTANT_TYPES):
        return value
    if isinstance(value, (tuple, list)):
        items = [_small(v) for v in value]
        if any(isinstance(v, Opaque) for v in items):
            return Opaque()
        return items if isinstance(value, list) else tuple(items)
    return Opaque()


def _is_tensor(value: Any) -> bool:
    return isinstance(value, TensorShape)


def _constant(one: Any, two: Any) -> bool:
    """A value computed at batch sizes 1 and 2 is a constant when it is small and the same at both."""
    return not isinstance(one, Opaque) and not isinstance(two, Opaque) and one == two


def _find_cuts(
    placeholders: list[fx.Node],
    nodes: list[fx.Node],
    result: Any,
    constants: dict[fx.Node, Any],
    one: dict[fx.Node, Any],
    two: dict[fx.Node, Any],
    inputs: InputLayout,
) -> list[CutPoint]:
    """Cut points by liveness: a value is live at position p when defined before p and used at or after p.

    The model's input and output bound the first and last segment; an inner cut needs exactly one
    live floating-point tensor with the batch as its first dimension (constants do not count)."""
    end = len(nodes)
    position_of = {**{p: -1 for p in placeholders}, **{node: i for i, node in enumerate(nodes)}}
    born_at: dict[int, list[fx.Node]] = {}
    last_use: dict[fx.Node, int] = {}
    for value, defined in position_of.items():
        uses = [position_of.get(user, end) for user in value.users]  # the output node counts as position `end`
        if uses and value not in constants:
            last_use[value] = max(uses)
            born_at.setdefault(defined + 1, []).append(value)
    single_input = placeholders[0] if not inputs.packed else None
    cuts = [CutPoint(0, single_input, inputs.wire_shape)]
    live: set[fx.Node] = set()
    for position in range(end):
        live.update(born_at.get(position, ()))
        live = {value for value in live if last_use[value] >= position}
        if position == 0 or len(live) != 1:
            continue
        (value,) = live
        small, large = one[value], two[value]
        if _is_tensor(small) and small.dtype.is_floating_point and small.shape[:1] == (1,) and large.shape == (2, *small.shape[1:]):
            cuts.append(CutPoint(position, value, small.shape[1:]))
    output = result if isinstance(result, fx.Node) and _is_tensor(one.get(result)) else None
    if output is not None:
        cuts.append(CutPoint(end, output, one[output].shape[1:]))
    else:
        leaves = [one[n] for n in tree_leaves(fx.node.map_arg(result, lambda n: n)) if isinstance(n, fx.Node) and _is_tensor(one.get(n))]
        cuts.append(CutPoint(end, None, (max(sum(math.prod(t.shape) for t in leaves), 1),)))
    return cuts
