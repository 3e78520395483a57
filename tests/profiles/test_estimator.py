"""The analytic estimator: roofline behaviour on real small models, and its error on published tables."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from daskpipe.profiles import ProfileError, estimate_profile, load_catalog, profile_model
from daskpipe.profiles.accuracy import estimator_error
from daskpipe.profiles.estimator import CALIBRATED, Constants, efficiency_factors, estimate_kinds, op_costs, op_latency_us


def conv_net(width: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, 10),
    ).eval()


def test_op_costs_count_conv_flops_and_skip_fused_ops():
    costs = op_costs(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()).eval(), (3, 16, 16), [2])[2]
    assert len(costs.flops) == 1  # batch norm and relu fold into the conv, as TensorRT does
    assert costs.total_flops == 2 * 2 * (8 * 16 * 16) * (3 * 9)
    assert costs.outputs[0] == 2 * 8 * 16 * 16


def test_faster_gpus_and_whole_gpus_are_faster():
    catalog = load_catalog()
    costs = op_costs(conv_net(64), (3, 64, 64), [4])[4]
    constants = Constants(launch_us=2.0, saturation=1024.0, default_efficiency=0.5)
    p4, l4, h100 = (op_latency_us(costs, catalog[g], 1, constants) for g in ("P4", "L4", "H100"))
    assert p4 > l4 > h100
    assert op_latency_us(costs, catalog["L4"], 2, constants) > l4


def test_estimate_profile_of_a_module_and_of_measured_blocks():
    module = conv_net()
    x = torch.randn(1, 3, 32, 32)
    estimated = estimate_profile(module, x, gpus=["A10", "T4"], name="conv", num_blocks=3, batch_sizes=8)
    assert estimated.gpu_types == ["A10", "T4"] and estimated.slices("T4") == [1, 2, 3, 4]
    assert [estimated.max_batch("T4", v) for v in (1, 2, 3, 4)] == [8, 4, 2, 2]
    assert estimated.slo_us == pytest.approx(5 * estimated.latency("A10", 1, 1))
    assert estimate_profile(module, x, gpus=["P4"], name="conv", num_blocks=3).slices("P4") == [1]  # no MPS slicing
    for v in (1, 2):
        table = estimated.table("T4", v)
        assert np.all(np.diff(table, axis=1) >= 0)  # bigger batches never get faster
    measured, blocked = profile_model(module, x, name="conv", num_blocks=3, batch_sizes=2, repeats=1, warmup=0)
    aligned = estimate_profile(blocked, gpus=["L4"], name="conv", batch_sizes=2, slices=[1])
    assert aligned.num_blocks == measured.num_blocks and aligned.boundary_bytes == measured.boundary_bytes
    assert aligned.meta["segment_boundaries"] == measured.meta["segment_boundaries"]


def test_estimate_rejects_unknown_gpus():
    with pytest.raises(ProfileError, match=r"unknown: \['B300'\]"):
        estimate_profile(conv_net(), torch.randn(1, 3, 8, 8), gpus=["B300"], name="conv", num_blocks=2)


def test_calibrated_constants_cover_the_published_gpu_types():
    assert set(CALIBRATED.efficiency) == {"L4", "P4", "T4", "V100"}
    assert 0 < CALIBRATED.efficiency_of("H100") < 1


def test_error_report_against_published_tables(ppipe_dir, tmp_path):
    from daskpipe.profiles.cli import profile

    out = tmp_path / "error.json"
    result = CliRunner().invoke(
        profile, ["estimator-error", "--profiles", str(ppipe_dir), "--models", "googlenet-v3,repvgg", "--gpus", "L4,T4", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["models"] == ["googlenet-v3-pytorch", "repvgg-b3"]
    for section in ("out_of_sample", "in_sample"):
        for gpu in ("L4", "T4"):
            summary = report[section]["per_gpu"][gpu]
            assert summary["n"] == 2 * 16 and 0 < summary["median_ape_pct"] < 1000
    assert set(report["in_sample"]["constants"]["efficiency"]) == {"L4", "T4"}
    assert set(report["out_of_sample"]["fold_constants"]) == {"googlenet-v3-pytorch", "repvgg-b3"}


def test_calibrating_on_one_measured_gpu_type_cuts_the_error_on_the_others(ppipe_dir, tmp_path):
    from daskpipe.profiles.cli import profile

    out = tmp_path / "calibrated.json"
    args = ["estimator-error", "--profiles", str(ppipe_dir), "--gpus", "L4,T4", "--calibrate", "--json", str(out)]  # all four models
    result = CliRunner().invoke(profile, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report["calibration"]["per_measured_gpu"]) == {"L4", "T4"}
    assert report["calibration"]["rows"] == 4 * 2 * 16, "each model's other type, held out once per measured type"
    for figure in ("median_ape", "mean_ape"):
        assert report[figure]["calibrated"] <= report[figure]["uncalibrated"] / 2


class _BatchGram(nn.Module):
    """A forward whose work grows with the square of the batch: each sample against every other."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(1)
        return flat @ flat.T


