"""Shared-pool deployments: ``deploy(..., pools=SharedPools(...))`` (docs/batching.md, "Shared pools").

Every model of a sub-cluster runs whole on every slot of it, and one multiplexing dispatcher per
sub-cluster (deferred, eager or timeout: ``daskpipe.sched.registry.make_shared_dispatcher``, the
one the simulator runs) decides, batch by batch, which model a free slot runs next. This module
turns the user's sub-clusters into slots, checks that each slot holds its models, and places one
stage per (model, slot); the scheduler plugin's ``serve_pool`` serves each sub-cluster. A service
changes a deployed pool's models with :class:`SharedDeployment` (the scheduler's ``join_pool`` and
``leave_pool``). Torch-free.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Collection, Mapping, Sequence

from daskpipe.plan.schema import Plan, PlanError
from daskpipe.plan.shared import SharedGroup, check_memory, shared_plan
from daskpipe.profiles.memory import CUDA_CONTEXT_BYTES, ModelMemory
from daskpipe.profiles.model import Profile
from daskpipe.runtime.errors import DeployError
from daskpipe.runtime.wire.messages import ServeSettings, WorkerSlot


@dataclass(frozen=True)
class SubCluster:
    """``models`` sharing ``slots``: that many of the cluster's slots (in server, address order,
    after those the sub-clusters before it took), or those worker addresses."""

    models: tuple[str, ...]
    slots: int | tuple[str, ...]

    def __post_init__(self) -> None:
        if isinstance(self.models, str) or not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise DeployError(f"a SubCluster's models must be a non-empty tuple of model names, got {self.models!r}")
        count = isinstance(self.slots, int) and not isinstance(self.slots, bool) and self.slots >= 1
        named = isinstance(self.slots, tuple) and self.slots and all(isinstance(a, str) for a in self.slots)
        if not (count or named):
            raise DeployError(f"a SubCluster's slots must be a count >= 1 or a tuple of worker addresses, got {self.slots!r}")


@dataclass(frozen=True)
class SharedPools:
    """How ``deploy`` shares slots between models.

    subclusters: the models of each sub-cluster and its slots; empty: one sub-cluster, every model
        on every slot. Symphony's partitioning (``daskpipe.plan.subclusters``) makes such a list.
    memory: a model's :class:`~daskpipe.profiles.memory.ModelMemory` as measured on its GPU, in
        place of ``deploy``'s estimate (its weights, and one host forward pass's activations).
    context_bytes: the CUDA context every slot's process holds before any model.
    timeout_ms: how long the ``timeout`` data plane lets a batch's first request wait (before
        time dilation), for the baseline's sweep: one wait for every model, or one for each (a
        mapping that names every model of the deployment; Symphony's Fig. 6b gives each model a
        share of its SLO); ``None``: the registry's ``TIMEOUT_S``.
    resplit_s: how often the service re-splits its models over its sub-clusters by their rates
        (``Service.resplit``, Symphony's epoch); ``None``: only when called.
    adopt_s: how often the service looks for workers that joined the cluster and adds them to its
        sub-clusters (``Service.add_workers``); ``None``: only when called.
    """

    subclusters: tuple[SubCluster, ...] = ()
    memory: Mapping[str, ModelMemory] = field(default_factory=dict)
    context_bytes: int = CUDA_CONTEXT_BYTES
    timeout_ms: float | Mapping[str, float] | None = None
    resplit_s: float | None = None
    adopt_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("resplit_s", "adopt_s"):
            every = getattr(self, name)
            if every is not None and (isinstance(every, bool) or not isinstance(every, (int, float)) or not 0 < every < math.inf):
                raise DeployError(f"SharedPools.{name} must be None or a number of seconds > 0, got {every!r}")
        if not isinstance(self.subclusters, tuple) or not all(isinstance(s, SubCluster) for s in self.subclusters):
            raise DeployError(f"SharedPools.subclusters must be a tuple of SubCluster, got {self.subclusters!r}")
        if not isinstance(self.memory, Mapping) or not all(isinstance(m, ModelMemory) for m in self.memory.values()):
            raise DeployError("SharedPools.memory must map model names to ModelMemory")
        if isinstance(self.context_bytes, bool) or not isinstance(self.context_bytes, int) or self.context_bytes < 0:
            raise DeployError(f"SharedPools.context_bytes must be a number of bytes >= 0, got {self.context_bytes!r}")
        waits = self.timeout_ms.values() if isinstance(self.timeout_ms, Mapping) else [] if self.timeout_ms is None else [self.timeout_ms]
        if any(isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < math.inf for w in waits):
            raise DeployError(
                f"SharedPools.timeout_ms must be None, a number of milliseconds >= 0 or a mapping of model names to such numbers, "
                f"got {self.timeout_ms!r}"
            )

    def timeouts_s(self, models: Sequence[str]) -> float | dict[str, float] | None:
        """The timeout plane's wait for ``models`` (a sub-cluster's) in seconds, as the scheduler takes it."""
        if not isinstance(self.timeout_ms, Mapping):
            return None if self.timeout_ms is None else self.timeout_ms * 1e-3
        missing = [name for name in models if name not in self.timeout_ms]
        if missing:
            raise DeployError(f"SharedPools.timeout_ms gives no wait for model(s) {missing}")
        return {name: self.timeout_ms[name] * 1e-3 for name in models}


@dataclass(frozen=True)
class Pool:
    """One sub-cluster, resolved: its models and its slots."""

    models: tuple[str, ...]
    slots: tuple[WorkerSlot, ...]

    def group(self) -> SharedGroup:
        return SharedGroup(self.models, dict(Counter((s.gpu, s.slices) for s in self.slots)))


def resolve(pools: SharedPools, names: Sequence[str], slots: Sequence[WorkerSlot]) -> list[Pool]:
    """``pools``' sub-clusters on ``slots``; every model of ``names`` in exactly one, no slot in two
    (and a timeout for each, where ``timeout_ms`` gives them one by one)."""
    pools.timeouts_s(names)
    if not pools.subclusters:
        return [Pool(tuple(names), tuple(sorted(slots, key=lambda s: (s.server, s.address))))]
    placed = [m for sub in pools.subclusters for m in sub.models]
    twice = sorted({m for m in placed if placed.count(m) > 1})
    unknown = sorted(set(placed) - set(names))
    missing = [m for m in names if m not in placed]
    problems = [f"{what} {models}" for what, models in (("in two:", twice), ("not deployed:", unknown), ("in none:", missing)) if models]
    if problems:
        raise DeployError(f"SharedPools.subclusters must hold every deployed model once; models {'; '.join(problems)}")
    free = {s.address: s for s in sorted(slots, key=lambda s: (s.server, s.address))}
    resolved = []
    for index, sub in enumerate(pools.subclusters):
        if isinstance(sub.slots, int):
            if sub.slots > len(free):
                raise DeployError(f"sub-cluster {index} needs {sub.slots} slots, {len(free)} are left of the cluster's {len(slots)}")
            taken = list(free)[: sub.slots]
        else:
            taken = list(sub.slots)
            gone = [a for a in taken if a not in free]
            if gone:
                raise DeployError(f"sub-cluster {index} names {gone}, which are not free slots of this cluster (free: {sorted(free)})")
        resolved.append(Pool(sub.models, tuple(free.pop(a) for a in taken)))
    return resolved


def pool_placement(plan: Plan, pools: Sequence[Pool]) -> dict[str, list[tuple[int, int, WorkerSlot]]]:
    """Every model on every slot of its pool, as the stage rows of its plan's pipeline of each slot's kind."""
    placed = {}
    for pool in pools:
        for name in pool.models:
            pipeline_of = {(pl.partitions[0].gpu, pl.partitions[0].slices): p for p, pl in enumerate(plan.model(name).pipelines)}
            placed[name] = [(pipeline_of[(s.gpu, s.slices)], 0, s) for s in pool.slots]
    return placed


def plan_pools(
    pools: Sequence[Pool],
    profiles: Mapping[str, Profile],
    slo_us: Mapping[str, float],
    memory: Mapping[str, ModelMemory],
    context_bytes: int,
) -> Plan:
    """The shared plan of ``pools`` (``daskpipe.plan.shared``), refused with a :class:`DeployError`
    when a model cannot be served there or a slot cannot hold its pool's models."""
    groups = [pool.group() for pool in pools]
    try:
        plan = shared_plan(profiles, groups, slo_us)
        check_memory(plan, groups, memory, context_bytes)
    except PlanError as exc:
        raise DeployError(str(exc)) from None
    return plan


