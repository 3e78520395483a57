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

Tests may add a policy of their own with :func:`register`.
"""

from __future__ import annotations

from dataclasses import replace
from enum import Enum
from typing import Any, Callable

from daskpipe.plan.schema import ModelPlan
from daskpipe.profiles.model import Profile
from daskpipe.sched.api import Dispatcher, Placement
from daskpipe.sched.batching import EagerDispatcher, TimeoutDispatcher
from daskpipe.sched.hybrid import FragmentDispatcher
from daskpipe.sched.ppipe import PPipeDispatcher, PPipeSettings
from daskpipe.sched.reactive import ReactiveDispatcher
from daskpipe.sched.symphony import DeferredDispatcher


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
