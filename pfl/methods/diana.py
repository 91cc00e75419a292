"""DIANA and ADIANA: compressed differences to learned shifts (docs/methods/seminar.md §3.1–3.2).

**DIANA** (Mishchenko et al. 2019), FL form (``mode: update``, docs/methods/seminar.md §3.1 [C]). Client i keeps a
shift h_i (init 0, in its state). In round t a sampled client runs the usual local training from
x^t, forms its update Δ_i = x_i − x^t and sends C(Δ_i − h_i) with the unbiased compressor
``compression.uplink`` names; both sides then know Δ̂_i = h_i + C(Δ_i − h_i) and move the shift,
h_i ← h_i + α·C(Δ_i − h_i). The server steps x^{t+1} = x^t + η_g·u, u = Σ p_i Δ̂_i (with server
momentum β > 0: v ← βv + u, x ← x + η_g v). As the shifts learn the clients' updates, the
compressed differences and with them the compression error shrink (for a fixed target the error
contracts by (1 − α) per round, α ≤ 1/(1 + ω)). Server memory: with every client in every round
only the weighted mean h̄ = Σ p_i h_i (the box's "average maintained in the server"); otherwise a
copy of every h_i (N·d), identical to the client's.

Defaults: α = 1/(1 + ω), ω of the compressor on the largest compressed block (tensor or bucket;
QSGD min(b/s², √b/s), TernGrad (√b − 1)/2, rand-k d/k − 1, no compression 0 ⇒ α = 1); β = 0.
The box's gradient form (FedSGD + DIANA) is this method with ``federation.local_steps=1`` (and
``batch_size=0`` for full gradients): compressors are positively homogeneous, so compressing
−η_l·g is compressing g. Evaluated with the global model x^t.

**ADIANA** (Li, Kovalev, Qian, Richtárik 2020): accelerated DIANA, one gradient iteration per
round, every client in every round. Server state y, z, w (and x), h̄; client state h_i and its copy
of w. Round k: x^k = θ1 z^k + θ2 w^k + (1 − θ1 − θ2) y^k is sent (and w^k when it changed); client
i sends a_i = C(∇f_i(x^k) − h_i) and b_i = C(∇f_i(w^k) − h_i) (two independent draws, two
compressed uploads — the box's server update of h needs b) and sets h_i ← h_i + α b_i; the server
forms g = h̄ + mean a_i, h̄ ← h̄ + α mean b_i, y^{k+1} = x^k − ηg, z^{k+1} = βz^k + (1 − β)x^k +
(γ/η)(y^{k+1} − x^k) and, with a shared coin of probability p, w^{k+1} = y^k (as the box writes it).
Both gradients are taken on the same minibatch (``federation.batch_size``; 0: full local data).
Defaults for networks (μ = 0) [C]: θ1 = 1/4, θ2 = 1/2, β = 1, γ = η/(2θ1), p = 1/(2(1 + ω)),
α = 1/(1 + ω) and the paper's η = min{1/(2L), N/(64ω(2p(ω+1)+1)²L)} with the client lr in the role
of 1/(2L), i.e. η = lr·min{1, N/(32ω(2p(ω+1)+1)²)} (η = lr without compression); with μ > 0 the
paper's strongly convex choices β = 1 − γμ, γ = η/(2(θ1 + ημ)). Evaluated with y^k.
"""

from __future__ import annotations

from dataclasses import dataclass


from ..aggregation import zeros_like
from ..compression import decode_update, encode_update
from ..federation.messages import Message, Model, Update
from ..schema import ConfigError, hp
from ..training import Params, batch_gradient
from . import register
from .base import ClientHandle, Method, ModelSize, members_of, samples_everyone
from .compressed import full_participation, generators, model_omega, require_full_participation, uplink_compressor
from .fedavg import FedAvg, FedAvgHparams


def reply_weights(replies: dict[int, Message], weighting: str) -> dict[int, float]:
    """p_i over the replying clients (by training-set size or uniform), summing to 1."""
    raw = {c: (float(r.info.get("n", 1)) if weighting == "samples" else 1.0) for c, r in replies.items()}
    total = sum(raw.values())
    return {c: w / total for c, w in raw.items()}


