"""What a model holds in memory: its weights, and one sample's largest live activations."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from daskpipe.profiles.memory import ModelMemory, measure_memory


def test_weights_are_every_parameter_and_buffer_and_activations_the_largest_layer_per_sample():
    model = nn.Sequential(nn.Linear(10, 1000), nn.BatchNorm1d(1000), nn.Linear(1000, 2)).eval()
    measured = measure_memory(model, torch.zeros(4, 10))
    parameters = (10 * 1000 + 1000) + 2 * 1000 + (1000 * 2 + 2)
    buffers = 2 * 1000  # batch norm's running mean and variance (its int64 counter: 8 bytes)
    assert measured.weights_bytes == 4 * (parameters + buffers) + 8
    assert measured.activation_bytes == 4 * (1000 + 1000)  # the batch norm's input and output, per sample
    assert measured.activations(8) == 8 * measured.activation_bytes


def test_memory_figures_must_be_byte_counts():
    with pytest.raises(ValueError, match="weights_bytes must be a number of bytes"):
        ModelMemory(-1, 0)
    with pytest.raises(ValueError, match="activation_bytes must be a number of bytes"):
        ModelMemory(0, 1.5)  # type: ignore[arg-type]
