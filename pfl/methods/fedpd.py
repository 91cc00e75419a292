"""FedPD (Zhang, Hong, Dhople, Yin, Liu, TSP 2021): a primal–dual method whose communication is
skipped with probability p (docs/methods/seminar.md §4.1; the seminar has its rate row only).

Problem: min Σ_i f_i(x_i) s.t. x_i = x_0, with client i's augmented Lagrangian
L_i(x_i, x_{0,i}, λ_i) = f_i(x_i) + ⟨λ_i, x_i − x_{0,i}⟩ + (1/(2η))‖x_i − x_{0,i}‖².
Client state: x_i (primal), λ_i (dual), x_{0,i} (its copy of the global model); all start at x⁰, λ = 0.

Round r, every client: (1) the federation's local SGD steps on L_i from the warm start x_i (the
gradient of the two extra terms, λ_i + (x_i − x_{0,i})/η, is added to every step); (2) λ_i ← λ_i +
(x_i − x_{0,i})/η; (3) x⁺_{0,i} = x_i + ηλ_i. Then ONE coin for everyone (public randomness):
communicate (probability 1 − p) — clients upload x⁺_{0,i}, the server averages them (unweighted)
into x_0 and sends it with the next round's start, x_{0,i} ← x_0 — or skip (p) — x_{0,i} ←
x⁺_{0,i}, nothing sent. ``schedule: every`` communicates every ``every`` rounds instead (the
official code's ``freq_out``). Skipped rounds cost 0 bytes; a communicating round costs d up per
client, and d down per client at the next round's start.

With p = 0 FedPD converges to the minimiser of Σf_i even under heterogeneity (a skipped round is a
local proximal step, so p > 0 drifts towards the clients' own optima: a p- and heterogeneity-
dependent neighbourhood). Defaults: η = 0.1 (official μ = 1/η = 10), p = 0; the official local
settings are 10 steps of lr 0.01, batch 10 (set them in ``federation``). Every client in every
round (the coin and the average are over all). Evaluated with the global model x_0 (``test/*`` and
``global/*``); ``fedpd/local_acc`` is the clients' primal x_i.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..aggregation import weighted_average, zeros_like
from ..federation.messages import Message, Update
from ..schema import hp
from ..training import Params, ProxPull, Shift, Terms
from . import register
from .base import GLOBAL, ClientHandle, EvalPlan, Method
from .compressed import require_full_participation


@dataclass
class FedPDHparams:
    """FedPD's penalty and communication schedule."""
    eta: float = hp(0.1, "η of the augmented Lagrangian's (1/(2η))‖x_i − x_0‖² (official: 1/μ = 0.1)",
                    low=0.0, low_open=True)
    p: float = hp(0.0, "probability of skipping a round's communication (schedule: bernoulli)",
                  low=0.0, high=1.0, high_open=True)
    schedule: str = hp("bernoulli", "'bernoulli': one shared coin per round; 'every': communicate every "
                       "`every` rounds (the official code)", choices=("bernoulli", "every"))
    every: int = hp(10, "rounds between communications (schedule: every)", low=1)


def fedpd_dual(x: Params, x0: Params, lam: Params, eta: float) -> tuple[Params, Params]:
    """Steps (2)–(3): λ⁺ = λ + (x − x_0)/η and x_0⁺ = x + ηλ⁺."""
    lam_new = {k: lam[k] + (x[k] - x0[k]) / eta for k in x}
    return lam_new, {k: x[k] + eta * lam_new[k] for k in x}


@register
class FedPD(Method):
    name = "fedpd"
    metric_names = ("fedpd/comm_rounds", "fedpd/local_acc")
    Hparams = FedPDHparams
    quick = {"federation.clients_per_round": 0}
    exact_downlink = ("a client uploads x_{0,i}⁺ as its change from the x_0 it last received, and the server "
                      "adds that change to its own x_0")
    description = ("FedPD: primal–dual local updates, communication skipped with probability p "
                   "(Zhang et al. 2021); global model x_0 (local x_i as fedpd/local_acc); every client every round")

    def configure(self) -> None:
        require_full_participation(self.ctx, self.name, "one shared coin and an average over all clients")
        self.init: Params = self.ctx.init_params()

    def communicates(self, rnd: int) -> bool:
        """The shared coin of round ``rnd`` (public randomness: every party draws the same)."""
        if self.hp.schedule == "every":
            return (rnd + 1) % self.hp.every == 0
        return bool(self.ctx.rng(rnd, "fedpd").random() >= self.hp.p)

    def setup(self) -> None:
        self.x0: Params = {k: v.clone() for k, v in self.init.items()}
        self.pending = False   # the last round communicated: x_0 goes out with this round's start
        self.comm_rounds = 0

    def broadcast(self, rnd: int, cid: int) -> Message | None:
        return Message.model(self.x0, name="x0") if self.pending else None

    def init_client(self, client: ClientHandle) -> None:
        # x0: the client's x_{0,i}; held: the last x_0 it received (x⁰ until the first), the base of its uploads
        client.state.update(x={k: v.clone() for k, v in self.init.items()},
                            x0={k: v.clone() for k, v in self.init.items()},
                            held={k: v.clone() for k, v in self.init.items()}, lam=zeros_like(self.init))

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message | None:
        st = client.state
        if msg is not None:
            st["x0"] = msg.tensors("x0")
            st["held"] = {k: v.clone() for k, v in st["x0"].items()}
        x0, lam, eta = st["x0"], st["lam"], self.hp.eta

        # ∇ of the augmented Lagrangian's terms: λ + (x − x0)/η, as terms a batched cohort can stack
        result = client.train(st["x"], rnd, grad_hook=Terms([Shift(lam), ProxPull(x0, eta)]))
        st["x"] = result.params
        st["lam"], x0_plus = fedpd_dual(result.params, x0, lam, eta)
        st["x0"] = x0_plus  # a skipped round keeps it; a communicating one replaces it next round
        if not self.communicates(rnd):
            return None
        # a change, not the weights: x_{0,i}⁺ − x_0 compresses like any update (after skipped rounds too)
        held = st["held"]
        change = {k: x0_plus[k] - held[k] for k in x0_plus}
        return Message.of({"dx0": Update(change)}, train_loss=result.mean_loss, n=client.n_train)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        self.pending = bool(replies) and self.communicates(rnd)
        if self.pending:  # x_0 ← mean_i x_{0,i}⁺ = x_0 + mean_i (x_{0,i}⁺ − x_0)
            mean = weighted_average([r.tensors("dx0") for r in replies.values()])
            self.x0 = {k: v + mean[k] for k, v in self.x0.items()}
            self.comm_rounds += 1

    def global_params(self) -> Params:
        return self.x0

    def eval_plan(self, rnd: int, client: ClientHandle, msg: Message | None) -> EvalPlan:
        received = msg.tensors()
        return EvalPlan(received, global_model=received if msg.info.get(GLOBAL) else None,
                        extra={"fedpd/local": client.state["x"]})

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        return {"fedpd/comm_rounds": float(self.comm_rounds)}


__all__ = ["FedPD", "fedpd_dual"]
