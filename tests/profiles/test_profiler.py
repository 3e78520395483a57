"""Profiling a real small model on the CPU: blocks, tables, SLO rule, interpolated batch sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from daskpipe.profiles import Profile, profile_model
from daskpipe.profiles.profiler import normalise_batch_sizes


def small_cnn() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)]
    return nn.Sequential(*layers)


def test_profile_matches_the_blocked_model(tmp_path):
    module = small_cnn()
    profile, blocked = profile_model(
        module, torch.randn(1, 3, 16, 16), name="small", num_blocks=3, batch_sizes=(1, 2, 4), repeats=1, warmup=1,
        cpu_threads=1,
    )
    assert profile.model == "small" and profile.gpu_types == ["cpu"] and profile.slices("cpu") == [1]
    assert profile.num_blocks == blocked.num_blocks == 3
    assert profile.max_batch("cpu") == 4
    assert profile.meta["interpolated_batch_sizes"] == [3]
    table = profile.table("cpu")
    assert (table[:, 2] == (table[:, 1] + table[:, 3]) / 2).all()
    assert profile.slo_us == pytest.approx(5 * table[:, 0].sum())
    assert list(profile.boundary_bytes) == blocked.boundary_bytes
    assert profile.input_shape == (3, 16, 16) and profile.boundary_shapes == tuple(blocked.boundary_shapes)
    with torch.inference_mode():
        x = torch.randn(2, 3, 16, 16)
        torch.testing.assert_close(blocked.run(x, fp16_boundaries=False), module(x))
    profile.save(tmp_path / "small.json")
    assert Profile.load(tmp_path / "small.json").table("cpu").shape == (3, 4)


def test_labels_slices_and_gpu_type_and_keeps_given_slo():
    threads = torch.get_num_threads()
    profile, _ = profile_model(
        small_cnn(), torch.randn(1, 3, 8, 8), name="small", num_blocks=2, batch_sizes=2, gpu_type="L4",
        slices=2, slo_us=1234.0, repeats=1, warmup=0, cpu_threads=1,
    )
    assert torch.get_num_threads() == threads and profile.meta["cpu_threads"] == 1
    assert list(profile.latency_us) == [("L4", 2)] and profile.slo_us == 1234.0
    assert "interpolated_batch_sizes" not in profile.meta


def test_bad_arguments():
    with pytest.raises(ValueError, match="at most"):
        profile_model(small_cnn(), torch.randn(1, 3, 8, 8), name="small", num_blocks=100, repeats=1)
    with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
        profile_model(small_cnn(), torch.randn(1, 3, 8, 8), name="small", cpu_threads=0)
    with pytest.raises(ValueError, match="slices must be >= 1"):
        profile_model(small_cnn(), torch.randn(1, 3, 8, 8), name="small", slices=0)
    with pytest.raises(ValueError, match="batch sizes must be integers >= 1"):
        normalise_batch_sizes([0, 2])
    assert normalise_batch_sizes(3) == [1, 2, 3]
    assert normalise_batch_sizes([8, 2, 2]) == [2, 8]
