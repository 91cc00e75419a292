"""LAG: lazily aggregated updates — a client that has little new to say skips its upload
(docs/methods/seminar.md §2.8: the seminar's "lazy aggregation (censoring)", spelt out as LAG-WK of Chen,
Giannakis, Sun, Yin 2018 in round form).

The server keeps Δ̂_i, the last update it received from client i, and the recent model movements
m_s = ‖x^s − x^{s−1}‖². With x^t it sends the threshold

    thr_t = (1/η_g²) · Σ_{j=1..D} ξ_j · m_{t+1−j}        (ξ_j = ξ/D; missing terms 0)

(one float). The client trains as FedAvg does, forms Δ_i = x_i − x^t and, if it has uploaded before
and ‖Δ_i − Δ̂_i‖² ≤ thr_t, sends SKIP (one header byte, 8 bits); otherwise it sends its model
encoded as the update of x^t by ``compression.uplink`` (any compressor, or dense) and both sides
set Δ̂_i to the decoded update. The server averages (FedAvg's weights and server step) the
uploaded models and, for skipping clients, x^t + Δ̂_i. ξ = 0 is FedAvg exactly (no client skips a
change, and an upload is averaged as FedAvg averages it); a large ξ makes every client skip from
its second round on, the server then repeating the stored updates. With sampling only sampled
clients enter the average. Evaluated with the global model; ``lag/skip_rate`` is the fraction of
uploads skipped so far.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..aggregation import weighted_average
from ..compression import decode_update, encode_update
from ..federation.messages import Message, Model, Scalars
from ..schema import hp
from ..training import Params
from . import register
from .base import ClientHandle, ModelSize, members_of
from .compressed import generators, uplink_compressor
from .fedavg import FedAvg, FedAvgHparams

SKIP = "skip"


def lag_threshold(movements: list[float], xi: float, D: int, server_lr: float = 1.0) -> float:
    """thr_t = (1/η_g²) Σ_{j=1}^{D} (ξ/D)·m_{t+1−j}; ``movements`` = [m_1, …, m_t] (latest last)."""
    recent = movements[-D:] if D > 0 else []
    return (xi / D) * float(sum(recent)) / server_lr**2 if D > 0 else 0.0


def sq_dist(a: Params, b: Params) -> float:
    return float(sum(((a[k].float() - b[k].float()) ** 2).sum() for k in a))


@dataclass
class LAGHparams(FedAvgHparams):
    """LAG-WK in round form: skip the upload when the update barely changed."""
    xi: float = hp(1.0, "ξ, total weight of the recent model movements in the skip threshold (0 = FedAvg) "
                   "[unverified default]", low=0.0)
    history: int = hp(10, "D, the number of recent movements the threshold looks at [unverified default]", low=1)


@register
class LAG(FedAvg):
    name = "lag"
    metric_names = ("lag/skip_rate",)
    Hparams = LAGHparams
    description = ("LAG: lazy aggregation — skip the upload (8 bits) when the update changed little "
                   "(Chen et al. 2018); global model; any compression.uplink")
    compresses_uplink = "any"
    exact_downlink = ("a client skips by comparing its update with Δ̂_i, the last update the server stored, "
                      "so both must compute updates from the same model")
    server_memory_note = "every client's last update Δ̂_i (m·p values)"

    @classmethod
    def server_bytes(cls, m: int, size: ModelSize, cfg) -> int:
        return size.itemsize * members_of(m, cfg) * size.params  # ``last``, once every client uploaded

    def configure(self) -> None:
        super().configure()
        self.compressor, self.min_numel = uplink_compressor(self.ctx)

    def setup(self) -> None:
        super().setup()
        self.last: dict[int, Params] = {}       # Δ̂_i, the server's copy of each client's last update
        self.movements: list[float] = []        # m_1 … m_t (the last D are used)
        self.uploads = 0
        self.skips = 0

    def threshold(self) -> float:
        return lag_threshold(self.movements, self.hp.xi, self.hp.history, self.hp.server_lr)

    def broadcast(self, rnd: int, cid: int) -> Message:
        thr = torch.tensor([self.threshold()], dtype=torch.float32)
        return Message.of({"model": Model(self.global_model), "thr": Scalars({"thr": thr})})

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        received = msg.tensors("model")
        thr = float(msg.tensors("thr")["thr"][0])
        result = client.train(self.start_params(client, received), rnd, **self.train_kwargs(client, received))
        info = {"train_loss": result.mean_loss, "n": client.n_train}
        delta = {k: result.params[k] - received[k] for k in received}
        last = client.state.get("last")
        if last is not None and sq_dist(delta, last) <= thr:
            return Message.of({SKIP: Scalars({SKIP: torch.zeros(1, dtype=torch.uint8)})}, **info)
        entries, values = encode_update(self.compressor, result.params, received,
                                        generators(self.ctx, rnd, client.cid), self.min_numel)
        client.state["last"] = {k: values[k] - received[k] for k in received}
        return Message.of({"model": Model(entries, base="model")}, **info)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        x = self.global_model
        models, weights = [], []
        for cid, reply in replies.items():
            if SKIP in reply:
                models.append({k: x[k] + self.last[cid][k] for k in x})
                self.skips += 1
            else:
                model = decode_update(reply["model"].entries, x)
                self.last[cid] = {k: model[k] - x[k] for k in x}
                models.append(model)
                self.uploads += 1
            weights.append(reply.info["n"])
        avg = weighted_average(models, weights if self.hp.weighting == "samples" else None)
        eta = self.hp.server_lr
        new = avg if eta == 1.0 else {k: g + eta * (avg[k] - g) for k, g in x.items()}
        self.movements = (self.movements + [sq_dist(new, x)])[-self.hp.history:]
        self.global_model = new

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        total = self.uploads + self.skips
        return {"lag/skip_rate": self.skips / total if total else 0.0}


__all__ = ["LAG", "lag_threshold"]