def weighted_sum(parts: dict[int, Params], weights: dict[int, float]) -> Params:
    cids = list(parts)
    names = list(parts[cids[0]])
    return {k: sum(weights[c] * parts[c][k] for c in cids) for k in names}


@dataclass
class DianaHparams(FedAvgHparams):
    """DIANA: FedAvg whose uplink is the compressed difference between the update and a learned shift."""
    alpha: float = hp(0.0, "shift step α (0: 1/(1+ω) from compression.uplink's ω; theory needs α ≤ 1/(1+ω))",
                      low=0.0, high=1.0)
    momentum: float = hp(0.0, "server momentum β (v ← βv + u, x ← x + η_g v)", low=0.0, high=1.0, high_open=True)
    shifts: str = hp("auto", "the server's copy of the shifts: 'mean' (h̄ only; every client every round), "
                     "'per_client' (every h_i, N·d), 'auto' (mean under full participation)",
                     choices=("auto", "mean", "per_client"))


@register
class Diana(FedAvg):
    name = "diana"
    metric_names = ("diana/alpha", "diana/omega")
    Hparams = DianaHparams
    description = ("DIANA: compressed differences to learned shifts h_i (Mishchenko et al. 2019); "
                   "global model; unbiased compression.uplink")
    compresses_uplink = "unbiased"
    server_memory_note = "every client's shift h_i (m·p values; shifts=per_client, or auto with client sampling)"

    @classmethod
    def server_bytes(cls, m: int, size: ModelSize, cfg) -> int:
        shifts = cfg.method.hparams.shifts
        per_client = shifts == "per_client" or (shifts == "auto" and not samples_everyone(m, cfg))
        return size.itemsize * members_of(m, cfg) * size.params if per_client else 0  # h

    def configure(self) -> None:
        super().configure()
        self.compressor, self.min_numel = uplink_compressor(self.ctx)
        self.omega = model_omega(self.ctx)
        if self.hp.shifts == "mean" and not full_participation(self.ctx):
            raise ConfigError("method.shifts", "shifts=mean needs every client in every round "
                                               "(federation.clients_per_round=0); use per_client or auto")

    @property
    def alpha(self) -> float:
        return self.hp.alpha or 1.0 / (1.0 + self.omega)

    @property
    def per_client(self) -> bool:
        return self.hp.shifts == "per_client" or (self.hp.shifts == "auto" and not full_participation(self.ctx))

    def setup(self) -> None:
        super().setup()
        if self.per_client:
            self.h: dict[int, Params] = {}
        else:
            self.h_mean: Params = zeros_like(self.global_model)
        self.velocity: Params | None = None

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        received = msg.tensors()
        result = client.train(self.start_params(client, received), rnd, **self.train_kwargs(client, received))
        h = client.state.get("h") or zeros_like(received)
        diff = {k: result.params[k] - received[k] - h[k] for k in received}
        entries, decoded = encode_update(self.compressor, diff, None, generators(self.ctx, rnd, client.cid),
                                         self.min_numel)
        client.state["h"] = {k: h[k] + self.alpha * decoded[k] for k in h}
        return Message.of({"delta": Update(entries)}, train_loss=result.mean_loss, n=client.n_train)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        comp = {c: decode_update(r["delta"].entries, None) for c, r in replies.items()}
        weights = reply_weights(replies, self.hp.weighting)
        alpha = self.alpha
        if self.per_client:
            zero = zeros_like(self.global_model)
            shifted = {c: {k: self.h.get(c, zero)[k] + comp[c][k] for k in zero} for c in comp}
            u = weighted_sum(shifted, weights)
            for c in comp:
                h = self.h.get(c, zero)
                self.h[c] = {k: h[k] + alpha * comp[c][k] for k in zero}
        else:
            mean_c = weighted_sum(comp, weights)
            u = {k: self.h_mean[k] + mean_c[k] for k in self.h_mean}
            self.h_mean = {k: self.h_mean[k] + alpha * mean_c[k] for k in self.h_mean}
        if self.hp.momentum:
            v = self.velocity or zeros_like(u)
            u = self.velocity = {k: self.hp.momentum * v[k] + u[k] for k in u}
        eta = self.hp.server_lr
        self.global_model = {k: g + eta * u[k] for k, g in self.global_model.items()}

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        return {"diana/alpha": self.alpha, "diana/omega": self.omega}


