"""Every data plane by name, for the simulator and the runtime alike (one registry, as vLLM keeps
its scheduling policies).

``daskpipe simulate --dataplane NAME`` and ``deploy(..., dispatcher=NAME)`` both build their
dispatchers with :func:`make_dispatcher`, so each name runs in both. The policies:

``ppipe``
    PPipe's planning dispatcher (:mod:`daskpipe.sched.ppipe`): whole pipelines, reserved ahead.
``ppipe-two-pass``
    PPipe with two-pass admission (:func:`ppipe_two_pass`): the one to serve with when overload is expected.
``deferred``
    Symphony's deferred batching (:mod:`daskpipe.sched.symphony`).
``eager``, ``timeout``
    Symphony's baselines (:mod:`daskpipe.sched.batching`): a batch as soon as a GPU idles, or once
    its head has waited ``timeout_s``.
``reactive``
    PPipe's reactive ablation (:mod:`daskpipe.sched.reactive`): one batcher per pool, a *staged*
    dispatch per partition.
``hybrid``
    The data plane of hybrid (fragment) plans (:mod:`daskpipe.sched.hybrid`): one PPipe per entry
    block over one timeline; on a plan whose pipelines all enter at block 0 it is PPipe.

``deferred``, ``eager`` and ``timeout`` also run *shared pools* (:func:`make_shared_dispatcher`):
one dispatcher over a sub-cluster's slots, each of which holds every model of the sub-cluster, as
in Symphony; the simulator and the runtime both build it there.

Tests may add a policy of their own with :func:`register`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from enum import Enum
from typing import Any, Callable, Collection, Mapping, Sequence

from daskpipe.plan.schema import ModelPlan
from daskpipe.profiles.model import Profile
from daskpipe.sched.api import Action, Dispatcher, Placement, Slot
from daskpipe.sched.batching import EagerDispatcher, TimeoutDispatcher
from daskpipe.sched.hybrid import FragmentDispatcher
from daskpipe.sched.ppipe import PPipeDispatcher, PPipeSettings
from daskpipe.sched.reactive import ReactiveDispatcher
from daskpipe.sched.symphony import DeferredDispatcher, SharedPoolRoute, SlotKind


class DataPlane(str, Enum):
    """The built-in data planes (the module docstring says what each is)."""

    PPIPE = "ppipe"
    PPIPE_TWO_PASS = "ppipe-two-pass"
    DEFERRED = "deferred"
    EAGER = "eager"
    TIMEOUT = "timeout"
    REACTIVE = "reactive"
    HYBRID = "hybrid"


DATAPLANES: tuple[str, ...] = tuple(plane.value for plane in DataPlane)
MULTIPLEXING: tuple[str, ...] = (DataPlane.DEFERRED.value, DataPlane.EAGER.value, DataPlane.TIMEOUT.value)
"""The data planes that can serve several models over the same slots (a shared pool)."""

TIMEOUT_S = 0.002
"""The timeout policy's default wait (Triton's and Ray Serve's order of magnitude)."""

DispatcherFactory = Callable[..., Dispatcher]
"""``factory(model_plan, placement, profile, *, bw_gbps) -> Dispatcher`` (a registered extra)."""

_EXTRA: dict[str, DispatcherFactory] = {}


def register(name: str, factory: DispatcherFactory) -> None:
    """Add data plane ``name`` (tests: a simple policy that exercises the executor, not policy).
    It is built with ``factory(model_plan, placement, profile, bw_gbps=...)``."""
    if name in DATAPLANES:
        raise ValueError(f"{name!r} is a built-in data plane")
    _EXTRA[name] = factory


def known() -> list[str]:
    """Every data plane name, built-in ones first."""
    return [*DATAPLANES, *sorted(_EXTRA)]


def check_name(name: Any) -> str:
    """``name`` if it names a data plane, else a ``ValueError`` that lists the known ones."""
    if not isinstance(name, str) or (name not in DATAPLANES and name not in _EXTRA):
        raise ValueError(f"unknown data plane {name!r}; known: {', '.join(known())}")
    return name


