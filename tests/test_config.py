"""daskpipe's Dask config keys: one file of defaults, described by its schema, read by the code, and
every value checked against the schema as it is read."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields

import dask.config
import pytest

from daskpipe.config import DEFAULTS, SCHEMA, ConfigError, check, check_settings, current_frames_can_deadlock, load, setting
from daskpipe.dashboard.server import UPDATE_CONFIG
from daskpipe.profiles.store import CONFIG_KEY as STORE_CONFIG
from daskpipe.runtime.gctune import GC_CONFIG
from daskpipe.runtime.scheduler import gray
from daskpipe.runtime.scheduler.plugin import EXTENSIONS_CONFIG


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        out.update(leaves(value, path) if isinstance(value, dict) else {path: value})
    return out


def described(schema: dict, path: str) -> dict:
    node = schema
    for part in path.split("."):
        node = node.get("properties", {}).get(part)
        if node is None:
            raise KeyError(path)
    return node


def test_every_default_is_described_by_the_schema_and_valid():
    defaults, schema = load(DEFAULTS), load(SCHEMA)
    check("daskpipe", defaults["daskpipe"])
    for path in leaves(defaults):
        assert described(schema, path).get("description") or described(schema, path.rsplit(".", 1)[0]).get("description"), path


@pytest.mark.parametrize(
    "key, value, why",
    [
        ("daskpipe.gc-threshold-factor", 0, "less than the minimum of 1"),
        ("daskpipe.gil-switch-interval", -1, "less than the minimum of 1e-05"),
        ("daskpipe.cuda-graphs", "x", "not of type 'boolean'"),
        ("daskpipe.dashboard.update-interval", "abc", "not a duration"),
        ("daskpipe.dashboard.update-interval", "50ms", "shorter than 0.1 s"),
        ("daskpipe.profile-store", 123, "not of type 'string', 'null'"),
        ("daskpipe.scheduler-extensions", "notalist", "not of type 'array'"),
        ("daskpipe.gray.suspect-factor", float("inf"), "inf is not of type 'number'"),
        ("daskpipe.gray.late-limit-slos", float("inf"), "inf is not of type 'number'"),
        ("daskpipe.gray.probe-interval-s", float("nan"), "nan is not of type 'number'"),
        ("daskpipe.gray.slow-batches", 2.5, "not of type 'integer'"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key_whichever_key_is_read(key, value, why):
    with dask.config.set({key: value}):
        for read in (key, "daskpipe.gc-freeze"):
            with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: .*{re.escape(why)}"):
                setting(read)


def test_a_misspelt_key_is_refused_naming_it():
    with dask.config.set({"daskpipe.gray.suspect-after": 3}), pytest.raises(ConfigError, match=r"^daskpipe.gray: .*'suspect-after'"):
        check_settings()
    with dask.config.set({"daskpipe.cuda-graph": False}), pytest.raises(ConfigError, match=r"^daskpipe: .*'cuda-graph' was unexpected"):
        check_settings()


def test_valid_settings_read_as_set():
    with dask.config.set(
        {"daskpipe.gil-switch-interval": None, "daskpipe.dashboard.update-interval": 0.25, "daskpipe.profile-store": "~/x"}
    ):
        assert setting("daskpipe.gil-switch-interval") is None
        assert setting("daskpipe.dashboard.update-interval") == 0.25 and setting("daskpipe.profile-store") == "~/x"


def test_the_keys_the_code_reads_have_their_defaults_in_the_file():
    flat = leaves(load(DEFAULTS))
    for key in (UPDATE_CONFIG, STORE_CONFIG, GC_CONFIG, EXTENSIONS_CONFIG):
        assert key in flat, key
        assert dask.config.get(key) == flat[key]  # importing daskpipe loaded them


def test_the_gray_failure_defaults_are_the_policys():
    flat = leaves(load(DEFAULTS))
    assert {f.name: getattr(gray.GrayPolicy(), f.name) for f in fields(gray.GrayPolicy)} == {
        key.rsplit(".", 1)[1].replace("-", "_"): value for key, value in flat.items() if key.startswith(f"{gray.CONFIG}.")
    }
    assert gray.GrayPolicy.from_config() == gray.GrayPolicy()


def test_a_users_setting_wins_over_the_default():
    with dask.config.set({"daskpipe.gray.readmit-ratio": 3.0}):
        assert gray.GrayPolicy.from_config().readmit_ratio == 3.0
    with (
        dask.config.set({"daskpipe.gray.readmit-ratio": "fast"}),
        pytest.raises(ConfigError, match="daskpipe.gray.readmit-ratio: 'fast' is not of type 'number'"),
    ):
        gray.GrayPolicy.from_config()


@pytest.mark.parametrize(
    "version, deadlocks",
    [((3, 10, 14), True), ((3, 11, 7), True), ((3, 11, 9), False), ((3, 12, 2), True), ((3, 12, 3), False), ((3, 13, 0), False)],
)
def test_the_pythons_whose_current_frames_can_deadlock_are_the_ones_before_the_fix(version, deadlocks):
    assert current_frames_can_deadlock(version) is deadlocks


def test_dasks_worker_profiler_is_off_only_where_python_can_deadlock_and_a_users_setting_wins():
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster:
        (worker,) = cluster.workers.values()
        assert ("profile" in worker.periodic_callbacks) is not current_frames_can_deadlock()
    with (
        dask.config.set({"distributed.worker.profile.enabled": True}),
        LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster,
    ):
        (worker,) = cluster.workers.values()
        assert "profile" in worker.periodic_callbacks


@pytest.mark.parametrize("value, problem", [("8192", None), ("-1", "daskpipe.inline-input-bytes: -1 is less than the minimum of 0")])
def test_a_key_set_in_the_environment_as_dask_spells_it_is_read_and_checked(value, problem):
    """``DASK_DASKPIPE__INLINE_INPUT_BYTES`` reaches Dask's config as ``inline_input_bytes``: the
    same key as ``inline-input-bytes`` to Dask, and to the schema."""
    read = "import daskpipe; from daskpipe.config import setting; print(setting('daskpipe.inline-input-bytes'))"
    env = {**os.environ, "DASK_DASKPIPE__INLINE_INPUT_BYTES": value}
    done = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, env=env, timeout=120)
    if problem is None:
        assert done.returncode == 0 and done.stdout.strip() == value, done.stderr
    else:
        assert done.returncode != 0 and problem in done.stderr, done.stderr
