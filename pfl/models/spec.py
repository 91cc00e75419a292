"""What a registered model is: its name, description, parameter dataclass and builder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: its name, a one-line description, its params dataclass and its builder.

    ``build(params, input_shape, num_classes)`` receives a validated instance of ``params``.
    ``inputs`` says which sample shapes it accepts (for the CLI listing).
    """
    name: str
    description: str
    params: type
    build: Callable[[Any, tuple[int, ...], int], nn.Module]
    inputs: str


__all__ = ["ModelSpec"]
