"""The GC policy of the scheduler, the stage workers and serving clients: Dask's CLI thresholds,
configurable, never lowered; the heap frozen once set up."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import dask.config
import pytest

from daskpipe.config import ConfigError
from daskpipe.runtime.gctune import CPYTHON_THRESHOLDS, GC_CONFIG, raise_gc_thresholds


def test_thresholds_are_raised_threefold_as_dask_scheduler_does_and_only_once(default_thresholds):
    assert raise_gc_thresholds() == (2100, 30, 30) == gc.get_threshold()
    assert raise_gc_thresholds() == (2100, 30, 30)  # idempotent: not 9x after two calls


def test_a_higher_threshold_is_kept_and_the_factor_is_configurable(default_thresholds):
    gc.set_threshold(50_000, 10, 10)
    with dask.config.set({GC_CONFIG: 2}):
        assert raise_gc_thresholds() == (50_000, 20, 20)
    with dask.config.set({GC_CONFIG: 1}):
        gc.set_threshold(*CPYTHON_THRESHOLDS)
        assert raise_gc_thresholds() == CPYTHON_THRESHOLDS


@pytest.mark.parametrize("bad", ["three", 0, -2, True, 10_000])
def test_a_bad_factor_is_refused_naming_the_key_and_changes_nothing(default_thresholds, bad):
    with dask.config.set({GC_CONFIG: bad}), pytest.raises(ConfigError, match=f"^{GC_CONFIG}: "):
        raise_gc_thresholds()
    assert gc.get_threshold() == CPYTHON_THRESHOLDS


FREEZING = textwrap.dedent(
    """
    import gc, sys, weakref
    import dask.config
    from daskpipe.runtime.gctune import FREEZE_CONFIG, freeze_heap

    class Node:
        pass

    gc.freeze()  # as a host's Python may at start, before daskpipe is imported
    before = gc.get_freeze_count()
    with dask.config.set({FREEZE_CONFIG: False}):
        assert not freeze_heap() and gc.get_freeze_count() <= before, "configured off: nothing frozen (refcounting may free some)"
    cycle = Node(); cycle.me = cycle; dead = weakref.ref(cycle); del cycle
    kept = [Node() for _ in range(5000)]
    assert freeze_heap(), "the first call freezes"
    assert dead() is None, "garbage made before was collected first, not frozen"
    frozen = gc.get_freeze_count()
    assert frozen > before + len(kept), (before, frozen)
    assert not any(node is kept for node in gc.get_objects()), "a full collection no longer walks what was alive"
    later = [Node() for _ in range(100)]
    assert not freeze_heap() and gc.get_freeze_count() == frozen, "once per process: what is made later stays collectable"
    print("frozen", frozen)
    """
)


def test_a_process_freezes_its_heap_once_after_collecting_and_only_if_configured():
    """In a fresh process: this one's heap holds every earlier test's objects."""
    done = subprocess.run([sys.executable, "-c", FREEZING], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("frozen"), done.stderr
