"""Cutting real models into single-tensor blocks that chain back to the whole model."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
import torchvision
from torch import nn

from daskpipe.profiles import SegmentationError, cut_model, segment_model
from daskpipe.profiles.fx import ResumedModel, UncutModel, UncutWarning
from daskpipe.profiles.prepartition import greedy_blocks


class TinyResidualNet(nn.Module):
    """Stem, one residual block (no cut inside it), a head: cuts only between the parts."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.conv_a = nn.Conv2d(8, 8, 3, padding=1)
        self.conv_b = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.conv_b(torch.relu(self.conv_a(x))))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def assert_blocks_match(module: nn.Module, x: torch.Tensor, blocked) -> None:
    with torch.inference_mode():
        expected = module(x)
        exact = blocked.run(x, fp16_boundaries=False)
        wire = blocked.run(x, fp16_boundaries=True)
    torch.testing.assert_close(exact, expected, rtol=1e-4, atol=1e-5)
    scale = expected.abs().max().item()
    assert (wire - expected).abs().max().item() <= 1e-2 * scale + 1e-4


def test_tiny_net_cut_points_avoid_the_residual_branch():
    module = TinyResidualNet().eval()
    segmented = segment_model(module, torch.randn(2, 3, 16, 16))
    # inside the residual block the skip input stays live, so the next cut is after the add
    assert [cut.value.name for cut in segmented.cuts] == [
        "x",
        "stem_0",
        "stem_1",
        "add",
        "relu_1",
        "adaptive_avg_pool2d",
        "flatten",
        "head",
    ]
    assert segmented.cut_shapes[0] == (3, 16, 16) and segmented.cut_shapes[-1] == (5,)
    assert segmented.cut_bytes[0] == 3 * 16 * 16 * 2


def test_tiny_net_blocks_run_alone_and_chain():
    module = TinyResidualNet().eval()
    x = torch.randn(3, 3, 16, 16)
    segmented = segment_model(module, x)
    blocked = segmented.cut([0, 2, segmented.num_segments])
    assert blocked.num_blocks == 2 and blocked.input_shape == (3, 16, 16)
    assert blocked.boundary_shapes == [(8, 16, 16)] and blocked.boundary_bytes == [8 * 16 * 16 * 2]
    assert_blocks_match(module, x, blocked)
    with torch.inference_mode():
        middle = blocked.blocks[0](x)
        assert middle.shape == (3, 8, 16, 16)
        assert blocked.blocks[1](middle).shape == (3, 5)
        torch.testing.assert_close(blocked.stage(0, 2)(x), blocked.run(x, fp16_boundaries=False))
    with pytest.raises(SegmentationError, match="0 <= start < end <= 2"):
        blocked.stage(1, 1)


def test_blocks_hold_only_their_own_parameters():
    module = TinyResidualNet().eval()
    segmented = segment_model(module, torch.randn(1, 3, 8, 8))
    blocked = segmented.cut([0, 2, segmented.num_segments])
    counts = [sum(p.numel() for p in block.parameters()) for block in blocked.blocks]
    assert sum(counts) == sum(p.numel() for p in module.parameters())
    assert counts[0] == 8 * 3 * 9 + 8


@pytest.mark.parametrize(
    "build, size",
    [
        (lambda: torchvision.models.resnet18(weights=None), 64),
        (lambda: torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False), 75),
        (lambda: torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False), 64),
    ],
    ids=["resnet18", "inception_v3", "googlenet"],
)
def test_torchvision_models_cut_into_equal_blocks(build, size):
    module = build().eval()
    x = torch.randn(2, 3, size, size)
    segmented = segment_model(module, x[:1])
    assert segmented.num_segments >= 10
    bounds = greedy_blocks([1.0] * segmented.num_segments, 4)
    blocked = cut_model(module, x[:1], bounds)
    assert blocked.num_blocks == 4 and len(blocked.boundary_shapes) == 3
    assert_blocks_match(module, x, blocked)
    with torch.inference_mode():  # each block runs on its own, from a tensor of the boundary shape
        assert blocked.blocks[2](torch.ones(2, *blocked.boundary_shapes[1])).shape == (2, *blocked.boundary_shapes[2])


def test_blocks_survive_pickle_and_torch_save():
    module = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(2, 3, 32, 32)
    segmented = segment_model(module, x[:1])
    blocked = segmented.cut(greedy_blocks([1.0] * segmented.num_segments, 3))
    restored = pickle.loads(pickle.dumps(blocked))
    with torch.inference_mode():
        torch.testing.assert_close(restored.run(x), blocked.run(x))
    buffer = io.BytesIO()
    torch.save(blocked.blocks[1], buffer)
    buffer.seek(0)
    block = torch.load(buffer, weights_only=False)
    middle = torch.randn(2, *blocked.boundary_shapes[0])
    with torch.inference_mode():
        torch.testing.assert_close(block(middle), blocked.blocks[1](middle))


