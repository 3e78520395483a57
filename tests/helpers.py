"""Helpers for the whole suite: the repository's root, waiting for a condition, and a paced stream of calls."""

from __future__ import annotations

import asyncio
import gc
import math
import time
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

import numpy as np

REPO = Path(__file__).resolve().parents[1]

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], *, timeout: float, interval: float = 0.02, what: str) -> T:
    """Poll ``predicate`` every ``interval`` seconds until it returns something true, and return that;
    fail naming ``what`` when ``timeout`` seconds pass first (a busy machine is slow, not wrong)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
    return value


async def wait_until_async(predicate: Callable[[], Awaitable[T]], *, timeout: float, interval: float = 0.02, what: str) -> T:
    """:func:`wait_until` for an asynchronous client: ``predicate`` returns an awaitable."""
    deadline = time.monotonic() + timeout
    while not (value := await predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)
    return value


def paced(
    submit: Callable[[], T], rate: float, *, seconds: float | None = None, count: int | None = None, poisson: bool = True, seed: int = 0
) -> list[T]:
    """Call ``submit`` ``rate`` times a second, open loop (no call waits for an earlier one to end),
    for ``seconds`` or ``count`` calls; what the calls returned.

    The calls come at Poisson arrival times drawn from ``seed`` (the first one gap after now), or,
    with ``poisson=False``, evenly from now on; each is timed from the start, so a slow call does
    not slow the pace."""
    if (seconds is None) == (count is None):
        raise ValueError("paced needs seconds or count, and not both")
    if poisson:
        offsets = np.cumsum(
            np.random.default_rng(seed).exponential(1 / rate, size=count if count is not None else int(rate * seconds * 2) + 10)
        )
    else:
        offsets = np.arange(count if count is not None else math.ceil(rate * seconds) + 1) / rate
    if seconds is not None:
        offsets = offsets[offsets < seconds]
    start, out = time.monotonic(), []
    for offset in offsets:
        time.sleep(max(0.0, start + offset - time.monotonic()))
        out.append(submit())
    return out


class LoopTurns:
    """Counts the turns of the running event loop from :meth:`start`: ``count`` is how many it
    has taken, so a check can tell what ran in one turn from what spread over several."""

    def __init__(self) -> None:
        self.count = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._count())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _count(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)


def settle_heap() -> None:
    """Collect what earlier tests left and keep the survivors out of later collections' walks
    (``gc.freeze``). The in-process clusters' schedulers and workers live in the test process,
    which carries every earlier test's objects: a full collection walking them took 170-240 ms
    a third of the way into the suite, a stall of every slot's compute and of the scheduler's loop."""
    gc.collect()
    gc.freeze()
