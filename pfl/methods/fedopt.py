"""FedOpt (Reddi et al. 2021): FedAvg clients, an adaptive optimiser on the server.

Clients train exactly as in FedAvg. The server treats the averaged update Δ = Σ p_k (θ_k − θ^t) as
a pseudo-gradient (with the sign of a descent step) and keeps two moment estimates, m and v:

    m ← β1·m + (1 − β1)·Δ
    adagrad: v ← v + Δ²
    adam:    v ← β2·v + (1 − β2)·Δ²
    yogi:    v ← v − (1 − β2)·Δ²·sign(v − Δ²)
    θ ← θ + η·m / (√v + τ)          (element-wise, no bias correction, as in the paper)

One implementation; the rule is configuration (``method.optimizer``) and the registered names
``fedadam``, ``fedadagrad``, ``fedyogi`` (and ``fedavgm``: heavy-ball server momentum,
m ← β1·m + Δ; θ ← θ + η·m) only change its default.

Decisions: m and v start at 0 (Flower, FL-bench); ``v_init: tau2`` starts v at τ² (the paper's
"v_{-1} ≥ τ²"). Δ is sample-weighted by default like FedAvg (``weighting: uniform`` gives the
paper's plain mean). Defaults η = 0.01, β1 = 0.9, β2 = 0.99, τ = 1e-3 (Flower's FedYogi/FedAdam).
Traffic equals FedAvg's; m and v stay on the server.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..aggregation import RobustAggregation, zeros_like
from ..federation.messages import Message
from ..schema import hp
from ..training import Params
from . import register
from .fedavg import FedAvg

RULES = ("adam", "adagrad", "yogi", "momentum")


@dataclass
class FedOptHparams(RobustAggregation):
    """The server optimiser of FedOpt (clients are plain FedAvg)."""
    optimizer: str = hp("adam", "server update rule", choices=RULES)
    server_lr: float = hp(0.01, "server step size η", low=0.0, low_open=True)
    beta1: float = hp(0.9, "first-moment decay β1 (momentum for fedavgm)", low=0.0, high=1.0, high_open=True)
    beta2: float = hp(0.99, "second-moment decay β2 (adam, yogi)", low=0.0, high=1.0, high_open=True)
    tau: float = hp(1e-3, "adaptivity τ added to √v (paper grid 1e-5 … 1)", low=0.0, low_open=True)
    v_init: str = hp("zero", "initial v: 0 (Flower, FL-bench) or τ² (paper)", choices=("zero", "tau2"))
    weighting: str = hp("samples", "how client updates are averaged into Δ", choices=("samples", "uniform"))


def server_moments(m: torch.Tensor, v: torch.Tensor, delta: torch.Tensor, rule: str,
                   beta1: float, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One update of the moment estimates (m, v) for pseudo-gradient ``delta``."""
    if rule == "momentum":
        return beta1 * m + delta, v
    m = beta1 * m + (1 - beta1) * delta
    sq = delta * delta
    if rule == "adagrad":
        v = v + sq
    elif rule == "adam":
        v = beta2 * v + (1 - beta2) * sq
    elif rule == "yogi":
        v = v - (1 - beta2) * sq * torch.sign(v - sq)
    else:
        raise ValueError(f"unknown FedOpt rule {rule!r}; allowed: {', '.join(RULES)}")
    return m, v


@register
class FedOpt(FedAvg):
    name = "fedadam"
    Hparams = FedOptHparams
    description = "FedAdam: adaptive server optimiser (Reddi et al. 2021)"
    streams_replies = True  # its aggregate reads the replies through reply_average only

    def setup(self) -> None:
        super().setup()
        self.m: Params = zeros_like(self.global_model)
        start = self.hp.tau ** 2 if self.hp.v_init == "tau2" else 0.0
        self.v: Params = {k: torch.full_like(t, start) for k, t in self.global_model.items()}

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        avg = self.reply_average(replies)
        hp_ = self.hp
        new_global = {}
        for k, g in self.global_model.items():
            delta = avg[k] - g
            self.m[k], self.v[k] = server_moments(self.m[k], self.v[k], delta, hp_.optimizer, hp_.beta1, hp_.beta2)
            if hp_.optimizer == "momentum":
                new_global[k] = g + hp_.server_lr * self.m[k]
            else:
                new_global[k] = g + hp_.server_lr * self.m[k] / (self.v[k].sqrt() + hp_.tau)
        self.global_model = new_global


@dataclass
class FedAdagradHparams(FedOptHparams):
    """FedAdagrad: FedOpt with the Adagrad server rule."""
    optimizer: str = hp("adagrad", "server update rule", choices=RULES)


@dataclass
class FedYogiHparams(FedOptHparams):
    """FedYogi: FedOpt with the Yogi server rule."""
    optimizer: str = hp("yogi", "server update rule", choices=RULES)


@dataclass
class FedAvgMHparams(FedOptHparams):
    """FedAvgM: FedOpt with heavy-ball server momentum (η = 1, β1 = 0.9 by default)."""
    optimizer: str = hp("momentum", "server update rule", choices=RULES)
    server_lr: float = hp(1.0, "server step size η", low=0.0, low_open=True)


@register
class FedAdagrad(FedOpt):
    name = "fedadagrad"
    Hparams = FedAdagradHparams
    description = "FedAdagrad: Adagrad server optimiser (Reddi et al. 2021)"


@register
class FedYogi(FedOpt):
    name = "fedyogi"
    Hparams = FedYogiHparams
    description = "FedYogi: Yogi server optimiser (Reddi et al. 2021)"


@register
class FedAvgM(FedOpt):
    name = "fedavgm"
    Hparams = FedAvgMHparams
    description = "FedAvgM: FedAvg with server momentum (Hsu et al. 2019)"
