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
def _locked(path: Path, operation: int) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, operation)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def _turn_of(item: pytest.Item) -> Iterator[None]:
    """Under pytest-xdist, an ``alone`` test runs while no other test does; the others share the machine.

    Those tests assert real-time latency on a 2-core machine, where another test's cluster beside
    them takes the cores their deadlines were set for. A readers-writer lock over the workers'
    files: every test holds the shared lock, an ``alone`` test the exclusive one; a turnstile lets
    a waiting ``alone`` test in before the next shared holder.
    """
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    base = Path(tempfile.gettempdir())
    turnstile, room = base / f"daskpipe-tests-{run}.turnstile", base / f"daskpipe-tests-{run}.room"
    if item.get_closest_marker("alone"):
        with _locked(turnstile, fcntl.LOCK_EX), _locked(room, fcntl.LOCK_EX):
            yield
        return
    with _locked(turnstile, fcntl.LOCK_EX):
        pass
    with _locked(room, fcntl.LOCK_SH):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of a test run in its turn (:func:`_turn_of`)."""
    with _turn_of(item):
        yield
