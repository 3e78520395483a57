"""Fit the interference model's parameters from profiling samples, with numpy least squares only.

InSS profiles each model alone on a grid of (share, batch) (16 configurations) and a few runs with
co-runners (five sets); we do the same. Every parameter is a linear least-squares fit except the
rational running time, whose one non-linear parameter ``k4`` is found by a one-dimensional search
with the four linear ones solved inside (variable projection), so no scipy is needed.
``emulate_profiling`` produces the same samples from a known model plus noise: the seam that
stands in for a GPU, and the test data with known parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import numpy as np

from daskpipe.colocation.latency import Colocated, ColocationError, GpuSpec, InterferenceModel, ModelCoefficients


@dataclass(frozen=True)
class SoloSample:
    """One profiling run of ``model`` alone at (``batch``, ``share``) on ``gpu``.

    ``sched_ms`` is the sum of inter-kernel idle gaps, ``running_ms`` the kernels' active time (an
    Nsight trace splits a batch into these), ``l2_util`` the duration-weighted L2 utilisation (0..1),
    ``total_ms`` the end-to-end batch latency, PCIe copies included.
    """

    model: str
    gpu: str
    batch: int
    share: float
    running_ms: float
    sched_ms: float
    l2_util: float
    memory_mb: float
    total_ms: float


@dataclass(frozen=True)
class CoSample:
    """One profiling run of ``me`` while ``others`` run on the same GPU at the same time."""

    gpu: str
    me: Colocated
    others: tuple[Colocated, ...]
    running_ms: float
    sched_ms: float
    total_ms: float


@dataclass(frozen=True)
class ModelInfo:
    """What is measured once per (model, GPU) rather than fitted: the kernel count of a batch (an
    Nsight trace) and the bytes a sample moves over PCIe."""

    kernels: int
    input_bytes: float
    output_bytes: float


@dataclass(frozen=True)
class FitReport:
    """Prediction error of the fitted model on the samples it was fitted to (InSS: <= 3.9%)."""

    solo_errors_pct: tuple[float, ...]
    co_errors_pct: tuple[float, ...]

    @property
    def mean_error_pct(self) -> float:
        errors = self.solo_errors_pct + self.co_errors_pct
        return float(np.mean(errors)) if errors else 0.0

    @property
    def max_error_pct(self) -> float:
        errors = self.solo_errors_pct + self.co_errors_pct
        return float(np.max(errors)) if errors else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "samples": len(self.solo_errors_pct) + len(self.co_errors_pct),
            "mean_error_pct": round(self.mean_error_pct, 3),
            "max_error_pct": round(self.max_error_pct, 3),
            "solo_max_error_pct": round(max(self.solo_errors_pct, default=0.0), 3),
            "colocated_max_error_pct": round(max(self.co_errors_pct, default=0.0), 3),
        }


def fit_line(x: Sequence[float], y: Sequence[float], *, through_origin: bool = False) -> tuple[float, float]:
    """Least-squares ``y ≈ a·x + b`` (``b = 0`` with ``through_origin``)."""
    xs, ys = np.asarray(x, float), np.asarray(y, float)
    if xs.size < (1 if through_origin else 2):
        raise ColocationError(f"need at least {1 if through_origin else 2} points to fit a line, got {xs.size}")
    design = xs[:, None] if through_origin else np.column_stack([xs, np.ones_like(xs)])
    sol, *_ = np.linalg.lstsq(design, ys, rcond=None)
    return (float(sol[0]), 0.0) if through_origin else (float(sol[0]), float(sol[1]))


# Column subsets of (u, k2, k3, k5) left free; k5, the constant, always is.
_NONNEG_SUBSETS = [[i for i in range(3) if mask >> i & 1] + [3] for mask in range(8)]


def fit_running(
    batches: Sequence[float], sms: Sequence[float], running_ms: Sequence[float], *, max_batch: int = 32
) -> tuple[float, float, float, float, float]:
    """Fit ``(k1·b² + k2·b + k3) / (sms + k4) + k5`` minimising the squared *relative* error.

    Measured latencies are often concave in the batch (InSS Table 2), so ``k1`` may be negative,
    but only so far that latency still grows up to ``max_batch`` and stays positive: we fit
    ``k1 = u - k2 / (2·max_batch)`` with ``u, k2, k3 >= 0``.

    For a fixed ``k4`` the rest is linear (an exhaustive non-negative least squares over which of
    ``u, k2, k3`` are zero); ``k4`` is searched on a grid over ``(-min sms, 20·max
    sms]`` and refined by golden section. Needs at least five points with two or more SM counts.
    """
    b, s, y = (np.asarray(a, float) for a in (batches, sms, running_ms))
    if not (b.size == s.size == y.size) or b.size < 5:
        raise ColocationError(f"fit_running needs >= 5 equal-length (batch, sms, ms) points, got {b.size}")
    if np.unique(s).size < 2 or np.any(y <= 0) or np.any(s <= 0):
        raise ColocationError("fit_running needs positive latencies and SM counts, with at least two distinct SM counts")
    weight = 1.0 / y

    def solve(k4: float) -> tuple[float, np.ndarray]:
        inv = 1.0 / (s + k4)
        design = np.column_stack([b * b * inv, (b - b * b / (2 * max_batch)) * inv, inv, np.ones_like(b)]) * weight[:, None]
        best: tuple[float, np.ndarray] = (math.inf, np.zeros(4))
        for free in _NONNEG_SUBSETS:
            sol = np.zeros(4)
            sol[free], *_ = np.linalg.lstsq(design[:, free], y * weight, rcond=None)
            if np.all(sol[:3] >= 0):
                residual = design @ sol - y * weight
                best = min(best, (float(residual @ residual), sol), key=lambda t: t[0])
        return best

    low = -0.95 * float(s.min())
    grid = low + (20.0 * float(s.max()) - low) * np.linspace(0.0, 1.0, 160) ** 3
    costs = [solve(k4)[0] for k4 in grid]
    best = int(np.argmin(costs))
    lo, hi = grid[max(0, best - 1)], grid[min(len(grid) - 1, best + 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(40):
        a, c = hi - golden * (hi - lo), lo + golden * (hi - lo)
        if solve(a)[0] < solve(c)[0]:
            hi = c
        else:
            lo = a
    k4 = (lo + hi) / 2
    _, (u, k2, k3, k5) = solve(k4)
    return float(u - k2 / (2 * max_batch)), float(k2), float(k3), float(k4), float(k5)


def fit_model(
    solo: Sequence[SoloSample],
    co: Sequence[CoSample],
    gpus: Iterable[GpuSpec],
    info: dict[tuple[str, str], ModelInfo],
    *,
    name: str = "fitted",
) -> tuple[InterferenceModel, FitReport]:
    """Fit every coefficient of every (model, GPU type) seen in ``solo``; report the fit error."""
    specs = {g.name: g for g in gpus}
    coefficients: dict[tuple[str, str], ModelCoefficients] = {}
    for key in sorted({(s.model, s.gpu) for s in solo}):
        model, gpu = key
        if gpu not in specs:
            raise ColocationError(f"samples name GPU {gpu!r}, which is not among the given GPU specs {sorted(specs)}")
        if key not in info:
            raise ColocationError(f"no ModelInfo (kernel count, bytes) for model {model!r} on {gpu!r}")
        rows = [s for s in solo if (s.model, s.gpu) == key]
        sm_count = specs[gpu].sm_count
        l2_alpha, l2_beta = fit_line([r.share for r in rows], [r.l2_util for r in rows])
        mem_per_sample, mem_base = fit_line([r.batch for r in rows], [r.memory_mb for r in rows])
        coefficients[key] = ModelCoefficients(
            model=model,
            gpu=gpu,
            kernels=info[key].kernels,
            sched_us_per_kernel=1000.0 * float(np.mean([r.sched_ms for r in rows])) / info[key].kernels,
            running=fit_running([r.batch for r in rows], [r.share * sm_count for r in rows], [r.running_ms for r in rows]),
            l2_alpha=l2_alpha,
            l2_beta=l2_beta,
            cache_sensitivity=0.0,  # fitted below from the co-located runs
            input_bytes=info[key].input_bytes,
            output_bytes=info[key].output_bytes,
            mem_base_mb=max(0.0, mem_base),
            mem_per_sample_mb=max(0.0, mem_per_sample),
        )
    partial = InterferenceModel(gpus=specs, coefficients=coefficients, name=name)
    fitted = _fit_colocation(partial, co)
    return fitted, _report(fitted, solo, co)


def _fit_colocation(model: InterferenceModel, co: Sequence[CoSample]) -> InterferenceModel:
    """α_s, β_s per GPU type from the extra per-kernel gaps; α_cache per model from the slowdown."""
    gpus = dict(model.gpus)
    coefficients = dict(model.coefficients)
    for gpu in sorted({c.gpu for c in co}):
        rows = [c for c in co if c.gpu == gpu]
        counts = [len(c.others) + 1 for c in rows]
        extra_us = [
            1000.0 * c.sched_ms / model.coeff(c.me.model, gpu).kernels - model.coeff(c.me.model, gpu).sched_us_per_kernel for c in rows
        ]
        if len(set(counts)) >= 2:
            alpha, beta = fit_line(counts, extra_us)
        else:  # one co-location degree only: the slope is not identifiable, keep an offset
            alpha, beta = 0.0, float(np.mean(extra_us))
        spec = gpus[gpu]
        gpus[gpu] = GpuSpec(spec.name, spec.sm_count, spec.memory_mb, spec.pcie_gb_per_s, sched_alpha_us=alpha, sched_beta_us=beta)
        for m in sorted({c.me.model for c in rows}):
            mine = [c for c in rows if c.me.model == m]
            solo_model = InterferenceModel(gpus=gpus, coefficients=coefficients)
            pressure = [sum(coefficients[(o.model, gpu)].l2_utilisation(o.share) for o in c.others) for c in mine]
            slowdown = [c.running_ms / solo_model.breakdown(gpu, c.me, c.others, interference=False).running_ms - 1.0 for c in mine]
            sensitivity, _ = fit_line(pressure, slowdown, through_origin=True)
            old = coefficients[(m, gpu)]
            coefficients[(m, gpu)] = replace(old, cache_sensitivity=max(0.0, sensitivity))
    return InterferenceModel(gpus=gpus, coefficients=coefficients, name=model.name)


def _report(model: InterferenceModel, solo: Sequence[SoloSample], co: Sequence[CoSample]) -> FitReport:
    def err(predicted: float, observed: float) -> float:
        return 100.0 * abs(predicted - observed) / observed

    solo_err = tuple(err(model.exec_ms(s.gpu, Colocated(s.model, s.share, s.batch)), s.total_ms) for s in solo)
    co_err = tuple(err(model.exec_ms(c.gpu, c.me, c.others), c.total_ms) for c in co)
    return FitReport(solo_errors_pct=solo_err, co_errors_pct=co_err)


# -- emulated profiling ------------------------------------------------------------------------
PAPER_SHARES = (0.24, 0.42, 0.60, 1.0)  # InSS Table 3 shares (plus the whole GPU)
PAPER_BATCHES = (1, 4, 8, 16)  # InSS Table 2 batch sizes


@dataclass(frozen=True)
class Measurement:
    """What one profiling run measures of the probed process (see ``SoloSample``); ``l2_util`` and
    ``memory_mb`` are only used from solo runs."""

    running_ms: float
    sched_ms: float
    total_ms: float
    l2_util: float = 0.0
    memory_mb: float = 0.0


Measure = Callable[[str, Colocated, Sequence[Colocated]], Measurement]
"""``measure(gpu, probe, others)``: run ``probe`` on ``gpu`` while ``others`` run beside it."""


def collect_samples(
    measure: Measure,
    gpu: str,
    models: Sequence[str],
    *,
    shares: Sequence[float] = PAPER_SHARES,
    batches: Sequence[int] = PAPER_BATCHES,
    co_sets: int = 5,
    rng: np.random.Generator,
) -> tuple[list[SoloSample], list[CoSample]]:
    """InSS's profiling campaign on ``gpu``, whatever runs it (a GPU under MPS, or emulation).

    Solo: the ``shares`` × ``batches`` grid per model. Co-located: ``co_sets`` runs per model with
    1..3 random co-runners (batch 4, as InSS's co-runners) at random shares summing to 1, none
    below the smallest profiled share.
    """
    solo = []
    for m in models:
        for share in shares:
            for b in batches:
                r = measure(gpu, Colocated(m, share, b), ())
                solo.append(
                    SoloSample(
                        model=m,
                        gpu=gpu,
                        batch=b,
                        share=share,
                        running_ms=r.running_ms,
                        sched_ms=r.sched_ms,
                        l2_util=r.l2_util,
                        memory_mb=r.memory_mb,
                        total_ms=r.total_ms,
                    )
                )
    co = []
    for m in models:
        candidates = [o for o in models if o != m] or [m]
        for k in range(co_sets):
            count = 1 + k % min(3, len(candidates))
            names = rng.choice(candidates, size=count, replace=len(candidates) < count)
            floor = min(min(shares), 1.0 / (count + 1))  # stay inside the profiled share range
            drawn = floor + rng.dirichlet(np.ones(count + 1)) * (1.0 - floor * (count + 1))
            me = Colocated(m, float(drawn[0]), int(rng.choice(batches)))
            others = tuple(Colocated(str(o), float(sh), 4) for o, sh in zip(names, drawn[1:]))
            r = measure(gpu, me, others)
            co.append(CoSample(gpu=gpu, me=me, others=others, running_ms=r.running_ms, sched_ms=r.sched_ms, total_ms=r.total_ms))
    return solo, co


def emulated_measure(truth: InterferenceModel, *, noise: float, rng: np.random.Generator) -> Measure:
    """What a GPU would measure if ``truth`` were the GPU, with multiplicative Gaussian noise of
    relative size ``noise`` on every measured quantity."""

    def jitter(x: float) -> float:
        return float(x * max(0.5, 1.0 + noise * rng.standard_normal()))

    def measure(gpu: str, probe: Colocated, others: Sequence[Colocated]) -> Measurement:
        parts = truth.breakdown(gpu, probe, others)
        if others:
            return Measurement(running_ms=jitter(parts.running_ms), sched_ms=jitter(parts.sched_ms), total_ms=jitter(parts.total_ms))
        c = truth.coeff(probe.model, gpu)
        running, sched = jitter(parts.running_ms), jitter(parts.sched_ms)
        l2, memory = jitter(c.l2_utilisation(probe.share)), jitter(c.memory_mb(probe.batch))
        return Measurement(running_ms=running, sched_ms=sched, total_ms=jitter(parts.total_ms), l2_util=l2, memory_mb=memory)

    return measure


def emulate_profiling(
    truth: InterferenceModel,
    gpu: str,
    models: Sequence[str],
    *,
    shares: Sequence[float] = PAPER_SHARES,
    batches: Sequence[int] = PAPER_BATCHES,
    co_sets: int = 5,
    noise: float = 0.02,
    seed: int = 0,
) -> tuple[list[SoloSample], list[CoSample]]:
    """``collect_samples`` on the emulated GPU ``truth``: the seam that stands in for a GPU, and
    test data with known parameters."""
    rng = np.random.default_rng(seed)
    return collect_samples(
        emulated_measure(truth, noise=noise, rng=rng), gpu, models, shares=shares, batches=batches, co_sets=co_sets, rng=rng
    )


def model_info(model: InterferenceModel) -> dict[tuple[str, str], ModelInfo]:
    """The measured-once quantities of ``model`` (to fit emulated samples against)."""
    return {k: ModelInfo(c.kernels, c.input_bytes, c.output_bytes) for k, c in model.coefficients.items()}
