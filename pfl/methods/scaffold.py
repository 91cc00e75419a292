"""SCAFFOLD (Karimireddy et al. 2020) with option-II control variates.

Server state: the model θ and the server control variate c (both d floats, c starts at 0).
Client state: its control variate c_k (d floats, starts at 0, kept across rounds).

A sampled client receives θ and c, runs K plain SGD steps on its loss with every gradient corrected
by c − c_k (so each client drifts towards the average direction instead of its own), and derives
its new control variate from how far it moved: c_k⁺ = c_k − c + (θ − y)/(K·η_l), i.e. the average
corrected gradient along its path minus the correction. It returns Δy = y − θ and Δc = c_k⁺ − c_k.
The server moves θ by η_g times the unweighted mean of Δy and c by (1/N)·ΣΔc (N = all clients,
because c estimates the average control variate over the whole population).

Both directions carry two model-sized tensors, so SCAFFOLD's traffic is 2× FedAvg's (measured by
the simulator from the messages, never counted here).

Decisions: K is the number of steps the loop actually took and η_l the round's client lr (the
formula is exact for plain SGD; with federation momentum or weight decay it is the usual
approximation). Weight decay, if configured, is applied on top of the corrected gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..aggregation import weighted_average, zeros_like
from ..federation.messages import Message, Model, State, Update
from ..schema import hp
from ..training import Params, Shift
from . import register
from .base import ClientHandle
from .fedavg import FedAvg

@dataclass
class ScaffoldHparams:
    """SCAFFOLD's server step (the control variates have no tunable knobs)."""
    server_lr: float = hp(1.0, "global step size η_g applied to the mean Δy (1 = average of the client models)",
                          low=0.0, low_open=True)


@register
class Scaffold(FedAvg):
    name = "scaffold"
    Hparams = ScaffoldHparams
    description = "SCAFFOLD: FedAvg with control variates against client drift (option II)"

    def setup(self) -> None:
        super().setup()
        self.c: Params = zeros_like(self.global_model)

    def broadcast(self, rnd: int, cid: int) -> Message:
        # the model and the server control variate: both kept by the client between rounds
        return Message.of({"theta": Model(self.global_model), "c": State(self.c)})

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        theta, c = msg.tensors("theta"), msg.tensors("c")
        c_k = client.state.get("c")
        if c_k is None:
            c_k = zeros_like(theta)
        correction = {k: c[k] - c_k[k] for k in theta}
        lr = self.ctx.lr(rnd)
        result = client.train(self.start_params(client, theta), rnd, lr=lr, grad_hook=Shift(correction))
        y = result.params
        steps = max(result.steps, 1)
        c_new = {k: c_k[k] - c[k] + (theta[k] - y[k]) / (steps * lr) for k in theta}
        client.state["c"] = c_new
        dy = {k: y[k] - theta[k] for k in theta}
        dc = {k: c_new[k] - c_k[k] for k in theta}
        return Message.of({"dy": Update(dy), "dc": Update(dc)}, train_loss=result.mean_loss, n=client.n_train)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        mean_dy = weighted_average([r.tensors("dy") for r in replies.values()])
        mean_dc = weighted_average([r.tensors("dc") for r in replies.values()])
        eta = self.hp.server_lr
        share = len(replies) / self.ctx.num_members  # (1/N)·Σ Δc = (|S|/N)·mean Δc
        self.global_model = {k: g + eta * mean_dy[k] for k, g in self.global_model.items()}
        self.c = {k: v + share * mean_dc[k] for k, v in self.c.items()}
