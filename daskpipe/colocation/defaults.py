"""Default parameter sets for emulating InSS's testbed without a GPU, and how they were derived.

The paper publishes no coefficient tables, only measurements, so we calibrate the model to them
with our own fitting code (``fit_running``), once, on import of this module's ``inss_testbed()``:

* GPUs: RTX 2060 Super (34 SMs, 8000 MB) and RTX 2060 (30 SMs, 6000 MB), InSS §6.1. PCIe 3.0 x16 at
  an effective 11 GB/s (our assumption; the paper measures it but prints no number).
* Anchors (total batch latency, ms, RTX 2060 Super assumed): Table 2 (ResNet50 alone, AlexNet with
  ResNet50, VGG16 with both; 30% shares, batch 1..16), Table 3 (MnasNet alone, ResNet18 with MnasNet,
  VGG19 with both, EfficientNet next to MobileNet; batch 4, shares 6..60%) and the whole-GPU batch-1
  throughputs ``H_i`` of InSS's released code (AlexNet 788.6, ResNet50 215.9, VGG16 146.9, MnasNet
  443.5, MobileNet 306.5, EfficientNet 217.3 req/s).
* A measurement taken next to co-runners is turned into a solo one by inverting the interference
  terms below; a dimension a model has no measurements along (share or batch) is filled with the
  relative curve of a similar model ("template": heavy CNNs follow ResNet50/ResNet18, light ones
  AlexNet/MnasNet); MobileNet and EfficientNet are MnasNet's curve scaled to their anchors.
* Interference: ``α_cache = 0.24`` for every model, so that ResNet50 at 40% next to AlexNet and
  VGG16 at 60% is 18.7% slower, the paper's largest observed slowdown (§2.2); L2 utilisation lines
  and kernel counts are typical of these torchvision models (our estimates, listed in ``_MODELS``);
  per-kernel scheduling 5 µs solo plus 1.5 µs per co-located model (Fig. 10 has no numbers).
* Memory: fp32 weights + 300 MB context + a per-sample activation estimate.

``docs/colocation.md`` prints the resulting table (``daskpipe bench colocation`` recomputes it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from daskpipe.colocation.fit import fit_running
from daskpipe.colocation.latency import Colocated, GpuSpec, InterferenceModel, ModelCoefficients

RTX2060S = GpuSpec("RTX2060S", sm_count=34, memory_mb=8000, pcie_gb_per_s=11.0, sched_alpha_us=1.5, sched_beta_us=0.0)
RTX2060 = GpuSpec("RTX2060", sm_count=30, memory_mb=6000, pcie_gb_per_s=11.0, sched_alpha_us=1.5, sched_beta_us=0.0)
ANCHOR_GPU = RTX2060S

IMAGE_BYTES = 3 * 224 * 224 * 4  # fp32 ImageNet input
LOGITS_BYTES = 1000 * 4
CACHE_SENSITIVITY = 0.24
SOLO_SCHED_US = 5.0
CONTEXT_MB = 300.0


@dataclass(frozen=True)
class _ModelFacts:
    kernels: int
    l2_alpha: float
    l2_beta: float
    params_m: float  # millions of fp32 parameters
    activation_mb: float  # per sample


_MODELS: dict[str, _ModelFacts] = {
    "alexnet": _ModelFacts(kernels=22, l2_alpha=0.30, l2_beta=0.10, params_m=61.1, activation_mb=6),
    "resnet50": _ModelFacts(kernels=160, l2_alpha=0.35, l2_beta=0.15, params_m=25.6, activation_mb=30),
    "vgg16": _ModelFacts(kernels=40, l2_alpha=0.50, l2_beta=0.20, params_m=138.4, activation_mb=60),
    "mnasnet": _ModelFacts(kernels=150, l2_alpha=0.25, l2_beta=0.10, params_m=4.4, activation_mb=20),
    "mobilenet": _ModelFacts(kernels=170, l2_alpha=0.25, l2_beta=0.10, params_m=5.5, activation_mb=16),
    "efficientnet": _ModelFacts(kernels=250, l2_alpha=0.30, l2_beta=0.10, params_m=5.3, activation_mb=30),
    "resnet18": _ModelFacts(kernels=60, l2_alpha=0.30, l2_beta=0.12, params_m=11.7, activation_mb=12),
    "vgg19": _ModelFacts(kernels=48, l2_alpha=0.50, l2_beta=0.20, params_m=143.7, activation_mb=65),
}

# InSS's eight models in the paper's order, with their SLOs (ms, §6.1).
INSS_SLO_MS: dict[str, float] = {
    "alexnet": 25,
    "resnet50": 80,
    "vgg16": 150,
    "mnasnet": 50,
    "mobilenet": 60,
    "efficientnet": 40,
    "resnet18": 60,
    "vgg19": 200,
}
# Evaluation start rates (req/s) of InSS's released simulator for its six models; ResNet18 and
# VGG19 are not given there: we use ResNet50's and VGG16's minus a quarter (our choice).
INSS_RATES: dict[str, float] = {
    "alexnet": 200,
    "resnet50": 150,
    "vgg16": 80,
    "mnasnet": 200,
    "mobilenet": 250,
    "efficientnet": 250,
    "resnet18": 110,
    "vgg19": 60,
}
# The whole-GPU batch-1 throughput H_i (req/s) of InSS's code; it also normalises the RL reward.
INSS_H: dict[str, float] = {
    "alexnet": 788.6,
    "resnet50": 215.9,
    "vgg16": 146.9,
    "mnasnet": 443.5,
    "mobilenet": 306.5,
    "efficientnet": 217.3,
}


@dataclass(frozen=True)
class Anchor:
    """A published total latency of ``model`` at (batch, share) with ``others`` running beside it."""

    batch: int
    share: float
    total_ms: float
    others: tuple[Colocated, ...] = ()


def _at(share: float, *names: str) -> tuple[Colocated, ...]:
    return tuple(Colocated(n, share, 4) for n in names)


_TABLE2_BATCHES = (1, 4, 8, 16)
_TABLE3_SHARES = (0.06, 0.24, 0.42, 0.60)
ANCHORS: dict[str, tuple[Anchor, ...]] = {
    "resnet50": tuple(Anchor(b, 0.3, ms) for b, ms in zip(_TABLE2_BATCHES, (8.690, 23.285, 43.422, 71.456))),
    "alexnet": tuple(Anchor(b, 0.3, ms, _at(0.3, "resnet50")) for b, ms in zip(_TABLE2_BATCHES, (2.848, 5.674, 8.898, 10.191))),
    "vgg16": tuple(
        Anchor(b, 0.3, ms, _at(0.3, "alexnet", "resnet50")) for b, ms in zip(_TABLE2_BATCHES, (18.196, 62.009, 120.382, 176.308))
    ),
    "mnasnet": tuple(Anchor(4, s, ms) for s, ms in zip(_TABLE3_SHARES, (13.686, 4.241, 3.468, 3.409))),
    "resnet18": tuple(Anchor(4, s, ms, _at(0.18, "mnasnet")) for s, ms in zip(_TABLE3_SHARES, (43.016, 11.446, 7.422, 5.483))),
    "vgg19": tuple(Anchor(4, s, ms, _at(0.18, "resnet18", "mnasnet")) for s, ms in zip(_TABLE3_SHARES, (358.270, 91.690, 53.947, 39.411))),
    "efficientnet": (Anchor(4, 0.18, 15.515, (Colocated("mobilenet", 0.06, 4),)),),
    "mobilenet": (),
}
for _name, _h in INSS_H.items():
    ANCHORS[_name] = ANCHORS[_name] + (Anchor(1, 1.0, 1000.0 / _h),)

# Which model's relative curve fills the dimension a model lacks: (source, "batch" or "share").
# Calibrated in this order, so each source is known before it is used.
TEMPLATES: tuple[tuple[str, str, str], ...] = (
    ("resnet18", "resnet50", "batch"),
    ("resnet50", "resnet18", "share"),
    ("mnasnet", "alexnet", "batch"),
    ("alexnet", "mnasnet", "share"),
    ("vgg16", "resnet18", "share"),
    ("vgg19", "resnet50", "batch"),
    ("mobilenet", "mnasnet", "scale"),
    ("efficientnet", "mnasnet", "scale"),
)
_GRID_BATCHES = (1, 2, 4, 8, 16, 32)
_GRID_SHARES = (0.06, 0.12, 0.24, 0.42, 0.6, 0.8, 1.0)


def _base_coefficients(model: str, gpu: GpuSpec, running: tuple[float, float, float, float, float]) -> ModelCoefficients:
    facts = _MODELS[model]
    return ModelCoefficients(
        model=model,
        gpu=gpu.name,
        kernels=facts.kernels,
        sched_us_per_kernel=SOLO_SCHED_US,
        running=running,
        l2_alpha=facts.l2_alpha,
        l2_beta=facts.l2_beta,
        cache_sensitivity=CACHE_SENSITIVITY,
        input_bytes=IMAGE_BYTES,
        output_bytes=LOGITS_BYTES,
        mem_base_mb=CONTEXT_MB + facts.params_m * 4.0,
        mem_per_sample_mb=facts.activation_mb,
    )


def _solo_running_ms(model: InterferenceModel, name: str, anchor: Anchor) -> float:
    """Invert the interference terms: the running time ``name`` would have had alone."""
    gpu = ANCHOR_GPU.name
    me = Colocated(name, anchor.share, anchor.batch)
    parts = model.breakdown(gpu, me, anchor.others)
    overhead = parts.upload_ms + parts.download_ms + parts.sched_ms
    solo_running = model.breakdown(gpu, me, anchor.others, interference=False).running_ms
    inflation = parts.running_ms / solo_running  # 1 + α_cache·Σ l_j
    return (anchor.total_ms - overhead) / inflation


def _raw_batch_ratio(source: str) -> dict[int, float]:
    """Relative latency along the batch of a source's own anchors at share 0.3 (before any fit)."""
    rows = [a for a in ANCHORS[source] if a.share == 0.3]
    ref = next(a for a in rows if a.batch == 4)
    return {a.batch: a.total_ms / ref.total_ms for a in rows}


