"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
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
