"""Parameters as plain tensors: the engine's view of a model.

One module object is shared by many clients; each client's state is a ``{name: tensor}`` dict that
is run through ``torch.func.functional_call``. These helpers take that dict out of a module, turn it
into one flat vector and back (server-side math such as FPFC's pairwise updates works on stacked
vectors), and draw a fresh, reproducible initialisation from a seeded generator.
"""

from __future__ import annotations

import copy
import math
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from .groups import NORM_TYPES

Params = dict[str, torch.Tensor]

_CONV_LINEAR = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def params_of(model: nn.Module) -> Params:
    """Detached copies of ``model``'s parameters, in ``named_parameters()`` order."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def num_params(model_or_params: nn.Module | Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> int:
    """Number of scalar parameters of a module, a name→tensor dict or an iterable of tensors."""
    if isinstance(model_or_params, nn.Module):
        tensors: Iterable[torch.Tensor] = model_or_params.parameters()
    elif isinstance(model_or_params, Mapping):
        tensors = model_or_params.values()
    else:
        tensors = model_or_params
    return sum(t.numel() for t in tensors)


def flatten_params(params: Mapping[str, torch.Tensor], names: Sequence[str] | None = None) -> torch.Tensor:
    """Concatenate the tensors ``names`` (default: all, in dict order) into one 1-D tensor."""
    names = list(params) if names is None else list(names)
    if not names:
        any_t = next(iter(params.values()), None)
        return torch.zeros(0) if any_t is None else any_t.new_zeros(0)
    return torch.cat([params[n].reshape(-1) for n in names])


def unflatten_params(vec: torch.Tensor, like: Mapping[str, torch.Tensor],
                     names: Sequence[str] | None = None) -> Params:
    """Inverse of :func:`flatten_params`: split ``vec`` into tensors shaped as ``like[name]``.

    The results are views of ``vec`` (no copy, gradients flow back to ``vec``).
    """
    names = list(like) if names is None else list(names)
    sizes = [like[n].numel() for n in names]
    if vec.dim() != 1 or vec.numel() != sum(sizes):
        raise ValueError(f"expected a 1-D vector of {sum(sizes)} values for {len(names)} tensors, "
                         f"got shape {tuple(vec.shape)}")
    pieces = torch.split(vec, sizes)
    return {n: piece.view(like[n].shape) for n, piece in zip(names, pieces)}


def _uniform(shape: torch.Size, bound: float, generator: torch.Generator) -> torch.Tensor:
    out = torch.empty(shape, device=generator.device)
    return out.uniform_(-bound, bound, generator=generator)


def _reset_elsewhere(module: nn.Module, prefix: str, generator: torch.Generator) -> Params:
    """A module without a rule here (your own model's LSTM, attention, bare nn.Parameter): its own
    ``reset_parameters`` on a CPU copy, with torch's RNG seeded from ``generator`` and restored
    afterwards; a module without one keeps the values it was built with (built under the run seed)."""
    own = dict(module.named_parameters(recurse=False))
    if not hasattr(module, "reset_parameters"):
        return {prefix + n: p.detach().cpu().clone() for n, p in own.items()}
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    twin = copy.deepcopy(module).cpu()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        twin.reset_parameters()
    return {prefix + n: p.detach().clone() for n, p in twin.named_parameters(recurse=False)}


def init_params(model: nn.Module, generator: torch.Generator) -> Params:
    """Re-initialise ``model``'s parameters from ``generator`` and return copies of them.

    PyTorch's own defaults, drawn from the given generator so a run seed fixes them: conv and linear
    weights and biases ~ U(−1/√fan_in, 1/√fan_in) (what ``kaiming_uniform_(a=√5)`` amounts to),
    normalisation layers weight 1 and bias 0, embeddings N(0, 1); any other module its own
    ``reset_parameters`` (see :func:`_reset_elsewhere`). Values are drawn on the generator's
    device, in ``model.modules()`` order (weight before bias), then moved to each parameter's device,
    so the same seed gives the same model on CPU and GPU. The module is updated in place, so
    ``model(x)`` and ``functional_call(model, returned, x)`` agree.
    """
    fresh: Params = {}
    for mname, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        prefix = f"{mname}." if mname else ""
        if isinstance(module, _CONV_LINEAR):
            fan_in = module.weight[0].numel()  # in_features, or in_channels/groups · kernel volume
            bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            for pname, p in own.items():
                fresh[prefix + pname] = _uniform(p.shape, bound, generator)
        elif isinstance(module, NORM_TYPES):
            for pname, p in own.items():
                fresh[prefix + pname] = (torch.ones if pname == "weight" else torch.zeros)(p.shape)
        elif isinstance(module, nn.Embedding):
            fresh[prefix + "weight"] = torch.randn(module.weight.shape, generator=generator,
                                                   device=generator.device)
        else:
            fresh.update(_reset_elsewhere(module, prefix, generator))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(fresh[name].to(device=p.device, dtype=p.dtype))
    return params_of(model)


__all__ = ["Params", "params_of", "num_params", "flatten_params", "unflatten_params", "init_params"]
