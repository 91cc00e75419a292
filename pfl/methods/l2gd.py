"""L2GD — loopless local gradient descent on the mixture objective (Hanzely & Richtárik 2020;
docs/methods/seminar.md §4.3, the seminar's "Mixture FL").

Objective: F(x_1..x_N) = Σ_i f_i(x_i) + (λ/2) Σ_i ‖x_i − x̄‖², x̄ = mean x_i — every client has its
own model, pulled towards the mean with strength λ (λ = 0: Local; λ → ∞: one global model).

Iteration k flips a shared coin ξ_k ~ Be(p): ξ = 0 is a local step x_i ← x_i − β∇f_i(x_i)
(β = α/(1 − p) = the client lr), ξ = 1 an averaging step x_i ← (1 − γ)x_i + γx̄ with γ = αλ/p =
λβ(1 − p)/p. Averaging keeps x̄, and A averaging steps in a row are x_i ← x̄ + (1 − γ)^A (x_i − x̄),
so communication is needed only at an averaging step that follows a local step: expected p(1 − p)
communications per iteration, and a communication per ≈ 1/p local steps — the bytes per unit of
local computation fall with p.

A round here is one communication [C]: the coin stream (public randomness) gives B_t local steps
(geometric on {1, 2, …}, mean 1/p) followed by A_t averaging steps (geometric, mean 1/(1 − p)).
A client applies the previous round's averaging (x̄^{t−1}, A_{t−1}) from the downlink, takes its B_t
local minibatch-SGD steps (lr β), and uploads x_i; the server averages the uploads into x̄^t. An
initial run of averaging steps is a no-op (all x_i start at x⁰) and is skipped: round 0 sends x⁰
with A = 0. Bytes: d up and d down per client per round, round 0 included. Under client sampling the
server averages the latest x_i of every client (stale copies, N·d) and only sampled clients step.

Clients are evaluated with their personal model after the round's averaging steps, x̄^t + (1 −
γ)^{A_t}(x_i − x̄^t) (the evaluation message carries x̄^t, counted as evaluation traffic);
``global/test_acc`` is x̄. ``l2gd/iterations`` counts the coin flips so far (local + averaging steps)
and ``l2gd/local_steps`` the local ones. γ must be ≤ 1 (checked before training): p → 0 with a
fixed λ makes γ explode, so "p → 0 is local training" holds with λ → 0 along with it (λ = 0 ⇒ γ = 0,
exactly Local with geometric run lengths).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..aggregation import weighted_average
from ..federation.messages import Message, Model
from ..schema import ConfigError, hp
from ..training import Params
from . import register
from .base import GLOBAL, ClientHandle, EvalPlan, Method, ModelSize, members_of, samples_everyone
from .compressed import full_participation


@dataclass
class L2GDHparams:
    """L2GD's mixture strength and coin."""
    lam: float = hp(1.0, "λ, the pull of every personal model towards the mean (0: Local); grid 0.01, 0.1, 1, 10",
                    low=0.0)
    p: float = hp(0.1, "probability of an averaging step (≈ 1/p local steps per communication)",
                  low=0.0, high=1.0, low_open=True, high_open=True)


def l2gd_gamma(lam: float, beta: float, p: float) -> float:
    """γ = λβ(1 − p)/p, the averaging weight."""
    return lam * beta * (1 - p) / p


def l2gd_counts(rng: np.random.Generator, p: float) -> tuple[int, int]:
    """(B, A): the lengths of one run of local steps and the run of averaging steps after it."""
    return int(rng.geometric(p)), int(rng.geometric(1 - p))


def l2gd_average(x: Params, xbar: Params, gamma: float, steps: int) -> Params:
    """``steps`` averaging steps: x̄ + (1 − γ)^A (x − x̄); x itself when γ = 0."""
    if gamma == 0 or steps == 0:
        return x
    keep = (1.0 - gamma) ** steps
    return {k: xbar[k] + keep * (x[k] - xbar[k]) for k in x}


