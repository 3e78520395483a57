"""daskpipe's Dask config keys: their defaults (``daskpipe.yaml``) and schema (``daskpipe-schema.yaml``),
as distributed keeps its own. Importing ``daskpipe`` loads the defaults, so every process that runs
daskpipe code reads the same keys with the same defaults, whichever module reads them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import dask.config
import yaml

DEFAULTS = Path(__file__).with_name("daskpipe.yaml")
SCHEMA = Path(__file__).with_name("daskpipe-schema.yaml")


def load(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return yaml.safe_load(f)


PROFILER_OFF = {"distributed": {"worker": {"profile": {"enabled": False}}}}


def update_defaults() -> None:
    """Give Dask's config daskpipe's defaults (what users set themselves stays), and, on a Python
    whose ``sys._current_frames`` can deadlock, turn off the one daskpipe process that calls it
    every 10 ms: Dask's statistical worker profiler."""
    dask.config.update_defaults(load(DEFAULTS))
    if current_frames_can_deadlock():
        import distributed.config  # noqa: F401  (its defaults first: imported later, it would put its own back)

        dask.config.update_defaults(PROFILER_OFF)


def current_frames_can_deadlock(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """CPython before 3.11.9 and 3.12.3 (gh-106883): ``sys._current_frames()`` holds the thread
    list's lock while it builds its dict, a garbage collection inside it runs Python callbacks (one
    is Dask's own GC diagnosis) that may hand the GIL over, and a thread that starts or ends then
    holds the GIL waiting for that lock. Seen in daskpipe's tests: a worker's profiler and a stage
    starting its compute thread hung a whole deploy."""
    return version < (3, 11, 9) or (3, 12) <= version < (3, 12, 3)
