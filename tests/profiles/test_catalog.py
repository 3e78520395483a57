"""The GPU catalog: one source of truth, NVML names mapped to types."""

from __future__ import annotations

import json

import pytest

from daskpipe.profiles import ProfileError, load_catalog, normalise_gpu_name
from daskpipe.profiles.catalog import REPO_CATALOG

REQUIRED = {"T4", "P4", "L4", "V100", "A10", "A100", "H100"}


def test_package_copy_is_identical_to_workers_catalog():
    packaged = REPO_CATALOG.parents[1] / "daskpipe" / "data" / "gpus.json"
    assert packaged.read_bytes() == REPO_CATALOG.read_bytes()


def test_catalog_has_required_types_with_sane_figures():
    catalog = load_catalog()
    assert REQUIRED <= set(catalog)
    assert catalog["L4"].sm_count == 58 and catalog["T4"].memory_bandwidth_gbs == 320
    assert catalog["V100"].tf32_or_fp32_tflops == catalog["V100"].fp32_tflops
    assert catalog["A100"].tf32_or_fp32_tflops > catalog["A100"].fp32_tflops


@pytest.mark.parametrize(
    "nvml, expected",
    [
        ("NVIDIA L4", "L4"),
        ("Tesla T4", "T4"),
        ("Tesla V100-SXM2-16GB", "V100"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("nvidia a10", "A10"),
        ("NVIDIA RTX A6000", "RTX-A6000"),
    ],
)
def test_normalise_gpu_name(nvml, expected):
    assert normalise_gpu_name(nvml) == expected


def test_bad_catalog_names_field(tmp_path):
    data = json.loads(REPO_CATALOG.read_text())
    data["gpus"]["T4"]["sm_count"] = "forty"
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"gpus.json: field 'gpus.T4'.sm_count: expected a positive number"):
        load_catalog(path)
