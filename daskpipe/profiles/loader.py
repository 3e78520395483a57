"""Read profiles from disk: the published PPipe table layout, daskpipe JSON files, or one JSON file.

Everything a planner or a simulator reads goes through ``load_profiles``, so every malformed file
is caught here, with an error that names the file and the row or field, instead of surfacing later
as a wrong plan.
"""

from __future__ import annotations

import csv
import math
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from daskpipe.profiles.model import MEASURED, Profile, ProfileError, kind_label

TIMING_DIR = "block-timing"
BOUNDARY_DIR = "boundary-bytes"
SLO_FILE = "models.csv"
_TIMING_NAME = re.compile(r"^(?P<model>.+)-(?P<gpu>[A-Za-z0-9_.]+)-(?P<v>[0-9]+)\.csv$")


def load_profiles(path: str | Path, models: list[str] | None = None) -> dict[str, Profile]:
    """Profiles by full model name, from a PPipe-layout folder, a folder of JSON files or one file.

    ``models`` may name each model exactly or by a unique prefix (``"fcn"``); ``None`` loads all.
    """
    path = Path(path)
    if not path.exists():
        raise ProfileError(f"{path}: no such file or folder")
    if path.is_file():
        profile = Profile.load(path)
        profiles = {profile.model: profile}
    elif (path / TIMING_DIR).is_dir():
        return _load_ppipe_folder(path, models)
    else:
        profiles = _load_json_folder(path)
    names = resolve_model_names(sorted(profiles), models, where=str(path)) if models is not None else sorted(profiles)
    return {name: profiles[name] for name in names}


def resolve_model_names(available: list[str], requested: list[str] | None, where: str = "profiles") -> list[str]:
    """Full names for ``requested``: an exact name wins, else the single name it is a prefix of."""
    available = sorted(available)
    if requested is None:
        return available
    resolved: list[str] = []
    for name in requested:
        if name in available:
            match = name
        else:
            candidates = [a for a in available if a.startswith(name)]
            if not candidates:
                raise ProfileError(f"{where}: unknown model {name!r}; available models: {', '.join(available) or '(none)'}")
            if len(candidates) > 1:
                raise ProfileError(f"{where}: model name {name!r} is ambiguous; it matches: {', '.join(candidates)}")
            match = candidates[0]
        if match not in resolved:
            resolved.append(match)
    return resolved


# -- daskpipe JSON ------------------------------------------------------------------------------
def _load_json_folder(folder: Path) -> dict[str, Profile]:
    files = sorted(folder.glob("*.json"))
    if not files:
        raise ProfileError(f"{folder}: holds neither profile JSON files nor a {TIMING_DIR}/ folder (the PPipe table layout)")
    profiles: dict[str, Profile] = {}
    for file in files:
        profile = Profile.load(file)
        if profile.model in profiles:
            raise ProfileError(f"{file}: model {profile.model!r} is also profiled in {profiles[profile.model].source}")
        profiles[profile.model] = profile
    return profiles


# -- PPipe table layout -------------------------------------------------------------------------
def _load_ppipe_folder(folder: Path, models: list[str] | None) -> dict[str, Profile]:
    timing_files: dict[str, dict[tuple[str, int], Path]] = defaultdict(dict)
    for file in sorted((folder / TIMING_DIR).glob("*.csv")):
        match = _TIMING_NAME.match(file.name)
        if match is None:
            raise ProfileError(f"{file}: file name must be <model>-<GPU>-<slices>.csv")
        v = int(match["v"])
        if v < 1:
            raise ProfileError(f"{file}: slice count in the file name must be >= 1, got {v}")
        timing_files[match["model"]][(match["gpu"], v)] = file
    if not timing_files:
        raise ProfileError(f"{folder / TIMING_DIR}: no <model>-<GPU>-<slices>.csv files")
    all_gpus = sorted({gpu for tables in timing_files.values() for gpu, _ in tables})
    slos = _read_slos(folder / SLO_FILE)
    names = resolve_model_names(sorted(timing_files), models, where=str(folder))
    return {name: _ppipe_profile(folder, name, timing_files[name], all_gpus, slos) for name in names}