@pytest.mark.parametrize("module", [conv_net(), _BatchGram()], ids=["affine-in-the-batch", "quadratic-in-the-batch"])
def test_op_costs_of_many_batch_sizes_are_those_of_each_size_alone(module):
    together = op_costs(module, (3, 16, 16), range(1, 9))
    assert sorted(together) == list(range(1, 9))
    for batch, costs in together.items():
        alone = op_costs(module, (3, 16, 16), [batch])[batch]
        for field in ("flops", "bytes", "outputs"):
            np.testing.assert_array_equal(getattr(costs, field), getattr(alone, field))


def test_efficiency_factors_scale_estimates_of_other_types_from_one_measured_type():
    blocked = profile_model(conv_net(), torch.randn(1, 3, 16, 16), name="conv", num_blocks=2, batch_sizes=2, repeats=1, warmup=0)[1]
    plain, _ = estimate_kinds(blocked, [("A10", 1)], name="conv", batch_sizes=2)
    reference, _ = estimate_kinds(blocked, [("L4", 1)], name="conv", batch_sizes=2)
    slower = {("L4", 1): reference[("L4", 1)] * np.array([[3.0], [1.5]])}  # block 0 runs 3x, block 1 1.5x the estimate
    calibrated, meta = estimate_kinds(blocked, [("A10", 1)], name="conv", batch_sizes=2, measured=slower)
    assert meta["calibrated_on"] == ["L4/1"] and meta["block_factors"] == pytest.approx([3.0, 1.5])
    np.testing.assert_allclose(calibrated[("A10", 1)], plain[("A10", 1)] * np.array([[3.0], [1.5]]))
    assert efficiency_factors(np.array([[2.0, 8.0]]), np.array([[1.0, 2.0]])) == pytest.approx([np.sqrt(8.0)])


def test_error_report_refuses_models_without_a_build(ppipe_dir):
    with pytest.raises(ProfileError, match="no torchvision build for .*fcn"):
        estimator_error(ppipe_dir, ["fcn", "repvgg-b3"])


def test_calibrated_constants_reproduce_from_published_tables(ppipe_dir):
    from daskpipe.profiles.zoo import REFERENCE_MODELS

    fitted = estimator_error(ppipe_dir, list(REFERENCE_MODELS))["in_sample"]["constants"]
    assert fitted["saturation"] == CALIBRATED.saturation and fitted["launch_us"] == CALIBRATED.launch_us
    assert fitted["efficiency"] == pytest.approx(dict(CALIBRATED.efficiency), abs=1e-4)
    assert CALIBRATED.default_efficiency == pytest.approx(float(np.median(list(CALIBRATED.efficiency.values()))), abs=1e-3)


class _AssertsOnValues(nn.Module):
    """A forward that reads a tensor's values: fine on real tensors, impossible on meta ones."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        torch._assert(y.abs().max() < 1e4, "out of range")
        return y.relu()


def test_a_forward_that_reads_values_is_estimated_on_a_random_input():
    example = torch.randn(1, 3, 8, 8)
    reading = estimate_profile(_AssertsOnValues(), name="asserts", gpus=["T4"], example_input=example, num_blocks=1)
    plain = estimate_profile(_AssertsOnValues().conv, name="plain", gpus=["T4"], example_input=example, num_blocks=1)
    assert reading.latency("T4", 1, 1) >= plain.latency("T4", 1, 1) > 0  # the same conv, and the assertion's few ops


class _RefusesRandomInputs(_AssertsOnValues):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert(x.abs().max() < 1e-6, "expects zeros")
        return self.conv(x)


def test_a_forward_that_fails_on_random_values_too_is_reported_as_data_dependent_control_flow():
    with pytest.raises(
        ProfileError,
        match=r"Tensor.item\(\) cannot be called on meta tensors\), then on a random input \(AssertionError: expects zeros\). This is "
        r"data-dependent control flow: .*torch._assert.*measure the profile on the real GPU type",
    ):
        estimate_profile(_RefusesRandomInputs(), name="asserts", gpus=["T4"], example_input=torch.zeros(1, 3, 8, 8), num_blocks=1)
