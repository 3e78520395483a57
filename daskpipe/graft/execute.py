"""Run a ``ServingPlan`` on real tensors: the reference data plane for hybrid requests.

A request enters at its fragment's start block with the feature map the device computed. Its
private stage runs it (batched with the same fragment's other requests); the shared stage then
runs *one* batch concatenated from every private stage that feeds it. Hand-overs between stages go
through fp16, as on the wire. ``run_stage`` is the seam to a real executor: by default stages run
in-process; ``StageActor`` runs one stage as a Dask actor (see tests/graft/test_execute.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from daskpipe.graft.planner import ServingPlan
from daskpipe.profiles.fx import BlockedModel
from daskpipe.profiles.model import Profile


class EntryError(ValueError):
    """A hybrid request does not fit the block it claims to enter at."""


def entry_shape(profile: Profile, start_block: int) -> tuple[int, ...]:
    """The per-sample shape block ``start_block`` takes: the input's, or boundary ``k``'s feature map.

    The one place both the reference data plane and the runtime's client check read it from.
    """
    if isinstance(start_block, bool) or not isinstance(start_block, int) or not 0 <= start_block < profile.num_blocks:
        raise EntryError(f"{profile.model!r}: start_block must be in 0..{profile.num_blocks - 1}, got {start_block!r}")
    expected = (
        profile.input_shape
        if start_block == 0
        else (profile.boundary_shapes[start_block - 1] if profile.boundary_shapes is not None else None)
    )
    if expected is None:
        raise EntryError(f"{profile.source}: profile of {profile.model!r} records no shapes; re-profile it to accept hybrid requests")
    return tuple(expected)


def check_entry(profile: Profile, start_block: int, feature_map: torch.Tensor) -> None:
    """Refuse a request whose batched ``feature_map`` is not what block ``start_block`` expects."""
    expected = entry_shape(profile, start_block)
    if tuple(feature_map.shape[1:]) != expected:
        raise EntryError(
            f"{profile.model!r}: block {start_block} expects per-sample shape {tuple(expected)}, got "
            f"{tuple(feature_map.shape[1:])} (batched shape {tuple(feature_map.shape)}); "
            f"did the device split at a different block?"
        )


class StageActor:
    """One stage of a plan as a Dask actor: holds blocks ``[start, end)`` and runs batches."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module.eval()

    def run(self, batch: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.module(batch)


@dataclass
class _Pending:
    device: str
    tensor: torch.Tensor
    hop: int = 0


def execute(
    plan: ServingPlan,
    blocked: BlockedModel,
    profile: Profile,
    requests: Mapping[str, tuple[int, torch.Tensor]],
    *,
    run_stage: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Outputs per device for ``requests`` (device -> (start block, batched feature map)).

    Each request is checked against the profile and against its route's first stage. Stages run
    in order of their first block (a shared stage starts where its private stages end), each in
    chunks of at most its planned batch size (counted in samples).
    """
    if run_stage is None:
        modules = {i: blocked.stage(s.start, s.end).eval() for i, s in enumerate(plan.stages)}

        def run_stage(index: int, batch: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                return modules[index](batch)

    pending = []
    for device, (start_block, tensor) in requests.items():
        if device not in plan.routes:
            raise EntryError(f"plan for {plan.model!r} has no route for device {device!r}")
        check_entry(profile, start_block, tensor)
        first = plan.stages[plan.routes[device][0]]
        if first.start != start_block:
            raise EntryError(f"device {device!r} enters at block {start_block} but its route starts at block {first.start}")
        pending.append(_Pending(device, tensor))
    outputs: dict[str, torch.Tensor] = {}
    for index in sorted(range(len(plan.stages)), key=lambda i: (plan.stages[i].start, plan.stages[i].end)):
        waiting = [p for p in pending if p.hop < len(plan.routes[p.device]) and plan.routes[p.device][p.hop] == index]
        for chunk in _chunks(waiting, plan.stages[index].batch):
            result = run_stage(index, torch.cat([p.tensor for p in chunk]))
            offset = 0
            for p in chunk:
                p.tensor, offset = result[offset : offset + len(p.tensor)], offset + len(p.tensor)
                p.hop += 1
                if p.hop == len(plan.routes[p.device]):
                    outputs[p.device] = p.tensor
                else:
                    p.tensor = p.tensor.to(torch.float16).to(result.dtype)  # the hand-over, as on the wire
    return outputs


def _chunks(waiting: list[_Pending], batch: int) -> list[list[_Pending]]:
    """Consecutive requests whose samples add up to at most ``batch`` (a request is never split)."""
    chunks: list[list[_Pending]] = []
    size = batch
    for p in waiting:
        if size + len(p.tensor) > batch:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += len(p.tensor)
    return chunks
