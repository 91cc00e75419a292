"""FedNova (Wang, Liu, Liang, Joshi, Poor, NeurIPS 2020): normalised averaging of local updates.

Clients that run different numbers of local steps τ_i (here: different data sizes at a fixed number
of epochs) pull FedAvg towards the objective of the clients that step most. FedNova removes that
inconsistency: with local SGD written as x − y_i = η Σ_j a_{i,j} g_{i,j} (a_i says how often each
local gradient counts in the update), a client sends its normalised update d_i = (x − y_i)/‖a_i‖₁,
and the server steps

    x ← x − η_g · τ_eff · Σ_i p_i d_i,       τ_eff = Σ_i p_i ‖a_i‖₁,

with p_i the data weights of the clients that replied. ‖a_i‖₁ depends on the local optimiser
(the paper's §4): plain SGD gives τ_i; heavy-ball momentum ρ (``federation.momentum``) gives
[τ − ρ(1 − ρ^τ)/(1 − ρ)]/(1 − ρ); a proximal pull μ(w − x) (``mu``, FedProx's local solver) gives
[1 − (1 − ημ)^τ]/(ημ). All are the total weight one unit gradient at every step would receive, so
:func:`update_weight` computes ‖a‖₁ by running that scalar recursion (momentum and pull together
too), and the truth tests compare it with the closed forms. With equal τ_i and no momentum nor
pull this is FedAvg.

The same algorithm, without momentum or pull, is the worked example of docs/design.md §16 (kept
there as the method authors' guide, registered only by its own test). Decisions: weight decay is
part of a client's objective, so its gradient counts as g (not normalised away); ``weighting``
chooses p_i (samples, the paper's, or uniform) and the same p_i weigh τ_eff; robust aggregators
(FedAvg's) apply to the normalised updates d_i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..federation.messages import Message, Update
from ..schema import hp
from ..training import Params, proximal_pull
from . import register
from .base import ClientHandle
from .fedavg import FedAvg, FedAvgHparams


@dataclass
class FedNovaHparams(FedAvgHparams):
    """FedNova: FedAvg's server on updates normalised by the local optimiser's ‖a_i‖₁."""
    mu: float = hp(0.0, "proximal weight μ of the local solver (FedProx's; 0 = plain local SGD, the "
                   "paper's main setting)", low=0.0)


def update_weight(steps: int, lr: float, momentum: float = 0.0, mu: float = 0.0) -> float:
    """‖a‖₁ of ``steps`` local steps with heavy-ball ``momentum`` and a pull ``mu`` towards the start:
    the distance (in units of lr) travelled when every step's gradient is 1."""
    offset, buf = 0.0, 0.0  # w − start, the momentum buffer (as pfl.training.local_sgd keeps it)
    for t in range(steps):
        g = 1.0 + mu * offset
        buf = g if t == 0 else momentum * buf + g
        offset -= lr * buf
    return -offset / lr if steps else 0.0


@register
class FedNova(FedAvg):
    name = "fednova"
    Hparams = FedNovaHparams
    description = "FedNova: normalised averaging against objective inconsistency (Wang et al. 2020)"
    metric_names = ("fednova/tau_eff",)
    #: aggregate reads the updates only through reply_average: folded as they arrive with the mean
    streams_replies: ClassVar[bool] = True

    def setup(self) -> None:
        super().setup()
        self.tau_eff = 0.0

    def train_kwargs(self, client: ClientHandle, received: Params) -> dict[str, Any]:
        return {"grad_hook": proximal_pull(received, self.hp.mu)} if self.hp.mu else {}

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        start = msg.tensors()
        # the start hook (a plug-in such as ALA may start elsewhere); the update stays a change of the received model
        result = client.train(self.start_params(client, start), rnd, **self.train_kwargs(client, start))
        norm = update_weight(result.steps, self.ctx.lr(rnd), self.ctx.cfg.federation.momentum, self.hp.mu)
        d = {k: (start[k] - result.params[k]) / max(norm, 1e-12) for k in start}
        # an Update part: compression sends its values (a Model part would name its base)
        return Message.of({"d": Update(d)}, n=client.n_train, a_norm=norm, train_loss=result.mean_loss)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        weights = [float(r.info["n"]) if self.hp.weighting == "samples" else 1.0 for r in replies.values()]
        self.tau_eff = sum(w * r.info["a_norm"] for w, r in zip(weights, replies.values())) / sum(weights)
        d = self.reply_average(replies)
        step = self.hp.server_lr * self.tau_eff
        self.global_model = {k: v - step * d[k] for k, v in self.global_model.items()}

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        return {"fednova/tau_eff": self.tau_eff}