def test_resnet_cuts_fall_between_basic_blocks():
    module = torchvision.models.resnet18(weights=None).eval()
    segmented = segment_model(module, torch.randn(1, 3, 64, 64))
    inner = [cut.value.name for cut in segmented.cuts[5:-3]]  # after the stem, before the pooling head
    # each BasicBlock ends in a residual add and a relu; nothing inside a block is a cut point
    assert inner == [name for i in range(8) for name in (f"add{'_' + str(i) if i else ''}", f"layer{i // 2 + 1}_{i % 2}_relu_1")]


class Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x
        return -x


class BranchyHead(nn.Module):
    """A traceable body and a head that reads its input's values, as a detector's post-processing does."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.head = Branchy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class ShapeAtTheEnd(nn.Module):
    """Reads its input's shape first and uses it last, as torchvision's segmentation models do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2, padding=1))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        size = x.shape[-2:]
        return {"out": nn.functional.interpolate(self.body(x), size=size)}


def test_a_model_fx_cannot_trace_is_served_whole_and_says_why():
    with pytest.warns(UncutWarning, match="Branchy is served whole.*torch.fx cannot trace it"):
        segmented = segment_model(Branchy().eval(), torch.randn(1, 4))
    assert isinstance(segmented, UncutModel) and segmented.num_segments == 1
    x = torch.randn(3, 4)
    torch.testing.assert_close(segmented.cut([0, 1]).run(x), Branchy()(x))


@pytest.mark.parametrize("leaf_modules", [(), ("head",), ("Branchy",)], ids=["found", "by-name", "by-class"])
def test_an_untraceable_submodule_is_kept_whole_and_the_rest_is_cut(leaf_modules):
    module = BranchyHead().eval()
    segmented = segment_model(module, torch.randn(1, 4), leaf_modules)
    assert segmented.leaves == ["head"] and segmented.num_segments == 5
    x = torch.randn(3, 4)
    torch.testing.assert_close(segmented.segments().run(x, fp16_boundaries=False), module(x))


def test_shapes_read_at_the_start_cross_cuts_as_constants():
    module = ShapeAtTheEnd().eval()
    segmented = segment_model(module, torch.randn(1, 3, 16, 16))
    assert segmented.num_segments >= 3 and segmented.cut_shapes[-1] == (4 * 16 * 16,)
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(segmented.segments().run(x, fp16_boundaries=False), module(x))


@pytest.mark.parametrize(
    "example, message",
    [
        (torch.randn(1, 3, 8, 8, dtype=torch.float16), "should be the same"),
        (torch.randn(1, 1, 8, 8), "expected input.* to have 3 channels, but got 1 channels"),
    ],
    ids=["fp16-example", "one-channel-example"],
)
def test_a_wrong_example_fails_with_torchs_own_message_and_the_module(example, message):
    with pytest.raises(SegmentationError, match=message) as failed:
        segment_model(TinyResidualNet().eval(), example)
    assert "module 'stem.0'" in str(failed.value) and str(tuple(example.shape)) in str(failed.value)


def test_bad_boundaries():
    segmented = segment_model(TinyResidualNet().eval(), torch.randn(1, 3, 8, 8))
    with pytest.raises(SegmentationError, match="must start at 0 and end at the segment count"):
        segmented.cut([0, 2])
    with pytest.raises(SegmentationError, match="strictly increasing"):
        segmented.cut([0, 2, 2, segmented.num_segments])
    with pytest.raises(SegmentationError, match="must be a batched tensor"):
        segment_model(TinyResidualNet(), torch.tensor(1.0))


class LoopsOverItsInput(nn.Module):
    """A backbone fx can trace, inside a forward it cannot (a loop over the batch), returning one dict per sample: a detector's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        widths = [row.shape[0] for row in x]
        return [{"features": f.relu(), "width": torch.tensor(w)} for f, w in zip(self.backbone(x), widths)]


def test_an_untraceable_forward_is_cut_inside_its_traceable_submodule():
    module = LoopsOverItsInput().eval()
    with pytest.warns(UncutWarning, match="cut inside its submodule 'backbone' only"):
        segmented = segment_model(module, torch.randn(1, 4))
    assert isinstance(segmented, ResumedModel) and segmented.num_segments >= 3
    blocked = segmented.cut([0, 1, 2, segmented.num_segments])
    x = torch.randn(3, 4)
    with torch.inference_mode():
        torch.testing.assert_close(pickle.loads(pickle.dumps(blocked)).run(x, fp16_boundaries=False), module(x))
