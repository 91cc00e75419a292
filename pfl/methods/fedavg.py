"""FedAvg and the methods that are FedAvg with one hook changed: FedProx, FedAvg-FT.

FedAvg (McMahan et al. 2017): sampled clients train from the global model; the server moves the
global model by ``server_lr`` towards the (sample-weighted) average of the returned models.

Every method of this family (and FedOpt, pFedMe, the partial-sharing methods) combines the replies
in one place, :meth:`FedAvg.reply_average`, and shares the :class:`~pfl.aggregation.RobustAggregation`
hyperparameters: ``method.aggregator=median`` (or ``trimmed_mean``, ``krum``) makes any of them a
Byzantine-robust variant; ``mean`` is the plain (weighted) average.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..aggregation import RobustAggregation, WeightedSum, aggregate
from ..federation.messages import Message
from ..schema import hp
from ..training import Params, proximal_pull
from . import register
from .base import ClientHandle, Method


@dataclass
class FedAvgHparams(RobustAggregation):
    """FedAvg's server step (and how the replies are combined: mean or a robust rule)."""
    server_lr: float = hp(1.0, "server step size η_g (1 = plain weighted average)", low=0.0, low_open=True)
    weighting: str = hp("samples", "average weights: by client training-set size or uniform",
                        choices=("samples", "uniform"))


@register
class FedAvg(Method):
    name = "fedavg"
    Hparams = FedAvgHparams
    description = "Federated averaging (McMahan et al. 2017)"
    newcomer_rule = "is evaluated with the final global model"

    def setup(self) -> None:
        self.global_model: Params = self.ctx.init_params()

    def broadcast(self, rnd: int, cid: int) -> Message:
        return Message.model(self.global_model)

    def start_params(self, client: ClientHandle, received: Params) -> Params:
        """Where local training starts (FedALA's adaptive local aggregation overrides this)."""
        return received

    def train_kwargs(self, client: ClientHandle, received: Params) -> dict[str, Any]:
        """Extra arguments of the local-SGD loop (FedProx adds its proximal gradient)."""
        return {}

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        received = msg.tensors()
        result = client.train(self.start_params(client, received), rnd, **self.train_kwargs(client, received))
        return Message.model(result.params, base="model", train_loss=result.mean_loss, n=client.n_train)

    #: this class's ``aggregate`` reads the replies' models only through :meth:`reply_average` (all
    #: names), so with the mean they are folded into a running weighted sum as they arrive; the
    #: flag counts only on the class that defines ``aggregate`` (an override keeps every reply unless
    #: it declares the flag again)
    streams_replies: ClassVar[bool] = True

    def streaming(self) -> bool:
        """Whether this round's replies are folded in as they arrive (the mean needs only their sum;
        the robust rules need them all)."""
        owner = next(c for c in type(self).__mro__ if "aggregate" in vars(c))
        return bool(vars(owner).get("streams_replies", False)) and self.hp.aggregator == "mean"

    def receive(self, rnd: int, cid: int, reply: Message) -> Message:
        if not self.streaming():
            return reply
        folded = getattr(self, "_folded", None)
        if folded is None or folded[0] != rnd:
            folded = self._folded = (rnd, WeightedSum())
        folded[1].add(reply.tensors(), reply.info["n"] if self.hp.weighting == "samples" else 1.0)
        return Message({}, dict(reply.info))

    def reply_average(self, replies: dict[int, Message], names: list[str] | None = None) -> Params:
        """The returned models (their tensors ``names``, default all) combined as ``aggregator`` says:
        the mean weighted as ``weighting`` says, or a robust rule (unweighted). With the mean the
        replies were folded in as they arrived (:meth:`receive`, a :class:`~pfl.aggregation.WeightedSum`):
        the same bits as :func:`~pfl.aggregation.weighted_average` of the kept replies."""
        folded, self._folded = getattr(self, "_folded", None), None
        if folded is not None:
            mean = folded[1].mean()
            return mean if names is None else {k: mean[k] for k in names}
        models = [r.tensors() for r in replies.values()]
        weights = ([r.info["n"] for r in replies.values()] if self.hp.weighting == "samples" else None)
        return aggregate(models, weights, self.hp, names=names, attack_fraction=self.ctx.cfg.attack.fraction)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        avg = self.reply_average(replies)
        if self.hp.server_lr == 1.0:
            self.global_model = avg
        else:
            eta = self.hp.server_lr
            self.global_model = {k: g + eta * (avg[k] - g) for k, g in self.global_model.items()}

    def global_params(self) -> Params:
        return self.global_model


@dataclass
class FedProxHparams(FedAvgHparams):
    """FedProx: FedAvg with a proximal term (μ/2)‖w − θ^t‖² in every client's objective."""
    mu: float = hp(0.01, "proximal weight μ (0 reproduces FedAvg exactly)", low=0.0)


@register
class FedProx(FedAvg):
    name = "fedprox"
    Hparams = FedProxHparams
    description = "FedAvg with a proximal term (Li et al. 2020)"

    def train_kwargs(self, client: ClientHandle, received: Params) -> dict[str, Any]:
        if self.hp.mu == 0:
            return {}
        return {"grad_hook": proximal_pull(received, self.hp.mu)}


@dataclass
class FedAvgFTHparams(FedAvgHparams):
    """FedAvg whose global model each client fine-tunes on its own data before evaluation."""
    ft_epochs: int = hp(1, "local fine-tuning epochs before evaluation", low=1)


@register
class FedAvgFT(FedAvg):
    name = "fedavg_ft"
    Hparams = FedAvgFTHparams
    description = "FedAvg + local fine-tuning before evaluation"
    newcomer_rule = "fine-tunes the final global model for ft_epochs (its evaluation rule)"

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        # the global model arrives with the evaluation message; fine-tuning is the client's work
        return client.train(received, rnd, epochs=self.hp.ft_epochs, steps=None, tag="finetune").params
