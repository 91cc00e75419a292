"""FedAMP (Huang et al., AAAI 2021): attentive message passing between clients' personal models.

The server keeps every client's latest personal model w_j. For a sampled client k it computes a
personalised cloud model from attention over the others,

    ξ_kj = α e^{−‖w_k − w_j‖²/σ}/σ (j ≠ k),  ξ_kk = 1 − Σ_{j≠k} ξ_kj,  u_k = Σ_j ξ_kj w_j,

i.e. one gradient step of size α/2 on Σ_{j<l} A(‖w_j − w_l‖²) with A(x) = 1 − e^{−x/σ}: similar
clients (small distance) pull on each other, dissimilar ones barely. u_k is sent; the client solves
min_w f_k(w) + (λ/(2α))‖w − u_k‖² approximately by the shared loop's local epochs from u_k (the pull
is the shared :func:`~pfl.training.proximal_pull`, so a vectorized cohort batches it), keeps w as its
personal model and sends it; the server stores it as w_k. There is no global model.

Decisions: only clients that have reported hold a model on the server and take part in the
attention (the paper's cross-silo setting has everyone every round); a client that has not reported
yet is w_k = θ⁰ in its own ξ_kk term. Local training starts at u_k (its minimiser does not depend on
the start; PFLlib starts from the client's previous model instead). A client never sampled is
evaluated with θ⁰. Defaults σ = 1 and a pull λ/α = 1 as PFLlib (its α = λ = σ = 1; the paper's code
was not checked), but α = 0.1: at small distances each close client takes α/σ of the weight, so
PFLlib's α = 1 makes ξ_kk negative (u_k extrapolates away from the clients) as soon as two others are
close; 0.1 keeps ξ_kk ≥ 0 up to ten close clients. ξ_kk is not clipped; ``fedamp/self_weight`` (the
mean ξ_kk of the last round's sampled clients) shows where it goes. For models with many parameters the
squared distances are large and e^{−x/σ} vanishes unless σ grows with them; then u_k = w_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..federation.messages import Message
from ..models import flatten_params, unflatten_params
from ..schema import hp
from ..training import Params, proximal_pull
from . import register
from .base import ClientHandle, Method, ModelSize, members_of, samples_everyone


@dataclass
class FedAMPHparams:
    """FedAMP: attention step α, proximal weight λ, attention scale σ."""
    alpha: float = hp(0.1, "step α of the attention (message-passing) step (PFLlib 1, which makes ξ_kk < 0 "
                      "as soon as two other clients are close)", low=0.0, low_open=True)
    lam: float = hp(0.1, "λ: the client's pull towards its cloud model has weight λ/α (default 1, PFLlib's)",
                    low=0.0)
    sigma: float = hp(1.0, "scale σ of the attention e^{−‖w_k − w_j‖²/σ}/σ: of the order of the squared "
                      "distances between clients' models (PFLlib 1)", low=0.0, low_open=True)


@register
class FedAMP(Method):
    name = "fedamp"
    Hparams = FedAMPHparams
    description = "FedAMP: personalised cloud models by attention over clients' models (Huang et al. 2021)"
    metric_names = ("fedamp/self_weight",)
    server_memory_note = "every client's latest personal model (m·p values)"

    @classmethod
    def server_bytes(cls, m: int, size: ModelSize, cfg) -> int:
        """``models``: one flat personal model per training client."""
        return size.itemsize * members_of(m, cfg) * size.params

    @classmethod
    def server_work_bytes(cls, m: int, size: ModelSize, cfg) -> int:
        """A round's cloud models and the sampled clients' own models, two (sampled, p) tensors."""
        sampled = members_of(m, cfg) if samples_everyone(m, cfg) else cfg.federation.clients_per_round
        return 2 * size.itemsize * sampled * size.params

    def configure(self) -> None:
        self.init: Params = self.ctx.init_params()
        self.names = list(self.init)

    def setup(self) -> None:
        self.models: dict[int, torch.Tensor] = {}
        self.self_weight = 1.0

    def clouds(self, cids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The cloud models u_k of clients ``cids`` as rows (len(cids), p) and their ξ_kk."""
        init = flatten_params(self.init, self.names)
        own = torch.stack([self.models.get(k, init) for k in cids])
        cloud = torch.zeros_like(own)
        self_w = torch.ones(len(cids), dtype=own.dtype, device=own.device)
        ids = torch.tensor(cids, device=own.device)
        for j, w_j in sorted(self.models.items()):  # one pass over the stored models: O(sampled · p) memory
            xi = self.hp.alpha * torch.exp(-((own - w_j) ** 2).sum(1) / self.hp.sigma) / self.hp.sigma
            xi = torch.where(ids == j, torch.zeros_like(xi), xi)
            cloud += xi.unsqueeze(1) * w_j
            self_w -= xi
        return cloud + self_w.unsqueeze(1) * own, self_w

    def begin_round(self, rnd: int, sampled: list[int]) -> None:
        cids = sorted(sampled)
        if not cids:
            self._clouds = {}
            return
        rows, self_w = self.clouds(cids)
        self._clouds = {k: rows[i] for i, k in enumerate(cids)}
        self.self_weight = float(self_w.mean())

    def broadcast(self, rnd: int, cid: int) -> Message:
        clouds = getattr(self, "_clouds", None) or {}
        row = clouds[cid] if cid in clouds else self.clouds([cid])[0][0]
        return Message.model({k: v.clone() for k, v in unflatten_params(row, self.init, self.names).items()})

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        cloud = msg.tensors()
        pull = self.hp.lam / self.hp.alpha
        result = client.train(cloud, rnd, **({"grad_hook": proximal_pull(cloud, pull)} if pull else {}))
        client.state["personal"] = result.params
        return Message.model(result.params, base="model", train_loss=result.mean_loss, n=client.n_train)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        for cid, reply in replies.items():
            self.models[int(cid)] = flatten_params(reply.tensors(), self.names)

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        return client.state.get("personal", self.init)

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        return {"fedamp/self_weight": self.self_weight}
