"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar 2020): FedAvg on the MAML objective F_k(w) = f_k(w − α∇f_k(w)).

Each local step draws fresh minibatches D, D′ (and D″ for the Hessian-free variant):

    w̃ = w − α ∇f_k(w; D)                  (only to evaluate the outer gradient; w is not moved)
    g = ∇f_k(w̃; D′)
    fo:    w ← w − β g
    hf:    h = [∇f_k(w + δg; D″) − ∇f_k(w − δg; D″)] / (2δ)    (finite-difference Hessian·g)
           w ← w − β (g − α h)
    exact: as hf with h = ∇²f_k(w; D″) g by double backpropagation (reference for tests; costlier)

It runs inside the shared SGD loop: the loop's own minibatch is D and its gradient ∇f_k(w; D);
the grad hook turns that into the meta-gradient (drawing D′, D″ from the client's seeded
generator) and the loop takes the step with lr β. The server averages the returned w (FedAvg).

Personalized evaluation: one SGD step of size α on one local training batch from the current
global model (the paper's and PFLlib's protocol). Traffic equals FedAvg's.

Newcomers (docs/methods/fpfc.md §8): a newcomer fine-tunes the final global model for
``newcomers.finetune_rounds`` local updates of plain SGD and is evaluated with the result (:class:`~pfl.methods.base.FineTuneNewcomers`).

Decisions (spec marks the paper values unverified): α = β = the client lr by default (PFLlib;
FL-bench's β = 1e-3 makes a round's progress ~50× smaller than the other baselines' at our lr, so
it is available but not the default); δ = 1e-3; local steps per round = the FedAvg minibatch budget
(``local_steps`` or epochs × batches) divided by the minibatches a step uses (2 fo, 3 hf/exact), so
all methods see the same number of samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch.func import functional_call

from ..federation.messages import Message
from ..models.functional import buffer_names
from ..schema import hp
from ..training import Params, loss_fn
from . import register
from .base import ClientHandle, FineTuneNewcomers
from .fedavg import FedAvg, FedAvgHparams

GradFn = Callable[[Params, torch.Tensor | None], Params]

VARIANTS = ("fo", "hf", "exact")


@dataclass
class PerFedAvgHparams(FedAvgHparams):
    """Per-FedAvg: MAML-style local steps; the personal model is one adaptation step away."""
    variant: str = hp("fo", "meta-gradient: first-order (fo), Hessian-free finite difference (hf) or "
                      "exact Hessian-vector product (exact)", choices=VARIANTS)
    alpha: float = hp(0.0, "inner (adaptation) step size α (0 = the client lr)", low=0.0)
    beta: float = hp(0.0, "outer step size β (0 = the client lr; FL-bench uses 1e-3)", low=0.0)
    delta: float = hp(1e-3, "finite-difference radius δ of the hf variant", low=0.0, low_open=True)
    steps: int = hp(0, "local meta-steps per round (0 = the FedAvg minibatch budget / batches per step)", low=0)


def meta_gradient(grad_fn: GradFn, w: Params, grad_d: Params, batches: list, alpha: float,
                  variant: str, delta: float) -> Params:
    """Per-FedAvg's meta-gradient at ``w`` from ∇f(w; D) = ``grad_d``.

    ``grad_fn(params, batch)`` returns ∇f(params; batch); ``batches`` are D′ (and D″).
    The exact variant needs ``grad_fn.hvp(params, vec, batch)`` (see :class:`BatchGradient`).
    """
    w = {k: v.detach() for k, v in w.items()}
    # entries without a gradient (a BatchNorm model's running statistics) ride along unchanged
    fixed = {k: v for k, v in w.items() if k not in grad_d}
    w = {k: w[k] for k in grad_d}
    w_tilde = {k: w[k] - alpha * grad_d[k] for k in w}
    g = grad_fn({**fixed, **w_tilde}, batches[0])
    if variant == "fo":
        return g
    if variant == "hf":
        plus = grad_fn({**fixed, **{k: w[k] + delta * g[k] for k in w}}, batches[1])
        minus = grad_fn({**fixed, **{k: w[k] - delta * g[k] for k in w}}, batches[1])
        h = {k: (plus[k] - minus[k]) / (2 * delta) for k in w}
    elif variant == "exact":
        h = grad_fn.hvp({**fixed, **w}, g, batches[1])  # type: ignore[attr-defined]
    else:
        raise ValueError(f"unknown Per-FedAvg variant {variant!r}; allowed: {', '.join(VARIANTS)}")
    return {k: g[k] - alpha * h[k] for k in w}