def _ppipe_profile(folder: Path, model: str, files: dict[tuple[str, int], Path], all_gpus: list[str], slos: dict[str, float]) -> Profile:
    missing = [gpu for gpu in all_gpus if (gpu, 1) not in files]
    if missing:
        expected = ", ".join(f"{model}-{gpu}-1.csv" for gpu in missing)
        raise ProfileError(
            f"{folder / TIMING_DIR}: model {model!r} is missing GPU type(s) {missing} that other models have (expected {expected})"
        )
    tables = {key: _read_timing_table(file) for key, file in files.items()}
    reference_key = min(tables, key=lambda k: (k[1], k[0]))
    num_blocks = tables[reference_key].shape[0]
    for key, table in tables.items():
        if table.shape[0] != num_blocks:
            raise ProfileError(f"{files[key]}: has {table.shape[0]} block rows, but {files[reference_key].name} has {num_blocks}")
    boundary_file = folder / BOUNDARY_DIR / f"{model}.csv"
    boundary = _read_boundary_bytes(boundary_file)
    if len(boundary) != num_blocks - 1:
        raise ProfileError(
            f"{boundary_file}: has {len(boundary)} rows; {num_blocks} blocks (as in {files[reference_key].name}) need {num_blocks - 1}"
        )
    if model not in slos:
        raise ProfileError(f"{folder / SLO_FILE}: no row for model {model!r} (column 'slo_us')")
    return Profile(
        model=model,
        slo_us=slos[model],
        num_blocks=num_blocks,
        latency_us=tables,
        boundary_bytes=tuple(boundary),
        source=str(folder),
        meta={
            "format": "ppipe-csv",
            "precision": "TensorRT TF32 (as published)",
            "tables": {kind_label(g, v): MEASURED for g, v in sorted(tables)},
        },
    )


def _read_rows(file: Path) -> list[list[str]]:
    if not file.is_file():
        raise ProfileError(f"{file}: file is missing")
    with file.open(newline="") as handle:
        return [row for row in csv.reader(handle) if any(cell.strip() for cell in row)]


def _parse_number(cell: str, where: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise ProfileError(f"{where}: {cell.strip()!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ProfileError(f"{where}: expected a finite non-negative number, got {cell.strip()!r}")
    return value


def _read_timing_table(file: Path) -> np.ndarray:
    rows = _read_rows(file)
    if not rows:
        raise ProfileError(f"{file}: table is empty (expected one row per block, one column per batch size)")
    width = len(rows[0])
    table = []
    for i, row in enumerate(rows):
        if len(row) != width:
            raise ProfileError(f"{file}: row {i + 1} has {len(row)} batch-size columns, row 1 has {width}")
        table.append([_parse_number(cell, f"{file}: row {i + 1}, column {j + 1} (batch {j + 1})") for j, cell in enumerate(row)])
    return np.asarray(table, dtype=float)


def _read_boundary_bytes(file: Path) -> list[float]:
    values = []
    for i, row in enumerate(_read_rows(file)):
        if len(row) != 1:
            raise ProfileError(f"{file}: row {i + 1} must hold one number (bytes), has {len(row)} columns")
        values.append(_parse_number(row[0], f"{file}: row {i + 1}"))
    return values


def _read_slos(file: Path) -> dict[str, float]:
    rows = _read_rows(file)
    if not rows or [c.strip() for c in rows[0]] != ["model", "slo_us"]:
        raise ProfileError(f"{file}: first row must be the header 'model,slo_us'")
    slos: dict[str, float] = {}
    for i, row in enumerate(rows[1:], start=2):
        if len(row) != 2:
            raise ProfileError(f"{file}: row {i} must be 'model,slo_us', has {len(row)} columns")
        slo = _parse_number(row[1], f"{file}: row {i}, column 'slo_us'")
        if slo <= 0:
            raise ProfileError(f"{file}: row {i}, column 'slo_us' must be positive, got {row[1].strip()!r}")
        slos[row[0].strip()] = slo
    return slos