# ---- ADIANA ------------------------------------------------------------------------------------

@dataclass
class AdianaHparams:
    """ADIANA's parameters (0 = the default derived from ω and the client lr)."""
    eta: float = hp(0.0, "gradient step η (0: federation.lr·min{1, N/(32ω(2p(ω+1)+1)²)}, the paper's "
                    "η with the client lr as 1/(2L))", low=0.0)
    theta1: float = hp(0.25, "θ1 of x = θ1 z + θ2 w + (1 − θ1 − θ2) y", low=0.0, high=1.0)
    theta2: float = hp(0.5, "θ2 (θ1 + θ2 ≤ 1)", low=0.0, high=1.0)
    prob: float = hp(0.0, "probability p of the w-update coin (0: 1/(2(1+ω)))", low=0.0, high=1.0)
    alpha: float = hp(0.0, "shift step α (0: 1/(1+ω))", low=0.0, high=1.0)
    mu: float = hp(0.0, "strong convexity μ (0: the network defaults β = 1, γ = η/(2θ1))", low=0.0)

    def validate(self, path: str) -> None:
        if self.theta1 + self.theta2 > 1:
            raise ConfigError(f"{path}.theta2", f"θ1 + θ2 must be ≤ 1, got {self.theta1} + {self.theta2}")


def adiana_x(y: Params, z: Params, w: Params, theta1: float, theta2: float) -> Params:
    """x^k = θ1 z^k + θ2 w^k + (1 − θ1 − θ2) y^k."""
    rest = 1.0 - theta1 - theta2
    return {k: theta1 * z[k] + theta2 * w[k] + rest * y[k] for k in y}


def adiana_step(x: Params, y: Params, z: Params, w: Params, h: Params, a_mean: Params, b_mean: Params, *,
                eta: float, gamma: float, beta: float, alpha: float, coin: bool) -> tuple[Params, Params, Params, Params]:
    """The server's update (8)–(11) with ψ = 0: (y⁺, z⁺, w⁺, h⁺) from the mean compressed messages."""
    g = {k: h[k] + a_mean[k] for k in h}
    h_new = {k: h[k] + alpha * b_mean[k] for k in h}
    y_new = {k: x[k] - eta * g[k] for k in x}
    z_new = {k: beta * z[k] + (1 - beta) * x[k] + (gamma / eta) * (y_new[k] - x[k]) for k in x}
    w_new = {k: y[k].clone() for k in y} if coin else w
    return y_new, z_new, w_new, h_new


def adiana_parameters(eta: float, theta1: float, mu: float) -> tuple[float, float]:
    """(β, γ): μ = 0 → (1, η/(2θ1)); μ > 0 → γ = η/(2(θ1 + ημ)), β = 1 − γμ."""
    if mu <= 0:
        return 1.0, eta / (2 * theta1)
    gamma = eta / (2 * (theta1 + eta * mu))
    return 1.0 - gamma * mu, gamma