@register
class L2GD(Method):
    name = "l2gd"
    metric_names = ("l2gd/iterations", "l2gd/local_steps", "l2gd/gamma")
    Hparams = L2GDHparams
    description = ("L2GD: local steps and averaging steps by a shared coin on the mixture objective "
                   "(Hanzely & Richtárik 2020); personal models x̄ + (1−γ)^A (x_i − x̄)")
    server_memory_note = "every client's latest x_i under client sampling (m·p values)"

    @classmethod
    def server_bytes(cls, m: int, size: ModelSize, cfg) -> int:
        return 0 if samples_everyone(m, cfg) else size.itemsize * members_of(m, cfg) * size.params  # x

    def configure(self) -> None:
        self.init: Params = self.ctx.init_params()
        self.stale = not full_participation(self.ctx)
        gamma = self.gamma(0)
        if gamma > 1:
            raise ConfigError("method.lam", f"the averaging weight γ = λβ(1−p)/p = {self.hp.lam}·"
                                            f"{self.ctx.lr(0)}·{1 - self.hp.p:.4g}/{self.hp.p} = {gamma:.4g} "
                                            "must be ≤ 1; lower λ or the client lr, or raise p")

    def gamma(self, rnd: int) -> float:
        return l2gd_gamma(self.hp.lam, self.ctx.lr(rnd), self.hp.p)

    def counts(self, rnd: int) -> tuple[int, int]:
        """(B_t, A_t) of round ``rnd`` from the shared coin stream."""
        return l2gd_counts(self.ctx.rng(rnd, "l2gd"), self.hp.p)

    def setup(self) -> None:
        self.xbar: Params | None = None
        self.x: dict[int, Params] = {}   # the latest x_i of every client (client sampling only)
        self.iterations = 0
        self.local_steps = 0

    def broadcast(self, rnd: int, cid: int) -> Message:
        if self.xbar is None:  # round 0: x⁰ and no averaging, so every upload has the x̄ it started from
            return Message.model(self.init, name="xbar", averaging_steps=0, averaging_round=0)
        return Message.model(self.xbar, name="xbar", averaging_steps=self.counts(rnd - 1)[1], averaging_round=rnd - 1)

    def init_client(self, client: ClientHandle) -> None:
        client.state["x"] = {k: v.clone() for k, v in self.init.items()}

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        x = client.state["x"]
        if msg is not None:
            before = int(msg.info["averaging_round"])
            x = l2gd_average(x, msg.tensors("xbar"), self.gamma(before), int(msg.info["averaging_steps"]))
        steps, _ = self.counts(rnd)
        result = client.train(x, rnd, steps=steps)
        client.state["x"] = result.params
        # x_i is the client's own model (only its local steps start from x̄'s averaging): its value
        return Message.of({"x": Model(result.params, ref="xbar")}, train_loss=result.mean_loss, n=client.n_train)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        b, a = self.counts(rnd)
        self.iterations += b + a
        self.local_steps += b
        if not replies:
            return
        uploads = {c: r.tensors() for c, r in replies.items()}
        if self.stale:
            self.x.update(uploads)
            # x̄ is the mean over the training clients (newcomers join after training)
            self.xbar = weighted_average([self.x.get(c, self.init) for c in self.ctx.members])
        else:
            self.xbar = weighted_average(list(uploads.values()))

    def global_params(self) -> Params | None:
        return self.xbar

    def eval_message(self, rnd: int, cid: int) -> Message | None:
        if self.xbar is None:
            return None
        return Message.model(self.xbar, name="xbar", averaging_steps=self.counts(rnd)[1], averaging_round=rnd,
                             **{GLOBAL: True})

    def eval_plan(self, rnd: int, client: ClientHandle, msg: Message | None) -> EvalPlan:
        x = client.state["x"]
        if msg is None:
            return EvalPlan(x)
        xbar = msg.tensors()
        personal = l2gd_average(x, xbar, self.gamma(int(msg.info["averaging_round"])),
                                int(msg.info["averaging_steps"]))
        return EvalPlan(personal, global_model=xbar)

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        return {"l2gd/iterations": float(self.iterations), "l2gd/local_steps": float(self.local_steps),
                "l2gd/gamma": self.gamma(rnd)}


__all__ = ["L2GD", "l2gd_average", "l2gd_counts", "l2gd_gamma"]
