"""Reading profiles: the PPipe table layout, daskpipe JSON, model-name prefixes, and every bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from daskpipe.profiles import ProfileError, load_profiles, resolve_model_names

TIMINGS = {
    ("L4", 1): "10,18,26\n20,35,50\n",
    ("L4", 2): "15,27\n30,52\n",
    ("T4", 1): "30,55,80\n60,110,160\n",
}


def write_ppipe(root: Path, model: str = "tiny-net", timings=TIMINGS, boundary: str = "4096\n", slos: str | None = None) -> Path:
    (root / "block-timing").mkdir(parents=True, exist_ok=True)
    (root / "boundary-bytes").mkdir(exist_ok=True)
    for (gpu, v), text in timings.items():
        (root / "block-timing" / f"{model}-{gpu}-{v}.csv").write_text(text)
    if boundary is not None:
        (root / "boundary-bytes" / f"{model}.csv").write_text(boundary)
    (root / "models.csv").write_text(slos if slos is not None else f"model,slo_us\n{model},500\n")
    return root


def test_reads_ppipe_layout(tmp_path):
    profiles = load_profiles(write_ppipe(tmp_path))
    profile = profiles["tiny-net"]
    assert profile.num_blocks == 2 and profile.slo_us == 500
    assert profile.gpu_types == ["L4", "T4"] and profile.slices("L4") == [1, 2]
    assert profile.latency("L4", 1, 3) == 76
    assert profile.max_batch("L4", 2) == 2
    assert profile.cut_bytes(1) == 4096
    assert profile.bytes_into(1) == 4096 and profile.bytes_into(0) == profile.input_bytes == 0
    for outside in (0, 2, -1):  # no cut there: never another cut's bytes
        with pytest.raises(ValueError, match=f"cuts before blocks 1 to 1, not before block {outside}"):
            profile.cut_bytes(outside)


def test_prefix_and_exact_names():
    names = ["gfl_r50_fpn", "gfl_x101-32x4d", "fcn-d6_r101", "resnet", "resnet50"]
    assert resolve_model_names(names, ["fcn", "gfl_x101"]) == ["fcn-d6_r101", "gfl_x101-32x4d"]
    assert resolve_model_names(names, ["resnet"]) == ["resnet"]  # exact beats prefix
    with pytest.raises(ProfileError, match="ambiguous.*gfl_r50_fpn, gfl_x101-32x4d"):
        resolve_model_names(names, ["gfl"])
    with pytest.raises(ProfileError, match="unknown model 'vgg'.*fcn-d6_r101"):
        resolve_model_names(names, ["vgg"])


def test_json_file_and_folder_round_trip(tmp_path):
    profile = load_profiles(write_ppipe(tmp_path / "ppipe"))["tiny-net"]
    out = tmp_path / "json"
    out.mkdir()
    profile.save(out / "tiny.json")
    for source in (out, out / "tiny.json"):
        again = load_profiles(source, ["tiny"])["tiny-net"]
        assert again.gpu_types == profile.gpu_types
        np.testing.assert_array_equal(again.table("L4", 2), profile.table("L4", 2))


def test_duplicate_model_in_json_folder(tmp_path):
    profile = load_profiles(write_ppipe(tmp_path / "ppipe"))["tiny-net"]
    profile.save(tmp_path / "a.json")
    profile.save(tmp_path / "b.json")
    with pytest.raises(ProfileError, match="b.json.*also profiled in .*a.json"):
        load_profiles(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(timings={("L4", 1): "10,18\n20,abc\n"}), r"tiny-net-L4-1.csv: row 2, column 2 \(batch 2\): 'abc' is not a number"),
        (dict(timings={("L4", 1): "10,18\n20\n"}), r"tiny-net-L4-1.csv: row 2 has 1 batch-size columns, row 1 has 2"),
        (dict(timings={("L4", 1): "10,-18\n20,30\n"}), r"tiny-net-L4-1.csv: row 1, column 2.*non-negative"),
        (
            dict(timings={("L4", 1): "10,18\n20,30\n", ("L4", 2): "1\n2\n3\n"}),
            r"tiny-net-L4-2.csv: has 3 block rows, but tiny-net-L4-1.csv has 2",
        ),
        (dict(boundary="1\n2\n"), r"boundary-bytes/tiny-net.csv: has 2 rows; 2 blocks .* need 1"),
        (dict(boundary=None), r"boundary-bytes/tiny-net.csv: file is missing"),
        (dict(slos="model,slo_us\nother,5\n"), r"models.csv: no row for model 'tiny-net'"),
        (dict(slos="name,slo\n"), r"models.csv: first row must be the header"),
        (dict(slos="model,slo_us\ntiny-net,0\n"), r"models.csv: row 2, column 'slo_us' must be positive"),
        (dict(timings={("L4", 1): "10\n\n"}), r"boundary-bytes/tiny-net.csv: has 1 rows; 1 blocks .* need 0"),
    ],
)
def test_malformed_ppipe_folder(tmp_path, change, message):
    write_ppipe(tmp_path, **change)
    with pytest.raises(ProfileError, match=message):
        load_profiles(tmp_path)


def test_missing_gpu_type_for_one_model(tmp_path):
    write_ppipe(tmp_path)
    write_ppipe(tmp_path, model="other", timings={("L4", 1): "1,2\n3,4\n"}, slos="model,slo_us\ntiny-net,500\nother,9\n")
    with pytest.raises(ProfileError, match=r"model 'other' is missing GPU type\(s\) \['T4'\].*other-T4-1.csv"):
        load_profiles(tmp_path, ["other"])
    assert list(load_profiles(tmp_path, ["tiny"])) == ["tiny-net"]


def test_bad_paths(tmp_path):
    with pytest.raises(ProfileError, match="no such file or folder"):
        load_profiles(tmp_path / "nowhere")
    with pytest.raises(ProfileError, match="neither profile JSON files nor a block-timing/"):
        load_profiles(tmp_path)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ProfileError, match="broken.json: not valid JSON"):
        load_profiles(tmp_path / "broken.json")
    (tmp_path / "block-timing").mkdir()
    (tmp_path / "block-timing" / "weird.csv").write_text("1\n")
    with pytest.raises(ProfileError, match="weird.csv: file name must be <model>-<GPU>-<slices>.csv"):
        load_profiles(tmp_path)


def test_published_ppipe_profiles(ppipe_dir):
    profiles = load_profiles(ppipe_dir)
    assert len(profiles) == 22
    for profile in profiles.values():
        assert profile.gpu_types == ["L4", "P4", "T4", "V100"]
        assert profile.slices("P4") == [1] and profile.slices("V100") == [1, 2, 3, 4]
        assert [profile.max_batch("L4", v) for v in (1, 2, 3, 4)] == [8, 4, 2, 2]
    chosen = load_profiles(ppipe_dir, ["fcn", "googlenet-v3", "gfl_x101", "wide_resnet101_2"])
    assert list(chosen) == [
        "fcn-d6_r101-d16_4xb2-40k_cityscapes-512x1024",
        "googlenet-v3-pytorch",
        "gfl_x101-32x4d_fpn_ms-2x_coco",
        "wide_resnet101_2",
    ]
    fcn = chosen["fcn-d6_r101-d16_4xb2-40k_cityscapes-512x1024"]
    assert fcn.slo_us == pytest.approx(33278.58)
    # PPipe's golden case: a whole V100 at batch 2 runs FCN in 12 303 µs; P4 blocks 0-7 at batch 1 in 11 086 µs
    assert fcn.latency("V100", 1, 2) == pytest.approx(12303, abs=1)
    assert fcn.latency("P4", 1, 1, 0, 7) == pytest.approx(11086, abs=1)
