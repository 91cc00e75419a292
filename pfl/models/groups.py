"""Layer groups: which parameters form each layer, the body and the head, and the low-rank candidates.

Methods address parts of a model by parameter name: FedRep / LG-FedAvg / FPFC's clustered head use
the last unit, FedALA's p counts units from the top, FedSLR thresholds the matrices. Every zoo model
declares its units (a layer or a residual block, bottom → top) in ``layer_units()``; this module
turns that declaration into the named groups and checks that it covers every parameter exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from torch import nn

# Module types whose affine parameters are normalisation parameters (FedBN-style methods keep them
# local). Recognised by type, never by a substring of the name.
NORM_TYPES = (nn.GroupNorm, nn.LayerNorm, nn.modules.batchnorm._NormBase)


@dataclass(frozen=True)
class LayerGroups:
    """Named parameter groups of one model; every list follows ``named_parameters()`` order.

    units:    the layers/blocks bottom → top, each a list of parameter names.
    head:     the parameter names of the last unit (the final linear classifier).
    body:     all other parameter names (the feature extractor).
    matrices: parameters with ndim >= 2 (conv and linear weights: the low-rank candidates).
    norms:    affine parameters of normalisation layers (GroupNorm here).
    """
    units: list[list[str]]
    head: list[str]
    body: list[str]
    matrices: list[str]
    norms: list[str]

    def top(self, p: int) -> list[str]:
        """Parameter names of the top ``p`` units, bottom → top; p <= 0 or p >= #units gives all.

        (p = 0 meaning "all" follows FedALA's code, where layer_idx 0 selects every tensor.)
        """
        chosen = self.units if p <= 0 or p >= len(self.units) else self.units[-p:]
        return [name for unit in chosen for name in unit]

    @property
    def names(self) -> list[str]:
        """Every parameter name, bottom → top."""
        return self.top(0)


def params_under(model: nn.Module, prefixes: Iterable[str]) -> list[str]:
    """Names of the parameters of the submodules ``prefixes`` (in named_parameters order).

    Used by models to declare a unit as a set of submodules, e.g. ``["conv1", "gn1"]``.
    """
    prefixes = list(prefixes)
    return [name for name, _ in model.named_parameters()
            if any(name.startswith(p + ".") for p in prefixes)]


def _default_units(model: nn.Module) -> list[list[str]]:
    """Fallback for modules without ``layer_units``: one unit per direct child holding parameters."""
    units = []
    for child_name, child in model.named_children():
        names = [f"{child_name}.{n}" for n, _ in child.named_parameters()]
        if names:
            units.append(names)
    own = [n for n, _ in model.named_parameters(recurse=False)]
    if own:
        units.append(own)
    return units


def layer_groups(model: nn.Module) -> LayerGroups:
    """The :class:`LayerGroups` of ``model`` (from its ``layer_units()``, else its direct children)."""
    declared = model.layer_units() if hasattr(model, "layer_units") else _default_units(model)
    params = dict(model.named_parameters())
    seen: dict[str, int] = {}
    for unit in declared:
        for name in unit:
            if name not in params:
                raise ValueError(f"{type(model).__name__}.layer_units names {name!r}, which is not a parameter")
            seen[name] = seen.get(name, 0) + 1
    twice = [n for n, c in seen.items() if c > 1]
    missing = [n for n in params if n not in seen]
    if twice or missing:
        raise ValueError(f"{type(model).__name__}.layer_units must cover every parameter exactly once; "
                         f"repeated: {twice}, missing: {missing}")
    if not declared or not declared[-1]:
        raise ValueError(f"{type(model).__name__}.layer_units declares no head unit")
    # Keep named_parameters order inside each unit, so flattening by group matches the model order.
    order = {name: i for i, name in enumerate(params)}
    units = [sorted(unit, key=order.__getitem__) for unit in declared if unit]
    head = units[-1]
    body = [n for unit in units[:-1] for n in unit]
    matrices = [n for n, p in params.items() if p.ndim >= 2]
    norms = [f"{mname}.{pname}" if mname else pname
             for mname, module in model.named_modules() if isinstance(module, NORM_TYPES)
             for pname, _ in module.named_parameters(recurse=False)]
    return LayerGroups(units=units, head=head, body=body, matrices=matrices, norms=norms)


def has_buffers(model: nn.Module) -> bool:
    return any(True for _ in model.buffers())


__all__ = ["LayerGroups", "layer_groups", "params_under", "has_buffers", "NORM_TYPES"]
