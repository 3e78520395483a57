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
"""

from __future__ import annotations

import gc
import logging

import dask.config

logger = logging.getLogger(__name__)

GC_CONFIG = "daskpipe.gc-threshold-factor"
"""Dask config key (``DASK_DASKPIPE__GC_THRESHOLD_FACTOR``): the factor on CPython's default
thresholds, 3 as in Dask's CLIs; 1 leaves the collector as it is."""
CPYTHON_THRESHOLDS = (700, 10, 10)


def raise_gc_thresholds() -> tuple[int, int, int]:
    """Raise this process's GC thresholds to the configured factor of CPython's defaults, never
    lowering one already higher (Dask's CLIs set them first; the call is idempotent); returns them.

    A bad factor is logged as an error and changes nothing: the thresholds only tune speed.
    """
    factor = dask.config.get(GC_CONFIG)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor <= 1000:
        logger.error(
            "daskpipe: %s must be a number from 1 to 1000, got %r; the GC thresholds stay %s", GC_CONFIG, factor, gc.get_threshold()
        )
        return gc.get_threshold()
    gen0, gen1, gen2 = (max(now, round(default * factor)) for now, default in zip(gc.get_threshold(), CPYTHON_THRESHOLDS))
    wanted = (gen0, gen1, gen2)
    if wanted != gc.get_threshold():
        gc.set_threshold(*wanted)
        logger.debug("daskpipe: GC thresholds of this process raised to %s", wanted)
    return wanted
