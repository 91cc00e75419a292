"""Ditto (Li, Hu, Beirami, Smith 2021): FedAvg plus a personal model pulled towards the global one.

Server: FedAvg on the returned global-task models. Client k (sampled) does two things per round:

(a) the global task: FedAvg's local training from θ^t, whose result it sends;
(b) the personal task: ``personal_epochs`` epochs of SGD on its personal model v_k with the
    proximal gradient ∇f_k(v) + λ(v − θ^t), centred at the *received* θ^t (not the client's
    freshly trained θ_k).

v_k lives in ``client.state["personal"]``; it starts at θ^0, and where training of v starts is
decided by :meth:`Ditto.personal_start` (a plug-in such as FedALA overrides it). Clients never
sampled are evaluated with θ^0, as in the paper's protocol. Evaluation uses v_k.

λ → ∞ makes v_k track θ^t; λ = 0 makes v_k a Local model (trained only when sampled).
Defaults: λ = 0.1 (FedSLR-tuned), one personal epoch, personal lr = the client lr.
Traffic equals FedAvg's. A newcomer (after training) receives the final θ^T and trains its personal
model from it with the same proximal pull for ``newcomers.finetune_rounds`` personal tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..federation.messages import Message
from ..schema import hp
from ..training import Params, proximal_pull
from . import register
from .base import ClientHandle
from .fedavg import FedAvg, FedAvgHparams


@dataclass
class DittoHparams(FedAvgHparams):
    """Ditto: the proximal personal task next to FedAvg's global task."""
    lam: float = hp(0.1, "proximal weight λ pulling the personal model to the global one "
                    "(grid 0.01, 0.05, 0.1, 0.5, 1, 2)", low=0.0)
    personal_epochs: int = hp(1, "epochs of the personal task per round (s)", low=1)
    personal_lr: float = hp(0.0, "learning rate of the personal task (0 = the client lr)", low=0.0)


@register
class Ditto(FedAvg):
    name = "ditto"
    Hparams = DittoHparams
    description = "Ditto: FedAvg + proximally regularised personal models (Li et al. 2021)"

    def configure(self) -> None:
        super().configure()
        self.init: Params = self.ctx.init_params()  # θ^0, regenerated from the run seed

    def personal_start(self, client: ClientHandle, received: Params) -> Params:
        """Where the personal model's training starts this round: the stored v_k (θ^0 at first)."""
        return client.state.get("personal", self.init)

    def personal_kwargs(self, client: ClientHandle, received: Params, rnd: int) -> dict[str, Any]:
        lam = self.hp.lam
        kwargs: dict[str, Any] = {"epochs": self.hp.personal_epochs, "steps": None, "tag": "personal",
                                  "lr": self.hp.personal_lr or self.ctx.lr(rnd)}
        if lam:
            kwargs["grad_hook"] = proximal_pull(received, lam)
        return kwargs

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        received = msg.tensors()
        result = client.train(self.start_params(client, received), rnd, **self.train_kwargs(client, received))
        personal = client.train(self.personal_start(client, received), rnd,
                                **self.personal_kwargs(client, received, rnd))
        client.state["personal"] = personal.params
        client.state["personal_loss"] = personal.mean_loss
        return Message.model(result.params, base="model", train_loss=result.mean_loss, n=client.n_train)

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        return client.state.get("personal", self.init)

    # newcomers: the personal task against the final global model, from it, once per join step
    newcomer_rule = ("trains its personal model from the final global model with Ditto's pull "
                     "(newcomers.finetune_rounds personal tasks)")

    def join_active(self, step: int) -> list[int]:
        return list(self.ctx.newcomers) if step < self.ctx.cfg.newcomers.finetune_rounds else []

    def join_message(self, rnd: int, step: int, cid: int) -> Message | None:
        return Message.model(self.global_model) if step == 0 else None

    def join_update(self, rnd: int, step: int, client: ClientHandle, msg: Message | None) -> None:
        if step == 0:
            client.state["join_anchor"] = msg.tensors()
            client.state["personal"] = dict(client.state["join_anchor"])
        anchor = client.state["join_anchor"]
        personal = client.train(client.state["personal"], rnd, **self.personal_kwargs(client, anchor, rnd))
        client.state["personal"] = personal.params
        return None
