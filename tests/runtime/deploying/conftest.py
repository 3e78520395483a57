import pytest


@pytest.fixture(autouse=True)
def timings_never_busy(monkeypatch):
    """These tests are about the profile store, whose subject is what a sound table becomes; on a
    busy machine (CI's two shared cores) a timing whose thread was off its CPU is flagged and its
    table kept out of the store, which tests/profiles/test_profiler.py and
    ``test_a_table_timed_on_a_busy_machine_is_said_and_not_stored`` check on purpose. So here no
    timing counts as busy (the clusters are in-process: the workers read this module's value)."""
    from daskpipe.profiles import profiler

    monkeypatch.setattr(profiler, "BUSY_CPU_SHARE", 0.0)
