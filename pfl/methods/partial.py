"""Partial sharing: one part of the model is federated, the other part is each client's own.

The split comes from :func:`pfl.models.layer_groups`: ``head`` is the final linear classifier,
``body`` everything below it. Only the shared part ever crosses the wire (down and up), so the
measured traffic is |shared| each way per sampled client. Each client's own part lives in
``client.state["own"]`` and starts at θ^0 (the same initialisation for every client). A client is
evaluated with its own part plus the server's current shared part (the shared part it would receive
next; spec convention for FedRep).

FedRep (Collins et al. 2021): shared body φ, personal head h_k. A sampled client first trains its
head for ``head_epochs`` with the body frozen, then the body for ``body_epochs`` (0 = the
federation's local epochs/steps) with the head frozen — two calls of the shared loop, so momentum
never leaks between the phases — and sends φ_k. Where local training starts is built by
:meth:`FedRep.start_params` (received body + own head); a plug-in such as FedALA overrides it.
Decision: ``head_epochs`` defaults to 1 (PFLlib) rather than the FedRep code's 10, which would make
FedRep several times costlier per round than the other baselines; set 10 for the paper's protocol.

LG-FedAvg (Liang et al. 2020): the reverse, personal body (local representation) and shared head.
Clients train all layers jointly and send their head; the server averages the heads (weighted as
FedAvg's ``weighting``; the reference uses a uniform mean) and every client then holds the same
head. ``warmup_rounds`` runs plain FedAvg first (the reference starts from a FedAvg-trained model);
after the warm-up each client receives the full model once, on its first sampling, and adopts its
body. Only the final linear layer is shared (the reference's num_layers_keep = 1).

A newcomer of LG-FedAvg fine-tunes (``newcomers.finetune_rounds`` local updates) the server's whole model (the averaged head and the server's body
copy: θ^0, or the warm-up's FedAvg model) and is evaluated with the result (docs/methods/fpfc.md §8, "LG ...
fine-tune the final global model"; :class:`~pfl.methods.base.FineTuneNewcomers`). FedRep's
newcomers use the default rule (their own head stays θ^0).

Neither method has a meaningful global model (the shared part alone cannot classify), so no
``global/test_acc`` is reported.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..federation.messages import Message
from ..models import layer_groups
from ..models.functional import with_statistics
from ..schema import hp
from ..training import Params
from . import register
from .base import ClientHandle, FineTuneNewcomers
from .fedavg import FedAvg, FedAvgHparams


class PartialSharing(FedAvg):
    """FedAvg over the ``shared`` parameter names only; the rest is kept per client."""

    def shared_names(self) -> list[str]:
        raise NotImplementedError

    def shared_entries(self, names: list[str]) -> list[str]:
        """Every entry of the model dict ``names`` (params, then statistics) that is shared: the
        shared parameters and, for a BatchNorm model, the running statistics of their layers."""
        return with_statistics(self.ctx.model, self.shared_names())

    def configure(self) -> None:
        super().configure()
        init = self.ctx.init_params()  # θ^0, regenerated from the run seed
        self.names = list(init)
        self.shared = self.shared_entries(self.names)
        shared = set(self.shared)
        self.own_names = [k for k in self.names if k not in shared]
        self.init_own: Params = {k: init[k] for k in self.own_names}

    def own(self, client: ClientHandle) -> Params:
        return client.state.get("own", self.init_own)

    def broadcast(self, rnd: int, cid: int) -> Message:
        return Message.model({k: self.global_model[k] for k in self.shared})

    def start_params(self, client: ClientHandle, received: Params) -> Params:
        """The model local training starts from: the received shared part + the client's own part."""
        own = self.own(client)
        return {k: (received[k] if k in received else own[k]) for k in self.names}

    def local_train(self, rnd: int, client: ClientHandle, start: Params):
        return client.train(start, rnd)

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        received = msg.tensors()
        result = self.local_train(rnd, client, self.start_params(client, received))
        client.state["own"] = {k: result.params[k] for k in self.own_names}
        return Message.model({k: result.params[k] for k in self.shared}, base="model", train_loss=result.mean_loss,
                          n=client.n_train)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        avg = self.reply_average(replies, names=self.shared)
        eta = self.hp.server_lr
        for k in self.shared:
            g = self.global_model[k]
            self.global_model[k] = avg[k] if eta == 1.0 else g + eta * (avg[k] - g)

    def global_params(self) -> Params | None:
        return None

    def eval_message(self, rnd: int, cid: int) -> Message:
        """The shared part a client is evaluated with (the one it would receive next)."""
        return Message.model({k: self.global_model[k] for k in self.shared})

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        own = self.own(client)
        return {k: (own[k] if k in own else received[k]) for k in self.names}


@dataclass
class FedRepHparams(FedAvgHparams):
    """FedRep: shared body, personal head; head epochs, then body epochs."""
    head_epochs: int = hp(1, "epochs on the personal head (body frozen) per round (FedRep code: 10)", low=1)
    body_epochs: int = hp(0, "epochs on the shared body (head frozen) per round (0 = federation "
                          "local_epochs / local_steps)", low=0)


@register
class FedRep(PartialSharing):
    name = "fedrep"
    Hparams = FedRepHparams
    description = "FedRep: shared representation, personal heads (Collins et al. 2021)"

    def shared_names(self) -> list[str]:
        return list(layer_groups(self.ctx.model).body)

    def local_train(self, rnd: int, client: ClientHandle, start: Params):
        groups = layer_groups(client.model)
        head = client.train(start, rnd, trainable=groups.head, epochs=self.hp.head_epochs, steps=None,
                            tag="head")
        body_kwargs = {"epochs": self.hp.body_epochs, "steps": None} if self.hp.body_epochs else {}
        return client.train(head.params, rnd, trainable=groups.body, tag="body", **body_kwargs)


@dataclass
class LGFedAvgHparams(FedAvgHparams):
    """LG-FedAvg: personal body, shared head."""
    warmup_rounds: int = hp(0, "rounds of plain FedAvg before the body becomes personal "
                            "(the reference starts from a FedAvg-trained model)", low=0)


@register
class LGFedAvg(FineTuneNewcomers, PartialSharing):
    name = "lgfedavg"
    Hparams = LGFedAvgHparams
    quick = {"method.warmup_rounds": 1}
    description = "LG-FedAvg: local representations, global head (Liang et al. 2020)"

    def shared_names(self) -> list[str]:
        return list(layer_groups(self.ctx.model).head)

    def setup(self) -> None:
        super().setup()
        self.synced: set[int] = set()

    def _full(self, rnd: int, cid: int) -> bool:
        """Whether client ``cid`` gets (and returns) the whole model this round."""
        warm = self.hp.warmup_rounds
        return bool(warm) and (rnd < warm or cid not in self.synced)

    def broadcast(self, rnd: int, cid: int) -> Message:
        if self._full(rnd, cid):
            if rnd >= self.hp.warmup_rounds:
                self.synced.add(cid)
            return Message.model(dict(self.global_model))
        return super().broadcast(rnd, cid)

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        if rnd >= self.hp.warmup_rounds:
            return super().local_update(rnd, client, msg)
        # warm-up: FedAvg on the whole model; the client adopts the trained body as its own
        result = client.train(msg.tensors(), rnd)
        client.state["own"] = {k: result.params[k] for k in self.own_names}
        return Message.model(result.params, base="model", train_loss=result.mean_loss, n=client.n_train)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if rnd < self.hp.warmup_rounds:
            FedAvg.aggregate(self, rnd, replies)
            return
        super().aggregate(rnd, replies)
