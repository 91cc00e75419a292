"""pFedMe (Dinh, Tran, Nguyen 2020): personalisation through Moreau envelopes.

Objective: min_w (1/N) Σ_k F_k(w) with F_k(w) = min_θ f_k(θ) + (λ/2)‖θ − w‖².

Client k (sampled) starts from w = θ^t and repeats R local iterations, each on one fresh minibatch ξ:

    K inner steps   θ ← θ − η_p (∇f_k(θ; ξ) + λ(θ − w) + μθ)     (θ warm-starts from the last inner
                                                                solution; the inner steps are the
                                                                shared SGD loop on ξ, full batch)
    outer step      w ← w − η λ (w − θ)                         (η = the client lr)

It sends w and keeps the last θ as its personal model θ̃_k (``client.state["personal"]``), which is
what it is evaluated with. The server takes θ^{t+1} = (1 − β)θ^t + β·avg_k w_k (sample-weighted
as in the reference code); β = 1 is plain averaging. Traffic equals FedAvg's.

Decisions: only sampled clients train (the reference trains every client every round and
aggregates the sampled ones); R defaults to the FedAvg minibatch budget of a round (``local_steps``,
else epochs × batches) instead of the reference's fixed 20, so all baselines see the same data per
round; θ starts each round at the received θ^t (as in the reference, where the local model is
overwritten by the global one); clients never sampled are evaluated with the current global model;
μ = 1e-3 weight decay on the inner problem (reference optimiser default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..aggregation import RobustAggregation
from ..federation.messages import Message
from ..schema import hp
from ..training import Params, batch_indices, proximal_pull
from . import register
from .base import ClientHandle
from .fedavg import FedAvg


@dataclass
class PFedMeHparams(RobustAggregation):
    """pFedMe's Moreau-envelope personalisation."""
    lam: float = hp(15.0, "Moreau-envelope weight λ tying personal θ to the local copy w "
                    "(grid 0.1, 1, 5, 15, 30)", low=0.0, low_open=True)
    personal_lr: float = hp(0.09, "step size η_p of the inner problem", low=0.0, low_open=True)
    inner_steps: int = hp(5, "inner steps K per minibatch", low=1)
    inner_weight_decay: float = hp(1e-3, "weight decay μ inside the inner problem", low=0.0)
    beta: float = hp(1.0, "server mixing β: θ ← (1−β)θ + β·avg w (1 = averaging; paper also uses 2)",
                     low=0.0, low_open=True)
    local_iters: int = hp(0, "local iterations R (minibatches) per round (0 = the FedAvg minibatch budget)", low=0)
    weighting: str = hp("samples", "how the returned w are averaged", choices=("samples", "uniform"))


@register
class PFedMe(FedAvg):
    name = "pfedme"
    Hparams = PFedMeHparams
    description = "pFedMe: personalised FL with Moreau envelopes (Dinh et al. 2020)"
    streams_replies = True  # its aggregate reads the replies through reply_average only

    def _iters(self, client: ClientHandle) -> int:
        if self.hp.local_iters:
            return self.hp.local_iters
        fed = self.ctx.cfg.federation
        n, b = client.n_train, fed.batch_size
        per_epoch = 1 if b <= 0 or b >= n else math.ceil(n / b)
        return fed.local_steps if fed.local_steps is not None else fed.local_epochs * per_epoch

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        received = msg.tensors()
        hp_ = self.hp
        lam, eta = hp_.lam, self.ctx.lr(rnd)
        w = {k: v.clone() for k, v in self.start_params(client, received).items()}
        theta = {k: v.clone() for k, v in w.items()}
        x, y = client.data.x_train, client.data.y_train
        batch_size = self.ctx.cfg.federation.batch_size

        moreau_pull = proximal_pull(w, lam)  # w moves in place below; the pull follows it
        losses = []
        batches = batch_indices(len(y), batch_size, 1, self._iters(client), client.generator(rnd, "pfedme"), x.device)
        for idx in batches:
            xb, yb = (x, y) if idx is None else (x[idx], y[idx])
            inner = client.train(theta, rnd, x=xb, y=yb, batch_size=0, steps=hp_.inner_steps, epochs=1,
                                 lr=hp_.personal_lr, momentum=0.0, weight_decay=hp_.inner_weight_decay,
                                 grad_hook=moreau_pull)
            theta = inner.params
            losses.append(inner.mean_loss)
            # in place, so the pull of the next inner problem sees the moved w
            for k in w:  # running statistics too (w's move toward θ's); a batch counter stays
                if w[k].is_floating_point():
                    w[k].sub_(eta * lam * (w[k] - theta[k]))
        client.state["personal"] = theta
        loss = float(np.mean(losses)) if losses else float("nan")
        return Message.model(w, base="model", train_loss=loss, n=client.n_train)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        avg = self.reply_average(replies)
        beta = self.hp.beta
        self.global_model = avg if beta == 1.0 else {
            k: (1 - beta) * g + beta * avg[k] for k, g in self.global_model.items()}

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        return client.state.get("personal", received)
