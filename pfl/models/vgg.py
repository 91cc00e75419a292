"""CIFAR-style VGG-11 / VGG-13 for PerFed-CKT's heterogeneous clients (perfed_ckt.md §6).

3×3 convs (padding 1) each followed by a norm and ReLU, 2×2 max-pools between stages, then one
Linear(512 → C) head. The papers' VGGs use BatchNorm; here it is GroupNorm, so the model has no
running statistics and every client's state is its parameters (same parameter count as the BN
version: 9,231,114 for VGG-11 and 9,416,010 for VGG-13 at C=10). Conv biases are kept, as in the
CIFAR VGGs these counts come from.

Pools use ceil mode and the features are average-pooled to 1×1 before the head: on 32×32 inputs
this is exactly the usual network (every map size is even and the last map is already 1×1), and
28×28 or 8×8 inputs, which five floor-mode pools would shrink to nothing, also work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..schema import hp
from .inputs import image_shape
from .layers import channels, group_norm

POOL = "M"
CONFIGS: dict[str, list[int | str]] = {
    "vgg11": [64, POOL, 128, POOL, 256, 256, POOL, 512, 512, POOL, 512, 512, POOL],
    "vgg13": [64, 64, POOL, 128, 128, POOL, 256, 256, POOL, 512, 512, POOL, 512, 512, POOL],
}


@dataclass
class VGGParams:
    width: float = hp(1.0, "channel multiplier for every conv (1.0 = 64 … 512; e.g. 0.125 for fast "
                           "CPU runs)", low=0.0, low_open=True)
    gn_groups: int = hp(2, "GroupNorm groups after each conv (replacing the papers' BatchNorm); a layer "
                           "whose channel count it does not divide uses the greatest common divisor",
                        low=1)


class VGG(nn.Module):
    """Conv layers conv1 … convK (each with norm1 … normK), then the head fc. One unit per conv+norm."""

    def __init__(self, image: tuple[int, int, int], layout: Sequence[int | str], num_classes: int,
                 width: float = 1.0, gn_groups: int = 2):
        super().__init__()
        self.image_shape = image
        self.plan: list[int | str] = []  # conv index or POOL, in forward order
        in_ch = image[0]
        k = 0
        for item in layout:
            if item == POOL:
                self.plan.append(POOL)
                continue
            k += 1
            out_ch = channels(int(item), width)
            self.add_module(f"conv{k}", nn.Conv2d(in_ch, out_ch, 3, padding=1))
            self.add_module(f"norm{k}", group_norm(gn_groups, out_ch))
            self.plan.append(k)
            in_ch = out_ch
        self.num_convs = k
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.image_shape)
        for step in self.plan:
            if step == POOL:
                x = F.max_pool2d(x, 2, ceil_mode=True)
            else:
                x = F.relu(getattr(self, f"norm{step}")(getattr(self, f"conv{step}")(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)

    def layer_units(self) -> list[list[str]]:
        units = []
        for k in range(1, self.num_convs + 1):
            units.append([f"conv{k}.weight", f"conv{k}.bias", f"norm{k}.weight", f"norm{k}.bias"])
        units.append(["fc.weight", "fc.bias"])
        return units


def _builder(name: str):
    def build(params: VGGParams, input_shape, num_classes: int) -> nn.Module:
        return VGG(image_shape(name, input_shape), CONFIGS[name], num_classes, params.width, params.gn_groups)
    build.__name__ = f"build_{name}"
    return build


build_vgg11 = _builder("vgg11")
build_vgg13 = _builder("vgg13")

__all__ = ["VGG", "VGGParams", "CONFIGS", "build_vgg11", "build_vgg13"]