def make_dispatcher(
    name: str,
    model_plan: ModelPlan,
    placement: Placement,
    profile: Profile,
    *,
    bw_gbps: float,
    timeout_s: float = TIMEOUT_S,
    max_batch: int | None = None,
    settings: Any = None,
) -> Dispatcher:
    """Data plane ``name`` for one model of a plan, on ``placement``.

    ``settings`` goes to the policy (``PPipeSettings`` for ppipe, ppipe-two-pass and hybrid,
    ``ReactiveSettings``, ``DeferredSettings`` for deferred, eager and timeout); ``max_batch``
    caps deferred, eager and timeout batches; ``timeout_s`` is the timeout policy's wait.
    """
    plane = check_name(name)
    if plane in _EXTRA:
        return _EXTRA[plane](model_plan, placement, profile, bw_gbps=bw_gbps)
    if plane == DataPlane.PPIPE:
        return PPipeDispatcher(model_plan, placement, profile, bw_gbps=bw_gbps, settings=settings)
    if plane == DataPlane.PPIPE_TWO_PASS:
        return ppipe_two_pass(model_plan, placement, profile, bw_gbps=bw_gbps, settings=settings)
    if plane == DataPlane.HYBRID:
        return FragmentDispatcher(model_plan, placement, profile, bw_gbps=bw_gbps, settings=settings)
    if plane == DataPlane.REACTIVE:
        return ReactiveDispatcher(model_plan, placement, profile, bw_gbps=bw_gbps, settings=settings)
    caps = {} if max_batch is None else {"max_batch": max_batch}
    if plane == DataPlane.DEFERRED:
        return DeferredDispatcher.for_plan(model_plan, placement, profile, bw_gbps=bw_gbps, settings=settings, **caps)
    if plane == DataPlane.EAGER:
        return EagerDispatcher.for_plan(model_plan, placement, profile, bw_gbps=bw_gbps, settings=settings, **caps)
    return TimeoutDispatcher.for_plan(model_plan, placement, profile, bw_gbps=bw_gbps, settings=settings, max_wait_s=timeout_s, **caps)


def ppipe_two_pass(model_plan: ModelPlan, placement: Placement, profile: Profile, *, bw_gbps: float, settings: Any = None) -> Dispatcher:
    """PPipe's dispatcher with two-pass admission (``PPipeSettings.two_pass_admission``, the
    published artifact's choice): the first look at a request tries only near-planned batch sizes,
    and drops it at once if none meets its deadline.

    Under overload the paper's rule admits requests at the very edge of their deadline, whose last
    moment has come by the time they are admitted, so they leave in small batches: the batches
    shrink as the load grows (7.2 -> 5.3 requests per batch of a planned 8 at 3x in ``bench
    overload``) and goodput falls with them. Two-pass admission keeps batches full at any load.
    """
    two_pass = replace(settings, two_pass_admission=True) if settings is not None else PPipeSettings(two_pass_admission=True)
    return PPipeDispatcher(model_plan, placement, profile, bw_gbps=bw_gbps, settings=two_pass)


def make_shared_dispatcher(
    name: str,
    models: Mapping[str, tuple[ModelPlan, Profile]],
    slots: Sequence[Slot],
    *,
    timeout_s: float | Mapping[str, float] = TIMEOUT_S,
    max_batch: int | None = None,
    settings: Any = None,
) -> DeferredDispatcher:
    """Data plane ``name`` (one of :data:`MULTIPLEXING`) for a shared pool: every model of
    ``models`` (name -> its plan and profile) whole on every one of ``slots``.

    Each model's plan has one single-partition pipeline per (GPU, slices) kind of ``slots``
    (``daskpipe.plan.shared``); a batch is timed on its slot's kind, and a model's largest batch is
    its pipelines' smallest planned one (what its slowest kind allows within the SLO). ``settings``
    is a ``DeferredSettings``; ``max_batch`` caps every model's batches; ``timeout_s`` is the
    timeout plane's wait, one for all models or one each (Symphony's Fig. 6b: a share of each SLO).
    """
    plane = check_name(name)
    if plane not in MULTIPLEXING:
        raise ValueError(f"data plane {name!r} does not share slots between models; a shared pool runs one of {', '.join(MULTIPLEXING)}")
    route = SharedPoolRoute({slot.id: (slot.gpu, slot.slices) for slot in slots})
    caps = {}
    for model, (model_plan, profile) in models.items():
        caps[model] = _join_route(route, model, model_plan, profile, list(route.kinds), max_batch)
    policy: dict[str, Any] = {"max_wait_s": timeout_s} if plane == DataPlane.TIMEOUT else {}
    kind = {DataPlane.DEFERRED: DeferredDispatcher, DataPlane.EAGER: EagerDispatcher, DataPlane.TIMEOUT: TimeoutDispatcher}[
        DataPlane(plane)
    ]
    return kind(
        {m: plan.slo_us / 1e6 for m, (plan, _) in models.items()},
        slots,
        route.slowest,
        max_batch=caps,
        route=route,
        settings=settings,
        **policy,
    )


