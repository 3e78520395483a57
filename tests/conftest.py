"""Fixtures shared by the whole suite."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import REPO


def shared_dir() -> Path | None:
    """``../shared`` beside the checkout (or $DASKPIPE_SHARED); ``None`` when absent."""
    path = Path(os.environ.get("DASKPIPE_SHARED", REPO.parent / "shared"))
    return path if path.is_dir() else None


@pytest.fixture(scope="session")
def ppipe_dir() -> Path:
    """The measured PPipe block profiles; tests that need them skip cleanly without them."""
    base = shared_dir()
    if base is None or not (base / "ppipe" / "block-timing").is_dir():
        pytest.skip("../shared/ppipe is not present")
    return base / "ppipe"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI a skipped heavy check (browser, UCX) is a failure: CI is the proof that they work."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("heavy") and os.environ.get("DASKPIPE_REQUIRE_HEAVY") == "1":
        report.outcome = "failed"
        report.longrepr = f"heavy check skipped but DASKPIPE_REQUIRE_HEAVY=1: {report.longrepr}"


@contextmanager
def machine_share(exclusive: bool) -> Iterator[None]:
    """Under pytest-xdist, a test marked ``alone`` runs while no other test does, and the others
    share the machine: a readers-writer lock of two ``flock`` files, the first a turnstile that an
    ``alone`` test holds while it waits, so that the others cannot keep it out. Without xdist it does nothing."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    directory = Path(tempfile.gettempdir()) / f"daskpipe-tests-{run}"
    directory.mkdir(exist_ok=True)
    with open(directory / "turnstile", "a") as turnstile, open(directory / "machine", "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test's setup, call and teardown under :func:`machine_share`."""
    with machine_share(exclusive=item.get_closest_marker("alone") is not None):
        yield
