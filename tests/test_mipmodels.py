"""python-mip models freed by the garbage collector while cffi's lock is held (daskpipe.mipmodels)."""

from __future__ import annotations

import subprocess
import sys

import pytest

FREED_UNDER_THE_LOCK = """
import gc, sys
import mip.cbc
from daskpipe.mipmodels import mip_model

gc.disable()
model = mip_model(sense="MAX", solver_name="CBC")
model.cycle = model  # as the collector finds a Model: in a reference cycle
del model
with mip.cbc.ffi._lock:  # as python-mip's set_start holds it while cffi parses a C type
    print("collecting", flush=True)
    gc.collect()  # the collector frees the model here, its finalizer calling into the C library
print("freed")
"""


@pytest.mark.timeout(120)
def test_a_model_the_collector_frees_inside_cffis_lock_does_not_deadlock():
    done = subprocess.run([sys.executable, "-c", FREED_UNDER_THE_LOCK], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["collecting", "freed"]


def test_the_same_script_with_a_plain_model_deadlocks():
    """The case above is the one that hangs without mip_model: a plain mip.Model's first finalizer
    lookup waits on the lock its own thread holds."""
    plain = FREED_UNDER_THE_LOCK.replace('mip_model(sense="MAX", solver_name="CBC")', 'mip.Model(sense="MAX", solver_name="CBC")')
    script = subprocess.Popen([sys.executable, "-c", plain], stdout=subprocess.PIPE, text=True)
    try:
        assert script.stdout is not None and script.stdout.readline().strip() == "collecting"
        with pytest.raises(subprocess.TimeoutExpired):  # the collection, seconds on a machine that does it in microseconds
            script.wait(timeout=3)
    finally:
        script.kill()
        script.wait(10)