@lru_cache(maxsize=1)
def inss_testbed() -> InterferenceModel:
    """The emulated InSS testbed: eight models on RTX 2060 Super and RTX 2060 (see module doc)."""
    placeholder = (0.0, 0.0, 1.0, 0.0, 0.0)
    coefficients = {(m, ANCHOR_GPU.name): _base_coefficients(m, ANCHOR_GPU, placeholder) for m in _MODELS}
    model = InterferenceModel(gpus={ANCHOR_GPU.name: ANCHOR_GPU}, coefficients=coefficients)
    calibrated: set[str] = set()
    for name, source, kind in TEMPLATES:
        points = [(a.batch, a.share, _solo_running_ms(model, name, a)) for a in ANCHORS[name]]
        if kind == "scale":
            src = model.coeff(source, ANCHOR_GPU.name)
            ratio = np.exp(np.mean([np.log(ms / src.solo_running_ms(b, s * ANCHOR_GPU.sm_count)) for b, s, ms in points]))
            k1, k2, k3, k4, k5 = src.running
            running = (k1 * ratio, k2 * ratio, k3 * ratio, k4, k5 * ratio)
        else:
            points += _templated(model, name, source, kind, points, calibrated)
            b, s, ms = zip(*points)
            running = fit_running(b, [x * ANCHOR_GPU.sm_count for x in s], ms)
        coefficients[(name, ANCHOR_GPU.name)] = replace(coefficients[(name, ANCHOR_GPU.name)], running=running)
        model = InterferenceModel(gpus={ANCHOR_GPU.name: ANCHOR_GPU}, coefficients=dict(coefficients))
        calibrated.add(name)
    # Running coefficients take absolute SMs, so they carry over to the 30-SM RTX 2060 (InSS §4.1).
    for (name, _), c in list(coefficients.items()):
        coefficients[(name, RTX2060.name)] = replace(c, gpu=RTX2060.name)
    return InterferenceModel(
        gpus={RTX2060S.name: RTX2060S, RTX2060.name: RTX2060},
        coefficients=coefficients,
        name="inss-testbed",
        notes={"source": "calibrated to InSS Tables 2-3 and H_i; see daskpipe/colocation/defaults.py"},
    )


