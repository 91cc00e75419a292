"""Parameters as plain tensors: the engine's view of a model.

One module object is shared by many clients; each client's state is a ``{name: tensor}`` dict that
is run through ``torch.func.functional_call``. These helpers take that dict out of a module, turn it
into one flat vector and back (server-side math such as FPFC's pairwise updates works on stacked
vectors), and draw a fresh, reproducible initialisation from a seeded generator.

**Buffers are state.** A normalisation layer's running statistics (BatchNorm's ``running_mean``,
``running_var``, ``num_batches_tracked``: :func:`state_buffers`) belong to a model as much as its
weights do, so a model's dict holds them too, after its parameters (torch's ``state_dict`` order would
interleave them; parameters first keeps ``list(d)[:p]`` the parameters). One dict therefore
travels, aggregates, is stored and checkpointed whole; the loop (:mod:`pfl.training`) trains only
the parameters and lets the forward pass update the statistics. A model without such layers has
exactly its parameters, as before.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from .groups import NORM_TYPES

Params = dict[str, torch.Tensor]

_CONV_LINEAR = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def params_of(model: nn.Module) -> Params:
    """Detached copies of ``model``'s parameters, in ``named_parameters()`` order, then of its state
    buffers (:func:`state_buffers`)."""
    out = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name in state_buffers(model):
        out[name] = model.get_buffer(name).detach().clone()
    return out


def state_buffers(model: nn.Module) -> list[str]:
    """The names of ``model``'s buffers that are state: the running statistics of normalisation
    layers that track them (BatchNorm, InstanceNorm with ``track_running_stats``), in
    ``named_modules()`` order. Other buffers (constants such as a normalisation mean) are part of
    the architecture: one copy, in the module, serves every client."""
    out = []
    for mname, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
            prefix = f"{mname}." if mname else ""
            out += [prefix + b for b, t in module.named_buffers(recurse=False) if t is not None]
    return out


def with_statistics(model: nn.Module, names: Iterable[str]) -> list[str]:
    """``names`` (parameter names) and the state buffers of the layers they belong to: a method that
    shares or keeps a layer (FedPer's body, LG-FedAvg's head) shares or keeps its statistics with it.
    A layer without parameters of its own (BatchNorm with ``affine=False``) goes with the layer
    before it (the one whose output it normalises)."""
    names = list(names)
    chosen = set(names)
    out = list(names)
    last: list[str] = []   # the parameters of the last module that had any
    for mname, module in model.named_modules():
        prefix = f"{mname}." if mname else ""
        own = [prefix + n for n, _ in module.named_parameters(recurse=False)]
        if own:
            last = own
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
            if any(n in chosen for n in (own or last)):
                out += [prefix + b for b, t in module.named_buffers(recurse=False) if t is not None]
    return out


def buffer_names(model: nn.Module) -> frozenset[str]:
    """:func:`state_buffers` as a set, cached on the module (the loop asks at every call; a module's
    layers do not change after it is built)."""
    cached = model.__dict__.get("_pfl_state_buffers")
    if cached is None:
        cached = frozenset(state_buffers(model))
        object.__setattr__(model, "_pfl_state_buffers", cached)
    return cached


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


@contextmanager
def in_mode(model: nn.Module, train: bool):
    """``model`` in train (or eval) mode for a block, its own mode put back afterwards (BatchNorm
    normalises by the batch and updates its statistics in train mode, by its statistics in eval)."""
    was = model.training
    if was == train:
        yield
        return
    model.train(train)
    try:
        yield
    finally:
        model.train(was)


def as_module_dtypes(model: nn.Module, state: Params) -> None:
    """``state``'s statistics in the module's dtypes, in place: a server rule's arithmetic (η_g·Δ,
    FedOpt's step) turns the integer ``num_batches_tracked`` into a float, which torch's BatchNorm
    would then count in floating point (rounded back to the nearest integer here)."""
    for k in buffer_names(model):
        t = state.get(k)
        want = model.get_buffer(k).dtype
        if t is not None and t.dtype != want:
            state[k] = t.round().to(want) if not want.is_floating_point else t.to(want)


def lend_statistics(model: nn.Module, state: Params) -> Params:
    """``state`` (its statistics in the module's dtypes, in place) with a copy of the module's own
    for every statistic it lacks: what a forward pass in train mode may write to, so that the one
    module every client shares is never written."""
    as_module_dtypes(model, state)
    return {**state, **{k: model.get_buffer(k).detach().clone() for k in buffer_names(model) if k not in state}}


def on_names(fn: Callable[[Params], None], names: list[str], state: Params) -> None:
    """``fn`` on the entries ``names`` of ``state`` (a proximal map on the parameters, not the statistics)."""
    fn({k: state[k] for k in names})


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
        for name in state_buffers(model):  # a fresh layer's statistics: mean 0, variance 1, no batches
            model.get_submodule(name.rpartition(".")[0]).reset_running_stats()
    return params_of(model)


__all__ = ["Params", "as_module_dtypes", "buffer_names", "in_mode", "lend_statistics", "on_names",
           "with_statistics", "params_of", "num_params", "flatten_params", "unflatten_params", "init_params",
           "state_buffers"]
