"""InSS's interference-aware latency model (§4) for models sharing one GPU through MPS.

The execution latency of one batch of model ``i`` on GPU ``k`` is

    t_inf = t_up + t_sched + t_run + t_down
    t_up, t_down = bytes · b / B_k                                  (PCIe in / out)
    t_sched = (o_sch + int_k) · n_kernels,  int_k = α_s·N + β_s if N > 1 else 0
    t_run = o_run(b, ρ·C_k) · (1 + α_cache · Σ_{co-runners j} l_j),  l_j = α_u·ρ_j + β_u

with ``N`` the number of models on the GPU and ``o_run`` the solo running time, for which we use the
rational form of InSS's released code, ``(k1·b² + k2·b + k3) / (SMs + k4) + k5`` (the paper's LWR
needs its training points at prediction time; the rational form is five numbers per model and GPU).
The task latency adds the wait for the batch to fill (§4.2). Everything is in milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Mapping, Sequence


class ColocationError(ValueError):
    """Bad input to the co-location model or a policy; the message names the value and the fix."""


@dataclass(frozen=True)
class GpuSpec:
    """What the latency model needs of one GPU type; ``sched_alpha_us``/``sched_beta_us`` are InSS's
    ``α_s``/``β_s``: extra per-kernel scheduling delay (µs) per co-located model, and its offset."""

    name: str
    sm_count: int
    memory_mb: float
    pcie_gb_per_s: float
    sched_alpha_us: float = 0.0
    sched_beta_us: float = 0.0

    def __post_init__(self) -> None:
        if self.sm_count < 1 or self.memory_mb <= 0 or self.pcie_gb_per_s <= 0:
            raise ColocationError(f"GPU {self.name!r}: sm_count, memory_mb and pcie_gb_per_s must be positive, got {self}")

    def share_units(self, sms_per_unit: int = 2) -> int:
        """InSS allocates SMs in units of about two SMs (17 units on 34 SMs, 15 on 30)."""
        return max(1, self.sm_count // sms_per_unit)


@dataclass(frozen=True)
class ModelCoefficients:
    """The fitted parameters of one model on one GPU type (InSS §4.1 and Table of §5 in the digest)."""

    model: str
    gpu: str
    kernels: int  # n_ik: kernels per batch
    sched_us_per_kernel: float  # o_sch: solo per-kernel scheduling gap
    running: tuple[float, float, float, float, float]  # k1..k5 of the solo running time (ms, SMs)
    l2_alpha: float  # l = l2_alpha·ρ + l2_beta: solo L2 utilisation (fraction of peak) at share ρ
    l2_beta: float
    cache_sensitivity: float  # α_cache: running-time inflation per unit of co-runner L2 utilisation
    input_bytes: float  # per sample, host -> GPU
    output_bytes: float  # per sample, GPU -> host
    mem_base_mb: float  # weights, context and workspace
    mem_per_sample_mb: float  # activations per sample

    def __post_init__(self) -> None:
        if self.kernels < 1:
            raise ColocationError(f"{self.model}@{self.gpu}: kernels must be >= 1, got {self.kernels}")
        if len(self.running) != 5 or not all(math.isfinite(k) for k in self.running):
            raise ColocationError(f"{self.model}@{self.gpu}: running must be five finite numbers k1..k5, got {self.running}")
        for name in ("sched_us_per_kernel", "cache_sensitivity", "input_bytes", "output_bytes", "mem_base_mb", "mem_per_sample_mb"):
            if getattr(self, name) < 0:
                raise ColocationError(f"{self.model}@{self.gpu}: {name} must be >= 0, got {getattr(self, name)}")

    def solo_running_ms(self, batch: int, sms: float) -> float:
        """Infinite where ``sms + k4 <= 0``: a fit with ``k4 < 0`` says so few SMs cannot run it
        (extrapolating the curve there would give negative times)."""
        k1, k2, k3, k4, k5 = self.running
        if sms + k4 <= 0:
            return math.inf
        return (k1 * batch * batch + k2 * batch + k3) / (sms + k4) + k5

    def l2_utilisation(self, share: float) -> float:
        return max(0.0, self.l2_alpha * share + self.l2_beta)

    def memory_mb(self, batch: int) -> float:
        return self.mem_base_mb + self.mem_per_sample_mb * batch


@dataclass(frozen=True)
class Colocated:
    """One process on a GPU: ``model`` with an MPS share ``share`` (fraction of SMs) at ``batch``."""

    model: str
    share: float
    batch: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ColocationError(f"MPS share of {self.model!r} must be in (0, 1], got {self.share}")
        if self.batch < 1:
            raise ColocationError(f"batch of {self.model!r} must be >= 1, got {self.batch}")


@dataclass(frozen=True)
class LatencyBreakdown:
    upload_ms: float
    sched_ms: float
    running_ms: float
    download_ms: float

    @property
    def total_ms(self) -> float:
        return self.upload_ms + self.sched_ms + self.running_ms + self.download_ms


@dataclass
class InterferenceModel:
    """GPU specs plus per-(model, GPU type) coefficients; predicts co-located batch latencies."""

    gpus: Mapping[str, GpuSpec]
    coefficients: Mapping[tuple[str, str], ModelCoefficients]
    name: str = "custom"
    notes: Mapping[str, str] = field(default_factory=dict)
    max_batch: int = 32  # the largest batch the coefficients hold for: policies never plan beyond it

    def coeff(self, model: str, gpu: str) -> ModelCoefficients:
        try:
            return self.coefficients[(model, gpu)]
        except KeyError:
            have = sorted({m for m, g in self.coefficients if g == gpu})
            raise ColocationError(f"no interference coefficients for model {model!r} on GPU {gpu!r} (have for {gpu!r}: {have})") from None

    def gpu(self, name: str) -> GpuSpec:
        try:
            return self.gpus[name]
        except KeyError:
            raise ColocationError(f"unknown GPU type {name!r} (known: {sorted(self.gpus)})") from None

    @property
    def models(self) -> list[str]:
        return sorted({m for m, _ in self.coefficients})

    def breakdown(self, gpu: str, me: Colocated, others: Sequence[Colocated] = (), *, interference: bool = True) -> LatencyBreakdown:
        """Execution latency of one batch of ``me`` while ``others`` share the GPU.

        MPS lets shares over-subscribe the GPU; then every process is scaled down by the sum, as
        the SMs are time-shared. ``interference=False`` gives the solo prediction at the same share
        (what interference-unaware policies believe).
        """
        spec = self.gpu(gpu)
        c = self.coeff(me.model, gpu)
        bytes_per_ms = spec.pcie_gb_per_s * 1e6
        total_share = me.share + sum(o.share for o in others)
        sms = me.share * spec.sm_count / max(1.0, total_share)
        running = c.solo_running_ms(me.batch, sms)
        sched_us = c.sched_us_per_kernel
        if interference and others:
            corunner_l2 = sum(self.coeff(o.model, gpu).l2_utilisation(o.share) for o in others)
            running *= 1.0 + c.cache_sensitivity * corunner_l2
            sched_us += spec.sched_alpha_us * (len(others) + 1) + spec.sched_beta_us
        return LatencyBreakdown(
            upload_ms=c.input_bytes * me.batch / bytes_per_ms,
            sched_ms=sched_us * c.kernels / 1000.0,
            running_ms=running,
            download_ms=c.output_bytes * me.batch / bytes_per_ms,
        )

    def exec_ms(self, gpu: str, me: Colocated, others: Sequence[Colocated] = (), *, interference: bool = True) -> float:
        return self.breakdown(gpu, me, others, interference=interference).total_ms

    def memory_mb(self, model: str, gpu: str, batch: int) -> float:
        return self.coeff(model, gpu).memory_mb(batch)

    # -- (de)serialisation: a plan carries the model its co-located stages are executed with ----
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "gpus": [asdict(g) for g in self.gpus.values()],
            "coefficients": [{**asdict(c), "running": list(c.running)} for c in self.coefficients.values()],
            "notes": dict(self.notes),
            "max_batch": self.max_batch,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<memory>") -> InterferenceModel:
        """The inverse of ``to_dict``; a missing or malformed field is named in the error."""

        def build(kind: type, raw: Any, where: str) -> Any:
            if not isinstance(raw, Mapping):
                raise ColocationError(f"{source}: {where} must be an object, got {raw!r:.60}")
            names = [f.name for f in fields(kind)]
            required = [f.name for f in fields(kind) if f.default is MISSING]
            absent = [n for n in required if n not in raw]
            if absent:
                raise ColocationError(f"{source}: {where} lacks field(s) {absent}")
            try:
                values = {n: raw[n] for n in names if n in raw}
                if "running" in values:
                    values["running"] = tuple(float(k) for k in values["running"])
                return kind(**values)
            except (TypeError, ValueError) as exc:
                raise ColocationError(f"{source}: {where} is malformed: {exc}") from None

        if not isinstance(data, Mapping):
            raise ColocationError(f"{source}: an interference model must be an object, got {type(data).__name__}")
        gpus = [build(GpuSpec, g, f"gpus[{i}]") for i, g in enumerate(data.get("gpus", []))]
        coefficients = [build(ModelCoefficients, c, f"coefficients[{i}]") for i, c in enumerate(data.get("coefficients", []))]
        if not gpus or not coefficients:
            raise ColocationError(f"{source}: an interference model needs non-empty 'gpus' and 'coefficients'")
        return cls(
            gpus={g.name: g for g in gpus},
            coefficients={(c.model, c.gpu): c for c in coefficients},
            name=str(data.get("name", "custom")),
            notes={str(k): str(v) for k, v in dict(data.get("notes", {})).items()},
            max_batch=int(data.get("max_batch", 32)),
        )


def worst_task_latency_ms(exec_ms: float, batch: int, rate_per_s: float, queued: int = 0) -> float:
    """InSS's task latency (§4.2, in the per-batch form of its released code) for the worst task.

    Tasks arrive evenly at ``rate_per_s``; ``queued`` are already waiting. Batches of ``batch`` start
    when full and the previous one is done; the first task of each batch waits longest. We follow
    the next ``ceil((queued + 1) / batch) + 1`` batches, enough to include a batch formed only of
    new arrivals, which is the steady-state case.
    """
    if rate_per_s <= 0:
        return exec_ms
    gap_ms = 1000.0 / rate_per_s
    worst = 0.0
    prev_end = 0.0

    def arrival(task: int) -> float:  # tasks are numbered with the queued ones first, at t = 0
        return (task - queued + 1) * gap_ms if task >= queued else 0.0

    for j in range(math.ceil((queued + 1) / batch) + 1):
        end = max(arrival((j + 1) * batch - 1), prev_end) + exec_ms
        worst = max(worst, end - arrival(j * batch))
        prev_end = end
    return worst
