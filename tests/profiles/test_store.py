"""The profile store: keys that change with the measurement, atomic entries, the Dask config key."""

from __future__ import annotations

import dask.config
import numpy as np
import pytest
import torch
from torch import nn

from daskpipe.profiles.model import ProfileError
from daskpipe.profiles.store import CONFIG_KEY, MeasurementKey, ProfileStore, configured_store, model_fingerprint


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


def test_entries_round_trip_and_a_corrupt_one_is_measured_again(tmp_path, caplog):
    store = ProfileStore(tmp_path / "new")
    path = store.put(key(), np.array([[1.0, 2.0], [3.0, 4.0]]), {"model": "m"})
    np.testing.assert_array_equal(store.get(key()), [[1.0, 2.0], [3.0, 4.0]])
    path.write_text("{not json")
    assert store.get(key()) is None and "ignoring profile store entry" in caplog.text
    assert len(store) == 1 and not list((tmp_path / "new").glob("*.tmp"))


def test_the_store_comes_from_the_argument_or_the_dask_config(tmp_path):
    assert configured_store(None) is None
    with dask.config.set({CONFIG_KEY: str(tmp_path)}):
        assert configured_store(None).root == tmp_path
    assert configured_store(tmp_path / "x").root == tmp_path / "x"
    (tmp_path / "file").write_text("")
    with pytest.raises(ProfileError, match="not a folder"):
        ProfileStore(tmp_path / "file")
