"""Arithmetic on parameter dicts: the one weighted-averaging helper and its small relatives."""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

Params = dict[str, torch.Tensor]


def weighted_average(models: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float] | None = None,
                     names: Iterable[str] | None = None) -> Params:
    """Σ_k w_k · model_k / Σ_k w_k per tensor (uniform when ``weights`` is None).

    Stacks each tensor once, so the cost is one reduction per parameter, not a Python loop over
    clients.
    """
    if not models:
        raise ValueError("weighted_average needs at least one model")
    keys = list(names) if names is not None else list(models[0])
    if weights is None:
        w = torch.full((len(models),), 1.0 / len(models))
    else:
        w = torch.as_tensor(list(weights), dtype=torch.float64)
        total = float(w.sum())
        if total <= 0:
            raise ValueError("weights must sum to a positive number")
        w = w / total
    out: Params = {}
    for k in keys:
        ref = models[0][k]
        stacked = torch.stack([m[k] for m in models])
        wk = w.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else torch.float32)
        out[k] = torch.tensordot(wk, stacked.to(wk.dtype), dims=1).to(ref.dtype)
    return out


def add(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], alpha: float = 1.0) -> Params:
    """a + alpha·b for the names of ``a``."""
    return {k: a[k] + alpha * b[k] for k in a}


def sub(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> Params:
    return {k: a[k] - b[k] for k in a}


def scale(a: Mapping[str, torch.Tensor], c: float) -> Params:
    return {k: c * v for k, v in a.items()}


def zeros_like(a: Mapping[str, torch.Tensor]) -> Params:
    return {k: torch.zeros_like(v) for k, v in a.items()}


def clone(a: Mapping[str, torch.Tensor]) -> Params:
    return {k: v.detach().clone() for k, v in a.items()}


def select(a: Mapping[str, torch.Tensor], names: Iterable[str]) -> Params:
    return {k: a[k] for k in names}


def sq_norm(a: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return sum((v.float() ** 2).sum() for v in a.values())
