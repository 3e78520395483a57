"""Eager and timeout batching, as Symphony frames them (§3.4): the same candidate/timer machinery
as :class:`~daskpipe.sched.symphony.DeferredDispatcher`, with the candidate's ``exec`` bound
changed from the frontrun ``d - l(b+1)`` to ``a + k`` (``a`` the arrival of the batch's head
request, ``k`` the timeout). ``k = 0`` is eager batching: a batch goes as soon as a GPU is idle.

The timeout baseline carries Triton's / Ray Serve's two knobs: ``max_wait_s`` (``k``, one for all
models or one per model: Symphony's Fig. 6b sets each model's to a share of its SLO) and
``max_batch`` (a full batch goes at once). Both still gather the largest batch that meets the head
request's deadline and drop, with the same drop policy, what cannot meet it.

Shepherd (Zhang et al., NSDI'23, as Symphony §2 describes its Flex scheduler) is eager batching that
gives a freed GPU the *largest* waiting candidate rather than the most urgent one; its preemption
of a running batch by one >= 3x larger is not modelled (a dispatcher cannot take back a batch it
dispatched).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

from daskpipe.sched.api import Slot, Time
from daskpipe.sched.symphony import DeferredDispatcher, DeferredSettings, ModelQueue, Route


class TimeoutDispatcher(DeferredDispatcher):
    """A batch runs when it is full or when its oldest request has waited ``max_wait_s``."""

    def __init__(
        self,
        models: Mapping[str, float],
        slots: Sequence[Slot],
        latency: Callable[[str, int], float],
        *,
        max_wait_s: float | Mapping[str, float],
        max_batch: int | Mapping[str, int] = 32,
        route: Route | None = None,
        settings: DeferredSettings | None = None,
    ) -> None:
        if isinstance(max_wait_s, Mapping) and set(models) - set(max_wait_s):
            raise ValueError(f"max_wait_s gives no timeout for model(s) {sorted(set(models) - set(max_wait_s))}")
        waits = {name: max_wait_s[name] if isinstance(max_wait_s, Mapping) else max_wait_s for name in models}
        for name, wait in waits.items():
            if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not (wait >= 0 and math.isfinite(wait)):
                raise ValueError(f"model {name!r}: max_wait_s must be a non-negative number of seconds, got {wait!r}")
        self.max_wait_s = {name: float(wait) for name, wait in waits.items()}
        self._wait_for_all = None if isinstance(max_wait_s, Mapping) else float(max_wait_s)
        super().__init__(models, slots, latency, max_batch=max_batch, route=route, settings=settings)

    def add_model(self, name: str, slo: float, max_batch: int, max_wait_s: float | None = None) -> None:
        """As the deferred dispatcher's, with ``name``'s wait: ``max_wait_s``, or the one every
        model was given (a dispatcher made with a wait for each model needs one)."""
        wait = self._wait_for_all if max_wait_s is None else max_wait_s
        if wait is None:
            raise ValueError(f"model {name!r}: this dispatcher gives each model its own max_wait_s; give one for it")
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not (wait >= 0 and math.isfinite(wait)):
            raise ValueError(f"model {name!r}: max_wait_s must be a non-negative number of seconds, got {wait!r}")
        super().add_model(name, slo, max_batch)
        self.max_wait_s[name] = float(wait)

    @property
    def _covers_windows(self) -> bool:
        return False  # the baselines as their systems run them

    def _exec_bound(self, model: ModelQueue, samples: int, deadline: Time) -> Time:
        if samples >= model.max_batch:
            return -math.inf
        return model.queue.at(0).arrival + self.max_wait_s[model.name]


class EagerDispatcher(TimeoutDispatcher):
    """Dispatch whenever a GPU is idle (Clockwork, Nexus, Shepherd by default): timeout 0."""

    def __init__(
        self,
        models: Mapping[str, float],
        slots: Sequence[Slot],
        latency: Callable[[str, int], float],
        *,
        max_batch: int | Mapping[str, int] = 32,
        route: Route | None = None,
        settings: DeferredSettings | None = None,
    ) -> None:
        super().__init__(models, slots, latency, max_wait_s=0.0, max_batch=max_batch, route=route, settings=settings)


class ShepherdDispatcher(EagerDispatcher):
    """Eager batching where a freed GPU takes the largest waiting batch (Shepherd's Flex, without
    its preemption)."""

    def _rank(self, model: ModelQueue) -> float:
        assert model.candidate is not None, "only a candidate is ranked"
        return -model.candidate.samples
