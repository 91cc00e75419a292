"""FedSLR's CIFAR ResNet-18 with GroupNorm (fedslr.md §5), and the same network with BatchNorm.

A 3×3 stride-1 stem (no max-pool, so 32×32 inputs keep their resolution), four stages of two
BasicBlocks (64, 128, 256, 512 channels; strides 1, 2, 2, 2), a 1×1 strided conv + GroupNorm
shortcut where the shape changes, global average pooling and a bias-free Linear(512 → C). GroupNorm
replaces BatchNorm so the model has no running statistics: a client's whole state is its
parameters. Conv layers have no bias (the norm that follows would cancel it). 11,220,032 parameters
for C=100 and 11,173,952 for C=10 on 3×32×32 inputs.

``resnet18_bn`` is that network with BatchNorm in place of every GroupNorm (torchvision's layer names
``bn1``, ``bn2``; the CIFAR stem): the model most image FL papers train, and what FedBN keeps local.
Its running statistics are state (:mod:`pfl.models.functional`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..schema import hp
from .groups import params_under
from .inputs import image_shape
from .layers import channels, group_norm

STAGE_CHANNELS = (64, 128, 256, 512)
STAGE_STRIDES = (1, 2, 2, 2)


@dataclass
class ResNet18GNParams:
    gn_groups: int = hp(2, "GroupNorm groups (FedSLR's reference uses 2); a layer whose channel count it "
                           "does not divide uses the greatest common divisor instead", low=1)
    width: float = hp(1.0, "channel multiplier for all stages (1.0 = 64/128/256/512; small values "
                           "make CPU tests and runs cheap)", low=0.0, low_open=True)


@dataclass
class ResNet18BNParams:
    width: float = hp(1.0, "channel multiplier for all stages (1.0 = 64/128/256/512; small values "
                           "make CPU tests and runs cheap)", low=0.0, low_open=True)


def _norm(groups: int, ch: int) -> nn.Module:
    """GroupNorm(groups), or BatchNorm for ``groups`` = 0 (the BN variant)."""
    return nn.BatchNorm2d(ch) if groups == 0 else group_norm(groups, ch)


class BasicBlock(nn.Module):
    """Two 3×3 convs with GroupNorm (``gn1``, ``gn2``) or, with ``groups`` = 0, BatchNorm (``bn1``,
    ``bn2``), and an identity or 1×1-conv shortcut."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, groups: int):
        super().__init__()
        self.norm = "bn" if groups == 0 else "gn"
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.add_module(f"{self.norm}1", _norm(groups, out_ch))
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.add_module(f"{self.norm}2", _norm(groups, out_ch))
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                          _norm(groups, out_ch))
        else:
            self.shortcut = nn.Sequential()  # identity, no parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(getattr(self, f"{self.norm}1")(self.conv1(x)))
        out = getattr(self, f"{self.norm}2")(self.conv2(out))
        # Out-of-place add and ReLU: in-place ops on a tensor autograd needs break functional transforms.
        return F.relu(out + self.shortcut(x))


class ResNet18GN(nn.Module):
    """CIFAR-style ResNet-18 with GroupNorm (``gn_groups`` = 0: BatchNorm, the stem's norm named
    ``bn1``). Units: stem (conv1 + its norm), layer1 … layer4, fc."""

    def __init__(self, image: tuple[int, int, int], num_classes: int, gn_groups: int = 2, width: float = 1.0):
        super().__init__()
        self.image_shape = image
        self.norm = "bn" if gn_groups == 0 else "gn"
        widths = [channels(c, width) for c in STAGE_CHANNELS]
        self.conv1 = nn.Conv2d(image[0], widths[0], 3, stride=1, padding=1, bias=False)
        self.add_module(f"{self.norm}1", _norm(gn_groups, widths[0]))
        in_ch = widths[0]
        for i, (out_ch, stride) in enumerate(zip(widths, STAGE_STRIDES), start=1):
            blocks = nn.Sequential(BasicBlock(in_ch, out_ch, stride, gn_groups),
                                   BasicBlock(out_ch, out_ch, 1, gn_groups))
            self.add_module(f"layer{i}", blocks)
            in_ch = out_ch
        self.fc = nn.Linear(in_ch, num_classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.image_shape)
        x = F.relu(getattr(self, f"{self.norm}1")(self.conv1(x)))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        # Adaptive pooling equals the reference's 4×4 average pool on 32×32 inputs and also accepts
        # other sizes (28×28, 8×8).
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)

    def layer_units(self) -> list[list[str]]:
        stem = params_under(self, ["conv1", f"{self.norm}1"])
        return [stem, *(params_under(self, [f"layer{i}"]) for i in range(1, 5)), params_under(self, ["fc"])]


def build_resnet18_gn(params: ResNet18GNParams, input_shape, num_classes: int) -> nn.Module:
    return ResNet18GN(image_shape("resnet18_gn", input_shape), num_classes, params.gn_groups, params.width)


def build_resnet18_bn(params: ResNet18BNParams, input_shape, num_classes: int) -> nn.Module:
    return ResNet18GN(image_shape("resnet18_bn", input_shape), num_classes, 0, params.width)


__all__ = ["ResNet18GN", "ResNet18GNParams", "ResNet18BNParams", "BasicBlock", "build_resnet18_bn",
           "build_resnet18_gn"]
