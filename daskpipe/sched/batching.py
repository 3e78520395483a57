"""Eager and timeout batching, as Symphony frames them (§3.4): the same candidate/timer machinery
as :class:`~daskpipe.sched.symphony.DeferredDispatcher`, with the candidate's ``exec`` bound
changed from the frontrun ``d - l(b+1)`` to ``a + k`` (``a`` the arrival of the batch's head
request, ``k`` the timeout). ``k = 0`` is eager batching: a batch goes as soon as a GPU is idle.

The timeout baseline carries Triton's / Ray Serve's two knobs: ``max_wait_s`` (``k``) and
``max_batch`` (a full batch goes at once). Both still gather the largest batch that meets the head
request's deadline and drop, with the same drop policy, what cannot meet it.
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
        max_wait_s: float,
        max_batch: int | Mapping[str, int] = 32,
        route: Route | None = None,
        settings: DeferredSettings | None = None,
    ) -> None:
        if isinstance(max_wait_s, bool) or not isinstance(max_wait_s, (int, float)) or not (max_wait_s >= 0 and math.isfinite(max_wait_s)):
            raise ValueError(f"max_wait_s must be a non-negative number of seconds, got {max_wait_s!r}")
        self.max_wait_s = float(max_wait_s)
        super().__init__(models, slots, latency, max_batch=max_batch, route=route, settings=settings)

    def _exec_bound(self, model: ModelQueue, samples: int, deadline: Time) -> Time:
        if samples >= model.max_batch:
            return -math.inf
        return model.queue.at(0).arrival + self.max_wait_s


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
