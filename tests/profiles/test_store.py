"""The profile store: keys that change with the measurement, atomic entries, entries checked before
use (a bad one moved aside), the Dask config key."""

from __future__ import annotations

import re

import dask.config
import numpy as np
import pytest
import torch
from torch import nn

from daskpipe.config import ConfigError
from daskpipe.profiles.model import ProfileError
from daskpipe.profiles.store import CONFIG_KEY, MeasurementKey, ProfileStore, check_table, configured_store, model_fingerprint
from tests.profiles.helpers import BAD_ENTRIES


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)).eval()


def key(**changes) -> MeasurementKey:
    fields = dict(
        model="abc",
        segment_boundaries=(0, 2, 4),
        batch_sizes=(1, 2),
        gpu="L4",
        slices=2,
        device="NVIDIA L4",
        driver="550.54",
        torch="2.4.0",
        threads=0,
    )
    return MeasurementKey(**{**fields, **changes})


def test_the_fingerprint_follows_graph_weights_and_input():
    x = torch.randn(1, 3, 8, 8)
    same = model_fingerprint(small_net(), x)
    assert model_fingerprint(small_net(), x) == same
    changed = small_net()
    with torch.no_grad():
        changed[0].bias[0] += 1e-3
    assert model_fingerprint(changed, x) != same
    assert model_fingerprint(small_net(), torch.randn(1, 3, 16, 16)) != same
    net = small_net()
    assert model_fingerprint(nn.Sequential(net[0], nn.Tanh(), *net[2:]).eval(), x) != same, "same weights, another graph"


@pytest.mark.parametrize(
    "change",
    [
        {"driver": "555.42"},
        {"slices": 1},
        {"batch_sizes": (1, 2, 4)},
        {"segment_boundaries": (0, 1, 4)},
        {"torch": "2.5.0"},
        {"threads": 4},
        {"together": 2},
    ],
)
def test_every_field_of_the_key_separates_entries(tmp_path, change):
    store = ProfileStore(tmp_path)
    store.put(key(), np.ones((2, 2)))
    assert store.get(key()) is not None and store.get(key(**change)) is None


def test_entries_round_trip(tmp_path):
    store = ProfileStore(tmp_path / "new")
    store.put(key(), np.array([[1.0, 2.0], [3.0, 4.0]]), {"model": "m"})
    np.testing.assert_array_equal(store.get(key()), [[1.0, 2.0], [3.0, 4.0]])
    assert len(store) == 1 and not list((tmp_path / "new").glob("*.tmp"))


@pytest.mark.parametrize(
    "spoil, why",
    [
        (BAD_ENTRIES["zero-latencies"], "at least 1 us, got 0 us"),
        (BAD_ENTRIES["too-wide"], "a 2x6 table, expected 2 blocks x 2 batch sizes"),
        (BAD_ENTRIES["directory"], "cannot read (Is a directory)"),
        (lambda path: path.write_text("{not json"), "not valid JSON"),
    ],
    ids=[*BAD_ENTRIES, "not-json"],
)
def test_a_bad_entry_is_logged_moved_aside_and_its_kind_written_again(tmp_path, caplog, spoil, why):
    store = ProfileStore(tmp_path)
    path = store.put(key(), np.array([[10.0, 20.0], [30.0, 40.0]]))
    spoil(path)
    spoilt = path.read_text() if path.is_file() else None
    assert store.get(key()) is None
    assert "profile store entry rejected" in caplog.text and why in caplog.text
    (aside,) = tmp_path.glob(f"{key().digest}.*.rejected")
    assert (aside.read_text() if aside.is_file() else None) == spoilt, "renamed as it was, not deleted"
    assert not path.exists() and len(store) == 0
    store.put(key(), np.array([[11.0, 21.0], [31.0, 41.0]]))
    np.testing.assert_array_equal(store.get(key()), [[11.0, 21.0], [31.0, 41.0]])
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    "table, why",
    [
        ([[10.0, 20.0]], "a 1x2 table, expected 2 blocks x 2 batch sizes"),
        ([[10.0], [30.0]], "a 2x1 table"),
        ([[10.0, 20.0], [30.0]], "not a table of numbers, one row per block"),
        (None, "not a table of numbers"),
        ([10.0, 20.0], "not a table of numbers"),
        ([[10.0, float("inf")], [30.0, 40.0]], "finite and at least 1 us, got inf us"),
        ([[10.0, float("nan")], [30.0, 40.0]], "got nan us"),
        ([[10.0, 20.0], [30.0, -1.0]], "got -1 us"),
        ([[10.0, 20.0], [30.0, 14.0]], "block 1 takes 14 us at batch 2, under 50% of its 30 us at a smaller batch"),
    ],
)
def test_a_table_that_is_no_measurement_of_its_key_is_refused_saying_why(table, why):
    with pytest.raises(ProfileError, match=f"^here: .*{re.escape(why)}"):
        check_table(table, key(), "here")


def test_a_real_tables_noise_passes():
    one_block = key(batch_sizes=(1, 2, 4), segment_boundaries=(0, 9))
    for real in ([[41.8, 44.0, 40.1, 52.3]], [[6.8, 6.7, 6.6, 6.6]]):  # a larger batch timed a little faster: noise, not a bad entry
        np.testing.assert_array_equal(check_table(real, one_block, "here"), real)
    assert check_table([[5.0], [7.0]], key(batch_sizes=(1,)), "here").shape == (2, 1)


def test_a_failed_write_says_where_and_leaves_no_temporary_file(tmp_path):
    store = ProfileStore(tmp_path)
    store.path(key()).mkdir()
    with pytest.raises(ProfileError, match=f"profile store {re.escape(str(store.path(key())))}: cannot write"):
        store.put(key(), np.ones((2, 2)))
    assert not list(tmp_path.glob("*.tmp"))


def test_the_store_comes_from_the_argument_or_the_dask_config(tmp_path):
    assert configured_store(None) is None
    with dask.config.set({CONFIG_KEY: str(tmp_path)}):
        assert configured_store(None).root == tmp_path
    with dask.config.set({CONFIG_KEY: 123}), pytest.raises(ConfigError, match=f"^{CONFIG_KEY}: 123 is not of type 'string', 'null'"):
        configured_store(None)
    assert configured_store(tmp_path / "x").root == tmp_path / "x"
    (tmp_path / "file").write_text("")
    with pytest.raises(ProfileError, match="not a folder"):
        ProfileStore(tmp_path / "file")
