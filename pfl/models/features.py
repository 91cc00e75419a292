"""A model's representation: what its head receives (MOON's and FedProto's features, FedRoD's heads).

The head is the last layer unit (:func:`pfl.models.layer_groups`; ``model.head`` for your own model),
so the representation of an input is the input of the module that holds the head's parameters. It
is read with a forward pre-hook on that module during one ordinary forward pass (or
``torch.func.functional_call``, which runs the same hooks), so every model of the zoo and every
model a user brings has one without declaring anything, and the logits come from the same pass.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.func import functional_call

from .groups import layer_groups


def head_module_name(model: nn.Module) -> str:
    """The dotted name of the smallest submodule holding every head parameter (``fc`` for the zoo's
    MLP). A head spread over the model's top level has no module of its own: a ValueError."""
    heads = [name.split(".")[:-1] for name in layer_groups(model).head]
    common = heads[0]
    for parts in heads[1:]:
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    if not common:
        raise ValueError(f"{type(model).__name__}: the head's parameters {layer_groups(model).head} are not in "
                         "one submodule, so its input (the representation) cannot be read")
    return ".".join(common)


def head_relative(model: nn.Module, head: str) -> list[str]:
    """The head's parameter names relative to its module (``fc.weight`` → ``weight``)."""
    return [name[len(head) + 1:] for name in layer_groups(model).head]


def features_and_logits(model: nn.Module, head: str, params: Mapping[str, torch.Tensor],
                        x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(representation, output) of ``model`` with ``params`` on ``x``: the representation is the head
    module's input as it received it (``.flatten(1)`` gives one vector per sample)."""
    seen: list[torch.Tensor] = []

    def grab(module: nn.Module, args: tuple) -> None:
        seen.append(args[0])

    handle = model.get_submodule(head).register_forward_pre_hook(grab)
    try:
        out = functional_call(model, dict(params), (x,))
    finally:
        handle.remove()
    return seen[-1], out


def head_output(model: nn.Module, head: str, head_params: Mapping[str, torch.Tensor],
                z: torch.Tensor) -> torch.Tensor:
    """The head module applied to representations ``z`` with other parameters (names relative to the
    head module): FedRoD's personal head beside the generic one."""
    return functional_call(model.get_submodule(head), dict(head_params), (z,))


__all__ = ["features_and_logits", "head_module_name", "head_output", "head_relative"]
