"""What the elastic controller (:mod:`daskpipe.runtime.scheduler.elastic.controller`) works on and is tuned by: its
settings, and the deployments it re-plans with their models. Torch-free: the scheduler imports it."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Mapping

from daskpipe.plan.options import PlannerOptions
from daskpipe.plan.schema import Plan
from daskpipe.profiles.model import Profile
from daskpipe.runtime.errors import DeployError
from daskpipe.runtime.wire.messages import ServeSettings

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class ElasticSettings:
    """How eagerly a deployment follows its cluster and its load (docs/operations.md).

    debounce_s
        A re-plan starts this long after the last worker joined or left (bursts make one re-plan).
    load_shift
        Re-plan when a model's share of the offered load moved by this much, relative to the share
        the plan was made for (0.25: from 40% to under 30% or over 50%).
    load_interval_s
        At most one load-mix re-plan per this many seconds.
    load_window_s
        Rates (offered, bad, busy) are measured over this window.
    plan_time_limit_s
        The MILP's time limit for a re-plan.
    flush_timeout_s
        The longest the switch waits for in-flight batches before it goes on without them.
    scale_up_bad_rate
        Ask for more GPUs when more than this share of a model's requests miss (drop, fail, late).
    target_utilisation
        Busy share per GPU type to scale down to, and the headroom a scaled-down plan must keep.
    scale_cooldown_s
        No scaling advice this long after the inventory or the plan changed.
    idle_grace_s
        A worker that joined is offered for closing only after this long without a stage.
    profile_band
        Re-plan when a stage's measured compute time (the median of its recent batches against
        the profile) leaves [1/band, band]; the profile is scaled to what was measured first. At
        most one such re-plan per ``load_interval_s``.
    """

    debounce_s: float = 1.0
    load_shift: float = 0.25
    load_interval_s: float = 60.0
    load_window_s: float = 10.0
    plan_time_limit_s: float = 30.0
    flush_timeout_s: float = 10.0
    scale_up_bad_rate: float = 0.01
    target_utilisation: float = 0.8
    scale_cooldown_s: float = 30.0
    idle_grace_s: float = 10.0
    profile_band: float = 1.3

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == math.inf:
                raise ValueError(f"ElasticSettings.{f.name} must be a finite number >= 0, got {value!r}")
        if not 0 < self.target_utilisation <= 1:
            raise ValueError(f"ElasticSettings.target_utilisation must be in (0, 1], got {self.target_utilisation!r}")
        if self.load_window_s <= 0:
            raise ValueError(f"ElasticSettings.load_window_s must be > 0, got {self.load_window_s!r}")
        if not self.profile_band > 1:
            raise ValueError(f"ElasticSettings.profile_band must be > 1, got {self.profile_band!r}")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ElasticSettings:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown elastic settings {sorted(unknown)}; known: {sorted(f.name for f in fields(cls))}")
        return cls(**data)


@dataclass
class ModelSpec:
    """What starting a stage of one model for any cut takes; the blocks stay opaque bytes here."""

    blocks: list[bytes]  # block i: ``pickle.dumps([torch.fx block i])``, unpickled by ``Stage`` on a worker
    input_shapes: list[tuple[int, ...]]  # the per-sample shape block i takes
    output_shape: tuple[int, ...]  # the per-sample shape the last block gives
    input_dtype: str  # the requests' torch dtype name
    profile: Profile  # undilated; tables of GPU kinds that join later are measured or estimated into it

    @classmethod
    def from_msg(cls, name: str, msg: Mapping[str, Any]) -> ModelSpec:
        """``msg``: the model's ``blocks`` (pickled one by one), ``input_shapes``, ``output_shape``,
        ``input_dtype`` and ``profile`` (a dict), as ``deploy`` and ``Service.add_model`` send them."""
        profile = Profile.from_dict(msg["profile"])
        blocks, shapes = list(msg["blocks"]), [tuple(int(x) for x in s) for s in msg["input_shapes"]]
        if len(blocks) != profile.num_blocks or len(shapes) != profile.num_blocks:
            raise DeployError(
                f"model {name!r} has {profile.num_blocks} blocks but {len(blocks)} pickled blocks and {len(shapes)} input shapes were given"
            )
        return cls(blocks, shapes, tuple(int(x) for x in msg["output_shape"]), str(msg["input_dtype"]), profile)


@dataclass(frozen=True)
class NewModel:
    """A model a re-plan starts serving (added, or a new version): its own queue bound and sample size."""

    max_queued: int | None = None
    sample_nbytes: int = 0


@dataclass
class Deployment:
    """The models of one ``deploy`` call: planned together, switched together."""

    models: dict[str, ModelSpec]
    plan: Plan  # undilated: the plan in force
    rows: dict[str, list[list]]  # model -> [[pipeline, partition, address, stage key], ...]
    planner: PlannerOptions  # deploy's, with the plan's bandwidth
    slo_us: dict[str, float]  # deploy's SLOs, where it gave them
    weights: dict[str, float]
    serving: ServeSettings  # deploy's: the data plane, time dilation and queue bound of every plan after
    profile_store: str | None = None  # deploy's store folder: used where this scheduler sees it
    retiring: dict[str, list[list]] = field(default_factory=dict)  # an updated model's old version: its stage rows, until its requests end
    epoch: int = 0
    replanned_at: float = field(default_factory=time.monotonic)

    def addresses(self) -> set[str]:
        return {row[2] for rows in self.rows.values() for row in rows}
