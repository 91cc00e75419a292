"""FedSplit (Pathak & Wainwright, NeurIPS 2020, Alg. 1): Peaceman–Rachford operator splitting for
min Σ_j f_j(x) (docs/methods/seminar.md §4.2; the seminar has its rate row only).

Client j keeps z_j (starts at x⁰, persists across rounds); the server keeps x̄ (starts at x⁰).
Round t: the server sends x̄^t; client j forms v_j = 2x̄^t − z_j, computes the proximal step

    z_j^{½} = prox_{s f_j}(v_j) = argmin_u f_j(u) + ‖u − v_j‖²/(2s)

inexactly with the federation's local SGD steps on that objective, started from x̄^t (the
gradient of the proximal term, (u − v_j)/s, is added to every step), then reflects,
z_j ← z_j + 2(z_j^{½} − x̄^t), and uploads z_j. The server sets x̄^{t+1} = mean_j z_j (unweighted).
For strongly convex f_j with exact proximal steps x̄ converges linearly to the minimiser of Σf_j
(FedAvg's fixed point is biased under heterogeneity). Under client sampling the server averages
the latest z_j of every client (stale copies, N·d). z_j is a reflected point, not a model:
clients are evaluated with the global model x̄. Defaults: s = 10 (fl-sim); the theory's
s = 1/√(μL) is for known μ, L. Bytes: d up and d down per client per round.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..aggregation import weighted_average
from ..federation.messages import Message, Model
from ..schema import hp
from ..training import Params, ProxPull
from . import register
from .base import ClientHandle, Method, ModelSize, members_of, samples_everyone
from .compressed import full_participation


@dataclass
class FedSplitHparams:
    """FedSplit's proximal step size."""
    s: float = hp(10.0, "step s of the local proximal problem prox_{s f_j} (theory: 1/√(μL))",
                  low=0.0, low_open=True)


def prox_pull(v: Params, s: float) -> ProxPull:
    """The ``grad_hook`` of the local proximal problem: adds (u − v)/s, the gradient of ‖u − v‖²/(2s)."""
    return ProxPull(v, s)


def fedsplit_reflect(z: Params, xbar: Params, prox) -> Params:
    """One client step: v = 2x̄ − z, z^{½} = prox(v), z ← z + 2(z^{½} − x̄)."""
    v = {k: 2 * xbar[k] - z[k] for k in z}
    half = prox(v)
    return {k: z[k] + 2 * (half[k] - xbar[k]) for k in z}


@register
class FedSplit(Method):
    name = "fedsplit"
    Hparams = FedSplitHparams
    description = "FedSplit: Peaceman–Rachford splitting with local proximal steps (Pathak & Wainwright 2020); global model x̄"
    server_memory_note = "every client's latest z_j under client sampling (m·p values)"

    @classmethod
    def server_bytes(cls, m: int, size: ModelSize, cfg) -> int:
        return 0 if samples_everyone(m, cfg) else size.itemsize * members_of(m, cfg) * size.params  # z

    def configure(self) -> None:
        self.init: Params = self.ctx.init_params()
        self.stale = not full_participation(self.ctx)

    def setup(self) -> None:
        self.xbar: Params = {k: v.clone() for k, v in self.init.items()}
        self.z: dict[int, Params] = {}  # the latest z_j of every client (client sampling only)

    def broadcast(self, rnd: int, cid: int) -> Message:
        return Message.model(self.xbar, name="xbar")

    def init_client(self, client: ClientHandle) -> None:
        client.state["z"] = {k: v.clone() for k, v in self.init.items()}

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        xbar = msg.tensors("xbar")
        s = self.hp.s
        losses = []

        def prox(v: Params) -> Params:
            result = client.train(xbar, rnd, grad_hook=prox_pull(v, s))
            losses.append(result.mean_loss)
            return result.params

        client.state["z"] = fedsplit_reflect(client.state["z"], xbar, prox)
        # z_j is the client's own point, sent as the change to the x̄ it was reflected about
        return Message.of({"z": Model(client.state["z"], ref="xbar")}, train_loss=losses[0], n=client.n_train)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        uploads = {c: r.tensors() for c, r in replies.items()}
        if not self.stale:
            self.xbar = weighted_average(list(uploads.values()))
            return
        self.z.update(uploads)
        models = [self.z.get(c, self.init) for c in self.ctx.members]  # newcomers join after training
        self.xbar = weighted_average(models)

    def global_params(self) -> Params:
        return self.xbar


__all__ = ["FedSplit", "fedsplit_reflect", "prox_pull"]