@register
class Adiana(Method):
    name = "adiana"
    metric_names = ("adiana/alpha", "adiana/prob", "adiana/omega")
    Hparams = AdianaHparams
    quick = {"federation.clients_per_round": 0}
    description = ("ADIANA: accelerated DIANA, one gradient iteration per round, two compressed uploads "
                   "(Li et al. 2020); global model y; every client every round")
    compresses_uplink = "unbiased"
    exact_downlink = "each client keeps its copy of w, sent only in the rounds it changes"

    def configure(self) -> None:
        require_full_participation(self.ctx, self.name, "the server keeps only the mean shift h̄")
        self.compressor, self.min_numel = uplink_compressor(self.ctx)
        self.omega = model_omega(self.ctx)
        self.init: Params = self.ctx.init_params()
        if self.hp.theta1 <= 0:
            raise ConfigError("method.theta1", "θ1 must be > 0 (γ = η/(2θ1))")

    # derived parameters (static functions of the hyperparameters, ω and the lr schedule)
    def eta(self, rnd: int) -> float:
        if self.hp.eta:
            return self.hp.eta
        w, p = self.omega, self.prob
        n = self.ctx.num_members  # the clients that train (newcomers join afterwards)
        factor = 1.0 if w == 0 else min(1.0, n / (32 * w * (2 * p * (w + 1) + 1) ** 2))
        return self.ctx.lr(rnd) * factor

    @property
    def alpha(self) -> float:
        return self.hp.alpha or 1.0 / (1.0 + self.omega)

    @property
    def prob(self) -> float:
        return self.hp.prob or 1.0 / (2.0 * (1.0 + self.omega))

    def coin(self, rnd: int) -> bool:
        """The shared w-coin of round ``rnd`` (public randomness: both sides can draw it)."""
        return bool(self.ctx.rng(rnd, "adiana").random() < self.prob)

    def setup(self) -> None:
        self.y = {k: v.clone() for k, v in self.init.items()}
        self.z = {k: v.clone() for k, v in self.init.items()}
        self.w = {k: v.clone() for k, v in self.init.items()}
        self.h = zeros_like(self.init)
        self.w_changed = False  # w moved at the end of the last round: send it with the next x
        self._x: Params | None = None

    def begin_round(self, rnd: int, sampled: list[int]) -> None:
        self._x = adiana_x(self.y, self.z, self.w, self.hp.theta1, self.hp.theta2)

    def broadcast(self, rnd: int, cid: int) -> Message:
        parts = {"x": Model(self._x)}
        if self.w_changed:
            parts["w"] = Model(self.w)
        return Message.of(parts)

    def init_client(self, client: ClientHandle) -> None:
        client.state["w"] = {k: v.clone() for k, v in self.init.items()}  # w⁰ = x⁰, regenerated

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        x = msg.tensors("x")
        if "w" in msg:
            client.state["w"] = msg.tensors("w")
        w = client.state["w"]
        h = client.state.get("h") or zeros_like(x)
        fed, d = self.ctx.cfg.federation, client.data
        kw = dict(task=self.ctx.meta.task, batch_size=fed.batch_size, weight_decay=fed.weight_decay)
        gx, loss = batch_gradient(client.model, x, d.x_train, d.y_train, generator=client.generator(rnd, "grad"), **kw)
        gw, _ = batch_gradient(client.model, w, d.x_train, d.y_train, generator=client.generator(rnd, "grad"), **kw)
        a_entries, _ = encode_update(self.compressor, {k: gx[k] - h[k] for k in h}, None,
                                     generators(self.ctx, rnd, client.cid, "a"), self.min_numel)
        b_entries, b = encode_update(self.compressor, {k: gw[k] - h[k] for k in h}, None,
                                     generators(self.ctx, rnd, client.cid, "b"), self.min_numel)
        client.state["h"] = {k: h[k] + self.alpha * b[k] for k in h}
        return Message.of({"a": Update(a_entries), "b": Update(b_entries)}, train_loss=loss, n=client.n_train)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        a = [decode_update(r["a"].entries, None) for r in replies.values()]
        b = [decode_update(r["b"].entries, None) for r in replies.values()]
        m = len(a)
        a_mean = {k: sum(d[k] for d in a) / m for k in self.h}
        b_mean = {k: sum(d[k] for d in b) / m for k in self.h}
        eta = self.eta(rnd)
        beta, gamma = adiana_parameters(eta, self.hp.theta1, self.hp.mu)
        coin = self.coin(rnd)
        self.y, self.z, self.w, self.h = adiana_step(self._x, self.y, self.z, self.w, self.h, a_mean, b_mean,
                                                     eta=eta, gamma=gamma, beta=beta, alpha=self.alpha, coin=coin)
        self.w_changed = coin

    def global_params(self) -> Params:
        return self.y

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        return {"adiana/alpha": self.alpha, "adiana/prob": self.prob, "adiana/omega": self.omega}


__all__ = ["Adiana", "Diana", "adiana_parameters", "adiana_step", "adiana_x", "reply_weights", "weighted_sum"]
