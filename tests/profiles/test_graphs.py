"""CUDA graphs: what a GPU stage and its profile replay. Without a GPU only the fallback runs here;
the captures were checked on an H200 (docs/runtime.md)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from daskpipe.profiles.graphs import capture
from daskpipe.profiles.profiler import CHAIN_TOLERANCE, Timing, chain_disagreement, chain_sums, timing_summary


class HostSync(nn.Module):
    """Reads a value back to the host inside its forward, which no CUDA graph can capture."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum().item())


def test_a_module_that_cannot_be_captured_is_left_eager_and_named(caplog):
    device = torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger="daskpipe.profiles.graphs"):
        graphs = capture(HostSync(), (4,), torch.float32, torch.float32, device, [1, 2], what="the host-sync block")
    assert graphs is None
    assert "the host-sync block runs eagerly" in caplog.text and "cannot be captured as a CUDA graph" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays need a CUDA GPU; the fallback above runs everywhere")
def test_replays_compute_what_the_module_computes_at_every_captured_batch_size():
    device = torch.device("cuda")
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device).eval()
    graphs = capture(module, (8,), torch.float16, torch.float32, device, [1, 3], what="mlp")  # fp16 in, cast on the GPU
    assert graphs is not None and graphs.batch_sizes == [1, 3]
    for batch, dtype in ((1, torch.float16), (3, torch.float16), (5, torch.float16), (3, torch.float32)):  # the last two run eagerly
        x = torch.randn(batch, 8).to(dtype)
        with torch.inference_mode():
            assert torch.allclose(graphs(x).cpu(), module(x.to(device).float()).cpu(), atol=1e-5)


def test_a_table_whose_blocks_do_not_add_up_to_the_whole_model_says_so():
    table = np.array([[100.0, 300.0], [100.0, 300.0]])  # batch 1 and 8
    agreeing = {1: 210.0, 8: 580.0}
    assert chain_sums(table, [1, 8], agreeing) == pytest.approx({1: 200 / 210, 8: 600 / 580})
    assert chain_disagreement(table, [1, 8], agreeing) < CHAIN_TOLERANCE
    assert "warning" not in timing_summary([Timing([1.0], None)], chain_sums(table, [1, 8], agreeing))

    disturbed = {1: 100.0, 8: 590.0}  # the blocks at batch 1 took twice the whole model
    assert chain_disagreement(table, [1, 8], disturbed) == pytest.approx(2.0)
    assert chain_disagreement(table, [1, 8], {1: 400.0, 8: 600.0}) == pytest.approx(2.0)  # either way
    summary = timing_summary([Timing([1.0], None)], chain_sums(table, [1, 8], disturbed))
    assert summary["table_over_whole"] == {"1": 2.0, "8": pytest.approx(1.017, abs=1e-3)}
    assert "2.00x at batch 1" in summary["warning"] and "batch 8" not in summary["warning"]
    assert "profile again on an idle GPU" in summary["warning"]
