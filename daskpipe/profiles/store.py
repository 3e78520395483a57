"""A profile store: measured latency tables kept on disk, under a key that changes when the measurement would.

One file per measured (model, kind) table, named by the SHA-256 of its :class:`MeasurementKey`:
the model's graph and weights (a content hash), its input shape and dtype, the block boundaries
and batch sizes, the GPU type, its MPS slices, the device's name and driver, the torch version
and, on a CPU, the threads it computes with. Anything else that changes a timing (a new driver,
a retrained model, other blocks) gives another key, so a stale table is never read. Only the
process that calls ``deploy`` (or ``daskpipe profile cluster``) reads and writes the store;
workers get the tables through Dask (docs/profiles.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from daskpipe.jsonfile import read_json_object
from daskpipe.profiles.model import ProfileError

FORMAT = "daskpipe-profile-store/1"
CONFIG_KEY = "daskpipe.profile-store"
"""The Dask config key naming the store's folder when ``deploy`` gets no ``ProfilingOptions(store=...)``."""

logger = logging.getLogger(__name__)


def model_fingerprint(module: nn.Module, example_input: Any) -> str:
    """SHA-256 of what ``module`` computes: its traced graph's code, its modules' types and settings
    (the graph calls a standard layer by name only: a ReLU swapped for a Tanh, or another stride,
    leaves the code as it was), its parameters and buffers (names, dtypes, shapes and bytes), and
    the input's per-sample shape and dtype."""
    from daskpipe.profiles.fx import InputLayout, segment_model

    digest = hashlib.sha256()
    digest.update(segment_model(module, example_input).code.encode())
    digest.update(repr(module).encode())
    for name, tensor in module.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(example_input, torch.Tensor):
        digest.update(f"input:{tuple(example_input.shape[1:])}:{example_input.dtype}".encode())
    else:
        inputs = InputLayout.of(example_input)
        digest.update(f"input:{inputs.spec}:{inputs.shapes}:{inputs.dtypes}".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class MeasurementKey:
    """What one measured table depends on."""

    model: str  # model_fingerprint: graph, weights, input shape and dtype
    segment_boundaries: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    gpu: str
    slices: int
    device: str  # e.g. "NVIDIA L4", or the CPU's model name
    driver: str  # the GPU driver's version ("" on a CPU)
    torch: str
    threads: int  # torch intra-op threads (what a CPU table depends on; 0 on a GPU)
    together: int = 1  # workers of the kind timed at once on one host (CPU workers share its memory and caches)
    cuda_graphs: bool = False  # a GPU table timed replaying CUDA graphs (daskpipe.profiles.graphs), not eagerly

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


class ProfileStore:
    """Measured tables in folder ``root`` (created on first write)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser()
        if self.root.exists() and not self.root.is_dir():
            raise ProfileError(f"profile store {self.root}: exists and is not a folder")

    def path(self, key: MeasurementKey) -> Path:
        return self.root / f"{key.digest}.json"

    def get(self, key: MeasurementKey) -> np.ndarray | None:
        """The table stored under ``key``; ``None`` when there is none, or it is unreadable (logged)."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            data = read_json_object(path, ProfileError)
            if data.get("format") != FORMAT or data.get("key") != json.loads(json.dumps(asdict(key))):
                raise ProfileError(f"{path}: not a {FORMAT} entry for this key")
            table = np.asarray(data["latency_us"], dtype=float)
            if table.ndim != 2 or len(table) != len(key.segment_boundaries) - 1 or not np.all(np.isfinite(table)) or np.any(table < 0):
                raise ProfileError(f"{path}: field 'latency_us' is not a blocks x batch-sizes table of latencies")
        except (ProfileError, KeyError, ValueError, TypeError) as exc:
            logger.warning("daskpipe: ignoring profile store entry (%s); the kind is measured again", exc)
            return None
        return table

    def put(self, key: MeasurementKey, table: np.ndarray, meta: Mapping[str, Any] | None = None) -> Path:
        """Write ``table`` under ``key`` atomically (readers never see half a file)."""
        self.root.mkdir(parents=True, exist_ok=True)
        entry = {"format": FORMAT, "key": asdict(key), "latency_us": np.asarray(table, dtype=float).tolist(), "meta": dict(meta or {})}
        path = self.path(key)
        with tempfile.NamedTemporaryFile("w", dir=self.root, suffix=".tmp", delete=False) as tmp:
            json.dump(entry, tmp)
        os.replace(tmp.name, path)
        return path

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("*.json")) if self.root.is_dir() else 0


def configured_store(store: str | os.PathLike | ProfileStore | None) -> ProfileStore | None:
    """``store`` as a :class:`ProfileStore`, or the one the Dask config key ``daskpipe.profile-store`` names."""
    if isinstance(store, ProfileStore):
        return store
    location = store
    if location is None:
        import dask.config

        location = dask.config.get(CONFIG_KEY, None)
    return ProfileStore(location) if location else None
