"""Building blocks shared by the deeper models (ResNet, VGG)."""

from __future__ import annotations

import math

from torch import nn


def channels(base: int, width: float) -> int:
    """A layer's channel count under a width multiplier (at least one channel)."""
    return max(1, int(round(base * width)))


def group_norm(groups: int, num_channels: int) -> nn.GroupNorm:
    """GroupNorm whose group count divides ``num_channels``: ``gcd(groups, num_channels)`` groups.

    GroupNorm stands in for BatchNorm everywhere in the zoo: it keeps no running statistics, so a
    model's whole state is its parameters. Taking the gcd lets any width multiplier work.
    """
    return nn.GroupNorm(math.gcd(groups, num_channels), num_channels)