@dataclass
class PoolMember:
    """A model of a shared pool, as its service keeps it to plan and move it: its profile, memory,
    SLO (``None``: its profile's), queue bound, cut blocks and the keys of its stage actors (one per
    slot of its pool; the service holds their futures)."""

    profile: Profile
    memory: ModelMemory
    slo_us: float | None
    max_queued: int | None
    blocked: Any
    stages: set[str]


@dataclass
class SharedDeployment:
    """A shared-pool deployment as its service changes its models while it serves: its pools and
    their members, under the names the scheduler serves the models as (an updated or moved model's
    version, ``name@v2``). A joining model's stages start on every slot of its pool, and the pool's
    other models serve on: no re-plan, no switch. ``epoch_sent`` and ``epoch_at``: what the
    service had sent each model (by its own name) at the last re-split, and when."""

    pools: list[Pool]
    settings: SharedPools
    serving: ServeSettings  # what the pools serve with
    members: dict[str, PoolMember]
    epoch_sent: dict[str, int] = field(default_factory=dict)
    epoch_at: float = field(default_factory=time.monotonic)

    def plan_join(self, name: str, member: PoolMember, into: int | None = None) -> tuple[int, Plan]:
        """The sub-cluster ``name`` joins (``into``, else the one of fewest models whose slots hold
        it beside them within its SLO and memory; ties: the first) and the deployment's plan with
        it there; or a :class:`DeployError` that says why each could not."""
        refusals = []
        candidates = [into] if into is not None else sorted(range(len(self.pools)), key=lambda i: (len(self.pools[i].models), i))
        for index in candidates:
            if not self.pools[index].models:
                refusals.append(f"sub-cluster {index} serves no model any more: it has no dispatcher to join")
                continue
            pools = [Pool((*pool.models, name), pool.slots) if i == index else pool for i, pool in enumerate(self.pools)]
            try:
                return index, self._plan(pools, {**self.members, name: member})
            except DeployError as exc:
                refusals.append(f"sub-cluster {index} ({', '.join(self.pools[index].models)}): {exc}")
        raise DeployError(f"no sub-cluster can serve {name!r} beside its models: {'; '.join(refusals)}")

    def addresses(self) -> set[str]:
        """The workers of every sub-cluster."""
        return {s.address for pool in self.pools for s in pool.slots}

    def plan_grow(self, slots: Sequence[WorkerSlot], into: int | None = None) -> tuple[int, Plan]:
        """The sub-cluster ``slots`` join (``into``, else the one of most models a slot, of those with
        a slot of each new slot's kind; ties: the first) and the deployment's plan with them there;
        or a :class:`DeployError` naming what cannot join."""
        if not slots:
            raise DeployError("no worker to add: every slot of the cluster serves this deployment already")
        addresses = [s.address for s in slots]
        twice = sorted({a for a in addresses if addresses.count(a) > 1})
        serving = sorted(self.addresses() & set(addresses))
        problems = [f"{what} {found}" for what, found in (("named twice:", twice), ("serve a sub-cluster already:", serving)) if found]
        if problems:
            raise DeployError(f"workers cannot join: {'; '.join(problems)}")
        if into is not None and not (isinstance(into, int) and not isinstance(into, bool) and 0 <= into < len(self.pools)):
            raise DeployError(f"subcluster must be one of 0..{len(self.pools) - 1}, got {into!r}")
        new = {(s.gpu, s.slices) for s in slots}
        fits = [i for i, pool in enumerate(self.pools) if pool.models and new <= {(s.gpu, s.slices) for s in pool.slots}]
        if into is None and not fits:
            kinds = ", ".join(f"{gpu}/v{v}" for gpu, v in sorted(new))
            raise DeployError(f"no sub-cluster serving a model has slots of kind {kinds}: a new kind needs a deploy that plans for it")
        index = into if into is not None else max(fits, key=lambda i: (len(self.pools[i].models) / len(self.pools[i].slots), -i))
        if index not in fits:
            have = ", ".join(sorted({f"{s.gpu}/v{s.slices}" for s in self.pools[index].slots}))
            raise DeployError(f"sub-cluster {index} serves no model, or has no slot of the new workers' kinds (it has {have or 'none'})")
        pools = [Pool(pool.models, (*pool.slots, *slots)) if i == index else pool for i, pool in enumerate(self.pools)]
        return index, self._plan(pools, self.members)

    def grown(self, index: int, slots: Sequence[WorkerSlot], stages: Mapping[str, Collection[str]]) -> None:
        """``slots`` serve in sub-cluster ``index`` now, each model's new stages among them (``stages``: keys)."""
        self.pools[index] = replace(self.pools[index], slots=(*self.pools[index].slots, *slots))
        for name, keys in stages.items():
            self.members[name].stages.update(keys)

    def joined(self, index: int, name: str, member: PoolMember) -> None:
        """``name`` serves in sub-cluster ``index`` now."""
        self.pools[index] = replace(self.pools[index], models=(*self.pools[index].models, name))
        self.members[name] = member

    def left(self, name: str) -> set[str]:
        """``name`` serves no more; the keys of its stages, to release."""
        # a pool's last model leaving leaves its slots idle; it keeps its index (a re-split's moves name pools by index)
        self.pools = [replace(pool, models=tuple(m for m in pool.models if m != name)) for pool in self.pools]
        return self.members.pop(name).stages

    def index_of(self, name: str) -> int:
        return next(i for i, pool in enumerate(self.pools) if name in pool.models)

    def plan(self) -> Plan:
        """The deployment's plan as its models are now."""
        return self._plan(self.pools, self.members)

    def timeout_s(self, name: str) -> float | None:
        """``name``'s wait on the timeout data plane, where the settings give each model its own."""
        wait = self.settings.timeouts_s([name])
        return wait[name] if isinstance(wait, dict) else None

    def _plan(self, pools: Sequence[Pool], members: Mapping[str, PoolMember]) -> Plan:
        slos = {name: m.slo_us for name, m in members.items() if m.slo_us is not None}
        profiles = {name: m.profile for name, m in members.items()}
        memory = {name: m.memory for name, m in members.items()}
        return plan_pools([pool for pool in pools if pool.models], profiles, slos, memory, self.settings.context_bytes)
