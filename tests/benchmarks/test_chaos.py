"""``daskpipe bench chaos``: a SIGKILLed worker and a scale-up under load lose no request."""

from __future__ import annotations

import numpy as np
import pytest

from daskpipe.benchmarks.chaos import WINDOW_S, recovery_seconds, run_chaos


def test_recovery_is_the_end_of_the_last_window_below_target_after_the_kill():
    submitted = np.arange(0.0, 40.0, 0.05)  # 20 requests per second
    good = np.ones_like(submitted, dtype=bool)
    assert recovery_seconds(submitted, good, kill_at=10.0, end_at=40.0) == 0.0
    good[(submitted >= 12.0) & (submitted < 13.0)] = False  # a second of misses, 2 s after the kill
    # the last window that holds one of them starts at 12.5 and ends WINDOW_S later
    assert recovery_seconds(submitted, good, kill_at=10.0, end_at=40.0) == pytest.approx(12.5 + WINDOW_S - 10.0)
    good[:] = True
    good[(submitted >= 5.0) & (submitted < 6.0)] = False  # misses before the kill do not count
    assert recovery_seconds(submitted, good, kill_at=10.0, end_at=40.0) == 0.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_worker_and_two_new_gpus_lose_no_request_and_the_new_plan_uses_them():
    figures = run_chaos(seed=7, phase_s=5.0)
    assert figures["lost"] == 0, figures
    assert figures["submitted"] == figures["completed"] + sum(figures["dropped"].values()) + sum(figures["failed"].values())
    assert set(figures["dropped"]) <= {"deadline", "worker-lost"} and not figures["failed"]
    assert figures["victim"].startswith("node-0/L4-")
    assert figures["plan_after_uses_new_gpus"], figures["plan_after"]
    assert any(q["gpu"] == "A10" for p in figures["plan_after"] for q in p["partitions"])
    assert len(figures["replans"]) >= 2  # after the loss, and after the scale-up


@pytest.mark.parametrize(
    "args, bad",
    [
        (["--load", "2"], "--load"),
        (["--capacity", "0"], "--capacity"),
        (["--phase-seconds", "5"], "--phase-seconds"),
        (["--fault", "melt"], "'--fault'"),
    ],
)
def test_the_chaos_command_refuses_bad_options_naming_them(args, bad):
    from click.testing import CliRunner

    from daskpipe.cli import main

    result = CliRunner().invoke(main, ["bench", "chaos", *args])
    assert result.exit_code == 2 and f"Invalid value for {bad}" in result.output
