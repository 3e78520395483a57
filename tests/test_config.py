"""daskpipe's Dask config keys: one file of defaults, described by its schema, and read by the code."""

from __future__ import annotations

from dataclasses import fields

import dask.config
import pytest

from daskpipe.config import DEFAULTS, SCHEMA, current_frames_can_deadlock, load
from daskpipe.dashboard.server import UPDATE_CONFIG
from daskpipe.profiles.store import CONFIG_KEY as STORE_CONFIG
from daskpipe.runtime import gray
from daskpipe.runtime.gctune import GC_CONFIG
from daskpipe.runtime.plugin import EXTENSIONS_CONFIG

TYPES = {"object": dict, "array": list, "string": str, "number": (int, float), "integer": int, "boolean": bool, "null": type(None)}


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


def test_every_default_is_described_by_the_schema_with_its_type():
    defaults, schema = load(DEFAULTS), load(SCHEMA)
    for path, value in leaves(defaults).items():
        node = described(schema, path)
        kinds = node["type"] if isinstance(node["type"], list) else [node["type"]]
        assert any(isinstance(value, TYPES[k]) and not (k in ("number", "integer") and isinstance(value, bool)) for k in kinds), (
            path,
            value,
            kinds,
        )
        assert node.get("description") or described(schema, path.rsplit(".", 1)[0]).get("description"), path


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
        pytest.raises(ValueError, match="readmit-ratio must be a number >= 1, got 'fast'"),
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