def add_shared_model(
    dispatcher: DeferredDispatcher,
    name: str,
    model_plan: ModelPlan,
    profile: Profile,
    slots: Sequence[Slot],
    *,
    max_wait_s: float | None = None,
    max_batch: int | None = None,
) -> None:
    """Model ``name`` joins the shared pool ``dispatcher`` serves (:func:`make_shared_dispatcher`'s,
    on ``slots``), as that function would have placed it; ``max_wait_s``: its wait on the timeout
    plane (default: the one every model has there)."""
    if not isinstance(dispatcher.route, SharedPoolRoute):
        raise ValueError(f"{type(dispatcher).__name__} does not serve a shared pool: models cannot join it")
    if name in dispatcher.route.pipelines:
        raise ValueError(f"model {name!r} is served by this pool already")
    placed = {slot.id for slot in slots}
    if not set(dispatcher.slots_in) <= placed <= set(dispatcher.route.kinds):
        raise ValueError(
            f"model {name!r} must join on every slot of its shared pool that is in, {sorted(dispatcher.slots_in)}, and on no other; "
            f"it was placed on {sorted(placed)}"
        )
    cap = _join_route(dispatcher.route, name, model_plan, profile, placed, max_batch)
    try:
        if isinstance(dispatcher, TimeoutDispatcher):
            dispatcher.add_model(name, model_plan.slo_us / 1e6, cap, max_wait_s=max_wait_s)
        else:
            dispatcher.add_model(name, model_plan.slo_us / 1e6, cap)
    except ValueError:
        dispatcher.route.remove(name)
        raise


def remove_shared_model(dispatcher: DeferredDispatcher, name: str, now: float) -> list[Action]:
    """Model ``name`` leaves the shared pool ``dispatcher`` serves; the drops of what it had queued."""
    actions = dispatcher.remove_model(name, now)
    if isinstance(dispatcher.route, SharedPoolRoute):
        dispatcher.route.remove(name)
    return actions


def add_shared_slot(dispatcher: DeferredDispatcher, slot: Slot, now: float) -> list[Action]:
    """``slot`` joins the shared pool ``dispatcher`` serves: every model of the pool runs there, on
    its pipeline of the slot's kind (one the pool has: a new kind needs a plan of its own); what
    the dispatcher sends there at once."""
    if not isinstance(dispatcher.route, SharedPoolRoute):
        raise ValueError(f"{type(dispatcher).__name__} does not serve a shared pool: slots cannot join it")
    dispatcher.route.add_slot(slot.id, (slot.gpu, slot.slices))
    try:
        return dispatcher.add_slot(slot, 0, 0, now)
    except ValueError:
        del dispatcher.route.kinds[slot.id]
        raise


def _join_route(route: SharedPoolRoute, model: str, model_plan: ModelPlan, profile: Profile, on: Collection[str], cap: int | None) -> int:
    """Put ``model`` on the slots ``on`` of ``route``: its whole-model pipeline of each slot's kind,
    timed on that kind. Its largest batch: its pipelines' smallest planned one, at most ``cap``."""
    by_kind = {(pl.partitions[0].gpu, pl.partitions[0].slices): p for p, pl in enumerate(model_plan.pipelines) if len(pl.partitions) == 1}
    missing = sorted({f"{gpu}/v{v}" for gpu, v in (route.kinds[slot] for slot in on) if (gpu, v) not in by_kind})
    if missing:
        raise ValueError(f"the plan of {model!r} has no whole-model pipeline on {', '.join(missing)}, a kind of its shared pool's slots")
    blocks = model_plan.pipelines[0].partitions[0].blocks

    def latency(kind: SlotKind, batch: int) -> float:
        gpu, v = kind
        return profile.latency(gpu, v, batch, *blocks) / 1e6

    route.add(model, latency, by_kind, on)
    return int(min(min(pl.batch_size for pl in model_plan.pipelines), cap or math.inf))
