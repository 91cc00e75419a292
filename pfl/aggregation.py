"""Arithmetic on parameter dicts: the one weighted-averaging helper and its small relatives, and the
robust (Byzantine-tolerant) replacements of the mean that methods with a global model share.

Robust rules (``method.aggregator``, the :class:`RobustAggregation` hyperparameter group):

* ``median`` — coordinate-wise median (Yin et al. 2018);
* ``trimmed_mean`` — coordinate-wise mean after dropping the ⌊β·n⌋ largest and smallest values
  (``trim_fraction`` = β);
* ``krum`` — the reply with the smallest sum of squared distances to its n − f − 2 nearest
  neighbours (Blanchard et al. 2017); ``krum_select`` > 1 averages that many best ones (multi-Krum).
  f = round(share·n) with ``byzantine_share`` (−1: the run's ``attack.fraction``, which is what the
  reference code of the FPFC paper's robustness experiment, Lin et al. 2022, passes).

They are unweighted: a reply's sample count is control data a Byzantine client can lie about, so the
``weighting`` of the mean does not apply to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

from .schema import ConfigError, hp

Params = dict[str, torch.Tensor]


class WeightedSum:
    """A running weighted sum of models, Σ_k w_k · model_k, and its mean Σ_k w_k · model_k / Σ_k w_k.

    Models are folded in one at a time (:meth:`add`), so a server that needs only the mean keeps one
    model's worth of sums instead of every reply (a streaming aggregate: FedAvg's
    :meth:`~pfl.methods.fedavg.FedAvg.receive`). The sum is taken in arrival order, one
    ``acc += w_k · model_k`` per tensor (floating tensors in their own dtype, integer ones in
    float64), divided by Σ_k w_k at the end. :func:`weighted_average` is this same sum over a list:
    a server that folds its replies as they arrive and one that keeps them and averages at the end
    compute the same bits (FedAvg and LAG at ξ = 0, say).
    """

    def __init__(self, names: Iterable[str] | None = None):
        self.names = None if names is None else list(names)
        self.sums: Params = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.total = 0.0
        self.count = 0

    def add(self, model: Mapping[str, torch.Tensor], weight: float = 1.0) -> None:
        if self.names is None:
            self.names = list(model)
        weight = float(weight)
        for k in self.names:
            t = model[k]
            acc = self.sums.get(k)
            if acc is None:
                self.dtypes[k] = t.dtype
                acc = self.sums[k] = torch.zeros_like(t, dtype=t.dtype if t.is_floating_point() else torch.float64)
            acc.add_(t.to(acc.dtype), alpha=weight)
        self.total += weight
        self.count += 1

    def mean(self) -> Params:
        """Σ_k w_k · model_k / Σ_k w_k, each tensor in its models' dtype."""
        if not self.count:
            raise ValueError("a weighted sum of no models has no mean")
        if self.total <= 0:
            raise ValueError("weights must sum to a positive number")
        return {k: self.sums[k].div(self.total).to(self.dtypes[k]) for k in self.sums}


def weighted_average(models: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float] | None = None,
                     names: Iterable[str] | None = None) -> Params:
    """Σ_k w_k · model_k / Σ_k w_k per tensor (uniform when ``weights`` is None): a
    :class:`WeightedSum` over ``models`` in order, so a mean of kept replies and the same replies
    folded in as they arrived are the same bits."""
    if not models:
        raise ValueError("weighted_average needs at least one model")
    acc = WeightedSum(names)
    for i, model in enumerate(models):
        acc.add(model, 1.0 if weights is None else weights[i])
    return acc.mean()


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


# ---- robust aggregation (Byzantine-tolerant replacements of the mean) ---------------------------

def _stack(models: Sequence[Mapping[str, torch.Tensor]], names: Iterable[str] | None) -> tuple[list[str], dict]:
    if not models:
        raise ValueError("robust aggregation needs at least one model")
    keys = list(names) if names is not None else list(models[0])
    return keys, {k: torch.stack([m[k] for m in models]) for k in keys}


