"""Fixtures shared by the whole suite."""

from __future__ import annotations

import multiprocessing.forkserver
import os
from collections.abc import Iterator
from pathlib import Path

import dask.config
import pytest

from tests.helpers import REPO, settle_heap


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


WORKER_PRELOAD = ("torch", "daskpipe.runtime.worker.stage")
"""What the suite's worker processes find imported: torch alone takes 2.3 s of a core to import."""


def pytest_configure() -> None:
    """The suite's clusters fork their worker processes (:func:`forked_workers`)."""
    forked_workers()


def forked_workers() -> None:
    """Worker processes of this process's clusters fork from one server that imported torch once.

    Dask spawns each Nanny's worker as a fresh interpreter that imports torch again (3.5 s per
    cluster of two on two cores; 0.2 s forked); Dask's own suite forks for the same reason. The
    server starts with the environment Dask's Nanny would give a stage worker (its pre-spawn
    settings less glibc's allocator ones, :mod:`daskpipe.runtime.worker.environ`), since a forked
    worker inherits the server's environment, not a Nanny's. Processes the tests start as commands
    (``daskpipe demo``, ``daskpipe worker``) spawn as users' do; so does a test marked ``spawn``.
    """
    from distributed.utils import get_mp_context

    from daskpipe.runtime.worker.environ import ALLOCATOR_VARIABLES, PRE_SPAWN_ENVIRON

    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    # in place of Dask's own list, which importing distributed covers
    get_mp_context().set_forkserver_preload(["distributed", "numpy", *WORKER_PRELOAD])
    pre_spawn = {k: str(v) for k, v in dask.config.get(PRE_SPAWN_ENVIRON).items() if v is not None and k not in ALLOCATOR_VARIABLES}
    saved = dict(os.environ)
    os.environ.update(pre_spawn)
    for name in ALLOCATOR_VARIABLES:
        os.environ.pop(name, None)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module", autouse=True)
def settled_heap() -> None:
    """Each test module starts on a settled heap (:func:`tests.helpers.settle_heap`): its real-time
    checks do not pay for collections of what earlier modules made (a clean-clone run once saw a
    stage profiled at 87.5 ms compute for 837 ms late in the suite, and drop a request)."""
    settle_heap()


@pytest.fixture(autouse=True)
def spawned_workers(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``spawn`` starts its clusters' worker processes as Dask does by default."""
    if request.node.get_closest_marker("spawn") is None:
        yield
        return
    with dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI a skipped heavy check (browser, UCX) is a failure: CI is the proof that they work."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("heavy") and os.environ.get("DASKPIPE_REQUIRE_HEAVY") == "1":
        report.outcome = "failed"
        report.longrepr = f"heavy check skipped but DASKPIPE_REQUIRE_HEAVY=1: {report.longrepr}"