def _templated(
    model: InterferenceModel, name: str, source: str, along: str, points: list[tuple[int, float, float]], calibrated: set[str]
) -> list[tuple[int, float, float]]:
    """Extra points for ``name`` along ``along``: its measured level times ``source``'s relative
    curve, the fitted one if ``source`` is already calibrated, else its raw anchors."""
    src = model.coeff(source, ANCHOR_GPU.name) if source in calibrated else None
    sms = ANCHOR_GPU.sm_count
    extra = []
    if along == "batch":  # name has a share sweep at batch 4: add batches at each of its shares
        raw = _raw_batch_ratio(source)
        for _, s, ms in [p for p in points if p[0] == 4]:
            for b in _GRID_BATCHES if src else sorted(raw):
                factor = src.solo_running_ms(b, s * sms) / src.solo_running_ms(4, s * sms) if src else raw[b]
                if b != 4:
                    extra.append((b, s, ms * factor))
    else:  # name has a batch sweep at one share: add shares at batch 1 and 4
        if src is None:
            raise ValueError(f"share template {source!r} for {name!r} must be calibrated first; reorder TEMPLATES")
        for b0, s0, ms in [p for p in points if p[0] in (1, 4) and p[1] < 1.0]:
            extra += [(b0, s, ms * src.solo_running_ms(b0, s * sms) / src.solo_running_ms(b0, s0 * sms)) for s in _GRID_SHARES if s != s0]
    return extra


def inss_gpus() -> list[tuple[str, str]]:
    """InSS's four GPUs as (uid, type): two RTX 2060 Super in one server, one RTX 2060 in two."""
    return [("s0/gpu0", RTX2060S.name), ("s0/gpu1", RTX2060S.name), ("s1/gpu0", RTX2060.name), ("s2/gpu0", RTX2060.name)]
