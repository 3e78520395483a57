"""Named clusters and model groups (the paper's HC1-HC4 and G1-G4), kept as data in ``plans/``.

``plans/*.json`` is the copy people edit; ``daskpipe/data/`` ships the same files inside the
package so that an installed daskpipe can read them too (a test keeps the two identical).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from daskpipe.plan.schema import PlanError

REPO_PLANS = Path(__file__).resolve().parents[2] / "plans"
PACKAGE_DATA = Path(__file__).resolve().parents[1] / "data"


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus: Mapping[str, int]
    gpus_per_server: Mapping[str, int]
    bw_gbps: float
    paper_ratio: Mapping[str, float]  # the artifact's MILP-level ppipe/np and ppipe/dart-r, where published


@dataclass(frozen=True)
class Group:
    name: str
    models: tuple[str, ...]
    weights: tuple[float, ...]


def spec_file(name: str) -> Path:
    """``plans/<name>`` in a checkout, else the package copy."""
    for folder in (REPO_PLANS, PACKAGE_DATA):
        if (folder / name).is_file():
            return folder / name
    raise PlanError(f"cannot find {name} in {REPO_PLANS} or {PACKAGE_DATA}")


def _read(name: str) -> Mapping[str, Any]:
    path = spec_file(name)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PlanError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, Mapping):
        raise PlanError(f"{path}: top level must map names to specs")
    return data


def clusters() -> dict[str, Cluster]:
    out = {}
    for name, spec in _read("clusters.json").items():
        try:
            out[name] = Cluster(name, dict(spec["gpus"]), dict(spec.get("gpus_per_server", {})), float(spec["bw_gbps"]), dict(spec.get("paper_ratio", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{spec_file('clusters.json')}: cluster {name!r} is malformed ({exc!r}); it needs gpus and bw_gbps") from None
    return out


def groups() -> dict[str, Group]:
    out = {}
    for name, spec in _read("groups.json").items():
        try:
            models, weights = tuple(spec["models"]), tuple(float(w) for w in spec["weights"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{spec_file('groups.json')}: group {name!r} is malformed ({exc!r}); it needs models and weights") from None
        if len(models) != len(weights):
            raise PlanError(f"{spec_file('groups.json')}: group {name!r} has {len(models)} models but {len(weights)} weights")
        out[name] = Group(name, models, weights)
    return out
