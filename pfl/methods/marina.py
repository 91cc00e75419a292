"""MARINA (Gorbunov, Burlachenko, Li, Richtárik 2021): compressed gradient differences with a
shared coin between a full and a compressed round (docs/methods/seminar.md §3.3, the box; gradient form).

Server state: the model x^k and the gradient estimator g^k; every client keeps its copy of x^k
(every client takes part in every round, so the copies agree). Round 0 is the box's g⁰ = ∇f(x⁰):
every client uploads its full local gradient at x⁰ (dense). Round k ≥ 1 draws the shared coin
c_k ~ Be(p) (public randomness, so it costs nothing on the wire) and sends g^k (d floats); each
client steps x^{k+1} = x^k − γg^k and uploads

* c_k = 1: ∇f_i(x^{k+1}) on its whole training split (or ``sync_batch`` samples), dense (32d bits);
* c_k = 0: Q(∇f_i(x^{k+1}) − ∇f_i(x^k)) with the unbiased compressor ``compression.uplink`` names,
  both gradients on the same minibatch of ``federation.batch_size`` (VR-MARINA style), so the
  difference vanishes as the steps shrink.

The server takes the same step and sets g^{k+1} = mean of the uploads (c_k = 1) or g^k + mean
Q(…) (c_k = 0). Q is unbiased; the estimator is biased: E[g^{k+1}] − ∇f(x^{k+1}) = (1 − p)(g^k −
∇f(x^k)). Defaults: p = bits(Q)/(32d) — the expected dense and compressed traffic are equal
(k/d for rand-k).
The step: γ = federation.lr/(1 + √((1 − p)ω/(pN))) — the paper's bound with the client lr in the
role of 1/L, so a noisier compressor (larger ω) or rarer full rounds get a smaller step; ``lr > 0``
sets γ directly. Evaluated with the global model x^k (the paper returns a random iterate; we
report the last).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..compression import decode_update, encode_update
from ..federation.messages import Message, Update
from ..schema import hp
from ..training import Params, batch_gradient
from . import register
from .base import ClientHandle, Method
from .compressed import generators, model_bits_ratio, model_omega, require_full_participation, uplink_compressor
from .diana import reply_weights, weighted_sum


@dataclass
class MarinaHparams:
    """MARINA's coin and step."""
    p: float = hp(0.0, "probability of a full (dense) round (0: bits(Q)/(32d), equal expected traffic)",
                  low=0.0, high=1.0)
    lr: float = hp(0.0, "step γ (0: federation.lr (and its schedule) / (1 + √((1−p)ω/(pN))), the paper's "
                   "bound with the client lr as 1/L)", low=0.0)
    sync_batch: int = hp(0, "samples per client for the full gradients of c = 1 rounds (0: all)", low=0)
    weighting: str = hp("uniform", "mean over clients: uniform (the box's f = (1/N)Σf_i) or by training-set size",
                        choices=("uniform", "samples"))


@register
class Marina(Method):
    name = "marina"
    metric_names = ("marina/p", "marina/omega", "marina/gamma", "marina/full_rounds")
    Hparams = MarinaHparams
    quick = {"federation.clients_per_round": 0}
    description = ("MARINA: a shared coin between full gradients and compressed gradient differences "
                   "(Gorbunov et al. 2021); global model; every client every round; unbiased compression.uplink")
    compresses_uplink = "unbiased"
    exact_downlink = "every client steps its own copy of x with the broadcast g^k, which must equal the server's x"

    def configure(self) -> None:
        require_full_participation(self.ctx, self.name, "every client keeps its copy of x and the coin's "
                                                        "full rounds need every gradient")
        self.compressor, self.min_numel = uplink_compressor(self.ctx)
        self.omega = model_omega(self.ctx)
        self.bits_ratio = model_bits_ratio(self.ctx)
        self.init: Params = self.ctx.init_params()

    @property
    def prob(self) -> float:
        return self.hp.p or min(1.0, self.bits_ratio)

    @property
    def step_factor(self) -> float:
        """1/(1 + √((1 − p)ω/(pN))): the theory's step relative to 1/L."""
        p, n = self.prob, self.ctx.num_members
        return 1.0 / (1.0 + math.sqrt((1 - p) * self.omega / (p * n)))

    def step(self, rnd: int) -> float:
        return self.hp.lr or self.ctx.lr(rnd) * self.step_factor

    def coin(self, rnd: int) -> bool:
        """c_k: round 0 is the initial full round; later rounds draw the shared coin."""
        return rnd == 0 or bool(self.ctx.rng(rnd, "marina").random() < self.prob)

    def setup(self) -> None:
        self.x: Params = {k: v.clone() for k, v in self.init.items()}
        self.g: Params | None = None
        self.full_rounds = 0

    def broadcast(self, rnd: int, cid: int) -> Message | None:
        return None if self.g is None else Message.of({"g": Update(self.g)})

    def init_client(self, client: ClientHandle) -> None:
        client.state["x"] = {k: v.clone() for k, v in self.init.items()}

    def _grad(self, client: ClientHandle, params: Params, rnd: int, batch_size: int):
        fed, d = self.ctx.cfg.federation, client.data
        return batch_gradient(client.model, params, d.x_train, d.y_train, task=self.ctx.meta.task,
                              batch_size=batch_size, generator=client.generator(rnd, "grad"),
                              weight_decay=fed.weight_decay)

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        x = client.state["x"]
        if msg is not None:
            g = msg.tensors("g")
            gamma = self.step(rnd)
            x_new = {k: x[k] - gamma * g[k] for k in x}
        else:
            x_new = x
        client.state["x"] = x_new
        info = {"n": client.n_train}
        if self.coin(rnd):
            grad, loss = self._grad(client, x_new, rnd, self.hp.sync_batch)
            return Message.of({"g": Update(dict(grad))}, **info, train_loss=loss)
        new, loss = self._grad(client, x_new, rnd, self.ctx.cfg.federation.batch_size)
        old, _ = self._grad(client, x, rnd, self.ctx.cfg.federation.batch_size)
        entries, _ = encode_update(self.compressor, {k: new[k] - old[k] for k in new}, None,
                                   generators(self.ctx, rnd, client.cid), self.min_numel)
        return Message.of({"g": Update(entries)}, **info, train_loss=loss)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        if self.g is not None:
            gamma = self.step(rnd)
            self.x = {k: self.x[k] - gamma * self.g[k] for k in self.x}
        mean = weighted_sum({c: decode_update(r["g"].entries, None) for c, r in replies.items()},
                            reply_weights(replies, self.hp.weighting))
        if self.coin(rnd):
            self.g = mean
            self.full_rounds += 1
        else:
            self.g = {k: self.g[k] + mean[k] for k in self.g}

    def global_params(self) -> Params:
        return self.x

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        return {"marina/p": self.prob, "marina/omega": self.omega, "marina/gamma": self.step(rnd),
                "marina/full_rounds": float(self.full_rounds)}


__all__ = ["Marina"]
