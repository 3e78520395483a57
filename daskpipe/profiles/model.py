"""The profile of a model: what each block costs on each (GPU type, MPS slice count, batch size).

A profile is the single input every planner, the data plane and the emulated workers read, so it
is validated once, on load, with errors that name the file and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from daskpipe.jsonfile import read_json_object

FORMAT = "daskpipe-profile/1"
MEASURED, ESTIMATED = "measured", "estimated"
"""Where a table came from (``Profile.origin``): timed on a device of its kind, or the analytic estimator."""


def kind_label(gpu: str, slices: int) -> str:
    """``"L4/2"``: how a (GPU type, slices) kind is named in files and tables."""
    return f"{gpu}/{slices}"


class ProfileError(ValueError):
    """A profile file or table is malformed; the message names the source and the field."""


@dataclass(frozen=True)
class Profile:
    """Per-block latency tables and boundary sizes of one model.

    ``latency_us[(gpu, v)]`` is an array of shape ``(num_blocks, max_batch)``: row ``i`` is block
    ``i``, column ``b - 1`` its latency in microseconds at batch size ``b`` when the GPU is cut into
    ``v`` equal MPS slices that all run at once. ``boundary_bytes[i]`` is the fp16 feature map (batch
    1) leaving block ``i`` for block ``i + 1``; ``input_bytes`` and ``output_bytes`` frame the model.
    """

    model: str
    slo_us: float
    num_blocks: int
    latency_us: Mapping[tuple[str, int], np.ndarray]
    boundary_bytes: tuple[float, ...]
    input_bytes: float = 0.0
    output_bytes: float = 0.0
    input_shape: tuple[int, ...] | None = None  # per-sample shape the first block expects
    boundary_shapes: tuple[tuple[int, ...], ...] | None = None  # per-sample shape at each boundary
    source: str = "<memory>"
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _validate(self)

    # -- queries -----------------------------------------------------------------------------
    @property
    def gpu_types(self) -> list[str]:
        return sorted({gpu for gpu, _ in self.latency_us})

    def slices(self, gpu: str) -> list[int]:
        """MPS slice counts ``v`` profiled for ``gpu`` (1 = the whole GPU)."""
        return sorted(v for g, v in self.latency_us if g == gpu)

    def max_batch(self, gpu: str, v: int = 1) -> int:
        return int(self.table(gpu, v).shape[1])

    def table(self, gpu: str, v: int = 1) -> np.ndarray:
        try:
            return self.latency_us[(gpu, v)]
        except KeyError:
            have = ", ".join(f"{g}/v{s}" for g, s in sorted(self.latency_us))
            raise KeyError(f"profile of {self.model!r} has no table for GPU {gpu!r} with v={v} (has: {have})") from None

    def origin(self, gpu: str, v: int = 1) -> str | None:
        """``"measured"`` or ``"estimated"`` where the profile records it (``meta["tables"]``), else ``None``."""
        return self.meta.get("tables", {}).get(kind_label(gpu, v))

    def latency(self, gpu: str, v: int, batch: int, start: int = 0, end: int | None = None) -> float:
        """Latency in µs of blocks ``[start, end)`` at ``batch`` on one 1/v slice of ``gpu``."""
        end = self.num_blocks if end is None else end
        return float(self.table(gpu, v)[start:end, batch - 1].sum())

    def cut_bytes(self, boundary: int) -> float:
        """fp16 bytes per request crossing the cut before block ``boundary`` (0 < boundary < N)."""
        if not 0 < boundary < self.num_blocks:  # else an index from the end: another cut's bytes
            raise ValueError(f"{self.model!r} has cuts before blocks 1 to {self.num_blocks - 1}, not before block {boundary}")
        return float(self.boundary_bytes[boundary - 1])

    def bytes_into(self, block: int) -> float:
        """Bytes per request that a partition starting at ``block`` receives: the request's own
        input at block 0 (``input_bytes``), else the feature map crossing the cut before it."""
        return self.input_bytes if block == 0 else self.cut_bytes(block)

    # -- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        tables: dict[str, dict[str, list[list[float]]]] = {}
        for (gpu, v), arr in sorted(self.latency_us.items()):
            tables.setdefault(gpu, {})[str(v)] = [[float(x) for x in row] for row in arr]
        out: dict[str, Any] = {
            "format": FORMAT,
            "model": self.model,
            "slo_us": self.slo_us,
            "num_blocks": self.num_blocks,
            "boundary_bytes": list(self.boundary_bytes),
            "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes,
            "latency_us": tables,
        }
        if self.input_shape is not None:
            out["input_shape"] = list(self.input_shape)
        if self.boundary_shapes is not None:
            out["boundary_shapes"] = [list(s) for s in self.boundary_shapes]
        if self.meta:
            out["meta"] = dict(self.meta)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<memory>") -> Profile:
        def need(key: str) -> Any:
            if key not in data:
                raise ProfileError(f"{source}: missing field {key!r}")
            return data[key]

        if data.get("format", FORMAT) != FORMAT:
            raise ProfileError(f"{source}: field 'format' is {data.get('format')!r}, expected {FORMAT!r}")
        tables_raw = need("latency_us")
        if not isinstance(tables_raw, Mapping) or not tables_raw:
            raise ProfileError(f"{source}: field 'latency_us' must map GPU type -> {{slices: table}}, got {tables_raw!r:.80}")
        tables: dict[tuple[str, int], np.ndarray] = {}
        for gpu, by_v in tables_raw.items():
            if not isinstance(by_v, Mapping) or not by_v:
                raise ProfileError(f"{source}: field 'latency_us.{gpu}' must map slice count -> table")
            for v_key, rows in by_v.items():
                where = f"latency_us.{gpu}.{v_key}"
                try:
                    v = int(v_key)
                except ValueError:
                    raise ProfileError(f"{source}: field {where!r}: slice count must be an integer") from None
                tables[(str(gpu), v)] = _table(rows, f"{source}: field {where!r}")
        shapes = data.get("boundary_shapes")
        return cls(
            model=str(need("model")),
            slo_us=_number(need("slo_us"), f"{source}: field 'slo_us'"),
            num_blocks=int(_number(need("num_blocks"), f"{source}: field 'num_blocks'")),
            latency_us=tables,
            boundary_bytes=tuple(
                _number(x, f"{source}: field 'boundary_bytes'") for x in _list(need("boundary_bytes"), f"{source}: field 'boundary_bytes'")
            ),
            input_bytes=_number(data.get("input_bytes", 0.0), f"{source}: field 'input_bytes'"),
            output_bytes=_number(data.get("output_bytes", 0.0), f"{source}: field 'output_bytes'"),
            input_shape=_shape(data["input_shape"], f"{source}: field 'input_shape'") if data.get("input_shape") is not None else None,
            boundary_shapes=tuple(
                _shape(s, f"{source}: field 'boundary_shapes[{i}]'")
                for i, s in enumerate(_list(shapes, f"{source}: field 'boundary_shapes'"))
            )
            if shapes is not None
            else None,
            source=source,
            meta=_mapping(data.get("meta", {}), f"{source}: field 'meta'"),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(read_json_object(path, ProfileError), source=str(path))

    def restricted(self, gpus: list[str]) -> Profile:
        """The same profile with only the tables of ``gpus``."""
        missing = [g for g in gpus if g not in self.gpu_types]
        if missing:
            raise ProfileError(f"{self.source}: model {self.model!r} has no profile for GPU type(s) {missing} (has {self.gpu_types})")
        tables = {k: a for k, a in self.latency_us.items() if k[0] in gpus}
        return _replace(self, latency_us=tables)


def _replace(p: Profile, **changes: Any) -> Profile:
    from dataclasses import replace

    return replace(p, **changes)


def _number(x: Any, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise ProfileError(f"{where}: expected a number, got {x!r:.60}")
    x = float(x)
    if not math.isfinite(x) or x < 0:
        raise ProfileError(f"{where}: expected a finite non-negative number, got {x}")
    return x


def _list(x: Any, where: str) -> list[Any]:
    if not isinstance(x, (list, tuple)):
        raise ProfileError(f"{where}: expected a list, got {type(x).__name__}")
    return list(x)


def _shape(x: Any, where: str) -> tuple[int, ...]:
    dims = _list(x, where)
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 1 for d in dims):
        raise ProfileError(f"{where}: expected a shape of positive integers, got {x!r:.60}")
    return tuple(int(d) for d in dims)


def _mapping(x: Any, where: str) -> dict[str, Any]:
    if not isinstance(x, Mapping):
        raise ProfileError(f"{where}: expected an object, got {type(x).__name__}")
    return dict(x)


def _table(rows: Any, where: str) -> np.ndarray:
    rows = _list(rows, where)
    if not rows:
        raise ProfileError(f"{where}: table has no rows")
    width = None
    out = []
    for i, row in enumerate(rows):
        row = _list(row, f"{where} row {i}")
        if width is None:
            width = len(row)
        if len(row) != width or width == 0:
            raise ProfileError(f"{where}: ragged table: row {i} has {len(row)} batch sizes, row 0 has {width}")
        out.append([_number(x, f"{where} row {i}") for x in row])
    return np.asarray(out, dtype=float)


def _validate(p: Profile) -> None:
    src = p.source
    if not p.model:
        raise ProfileError(f"{src}: field 'model' is empty")
    if p.num_blocks < 1:
        raise ProfileError(f"{src}: field 'num_blocks' must be >= 1, got {p.num_blocks}")
    if not math.isfinite(p.slo_us) or p.slo_us <= 0:
        raise ProfileError(f"{src}: field 'slo_us' must be a positive number of microseconds, got {p.slo_us}")
    if len(p.boundary_bytes) != p.num_blocks - 1:
        raise ProfileError(
            f"{src}: field 'boundary_bytes' has {len(p.boundary_bytes)} entries; {p.num_blocks} blocks need {p.num_blocks - 1}"
        )
    if not p.latency_us:
        raise ProfileError(f"{src}: field 'latency_us' has no GPU tables")
    for (gpu, v), arr in p.latency_us.items():
        where = f"{src}: field 'latency_us.{gpu}.{v}'"
        if v < 1:
            raise ProfileError(f"{where}: slice count must be >= 1")
        if arr.ndim != 2:
            raise ProfileError(f"{where}: expected a blocks x batch-sizes table")
        if arr.shape[0] != p.num_blocks:
            raise ProfileError(f"{where}: has {arr.shape[0]} block rows, num_blocks is {p.num_blocks}")
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise ProfileError(f"{where}: latencies must be finite and non-negative")
    if p.boundary_shapes is not None and len(p.boundary_shapes) != p.num_blocks - 1:
        raise ProfileError(f"{src}: field 'boundary_shapes' needs {p.num_blocks - 1} entries, has {len(p.boundary_shapes)}")
