"""FedRoD (Chen & Chao, ICLR 2022): one body, a generic head for everyone and a personal head each.

The model's body φ and its head (the last layer unit) are the *generic* model, shared and averaged as
FedAvg does; each client also keeps a *personal* head h_k of the same shape, which never leaves it.
On every minibatch (x, y) of client k, with z = φ(x) the representation (the head's input,
:mod:`pfl.models.features`) and g = h_G(z) the generic logits, one step of the shared loop minimises

    BSM_k(g, y) + CE(stop(g) + h_k(stop(z)), y)

where BSM_k is the balanced softmax, the cross-entropy of g + log π_k with π_k client k's class
counts on its training split: the generic model learns as if the client's labels were balanced.
The two terms touch disjoint parameters (the first φ and h_G, the second h_k only), so one step
updates all three simultaneously, each with its own gradient. The client sends (φ, h_G); the server
averages them. A client predicts with g + h_k(z) (the personal model, ``test/*``); the generic model
alone is the global one (``global/*``).

Decisions: the paper's linear personal head (not its hypernetwork variant), started at zero so that
an untrained client predicts with the generic model (PFLlib copies the initial head instead);
``generic_loss: ce`` replaces the balanced softmax by the plain cross-entropy (the paper's ablation).
A class a client does not hold gets the prior of 1e-12 samples (about −27.6 on the logit) rather
than log 0: the padded rows of a batched cohort would otherwise give ∞·0. The personal prediction
uses the server's current body and generic head with the client's own h_k (partial.py's convention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..federation.messages import Message
from ..models.features import features_and_logits, head_module_name, head_output, head_relative
from ..schema import ConfigError, hp
from ..training import Params, Term
from . import register
from .base import ClientHandle
from .fedavg import FedAvg, FedAvgHparams

_P = "phead."  # the personal head's entries beside the model's in the training dict


@dataclass
class FedRoDHparams(FedAvgHparams):
    """FedRoD: balanced-softmax generic model, linear personal head on its representation."""
    generic_loss: str = hp("bsm", "the generic model's loss: balanced softmax (paper) or plain cross-entropy",
                           choices=("bsm", "ce"))


def _split(params: Params) -> tuple[Params, Params]:
    n = len(_P)
    return ({k: v for k, v in params.items() if not k.startswith(_P)},
            {k[n:]: v for k, v in params.items() if k.startswith(_P)})


@dataclass
class FedRoDLoss(Term):
    """Per-sample BSM(g + log π, y) + CE(stop(g) + h_k(stop(z)), y) (module docstring)."""
    model: torch.nn.Module
    head: str
    log_prior: torch.Tensor  # (classes,): log π_k, or zeros for the plain cross-entropy

    def __call__(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shared, personal = _split(params)
        z, g = features_and_logits(self.model, self.head, shared, x)
        generic = F.cross_entropy(g + self.log_prior, y, reduction="none")
        p = head_output(self.model, self.head, personal, z.detach())
        return generic + F.cross_entropy(g.detach() + p, y, reduction="none")


@dataclass
class FedRoDForward(Term):
    """The personal prediction: generic logits plus the personal head's, on one representation."""
    model: torch.nn.Module
    head: str

    def __call__(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        shared, personal = _split(params)
        z, g = features_and_logits(self.model, self.head, shared, x)
        return g + head_output(self.model, self.head, personal, z)


@register
class FedRoD(FedAvg):
    name = "fedrod"
    Hparams = FedRoDHparams
    description = "FedRoD: balanced-softmax generic model and personal heads (Chen & Chao 2022)"

    def configure(self) -> None:
        super().configure()
        if self.ctx.meta.task != "classification":
            raise ConfigError("method.name", "fedrod needs a classification task (balanced softmax over classes)")
        self.head = head_module_name(self.ctx.model)
        init = self.ctx.init_params()
        self.init_personal: Params = {k: torch.zeros_like(init[f"{self.head}.{k}"])
                                      for k in head_relative(self.ctx.model, self.head)}

    def personal_head(self, client: ClientHandle) -> Params:
        return client.state.get("personal_head", self.init_personal)

    def log_prior(self, client: ClientHandle) -> torch.Tensor:
        y = client.data.y_train
        classes = self.ctx.meta.num_classes
        if self.hp.generic_loss == "ce":
            return torch.zeros(classes, device=y.device)
        counts = torch.bincount(y, minlength=classes).to(torch.float32)
        return torch.log(counts.clamp_min(1e-12))

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        received = msg.tensors()
        start = {**self.start_params(client, received), **{_P + k: v for k, v in self.personal_head(client).items()}}
        result = client.train(start, rnd, loss=FedRoDLoss(client.model, self.head, self.log_prior(client)))
        shared, personal = _split(result.params)
        client.state["personal_head"] = personal
        return Message.model(shared, base="model", train_loss=result.mean_loss, n=client.n_train)

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        return {**received, **{_P + k: v for k, v in self.personal_head(client).items()}}

    def eval_forward(self, client: ClientHandle):
        return FedRoDForward(client.model, self.head)
