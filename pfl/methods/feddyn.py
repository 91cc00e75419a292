"""FedDyn (Acar et al. 2021): dynamic regularisation so local optima line up with the global one.

Client k keeps g_k (d floats, starts at 0), its running estimate of the gradient of its loss at
its last local model. From the received θ^t it minimises

    f_k(θ) − ⟨g_k, θ⟩ + (α/2)‖θ − θ^t‖²

with the shared SGD loop (the linear and quadratic terms enter as a gradient correction
−g_k + α(θ − θ^t), cheaper than autograd through them), then sets g_k ← g_k − α(θ_k − θ^t) and
sends θ_k. The server keeps h (d floats, starts at 0):

    h ← h − α·(1/N)·Σ_{k∈S_t}(θ_k − θ^t)        (N = all clients, not |S_t|)
    θ^{t+1} = mean_{k∈S_t} θ_k − h/α              (unweighted mean, as in the paper)

θ^{t+1} (with the −h/α correction) is both what is broadcast and the reported global model.
g_k never leaves the client, so traffic equals FedAvg's.

Decisions: the paper's squared norm (PFLlib's loss uses the unsquared one); no gradient clipping
by default (FL-bench clips at 10: ``max_grad_norm``), since the paper's algorithm has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


from ..aggregation import weighted_average, zeros_like
from ..federation.messages import Message
from ..schema import hp
from ..training import ClipNorm, Params, PullTo, Shift, Terms
from . import register
from .base import ClientHandle
from .fedavg import FedAvg


@dataclass
class FedDynHparams:
    """FedDyn's regularisation strength (and an optional clip of the corrected gradient)."""
    alpha: float = hp(0.1, "dynamic regularisation weight α (paper grid 0.1, 0.01, 0.001; FedSLR-tuned 0.1)",
                      low=0.0, low_open=True)
    max_grad_norm: float = hp(0.0, "clip the global norm of each corrected gradient to this (0 = off; "
                              "FL-bench uses 10)", low=0.0)


@register
class FedDyn(FedAvg):
    name = "feddyn"
    Hparams = FedDynHparams
    quick = {"method.max_grad_norm": 5.0}
    description = "FedDyn: dynamic regularisation (Acar et al. 2021)"

    def setup(self) -> None:
        super().setup()
        self.h: Params = zeros_like(self.global_model)

    def train_kwargs(self, client: ClientHandle, received: Params) -> dict[str, Any]:
        # ∇f_k(θ) + α(θ − θ^t) − g_k, optionally clipped
        terms: list = [PullTo(received, self.hp.alpha)]
        g_k = client.state.get("g")
        if g_k is not None:
            terms.append(Shift(g_k, -1.0))
        if self.hp.max_grad_norm:
            terms.append(ClipNorm(self.hp.max_grad_norm))
        return {"grad_hook": Terms(terms)}

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        received = msg.tensors()
        result = client.train(self.start_params(client, received), rnd, **self.train_kwargs(client, received))
        theta_k, alpha = result.params, self.hp.alpha
        g_k = client.state.get("g") or zeros_like(received)
        client.state["g"] = {k: g_k[k] - alpha * (theta_k[k] - received[k]) for k in received}
        return Message.model(theta_k, base="model", train_loss=result.mean_loss, n=client.n_train)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        models = [r.tensors() for r in replies.values()]
        mean = weighted_average(models)
        alpha = self.hp.alpha
        share = len(models) / self.ctx.num_members  # (1/N)·Σ_{S_t} = (|S_t|/N)·mean_{S_t}
        old = self.global_model
        self.h = {k: v - alpha * share * (mean[k] - old[k]) for k, v in self.h.items()}
        self.global_model = {k: mean[k] - self.h[k] / alpha for k in old}
