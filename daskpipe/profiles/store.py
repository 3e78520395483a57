"""A profile store: measured latency tables kept on disk, under a key that changes when the measurement would.

One file per measured (model, kind) table, named by the SHA-256 of its :class:`MeasurementKey`:
the model's graph and weights (a content hash), its input shape and dtype, the block boundaries
and batch sizes, the GPU type, its MPS slices, the device's name and driver, the torch version
and, on a CPU, the threads it computes with. Anything else that changes a timing (a new driver,
a retrained model, other blocks) gives another key, so a stale table is never read. Only the
process that calls ``deploy`` (or ``daskpipe profile cluster``) reads and writes the store;
workers get the tables through Dask (docs/profiles.md).

An entry is checked before it is used (:func:`check_table`): the planner believes a table, so
one of zero latencies would plan a million requests a second, and one wider than its batch sizes
batches the planner never saw timed. A bad entry is logged and moved aside (renamed
``<digest>.<UTC time>.rejected``, kept for a look), and its kind is measured again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from daskpipe.config import setting
from daskpipe.jsonfile import read_json_object
from daskpipe.profiles.model import ProfileError

FORMAT = "daskpipe-profile-store/1"
MIN_LATENCY_US = 1.0
"""No block of a torch model runs in less: one Python call to it takes about a microsecond."""
LARGER_BATCH_MIN_RATIO = 0.5
"""A block's latency at a larger batch is at least this share of its slowest at a smaller one:
more inputs never take half the time (timing noise stays within a few tens of percent)."""
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
        """The table stored under ``key``; ``None`` when there is none, or when the entry is bad
        (unreadable, another key's, or a table :func:`check_table` refuses): that one is logged and
        moved aside, so that the kind is measured again and its new entry takes the path."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            data = read_json_object(path, ProfileError)
            if data.get("format") != FORMAT or data.get("key") != json.loads(json.dumps(asdict(key))):
                raise ProfileError(f"{path}: not a {FORMAT} entry for this key")
            return check_table(data.get("latency_us"), key, f"{path}: field 'latency_us'")
        except ProfileError as exc:
            aside = path.with_name(f"{key.digest}.{datetime.now(timezone.utc):%Y%m%dT%H%M%S%fZ}.rejected")
            try:
                path.rename(aside)
            except OSError as failed:
                logger.warning("daskpipe: profile store entry rejected (%s), and it cannot be moved aside (%s)", exc, failed.strerror)
            else:
                logger.warning("daskpipe: profile store entry rejected (%s); moved to %s, the kind is measured again", exc, aside.name)
            return None

    def put(self, key: MeasurementKey, table: np.ndarray, meta: Mapping[str, Any] | None = None) -> Path:
        """Write ``table`` under ``key`` atomically (readers never see half a file, and a failed
        write leaves no temporary file behind)."""
        path = self.path(key)
        entry = {"format": FORMAT, "key": asdict(key), "latency_us": np.asarray(table, dtype=float).tolist(), "meta": dict(meta or {})}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(entry, f)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            raise ProfileError(f"profile store {path}: cannot write ({exc.strerror})") from None
        return path

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("*.json")) if self.root.is_dir() else 0


def check_table(latency_us: Any, key: MeasurementKey, where: str) -> np.ndarray:
    """``latency_us`` as the table of ``key``: one row per block, one column per batch size 1 to
    the largest timed (the profiler interpolates between those it times), latencies finite, at least
    :data:`MIN_LATENCY_US`, and monotone in batch size within :data:`LARGER_BATCH_MIN_RATIO`.
    Raises :class:`ProfileError` saying what is wrong, ``where``."""
    try:
        table = np.asarray(latency_us, dtype=float)
    except (TypeError, ValueError):
        table = np.empty(0)
    if table.ndim != 2:
        raise ProfileError(f"{where}: not a table of numbers, one row per block")
    blocks, widest = len(key.segment_boundaries) - 1, max(key.batch_sizes)
    if table.shape != (blocks, widest):
        raise ProfileError(f"{where}: a {'x'.join(map(str, table.shape))} table, expected {blocks} blocks x {widest} batch sizes")
    unreal = table[~(np.isfinite(table) & (table >= MIN_LATENCY_US))]
    if unreal.size:
        raise ProfileError(f"{where}: latencies must be finite and at least {MIN_LATENCY_US:g} us, got {unreal[0]:g} us")
    if widest == 1:
        return table
    slowest_before = np.maximum.accumulate(table, axis=1)[:, :-1]
    block, batch = np.unravel_index(np.argmin(table[:, 1:] / slowest_before), slowest_before.shape)
    if table[block, batch + 1] < LARGER_BATCH_MIN_RATIO * slowest_before[block, batch]:
        raise ProfileError(
            f"{where}: block {block} takes {table[block, batch + 1]:g} us at batch {batch + 2}, under "
            f"{LARGER_BATCH_MIN_RATIO:.0%} of its {slowest_before[block, batch]:g} us at a smaller batch: not a measurement"
        )
    return table


def configured_store(store: str | os.PathLike | ProfileStore | None) -> ProfileStore | None:
    """``store`` as a :class:`ProfileStore`, or the one the Dask config key ``daskpipe.profile-store`` names."""
    if isinstance(store, ProfileStore):
        return store
    location = setting(CONFIG_KEY) if store is None else store
    return ProfileStore(location) if location else None