class BatchGradient:
    """∇f_k(params; batch) (and Hessian-vector products) of one client's training loss."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, task: str):
        self.model, self.x, self.y, self.loss = model, x, y, loss_fn(task)

    def _loss(self, params: Params, idx: torch.Tensor | None) -> torch.Tensor:
        xb, yb = (self.x, self.y) if idx is None else (self.x[idx], self.y[idx])
        return self.loss(functional_call(self.model, params, (xb,)), yb)

    def _split(self, params: Params) -> tuple[Params, Params]:
        """(the leaves to differentiate, the running statistics: read and updated, never differentiated)."""
        stats = buffer_names(self.model)
        return ({k: v.detach().requires_grad_(True) for k, v in params.items() if k not in stats},
                {k: v.detach() for k, v in params.items() if k in stats})

    def __call__(self, params: Params, idx: torch.Tensor | None) -> Params:
        p, stats = self._split(params)
        grads = torch.autograd.grad(self._loss({**p, **stats}, idx), list(p.values()), allow_unused=True)
        return {k: (g if g is not None else torch.zeros_like(p[k])) for k, g in zip(p, grads)}

    def hvp(self, params: Params, vec: Params, idx: torch.Tensor | None) -> Params:
        p, stats = self._split(params)
        grads = torch.autograd.grad(self._loss({**p, **stats}, idx), list(p.values()), create_graph=True)
        dot = sum((g * vec[k].detach()).sum() for k, g in zip(p, grads))
        out = torch.autograd.grad(dot, list(p.values()), allow_unused=True)
        return {k: (h if h is not None else torch.zeros_like(p[k])) for k, h in zip(p, out)}


@register
class PerFedAvg(FineTuneNewcomers, FedAvg):
    name = "perfedavg"
    Hparams = PerFedAvgHparams
    description = "Per-FedAvg: MAML-style personalised FedAvg (Fallah et al. 2020)"
    cohort = "sequential"

    def _batches_per_step(self) -> int:
        return 2 if self.hp.variant == "fo" else 3

    def _steps(self, client: ClientHandle) -> int:
        if self.hp.steps:
            return self.hp.steps
        fed = self.ctx.cfg.federation
        n, b = client.n_train, fed.batch_size
        per_epoch = 1 if b <= 0 or b >= n else math.ceil(n / b)
        budget = fed.local_steps if fed.local_steps is not None else fed.local_epochs * per_epoch
        return max(1, budget // self._batches_per_step())

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        received = msg.tensors()
        lr = self.ctx.lr(rnd)
        alpha, beta = self.hp.alpha or lr, self.hp.beta or lr
        fed = self.ctx.cfg.federation
        n, b = client.n_train, fed.batch_size
        grad_fn = BatchGradient(client.model, client.data.x_train, client.data.y_train, self.ctx.meta.task)
        gen = client.generator(rnd, "perfedavg-batches")
        extra = self._batches_per_step() - 1
        variant, delta = self.hp.variant, self.hp.delta

        def draw() -> torch.Tensor | None:
            if b <= 0 or b >= n:
                return None
            return torch.randperm(n, generator=gen)[:b].to(client.data.x_train.device)

        def meta_step(grads: Params, params: Params) -> Params:
            return meta_gradient(grad_fn, params, grads, [draw() for _ in range(extra)], alpha, variant, delta)

        result = client.train(self.start_params(client, received), rnd, lr=beta, steps=self._steps(client),
                              grad_hook=meta_step)
        return Message.model(result.params, base="model", train_loss=result.mean_loss, n=client.n_train)

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        # one adaptation step from the global model the evaluation message carried
        alpha = self.hp.alpha or self.ctx.lr(rnd)
        return client.train(received, rnd, lr=alpha, steps=1, tag="adapt").params
