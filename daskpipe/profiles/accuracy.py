"""How far the analytic estimator is from measured tables, and the fit of its constants.

The published PPipe tables are TensorRT TF32 with their own block mapping, so the comparison is on
whole-model latency (sum of blocks) per (GPU type, slices v, batch b). The saturation and one
compute efficiency per GPU type are fitted by grid search on the mean absolute log error; the
launch overhead and the memory efficiency stay fixed, as the data cannot tell them apart from the
compute efficiency. The reported error is leave-one-model-out: each model is predicted with
constants fitted on the other models only.

With ``calibrate``, the estimator is also calibrated the way ``deploy`` does it when it measured
a kind: on one GPU type's measured tables of a model (``estimator.efficiency_factors``), and the
error is taken on the model's other GPU types, leaving each type out as the measured one in turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from daskpipe.profiles.catalog import GPUSpec, load_catalog
from daskpipe.profiles.estimator import LAUNCH_US, Constants, OpCosts, efficiency_factors, mape, op_costs, op_latency_us, roofline_terms
from daskpipe.profiles.loader import load_profiles
from daskpipe.profiles.model import Profile, ProfileError
from daskpipe.profiles.zoo import REFERENCE_MODELS, build_reference_model

SATURATION_GRID = np.array([256.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0])
EFFICIENCY_GRID = np.geomspace(0.01, 1.0, 241)


@dataclass(frozen=True)
class Entry:
    """One measured whole-model latency and the op costs it should be predicted from."""

    model: str
    gpu: str
    slices: int
    batch: int
    measured_us: float
    costs: OpCosts


def collect_entries(profiles: Mapping[str, Profile], costs: Mapping[str, Mapping[int, OpCosts]], gpus: Sequence[str]) -> list[Entry]:
    entries = []
    for model, profile in profiles.items():
        for gpu in gpus:
            for v in profile.slices(gpu):
                for b in range(1, profile.max_batch(gpu, v) + 1):
                    entries.append(Entry(model, gpu, v, b, profile.latency(gpu, v, b), costs[model][b]))
    return entries


def fit_constants(entries: Sequence[Entry], catalog: Mapping[str, GPUSpec]) -> Constants:
    """Global saturation and one compute efficiency per GPU type, minimising mean |log error|."""
    if not entries:
        raise ProfileError("no measured entries to fit the estimator on")
    gpus = sorted({e.gpu for e in entries})
    best: tuple[float, Constants] | None = None
    for saturation in SATURATION_GRID:
        per_gpu = {}
        for gpu in gpus:
            rows = [e for e in entries if e.gpu == gpu]
            work = []  # [entry, eff]: roofline time without launch overheads
            for e in rows:
                compute_us, memory_us = roofline_terms(e.costs, catalog[gpu], e.slices, saturation)
                per_op = np.maximum(compute_us[None, :] / EFFICIENCY_GRID[:, None], memory_us[None, :] / Constants.memory_efficiency)
                work.append(per_op.sum(axis=1) + LAUNCH_US * len(compute_us))
            measured = np.array([e.measured_us for e in rows])
            per_gpu[gpu] = np.abs(np.log(np.array(work) / measured[:, None])).mean(axis=0)  # per efficiency
        loss = float(sum(errors.min() for errors in per_gpu.values()))
        if best is None or loss < best[0]:
            efficiency = {gpu: float(EFFICIENCY_GRID[np.argmin(errors)]) for gpu, errors in per_gpu.items()}
            best = (
                loss,
                Constants(
                    launch_us=LAUNCH_US,
                    saturation=float(saturation),
                    default_efficiency=float(np.median(list(efficiency.values()))),
                    efficiency=efficiency,
                ),
            )
    assert best is not None
    return best[1]


def predict(entry: Entry, constants: Constants, catalog: Mapping[str, GPUSpec]) -> float:
    return op_latency_us(entry.costs, catalog[entry.gpu], entry.slices, constants)


def _summary(rows: Sequence[tuple[Entry, float]]) -> dict[str, float | int]:
    mean, median = mape([p for _, p in rows], [e.measured_us for e, _ in rows])
    return {"mean_ape_pct": round(mean, 2), "median_ape_pct": round(median, 2), "n": len(rows)}


def estimator_error(
    profiles_dir: str | Path,
    models: Sequence[str] | None = None,
    gpus: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
    calibrate: bool = False,
) -> dict:
    """Leave-one-model-out error of the estimator against measured tables, per GPU type and model;
    with ``calibrate``, also the error after calibrating on one measured GPU type (module docstring)."""
    names = list(models) if models is not None else [m for m in REFERENCE_MODELS]
    profiles = load_profiles(profiles_dir, names)
    missing = [m for m in profiles if m not in REFERENCE_MODELS]
    if missing:
        raise ProfileError(f"no torchvision build for {missing}; the estimator can be checked on {list(REFERENCE_MODELS)}")
    if len(profiles) < 2:
        raise ProfileError("leave-one-model-out needs at least two models")
    catalog = load_catalog()
    gpus = list(gpus) if gpus is not None else sorted(set.intersection(*(set(p.gpu_types) for p in profiles.values())))
    unknown = [g for g in gpus if g not in catalog]
    if unknown:
        raise ProfileError(f"GPU type(s) {unknown} are not in the catalog ({sorted(catalog)})")
    costs = {}
    for name, profile in profiles.items():
        if progress:
            progress(name)
        with torch.device("meta"):
            module, shape = build_reference_model(name)
        costs[name] = op_costs(module, shape, range(1, max(profile.max_batch(g) for g in gpus) + 1))
    entries = collect_entries(profiles, costs, gpus)

    held_out: list[tuple[Entry, float]] = []
    folds = {}
    for name in profiles:
        constants = fit_constants([e for e in entries if e.model != name], catalog)
        folds[name] = _constants_json(constants)
        held_out += [(e, predict(e, constants, catalog)) for e in entries if e.model == name]
    in_sample_constants = fit_constants(entries, catalog)
    in_sample = [(e, predict(e, in_sample_constants, catalog)) for e in entries]
    report = {
        "comparison": "whole-model latency (sum of blocks) per (GPU, slices, batch); measured = published TensorRT TF32 tables",
        "models": list(profiles),
        "gpus": gpus,
        "out_of_sample": {
            "method": "leave-one-model-out: constants fitted on the other models",
            "per_gpu": {g: _summary([r for r in held_out if r[0].gpu == g]) for g in gpus},
            "per_model": {m: {g: _summary([r for r in held_out if r[0].model == m and r[0].gpu == g]) for g in gpus} for m in profiles},
            "all": _summary(held_out),
            "fold_constants": folds,
        },
        "in_sample": {
            "method": "constants fitted on all models, error on the same models",
            "per_gpu": {g: _summary([r for r in in_sample if r[0].gpu == g]) for g in gpus},
            "all": _summary(in_sample),
            "constants": _constants_json(in_sample_constants),
        },
    }
    if calibrate:
        report.update(calibration_error(held_out, gpus))
    return report


def calibration_error(predicted: Sequence[tuple[Entry, float]], gpus: Sequence[str]) -> dict:
    """Leave-one-GPU-type-out: for each measured type and each model, the estimates of the model's
    other types, as they are (``uncalibrated``) and scaled by the model's efficiency factor on the
    measured type (``calibrated``); ``median_ape`` and ``mean_ape`` in percent over all those rows."""
    uncalibrated: list[tuple[Entry, float]] = []
    calibrated: list[tuple[Entry, float]] = []
    per_reference = {}
    for reference in gpus:
        rows_before, rows_after = [], []
        for model in sorted({e.model for e, _ in predicted}):
            measured = [(e, p) for e, p in predicted if e.model == model and e.gpu == reference]
            if not measured:
                continue
            factor = float(efficiency_factors(np.array([[e.measured_us for e, _ in measured]]), np.array([[p for _, p in measured]]))[0])
            others = [(e, p) for e, p in predicted if e.model == model and e.gpu != reference]
            rows_before += others
            rows_after += [(e, p * factor) for e, p in others]
        per_reference[reference] = {"uncalibrated": _summary(rows_before), "calibrated": _summary(rows_after)}
        uncalibrated += rows_before
        calibrated += rows_after
    before, after = _summary(uncalibrated), _summary(calibrated)
    return {
        "calibration": {
            "method": "leave-one-GPU-type-out: per model, one efficiency factor (geometric mean of measured/estimated) "
            "on the measured type scales the estimates of its other types; estimates use the leave-one-model-out constants",
            "per_measured_gpu": per_reference,
            "rows": after["n"],
        },
        "median_ape": {"uncalibrated": before["median_ape_pct"], "calibrated": after["median_ape_pct"]},
        "mean_ape": {"uncalibrated": before["mean_ape_pct"], "calibrated": after["mean_ape_pct"]},
    }


def _constants_json(constants: Constants) -> dict:
    return {
        "launch_us": constants.launch_us,
        "saturation": constants.saturation,
        "memory_efficiency": constants.memory_efficiency,
        "efficiency": {g: round(e, 4) for g, e in constants.efficiency.items()},
    }
