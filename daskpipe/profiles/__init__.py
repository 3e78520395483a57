"""What a model costs: per-block latency per (GPU type, MPS slices, batch size) and boundary bytes.

Names that need torch (cutting, profiling, estimating) load on first use, so reading profiles and
plans stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from daskpipe.profiles.catalog import GPUSpec, load_catalog, normalise_gpu_name
from daskpipe.profiles.loader import load_profiles, resolve_model_names
from daskpipe.profiles.model import Profile, ProfileError

_LAZY = {
    "BlockedModel": "daskpipe.profiles.fx",
    "SegmentedModel": "daskpipe.profiles.fx",
    "SegmentationError": "daskpipe.profiles.fx",
    "cut_model": "daskpipe.profiles.fx",
    "segment_model": "daskpipe.profiles.fx",
    "profile_model": "daskpipe.profiles.profiler",
    "estimate_profile": "daskpipe.profiles.estimator",
}

__all__ = [
    "GPUSpec",
    "Profile",
    "ProfileError",
    "load_catalog",
    "load_profiles",
    "normalise_gpu_name",
    "resolve_model_names",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'daskpipe.profiles' has no attribute {name!r}")
