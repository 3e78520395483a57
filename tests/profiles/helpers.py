"""The bad profile store entries issue #43 found the store reading as good, made from a good one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np


def rewrite_table(path: Path, change: Callable[[np.ndarray], np.ndarray]) -> None:
    entry = json.loads(path.read_text())
    entry["latency_us"] = change(np.asarray(entry["latency_us"])).tolist()
    path.write_text(json.dumps(entry))


def zero_latencies(path: Path) -> None:
    """Planned 1,000,000 requests a second."""
    rewrite_table(path, np.zeros_like)


def too_wide(path: Path) -> None:
    """Batches up to 3x the largest timed, each as fast as it: planned 3x the capacity."""
    rewrite_table(path, lambda table: np.hstack([table, np.repeat(table[:, -1:], 2 * table.shape[1], axis=1)]))


def directory(path: Path) -> None:
    """Raised a raw IsADirectoryError and left a ``.tmp`` behind."""
    path.unlink()
    path.mkdir()


BAD_ENTRIES = {"zero-latencies": zero_latencies, "too-wide": too_wide, "directory": directory}
"""Each bad entry by name, and why: what it does to the good entry at a path."""
