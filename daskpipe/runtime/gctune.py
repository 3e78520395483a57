"""The garbage collector's thresholds in processes that host a scheduler, daskpipe workers or a
client that serves requests.

Every request is a Dask key: while it is in flight the client, the scheduler and the last
stage's worker each hold a few dozen container objects for it (futures, task states and their
sets). With CPython's default thresholds, a burst of requests makes full collections run every
few thousand requests, each walking the whole heap (torch, bokeh and dask included): measured
on the in-process ``bench runtime``, 40-50% of the run. ``dask scheduler`` and ``dask worker``
raise the thresholds threefold at start for the same reason (dask/distributed#2624), but a
``LocalCluster`` or an ``EmulatedCluster`` never runs that code; the scheduler plugin and the
slot workers apply the same policy, configurable with :data:`GC_CONFIG`. So does a client when it
opens its daskpipe stream: a client process that holds torch ran 13-17 full collections of
120-280 ms each in one ``bench runtime`` at CPython's thresholds, 5 at these, and served 25-30%
more requests per second.

Higher thresholds make full collections rarer, not shorter: one still walks the whole heap, which
torch and Dask fill with hundreds of thousands of long-lived objects (445k and 222 ms on this
2-core machine). On an H200's host the late requests of a real-time deploy came in bursts, a
second of the trial at a time, the stall of one process's collection. So once a process has
set up what it serves with (the scheduler its first model, a worker its first stage, a client its
stream), :func:`freeze_heap` collects once and moves every object alive to CPython's permanent
generation (``gc.freeze``, as vLLM does after its CUDA graphs are captured): later collections
walk only what was made since. Refcounting still frees frozen objects; only cycles among them
are never collected, so it freezes once per process, when little garbage exists.
"""

from __future__ import annotations

import gc
import logging

from daskpipe.config import setting

logger = logging.getLogger(__name__)

GC_CONFIG = "daskpipe.gc-threshold-factor"
"""Dask config key (``DASK_DASKPIPE__GC_THRESHOLD_FACTOR``): the factor on CPython's default
thresholds, 3 as in Dask's CLIs; 1 leaves the collector as it is."""
CPYTHON_THRESHOLDS = (700, 10, 10)
FREEZE_CONFIG = "daskpipe.gc-freeze"
"""Dask config key (``DASK_DASKPIPE__GC_FREEZE``): false leaves the heap to full collections."""


def raise_gc_thresholds() -> tuple[int, int, int]:
    """Raise this process's GC thresholds to the configured factor of CPython's defaults, never
    lowering one already higher (Dask's CLIs set them first; the call is idempotent); returns them."""
    factor = setting(GC_CONFIG)
    gen0, gen1, gen2 = (max(now, round(default * factor)) for now, default in zip(gc.get_threshold(), CPYTHON_THRESHOLDS))
    wanted = (gen0, gen1, gen2)
    if wanted != gc.get_threshold():
        gc.set_threshold(*wanted)
        logger.debug("daskpipe: GC thresholds of this process raised to %s", wanted)
    return wanted


_heap_frozen = False


def freeze_heap() -> bool:
    """Once per process, if :data:`FREEZE_CONFIG` is true: collect, then freeze every object alive
    out of later collections' reach (module docstring); whether this call froze the heap.

    Once is counted here, not from ``gc.get_freeze_count()``: the H200 host's Python froze 375
    objects of its own at start, which a count would have taken for this freeze."""
    global _heap_frozen
    if _heap_frozen or not setting(FREEZE_CONFIG):
        return False
    _heap_frozen = True
    gc.collect()
    gc.freeze()
    logger.debug("daskpipe: %d objects frozen out of the garbage collector's reach", gc.get_freeze_count())
    return True
