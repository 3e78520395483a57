"""What the scheduler plugin checks of what comes in: models to serve and submissions.

Pure functions: a model whose SLO cannot be served, an unknown dispatcher or a malformed submit
message is refused here with a clear error, before the plugin keeps anything of it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

from daskpipe.plan.schema import ModelPlan
from daskpipe.profiles.model import Profile
from daskpipe.runtime.errors import DeployError
from daskpipe.sched.registry import check_name, known


def check_feasible(
    model: str, plan: ModelPlan, profile: Profile, budgets: dict[int, float], margin_s: float, *, bw_gbps: float, time_dilation: float
) -> float:
    """Refuse a model whose every entry cannot be served even for a lone request on an idle
    pipeline (batch 1, no queueing) plus the control path's margin: it would drop everything.
    Else the headroom: the least, over its entries, of the budget beyond a lone request's latency,
    the most a margin may take. All times dilated by ``time_dilation`` except the margin, which is
    real time."""
    headroom = float("inf")
    for block, budget in budgets.items():
        paths = [p for p in plan.pipelines if p.entry_block == block]
        if not paths:
            continue
        fastest = min(sum(lone_latency_s(profile, part, bw_gbps, first=q == 0) for q, part in enumerate(p.partitions)) for p in paths)
        if fastest + margin_s > budget:
            smallest_ms = math.ceil((fastest + margin_s) / time_dilation * 1e3 * 10) / 10
            entry = f" entering at block {block}" if block else ""
            raise DeployError(
                f"the SLO of {plan.name!r}{entry}, {budget / time_dilation * 1e3:.1f} ms, cannot be served: a lone request takes "
                f"{fastest / time_dilation * 1e3:.1f} ms on its fastest pipeline and the measured control path "
                f"{margin_s / time_dilation * 1e3:.2f} ms more; the smallest SLO it can serve is {smallest_ms:.1f} ms"
            )
        headroom = min(headroom, budget - fastest)
    return headroom


def lone_latency_s(profile: Profile, part: Any, bw_gbps: float, *, first: bool) -> float:
    """Seconds one sample spends in ``part``: its compute at batch 1, and its input's transfer."""
    transfer = 0.0 if first else profile.cut_bytes(part.blocks[0]) * 8 / (bw_gbps * 1e9)
    return profile.latency(part.gpu, part.slices, 1, *part.blocks) * 1e-6 + transfer


def check_dispatcher(name: Any) -> None:
    """Refuse a dispatcher name the registry does not know, listing those it does."""
    try:
        check_name(name)
    except ValueError:
        raise DeployError(f"unknown dispatcher {name!r}; known: {', '.join(known())}") from None


def is_key(key: Any) -> bool:
    """What a daskpipe client sends as a request key (``Service``: strings); Dask takes a few more."""
    return isinstance(key, (str, bytes, int)) and not isinstance(key, bool)


def malformed(model: Any, keys: Sequence, inputs: Any, sizes: Any, start_block: Any, unknown: dict) -> str | None:
    """What is wrong with a submission message as a whole, or ``None``; requests are checked one
    by one later (``Served.refusal``)."""
    if unknown:
        return f"unknown fields {sorted(unknown)}"
    if not isinstance(model, str):
        return f"the model must be a name, got {type(model).__name__}"
    if type(start_block) is not int or start_block < 0:
        return f"start_block must be an integer >= 0, got {start_block!r}"
    for name, values in (("inputs", inputs), ("sizes", sizes)):
        if not isinstance(values, (list, tuple)):  # msgpack reads lists as tuples
            return f"{name} must be a list, got {type(values).__name__}"
        if len(values) != len(keys):
            return f"{len(keys)} keys and {len(values)} {name}"
    return None


def dilated(model: ModelPlan, profile: Profile, k: float) -> tuple[ModelPlan, Profile]:
    """The plan and profile with every latency and the SLO scaled by ``k`` (throughputs by 1/k)."""
    if k == 1.0:
        return model, profile
    pipelines = tuple(
        replace(
            p,
            throughput=p.throughput / k,
            slo_us=None if p.slo_us is None else p.slo_us * k,
            partitions=tuple(replace(q, latency_us=q.latency_us * k, transfer_us=q.transfer_us * k) for q in p.partitions),
        )
        for p in model.pipelines
    )
    tables = {key: table * k for key, table in profile.latency_us.items()}
    return (
        replace(model, slo_us=model.slo_us * k, throughput=model.throughput / k, pipelines=pipelines),
        replace(profile, slo_us=profile.slo_us * k, latency_us=tables),
    )
