"""APFL (Deng, Kamani, Mahdavi 2020): adaptive personalised FL by mixing a local and the global model.

Client k keeps a local model v_k and a mixing weight α_k. In a round it starts w from θ^t and, on
every minibatch ξ, updates simultaneously (the paper's Algorithm 1; the FL-bench/PFLlib code moves w
first and mixes with the new w):

    w ← w − η ∇f_k(w; ξ)
    v ← v − η α ∇f_k(v̄; ξ)                 v̄ = α v + (1 − α) w
    α ← clip_[0,1](α − η_α ⟨v − w, ∇f_k(v̄; ξ)⟩)   (adaptive only)

All three are one step of the shared SGD loop on the loss f_k(w) + f_k(v̄) with w detached inside
v̄: its gradients are exactly ∇f(w), α∇f(v̄) and ⟨v − w, ∇f(v̄)⟩. The loop runs on sample indices so
that the extra loss sees the minibatch the main loss used. The client sends w; the server averages
(FedAvg). Evaluation uses the mixture with the current global model, α_k v_k + (1 − α_k) θ
(``mix: params``, the paper) or the same mixture of the two models' logits (``mix: logits``,
FL-bench). α = 0 is therefore FedAvg's model; α = 1 a purely local one. Traffic equals FedAvg's.

Defaults: α = 0.5 (FedSLR's tuned value, FL-bench's default), adaptive on, η_α = the client lr;
``alpha_l2`` adds the code-level c·α_k inside the α-gradient (FedTorch/FL-bench/PFLlib use 0.02;
the paper has none, so the default is 0). v_k starts at θ^0 and α_k at ``alpha``; clients never
sampled are evaluated with that start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import functional_call

from ..federation.messages import Message
from ..models.functional import buffer_names
from ..schema import hp
from ..training import Clamp, Params, Term, per_sample_loss
from . import register
from .base import ClientHandle
from .fedavg import FedAvg, FedAvgHparams

_W, _V, _A = "w.", "v.", "alpha"


@dataclass
class APFLHparams(FedAvgHparams):
    """APFL: a mixture of a local model and the global model, with a learned mixing weight."""
    alpha: float = hp(0.5, "initial (or fixed) mixing weight α of the local model "
                      "(grid 0.1, 0.25, 0.5, 0.75, 0.9)", low=0.0, high=1.0)
    adaptive: bool = hp(True, "learn α_k per client by gradient descent")
    alpha_lr: float = hp(0.0, "step size η_α of α (0 = the client lr)", low=0.0)
    alpha_l2: float = hp(0.0, "c in the code-level α-gradient term c·α (FedTorch uses 0.02)", low=0.0)
    mix: str = hp("params", "what is mixed: parameters (paper) or output logits (FL-bench)",
                  choices=("params", "logits"))


def _part(state: Params, prefix: str) -> Params:
    n = len(prefix)
    return {k[n:]: v for k, v in state.items() if k.startswith(prefix)}


def mixed_params(v: Params, w: Params, alpha: torch.Tensor | float, stats: frozenset = frozenset()) -> Params:
    """α v + (1 − α) w per tensor; running statistics (``stats``) are mixed with α held constant
    (BatchNorm differentiates nothing through them)."""
    a = alpha.detach() if stats and isinstance(alpha, torch.Tensor) else alpha
    return {k: (a * v[k] + (1 - a) * w[k] if k in stats else alpha * v[k] + (1 - alpha) * w[k]) for k in w}


def mixed_output(model: torch.nn.Module, mix: str, v: Params, w: Params, alpha: torch.Tensor,
                 x: torch.Tensor) -> torch.Tensor:
    """Output of the personal mixture for inputs x: a mixture of parameters or of logits."""
    if mix == "params":
        return functional_call(model, mixed_params(v, w, alpha, buffer_names(model)), (x,))
    return alpha * functional_call(model, v, (x,)) + (1 - alpha) * functional_call(model, w, (x,))


@dataclass
class APFLLoss(Term):
    """Per-sample f(w) + f(v̄) with v̄ = α v + (1 − α)·stop_grad(w): one backward pass gives ∇f(w),
    α∇f(v̄) and ⟨v − w, ∇f(v̄)⟩, the three simultaneous APFL updates (module docstring)."""
    model: torch.nn.Module
    mix: str
    task: str

    def __call__(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        crit = per_sample_loss(self.task)
        w = _part(params, _W)
        w_fixed = {k: t.detach() for k, t in w.items()}
        own = crit(functional_call(self.model, w, (x,)), y)
        return own + crit(mixed_output(self.model, self.mix, _part(params, _V), w_fixed, params[_A], x), y)


@dataclass
class AlphaGradient(Term):
    """α's step: scale·(∂ + c·α), minus the loop's weight decay on α (a mixing weight is not a weight)."""
    scale: float
    l2: float
    weight_decay: float

    def __call__(self, grads: Params, params: Params) -> Params:
        if _A in grads:
            a = params[_A].detach()
            grads = dict(grads, **{_A: self.scale * (grads[_A] + self.l2 * a) - self.weight_decay * a})
        return grads


@register
class APFL(FedAvg):
    name = "apfl"
    Hparams = APFLHparams
    description = "APFL: adaptive mixture of local and global models (Deng et al. 2020)"

    def configure(self) -> None:
        super().configure()
        self.init: Params = self.ctx.init_params()  # v_k's start θ^0, regenerated from the run seed

    def client_alpha(self, client: ClientHandle) -> torch.Tensor:
        alpha = client.state.get("alpha")
        if alpha is None:
            alpha = torch.tensor(float(self.hp.alpha), device=self.ctx.device)
        return alpha

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        received = msg.tensors()
        hp_ = self.hp
        lr = self.ctx.lr(rnd)
        start = self.start_params(client, received)
        v = client.state.get("v", self.init)
        state = {**{_W + k: t for k, t in start.items()}, **{_V + k: t for k, t in v.items()},
                 _A: self.client_alpha(client).clone()}
        stats = buffer_names(client.model)  # running statistics: updated by the forward passes, not trained
        trainable = [k for k in state if k != _A and k[len(_W):] not in stats] + ([_A] if hp_.adaptive else [])
        wd = self.ctx.cfg.federation.weight_decay
        result = client.train(state, rnd, lr=lr, trainable=trainable,
                              loss=APFLLoss(client.model, hp_.mix, self.ctx.meta.task),
                              grad_hook=AlphaGradient((hp_.alpha_lr or lr) / lr, hp_.alpha_l2, wd),
                              post_step=Clamp((_A,), 0.0, 1.0))
        out = result.params
        client.state["v"] = _part(out, _V)
        client.state["alpha"] = out[_A].detach().clone()
        return Message.model(_part(out, _W), base="model", train_loss=result.mean_loss, n=client.n_train)

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        v, alpha = client.state.get("v", self.init), self.client_alpha(client)
        if self.hp.mix == "params":
            return mixed_params(v, received, alpha)
        return {**{_W + k: t for k, t in received.items()}, **{_V + k: t for k, t in v.items()}, _A: alpha}

    def eval_forward(self, client: ClientHandle):
        if self.hp.mix == "params":
            return None
        model = client.model
        return lambda p, xb: mixed_output(model, "logits", _part(p, _V), _part(p, _W), p[_A], xb)
