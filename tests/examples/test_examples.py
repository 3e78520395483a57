"""The scripts in ``examples/`` run as a user runs them, and say what they promise."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.timeout(300)


def run_example(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(REPO / "examples" / script), *args], capture_output=True, text=True, timeout=280, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_serve_emulated_gpus_serves_every_request_and_refuses_a_bad_one():
    out = run_example("serve_emulated_gpus.py", "--gpus", "L4:1,T4:1", "--requests", "30", "--dashboard-address", ":0")
    assert "/daskpipe-slos" in out and "pool: " in out
    assert "a wrong shape: InvalidRequest" in out
    ended = ast.literal_eval(re.search(r"30 requests in [\d.]+ s: (\{.*\})", out).group(1))
    # every request ends; at 70% of the plan's capacity, nearly all are served: the command's own
    # cluster shares 2 cores with whatever the machine does, and a stall of a second drops a few
    # (27 of 30 once in a full run); attainment under control is the runtime tests' business
    assert sum(ended.values()) == 30 and ended.get("output", 0) >= 27, ended


def test_plan_and_simulate_plans_both_models_and_meets_the_slo():
    out = run_example("plan_and_simulate.py", "--gpus", "L4=1,T4=2", "--duration", "2")
    attainments = [float(a) for a in re.findall(r"^simulated .*SLO attainment ([\d.]+)", out, re.MULTILINE)]
    assert len(attainments) == 2 and min(attainments) >= 0.99, out


def test_plan_and_simulate_names_a_bad_inventory():
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "plan_and_simulate.py"), "--gpus", "L4"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "--gpus takes TYPE=COUNT" in done.stderr
