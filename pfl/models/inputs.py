"""Interpreting a data source's ``input_shape`` for a model.

Sources describe one sample's shape: ``(d,)`` for feature vectors, ``(C, H, W)`` for images. Vector
models flatten whatever they get; image models need (C, H, W) and accept a flat ``(d,)`` input when
``d`` is a perfect square, read as a one-channel √d×√d image (scikit-learn's digits are stored as
64 flat pixels of an 8×8 image).
"""

from __future__ import annotations

import math
from typing import Sequence

from ..schema import ConfigError


def check_input_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"input_shape must be a non-empty tuple of positive sizes, got {input_shape!r}")
    return shape


def vector_dim(input_shape: Sequence[int]) -> int:
    """Number of features a flattening model sees."""
    return math.prod(check_input_shape(input_shape))


def image_shape(model_name: str, input_shape: Sequence[int]) -> tuple[int, int, int]:
    """(C, H, W) for an image model, or a ConfigError naming ``model.name`` when there is none."""
    shape = check_input_shape(input_shape)
    if len(shape) == 3:
        return shape  # type: ignore[return-value]
    if len(shape) == 2:
        return (1, shape[0], shape[1])
    if len(shape) == 1:
        side = math.isqrt(shape[0])
        if side * side == shape[0]:
            return (1, side, side)
    raise ConfigError("model.name", f"{model_name} needs image inputs: (C, H, W), (H, W) or a flat (d,) "
                                    f"with d a perfect square; the data has input shape {shape}")


def conv_out(size: int, kernel: int, padding: int) -> int:
    """Spatial size after a stride-1 convolution."""
    return size + 2 * padding - kernel + 1

