"""The scheduler's and the stage workers' GC policy: Dask's CLI thresholds, configurable, never lowered."""

from __future__ import annotations

import gc
import logging

import dask.config
import pytest

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
def test_a_bad_factor_is_logged_and_changes_nothing(default_thresholds, caplog, bad):
    with dask.config.set({GC_CONFIG: bad}), caplog.at_level(logging.ERROR, logger="daskpipe.runtime.gctune"):
        assert raise_gc_thresholds() == CPYTHON_THRESHOLDS == gc.get_threshold()
    assert GC_CONFIG in caplog.text and repr(bad) in caplog.text
