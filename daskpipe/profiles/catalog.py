"""The GPU catalog: datasheet figures per GPU type, and the names NVML reports for each.

Profiles, plans and worker resources all speak of GPU *types* ("L4", "V100"); NVML speaks of
product names ("NVIDIA L4", "Tesla V100-SXM2-16GB"). The catalog maps one to the other and gives
the estimator the peaks it needs. ``workers/gpus.json`` is the one source; the package ships a copy
(``daskpipe/data/gpus.json``, kept identical by a test) so an installed daskpipe finds it too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

from daskpipe.colocation.latency import ColocationError, GpuSpec
from daskpipe.profiles.model import ProfileError

FORMAT = "daskpipe-gpus/1"
REPO_CATALOG = Path(__file__).resolve().parents[2] / "workers" / "gpus.json"
_NUMBER_FIELDS = ("fp32_tflops", "fp16_tflops", "memory_bandwidth_gbs", "sm_count", "memory_gb", "pcie_gen")
_VENDOR_PREFIX = re.compile(r"^(nvidia|tesla|geforce|quadro)\s+", re.IGNORECASE)


@dataclass(frozen=True)
class GPUSpec:
    """Peak figures of one GPU type (dense, no sparsity)."""

    name: str
    architecture: str
    fp32_tflops: float
    tf32_tflops: float | None  # None before Ampere: TF32 requests run at the FP32 rate
    fp16_tflops: float  # tensor-core FP16 where present
    memory_bandwidth_gbs: float
    sm_count: int
    memory_gb: float
    pcie_gen: int
    mps_slicing: bool = True  # MPS execution-resource provisioning (Volta and later): 1/v slices exist
    aliases: tuple[str, ...] = ()

    @property
    def tf32_or_fp32_tflops(self) -> float:
        """The matmul peak TensorRT reaches in TF32 mode (plain FP32 where there is no TF32)."""
        return self.tf32_tflops if self.tf32_tflops is not None else self.fp32_tflops


def load_catalog(path: str | Path | None = None) -> dict[str, GPUSpec]:
    """GPU specs by type name, from ``path`` or the default catalog."""
    if path is None:
        return dict(_default_catalog())
    return _parse(Path(path).read_text(), str(path))


def normalise_gpu_name(nvml_name: str, catalog: Mapping[str, GPUSpec] | None = None) -> str:
    """The catalog type for an NVML product name ("NVIDIA L4" -> "L4").

    Names the catalog does not know come back without vendor prefix and with dashes for spaces
    ("NVIDIA RTX A6000" -> "RTX-A6000"), so an uncatalogued GPU still gets a stable type name.
    """
    specs = catalog if catalog is not None else _default_catalog()
    wanted = nvml_name.strip().casefold()
    for spec in specs.values():
        if wanted == spec.name.casefold() or wanted in (a.casefold() for a in spec.aliases):
            return spec.name
    stripped = _VENDOR_PREFIX.sub("", nvml_name.strip())
    for spec in specs.values():
        if stripped.casefold() == spec.name.casefold():
            return spec.name
    return re.sub(r"\s+", "-", stripped)


@lru_cache(maxsize=1)
def _default_catalog() -> dict[str, GPUSpec]:
    if REPO_CATALOG.is_file():
        return _parse(REPO_CATALOG.read_text(), str(REPO_CATALOG))
    packaged = resources.files("daskpipe") / "data" / "gpus.json"
    return _parse(packaged.read_text(), str(packaged))


def _parse(text: str, source: str) -> dict[str, GPUSpec]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f"{source}: field 'format' must be {FORMAT!r}")
    gpus = data.get("gpus")
    if not isinstance(gpus, dict) or not gpus:
        raise ProfileError(f"{source}: field 'gpus' must map GPU type -> figures")
    return {name: _spec(name, entry, f"{source}: field 'gpus.{name}'") for name, entry in gpus.items()}


def _spec(name: str, entry: Any, where: str) -> GPUSpec:
    if not isinstance(entry, dict):
        raise ProfileError(f"{where}: must be an object")
    for key in _NUMBER_FIELDS:
        value = entry.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ProfileError(f"{where}.{key}: expected a positive number, got {value!r}")
    tf32 = entry.get("tf32_tflops")
    if tf32 is not None and (not isinstance(tf32, (int, float)) or tf32 <= 0):
        raise ProfileError(f"{where}.tf32_tflops: expected a positive number or null, got {tf32!r}")
    mps_slicing = entry.get("mps_slicing", True)
    if not isinstance(mps_slicing, bool):
        raise ProfileError(f"{where}.mps_slicing: expected true or false, got {mps_slicing!r}")
    aliases = entry.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ProfileError(f"{where}.aliases: expected a list of names")
    return GPUSpec(
        name=name,
        architecture=str(entry.get("architecture", "")),
        fp32_tflops=float(entry["fp32_tflops"]),
        tf32_tflops=float(tf32) if tf32 is not None else None,
        fp16_tflops=float(entry["fp16_tflops"]),
        memory_bandwidth_gbs=float(entry["memory_bandwidth_gbs"]),
        sm_count=int(entry["sm_count"]),
        memory_gb=float(entry["memory_gb"]),
        pcie_gen=int(entry["pcie_gen"]),
        mps_slicing=mps_slicing,
        aliases=tuple(aliases),
    )


# Effective host-to-GPU bandwidth (GB/s) of a x16 link by PCIe generation.
PCIE_GB_PER_S = {3: 12.0, 4: 24.0, 5: 48.0}


def gpu_specs(types: Sequence[str]) -> dict[str, GpuSpec]:
    """What co-location's latency model needs of each GPU type, from the GPU catalog."""
    catalog = load_catalog()
    unknown = [t for t in types if t not in catalog]
    if unknown:
        raise ColocationError(f"GPU type(s) {unknown} are not in the GPU catalog (it has {sorted(catalog)}); add them to workers/gpus.json")
    return {
        t: GpuSpec(
            t,
            sm_count=catalog[t].sm_count,
            memory_mb=catalog[t].memory_gb * 1024,
            pcie_gb_per_s=PCIE_GB_PER_S.get(catalog[t].pcie_gen, 12.0),
        )
        for t in types
    }
