"""torchvision builds of the published PPipe models that torchvision can express.

The estimator is checked against the measured tables of these models; the names are the ones used
in ``../shared/ppipe``. Weights are random (``weights=None``): latency does not depend on them.
"""

from __future__ import annotations

from typing import Callable

from torch import nn


def _wide_resnet101_2() -> nn.Module:
    from torchvision.models import wide_resnet101_2

    return wide_resnet101_2(weights=None)


def _inception_v3() -> nn.Module:
    from torchvision.models import inception_v3

    return inception_v3(weights=None, aux_logits=False, init_weights=False)


def _resnext152_32x4d() -> nn.Module:
    """mmpretrain's ResNeXt-152 32x4d: torchvision's ResNet with bottleneck counts [3, 8, 36, 3]."""
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [3, 8, 36, 3], groups=32, width_per_group=4)


def _repvgg_b3() -> nn.Module:
    """RepVGG-B3 in its deployed form (each block re-parameterised into one 3x3 conv + ReLU), as served."""
    widths, depths = (192, 384, 768, 2560), (4, 6, 16, 1)
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, stride=2, padding=1), nn.ReLU()]
    channels = 64
    for width, depth in zip(widths, depths):
        for i in range(depth):
            layers += [nn.Conv2d(channels, width, 3, stride=2 if i == 0 else 1, padding=1), nn.ReLU()]
            channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 1000)]
    return nn.Sequential(*layers)


REFERENCE_MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, int, int]]] = {
    "wide_resnet101_2": (_wide_resnet101_2, (3, 224, 224)),
    "googlenet-v3-pytorch": (_inception_v3, (3, 299, 299)),
    "resnext152-32x4d_8xb32_in1k": (_resnext152_32x4d, (3, 224, 224)),
    "repvgg-b3": (_repvgg_b3, (3, 224, 224)),
}


def build_reference_model(name: str) -> tuple[nn.Module, tuple[int, int, int]]:
    """The module (eval mode) and its per-sample input shape for a PPipe model name."""
    if name not in REFERENCE_MODELS:
        raise KeyError(f"no torchvision build for {name!r}; known: {', '.join(REFERENCE_MODELS)}")
    build, shape = REFERENCE_MODELS[name]
    return build().eval(), shape