def coordinate_median(models: Sequence[Mapping[str, torch.Tensor]], names: Iterable[str] | None = None) -> Params:
    """Coordinate-wise median of the models (Yin et al. 2018): per entry, the middle value; with an
    even number of models the mean of the two middle values (as ``numpy.median``). Integer tensors
    take the lower middle value."""
    keys, stacked = _stack(models, names)
    n = len(models)
    out: Params = {}
    for k in keys:
        s = stacked[k].sort(dim=0).values
        if n % 2 or not s.is_floating_point():
            out[k] = s[(n - 1) // 2].clone()
        else:
            out[k] = (s[n // 2 - 1] + s[n // 2]) / 2
    return out


def trim_count(n: int, fraction: float) -> int:
    """Values cut from each end by a trimmed mean of ``n`` values: ⌊fraction·n⌋, at most (n−1)//2
    so that at least one value is left."""
    return min(int(fraction * n), (n - 1) // 2)


def trimmed_mean(models: Sequence[Mapping[str, torch.Tensor]], fraction: float,
                 names: Iterable[str] | None = None) -> Params:
    """Coordinate-wise trimmed mean (Yin et al. 2018): per entry, drop the ⌊fraction·n⌋ largest and
    the ⌊fraction·n⌋ smallest values and average the rest (see :func:`trim_count`)."""
    keys, stacked = _stack(models, names)
    n = len(models)
    b = trim_count(n, fraction)
    out: Params = {}
    for k in keys:
        s = stacked[k].sort(dim=0).values[b:n - b]
        out[k] = s.mean(dim=0) if s.is_floating_point() else s[(len(s) - 1) // 2].clone()
    return out


def krum_scores(flat: torch.Tensor, f: int) -> torch.Tensor:
    """Krum's score of each row of ``flat`` (n, d): the sum of squared distances to its n − f − 2
    nearest other rows (at least 1, at most n − 1; Blanchard et al. 2017)."""
    n = flat.shape[0]
    if n == 1:
        return torch.zeros(1, dtype=torch.float64)
    x = flat.to(torch.float64)
    sq = (x * x).sum(1)
    dist = sq[:, None] + sq[None, :] - 2 * x @ x.T
    # exactly symmetric (the matrix product need not be): with n − f − 2 = 1 two mutually nearest
    # replies tie by definition, and the tie must be broken by position, not by rounding noise, so
    # that any two computations of the same replies (sequential or batched clients) pick the same one
    dist = ((dist + dist.T) / 2).clamp_min_(0.0)
    dist.fill_diagonal_(float("inf"))
    k = max(1, min(n - f - 2, n - 1))
    return dist.topk(k, dim=1, largest=False).values.sum(1)


def krum(models: Sequence[Mapping[str, torch.Tensor]], f: int, select: int = 1,
         names: Iterable[str] | None = None) -> tuple[Params, list[int]]:
    """(Multi-)Krum: the ``select`` models with the lowest Krum scores (see :func:`krum_scores`,
    computed on all named tensors flattened together), averaged; also their indices (ascending
    score, ties by position). ``select = 1`` is Krum."""
    keys, stacked = _stack(models, names)
    n = len(models)
    flat = torch.cat([stacked[k].reshape(n, -1).to(torch.float64) for k in keys], dim=1)
    scores = krum_scores(flat, f)
    order = sorted(range(n), key=lambda i: (float(scores[i]), i))
    chosen = order[:max(1, min(select, n))]
    picked = [models[i] for i in chosen]
    return weighted_average(picked, None, names=keys), chosen


AGGREGATORS = ("mean", "median", "trimmed_mean", "krum")


@dataclass
class RobustAggregation:
    """How the server combines the replies into the global model (mean or a robust rule)."""
    aggregator: str = hp("mean", "combine the replies by their (weighted) mean or a robust rule: coordinate-wise "
                         "median, trimmed mean, (multi-)Krum", choices=AGGREGATORS)
    trim_fraction: float = hp(0.1, "trimmed_mean: share β of the replies cut at each end per coordinate",
                              low=0.0, high=0.5, high_open=True)
    byzantine_share: float = hp(-1.0, "krum: assumed share of Byzantine replies, f = round(share·|S|); "
                                "-1 = the run's attack.fraction (the reference's choice)", low=-1.0, high=1.0,
                                high_open=True)
    krum_select: int = hp(1, "krum: how many best-scored replies are averaged (1 = Krum, >1 = multi-Krum)", low=1)

    def validate(self, path: str) -> None:
        if self.byzantine_share < 0 and self.byzantine_share != -1.0:
            raise ConfigError(f"{path}.byzantine_share", f"must be in [0, 1) or -1 (the attack fraction), "
                                                         f"got {self.byzantine_share}")


def byzantine_count(n: int, share: float) -> int:
    """Krum's f for ``n`` replies: round(share·n) (half away from zero)."""
    return int(share * n + 0.5)


def aggregate(models: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float] | None,
              rule: RobustAggregation, names: Iterable[str] | None = None,
              attack_fraction: float = 0.0) -> Params:
    """The replies combined as ``rule.aggregator`` says (``weights`` apply to the mean only)."""
    kind = rule.aggregator
    if kind == "mean":
        return weighted_average(models, weights, names=names)
    if kind == "median":
        return coordinate_median(models, names)
    if kind == "trimmed_mean":
        return trimmed_mean(models, rule.trim_fraction, names)
    if kind == "krum":
        share = attack_fraction if rule.byzantine_share < 0 else rule.byzantine_share
        return krum(models, byzantine_count(len(models), share), rule.krum_select, names)[0]
    raise ValueError(f"unknown aggregator {kind!r}; allowed: {', '.join(AGGREGATORS)}")
