"""FedBABU (Oh, Kim, Yun, ICLR 2022): federate the body with a fixed random head; fine-tune to personalise.

During federation the head (the last layer unit, :func:`pfl.models.layer_groups`) keeps its random
initialisation θ⁰_h on every client and is never trained nor sent; a sampled client trains the body
only, from the received body and the fixed head, and sends the body; the server averages the bodies
(FedAvg's rule, weighting and robust aggregators). Only the body crosses the wire.

Personalisation happens at evaluation: every client fine-tunes the federated model (the server's
current body + θ⁰_h) on its own training split for ``finetune_epochs`` and is evaluated with the
result. ``finetune_part`` says what moves: ``full`` (the paper's default: body and head) or ``head``
/ ``body``. The federated model itself is the global model (``global/*``).

Partial sharing (:mod:`pfl.methods.partial`) with body shared and the head frozen: the client keeps no
state, since its head is θ⁰_h, which every side regenerates from the run seed.
Decisions: fine-tuning uses the client lr unless ``finetune_lr`` is set (the paper fine-tunes with the
training lr) and the federation's batch size; ``finetune_epochs`` = 5 is the paper's τ_f of its main
tables (unverified against its code); 0 evaluates the federated model as is. Fine-tuning draws its
minibatches from the client's ``finetune`` stream of the round, so an evaluation is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..federation.messages import Message
from ..models import layer_groups
from ..schema import hp
from ..training import Params
from . import register
from .base import ClientHandle, EvalPlan
from .fedavg import FedAvgHparams
from .partial import PartialSharing


@dataclass
class FedBABUHparams(FedAvgHparams):
    """FedBABU: body-only federation with a fixed random head; fine-tuning at evaluation."""
    finetune_epochs: int = hp(5, "epochs of fine-tuning before evaluation (paper τ_f = 5; 0 = none)", low=0)
    finetune_part: str = hp("full", "what fine-tuning trains: the whole model (paper), the head or the body",
                            choices=("full", "head", "body"))
    finetune_lr: float = hp(0.0, "learning rate of fine-tuning (0 = the client lr)", low=0.0)


@register
class FedBABU(PartialSharing):
    name = "fedbabu"
    Hparams = FedBABUHparams
    description = "FedBABU: body trained with a fixed random head, fine-tuned to personalise (Oh et al. 2022)"
    newcomer_rule = "fine-tunes the final federated model for finetune_epochs (its evaluation rule)"

    def shared_names(self) -> list[str]:
        return list(layer_groups(self.ctx.model).body)

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        # the head never trains during federation (trainable = body): it stays θ⁰_h, so nothing is kept
        result = client.train(self.start_params(client, msg.tensors()), rnd, trainable=self.shared)
        return Message.model({k: result.params[k] for k in self.shared}, base="model", train_loss=result.mean_loss,
                             n=client.n_train)

    def global_params(self) -> Params:
        # the server's head entries are θ⁰_h for ever (aggregate moves the shared names only)
        return self.global_model

    def finetuned(self, rnd: int, client: ClientHandle, model: Params) -> Params:
        """The federated model fine-tuned on the client's training split (the personal model)."""
        if self.hp.finetune_epochs == 0:
            return model
        part = {"full": None, "head": self.own_names, "body": self.shared}[self.hp.finetune_part]
        kwargs = {"lr": self.hp.finetune_lr} if self.hp.finetune_lr else {}
        return client.train(model, rnd, epochs=self.hp.finetune_epochs, steps=None, trainable=part, tag="finetune",
                            **kwargs).params

    def eval_plan(self, rnd: int, client: ClientHandle, msg: Message | None) -> EvalPlan:
        # only the body is sent (eval_message of PartialSharing); the head is θ⁰_h on both sides
        model = self.start_params(client, self.decode(msg))
        return EvalPlan(self.finetuned(rnd, client, model), global_model=model)
