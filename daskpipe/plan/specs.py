"""Named clusters and model groups (the paper's HC1-HC4 and G1-G4), kept as data in ``plans/``.

``plans/*.json`` is the copy people edit; ``daskpipe/data/`` ships the same files inside the
package so that an installed daskpipe can read them too (a test keeps the two identical).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from daskpipe.jsonfile import read_json_object
from daskpipe.plan.schema import PlanError

if TYPE_CHECKING:
    from daskpipe.profiles.model import Profile

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
    return read_json_object(spec_file(name), PlanError)


def clusters() -> dict[str, Cluster]:
    out = {}
    for name, spec in _read("clusters.json").items():
        try:
            out[name] = Cluster(
                name, dict(spec["gpus"]), dict(spec.get("gpus_per_server", {})), float(spec["bw_gbps"]), dict(spec.get("paper_ratio", {}))
            )
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


def group_cases(
    cluster_names: Sequence[str], group_names: Sequence[str], profiles_dir: str | Path
) -> Iterator[tuple[Cluster, Group, dict[str, Profile], dict[str, float]]]:
    """Each (cluster, group) of the grid, with the group's profiles and workload weights by full model name."""
    from daskpipe.profiles.loader import load_profiles

    known_clusters, known_groups = clusters(), groups()
    unknown = [c for c in cluster_names if c not in known_clusters] + [g for g in group_names if g not in known_groups]
    if unknown:
        raise PlanError(f"unknown cluster/group name(s) {unknown}; known: {sorted(known_clusters)}, {sorted(known_groups)}")
    for cluster_name in cluster_names:
        for group_name in group_names:
            group = known_groups[group_name]
            profiles = load_profiles(profiles_dir, list(group.models))
            yield known_clusters[cluster_name], group, profiles, dict(zip(profiles, group.weights))
