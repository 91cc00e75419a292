"""MOON (Li, He, Song, CVPR 2021): model-contrastive federated learning.

FedAvg whose local objective adds a contrastive term on the representation z (the head's input,
:mod:`pfl.models.features`). For a minibatch sample x let z = R_w(x) under the model being trained,
z_g = R_θ(x) under the received global model θ^t and z_p = R_prev(x) under the client's own model of
its previous participation, all three frozen but z. With s(a, b) the cosine similarity and τ the
temperature, the term is the cross-entropy of picking the global representation as the positive
among {global, previous}:

    ℓ_con = −log( e^{s(z, z_g)/τ} / (e^{s(z, z_g)/τ} + e^{s(z, z_p)/τ}) )

and the client minimises CE(w; x, y) + μ·ℓ_con on every minibatch, from θ^t, with the shared loop
(the loss is a :class:`~pfl.training.Term`, so a vectorized cohort batches it). It sends its model,
keeps it as its next "previous" model, and the server averages (FedAvg's rule). Evaluation uses the
global model, as the paper does.

Decisions: the representation is the head's input (PFLlib's choice), not the paper's extra
two-layer projection head, which would change the model being compared; one previous model (the
paper's default buffer size 1). A client's first "previous" model is θ⁰, so in round 0 z_g = z_p and
the term's gradient is zero (the paper's code starts from the initial nets too). Defaults μ = 5 and
τ = 0.5 (the paper's CIFAR-10 values; μ = 1 for CIFAR-100 and Tiny-ImageNet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..federation.messages import Message
from ..models.features import features_and_logits, head_module_name
from ..schema import ConfigError, hp
from ..training import Params, Term
from . import register
from .base import ClientHandle
from .fedavg import FedAvg, FedAvgHparams


@dataclass
class MOONHparams(FedAvgHparams):
    """MOON: FedAvg plus the model-contrastive term μ·ℓ_con."""
    mu: float = hp(5.0, "weight μ of the contrastive term (paper: 5 on CIFAR-10, 1 on CIFAR-100; "
                   "grid 0.1, 1, 5, 10); 0 is FedAvg", low=0.0)
    tau: float = hp(0.5, "temperature τ of the cosine similarities (paper 0.5)", low=0.0, low_open=True)


@dataclass
class MOONLoss(Term):
    """Per-sample CE + μ·ℓ_con (module docstring); ``glob`` and ``prev`` are frozen models."""
    model: torch.nn.Module
    head: str
    glob: Params
    prev: Params
    mu: float
    tau: float

    def __call__(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z, out = features_and_logits(self.model, self.head, params, x)
        with torch.no_grad():
            z_g = features_and_logits(self.model, self.head, self.glob, x)[0].flatten(1)
            z_p = features_and_logits(self.model, self.head, self.prev, x)[0].flatten(1)
        z = z.flatten(1)
        pos = F.cosine_similarity(z, z_g, dim=1) / self.tau
        neg = F.cosine_similarity(z, z_p, dim=1) / self.tau
        contrast = torch.logsumexp(torch.stack([pos, neg]), dim=0) - pos
        return F.cross_entropy(out, y, reduction="none") + self.mu * contrast


@register
class MOON(FedAvg):
    name = "moon"
    Hparams = MOONHparams
    description = "MOON: FedAvg with a model-contrastive term on representations (Li et al. 2021)"

    def configure(self) -> None:
        super().configure()
        if self.ctx.meta.task != "classification":
            raise ConfigError("method.name", "moon needs a classification task (its local loss is a cross-entropy)")
        self.head = head_module_name(self.ctx.model)
        self.init: Params = self.ctx.init_params()  # the first "previous" model θ⁰, from the run seed

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        received = msg.tensors()
        kwargs = {}
        if self.hp.mu:
            prev = client.state.get("previous", self.init)
            kwargs["loss"] = MOONLoss(client.model, self.head, received, prev, self.hp.mu, self.hp.tau)
        result = client.train(self.start_params(client, received), rnd, **kwargs)
        client.state["previous"] = result.params
        return Message.model(result.params, base="model", train_loss=result.mean_loss, n=client.n_train)
