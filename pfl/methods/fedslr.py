"""FedSLR: a low-rank global knowledge representation (GKR) plus a sparse personal component.

Huang et al., "Fusion of Global and Local Knowledge for Personalized Federated Learning"
(TMLR 2023, arXiv:2302.11051); notes: docs/methods/fedslr.md.

Phase I (the GKR, problem  (1/n) Σ f_i(w) + λ Σ_l ‖R_l(w_l)‖_* ). A sampled client starts from
the GKR w^t and minimises with the shared local-SGD loop

    f_i(w) + ⟨γ_i, w − w^t⟩ + (1/(2η))‖w − w^t‖² + (ω/2)‖w‖²

(the last three terms enter as a gradient hook), then moves its auxiliary variable
γ_i ← γ_i + (w_i − w^t)/η and uploads w_i (dense). The server replays that γ update from w_i and
w^t it already knows (no extra traffic) and forms

    z = mean_{i∈S_t} w_i + η · mean_{all n clients} γ_i,

then applies singular-value soft-thresholding with τ = ηλ to the matrix view R_l (pfl.lowrank) of
every conv/linear weight; vector tensors (biases, norms) are taken from z unthresholded.
``server=algo2`` keeps every γ_i on the server (n·d floats; the reference code); ``server=algo3``
keeps only their running average h (d floats): h ← h + Σ_{S_t}(w_i − w^t)/(nη). Both give the
same iterates up to float rounding. With λ = 0 Phase I is exactly FedDyn with α = 1/η (same
dual update, same server correction), so ``lam=0`` doubles as a FedDyn baseline.

Phase II (fusion, per client):  min_P f_i(w^t + P) + μ‖P‖₁ (+ (ω₂/2)‖P‖² as the code does), one
epoch of proximal SGD with the GKR w^t received *this round* frozen: the forward pass uses
w^t + P, and after every step P ← S_{ℓμ}(P) (element-wise soft-threshold). P_i stays on the
client. The personalized ("mixed") model is w^{t+1} + P_i; the global model is the GKR.

Downlink: the GKR as a LowRank factor pair per layer where (rows + cols)·r < rows·cols (rank 0:
an empty pair, 0 bytes), dense otherwise, so ``comm/down_bytes`` falls with the rank. The server
stores w^{t+1}_l as exactly the product the clients decode, so both sides hold the same w^t.

Metrics (evaluation rounds): ``test/acc_mean`` is the mixed model's personalized accuracy,
``global/test_acc`` the GKR's; ``model/rank_mean`` (mean rank over thresholded matrix tensors),
``model/rank/<name>``, ``model/rank_kept_ratio`` (Σ r_l / Σ min(rows_l, cols_l)), ``model/params``
(GKR scalars with factorized layers counted as (rows + cols)·r = the downlink size),
``model/mixed_params`` (that + mean nnz(P_i)), ``model/sparsity`` (mean fraction of zeros in P_i).
The server's SVT wall time per round is kept in ``svd_seconds`` (pipelines/bench_fedslr.py).

Decisions where the spec is silent or our engine differs:

* Sampling is the simulator's (``federation.clients_per_round`` clients without replacement),
  not the code's Bernoulli(q) participation.
* ω (``method.weight_decay``, default 1e-3 as in the code) replaces ``federation.weight_decay``
  in Phase I; Phase II uses ``method.phase2_weight_decay``. Both apply to every tensor.
* The average of the returned models is uniform (the code's; client sizes are equal there).
* ``server`` defaults to ``algo3`` (same iterates, d instead of n·d floats of server memory).
* γ_i and P_i are created on a client's first participation (zeros, or for ``p_init=copy_init``
  the run's seeded initial conv/linear weights with vector tensors at zero, like the code);
  a client that never trained is evaluated with w + P_init (``zeros``: w itself, the GKR's BatchNorm
  statistics included, not P_init's placeholder ones).
* λ = 0 skips the SVD (nothing is thresholded; the reported rank is the full rank).
* A client reports nnz(P_i) and its size in its reply's ``info`` (two integers for metrics,
  no model content); ``model/sparsity`` and ``model/mixed_params`` average over clients that have
  reported (i.e. that have trained a P).
* ``lowrank_exclude`` names matrix tensors that are not thresholded (sent dense); a name that is
  not a matrix tensor of the model is a ConfigError.
* Matrix view of tensors other than 2-D and 4-D: see pfl.lowrank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import lowrank
from ..aggregation import weighted_average
from ..federation.messages import Message
from ..models import layer_groups
from ..schema import ConfigError, hp
from ..models.functional import buffer_names
from ..training import AddToParams, Params, PullTo, Shift, SoftThreshold, Terms
from . import register
from .base import GLOBAL, ClientHandle, Method, ModelSize


@dataclass
class FedSLRHparams:
    """FedSLR's penalties, step sizes and server variant (defaults: the reference code)."""
    lam: float = hp(1e-4, "nuclear-norm weight λ of the GKR; the server's SVT threshold is τ = η·λ",
                    low=0.0)
    eta: float = hp(10.0, "proximal/global step η (the code's α = 1/η); Phase I's proximal weight is 1/η",
                    low=0.0, low_open=True)
    mu: float = hp(1e-3, "L1 weight μ of the sparse personal component P (prox step ℓ·μ)", low=0.0)
    server: str = hp("algo3", "algo2: the server keeps every γ_i (n·d floats); algo3: only their "
                              "average (d floats); same iterates", choices=("algo2", "algo3"))
    phase2_epochs: int = hp(1, "epochs of proximal SGD on P per round (0: no personal component)", low=0)
    phase2_weight_decay: float = hp(1e-3, "L2 weight decay on P in Phase II (the code's elastic net)", low=0.0)
    weight_decay: float = hp(1e-3, "weight decay ω in Phase I (replaces federation.weight_decay)", low=0.0)
    p_init: str = hp("zeros", "initial P: zeros, or copy_init (the code: a copy of the initial "
                              "conv/linear weights, vectors at zero)", choices=("zeros", "copy_init"))
    lowrank_exclude: list[str] = hp(default_factory=list,
                                    doc="matrix parameter names that are not thresholded (sent dense)")
    factorize_downlink: bool = hp(True, "send low-rank layers as factor pairs when smaller than dense")


@register
class FedSLR(Method):
    name = "fedslr"
    Hparams = FedSLRHparams
    quick = {"method.lam": 1e-2}
    description = "Low-rank global model (server SVT) + sparse personal part (Huang et al. 2023)"
    metric_names = ("model/rank_mean", "model/rank_kept_ratio", "model/rank/*", "model/params",
                    "model/mixed_params", "model/sparsity")
    server_memory_note = "every client's γ_i with server=algo2 (m·p values)"
    memory_options = {"server": "algo3"}

    @classmethod
    def server_bytes(cls, m: int, size: ModelSize, cfg) -> int:
        return size.itemsize * m * size.params if cfg.method.hparams.server == "algo2" else 0  # gamma_all

    # ---- lifecycle -------------------------------------------------------------------------
    def configure(self) -> None:
        matrices = layer_groups(self.ctx.model).matrices
        unknown = [n for n in self.hp.lowrank_exclude if n not in matrices]
        if unknown:
            raise ConfigError("method.lowrank_exclude",
                              f"{unknown} are not matrix parameters of {self.ctx.cfg.model.name}; "
                              f"allowed: {', '.join(matrices)}")
        self.low_rank_names = [n for n in matrices if n not in self.hp.lowrank_exclude]

    def setup(self) -> None:
        self.global_model: Params = self.ctx.init_params()
        self.layers: dict[str, lowrank.LayerSVT] = {}
        n = self.ctx.num_clients
        if self.hp.server == "algo2":
            self.gamma_all: Params | None = {k: torch.zeros((n, *v.shape), device=v.device,
                                                            dtype=v.dtype if v.is_floating_point() else torch.float32)
                                             for k, v in self.global_model.items()}
            self.gamma_mean: Params | None = None
        else:
            self.gamma_all = None
            # float: a BatchNorm model's batch counter is an integer entry of the model
            self.gamma_mean = {k: torch.zeros_like(v, dtype=torch.float32 if not v.is_floating_point() else v.dtype)
                               for k, v in self.global_model.items()}
        self.p_stats: dict[int, tuple[int, int]] = {}
        self.svd_seconds: list[float] = []

    def _p_init(self) -> Params:
        # the run's seeded initial weights: every client can regenerate them without communication
        init = self.ctx.init_params()
        stats = buffer_names(self.ctx.model)  # a BatchNorm model: P holds the personal model's statistics
        if self.hp.p_init == "zeros":
            return {k: (v.clone() if k in stats else torch.zeros_like(v)) for k, v in init.items()}
        return {k: (v.clone() if v.ndim >= 2 or k in stats else torch.zeros_like(v)) for k, v in init.items()}

    # ---- one round ---------------------------------------------------------------------------
    def broadcast(self, rnd: int, cid: int) -> Message:
        layers = self.layers if self.hp.factorize_downlink else {}
        return Message.model(lowrank.encode(self.global_model, layers))

    def decode(self, msg: Message) -> Params:
        return lowrank.decode(msg)

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        hp_ = self.hp
        received = self.decode(msg)
        gamma = client.state.get("gamma")
        if gamma is None:
            gamma = {k: torch.zeros_like(v) for k, v in received.items()}
        eta, omega = hp_.eta, hp_.weight_decay
        # ∇f_i(w) + γ_i + (w − w^t)/η + ω·w
        dual_prox_gradient = Terms([Shift(gamma), PullTo(received, 1.0 / eta), PullTo(None, omega)])
        phase1 = client.train(received, rnd, weight_decay=0.0, grad_hook=dual_prox_gradient)
        w_i = phase1.params
        client.state["gamma"] = {k: gamma[k] + (w_i[k] - received[k]) / eta for k in gamma}

        p = client.state.get("P")
        if p is None:
            p = self._p_init()
        if hp_.phase2_epochs > 0:
            p = self._fuse(client, rnd, received, p)
        client.state["P"] = p
        nnz = sum(int(torch.count_nonzero(v)) for v in p.values())
        numel = sum(v.numel() for v in p.values())
        return Message.model(w_i, base="model", n=client.n_train, train_loss=phase1.mean_loss, p_nnz=nnz,
                             p_numel=numel)

    def _fuse(self, client: ClientHandle, rnd: int, gkr: Params, p: Params) -> Params:
        """Phase II: proximal SGD on P with the received GKR frozen inside the forward pass."""
        kappa = self.ctx.lr(rnd) * self.hp.mu
        return client.train(p, rnd, epochs=self.hp.phase2_epochs, steps=None,
                            weight_decay=self.hp.phase2_weight_decay, forward=AddToParams(client.model, gkr),
                            post_step=SoftThreshold(kappa) if kappa > 0 else None, tag="phase2").params

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        hp_ = self.hp
        eta, n = hp_.eta, self.ctx.num_members  # the federation's size (newcomers join after training)
        cids = list(replies)
        models = [replies[c].tensors() for c in cids]
        mean_w = weighted_average(models)
        wt = self.global_model
        z: Params = {}
        for k, wk in wt.items():
            steps = torch.stack([m[k] for m in models]) - wk  # (|S_t|, *shape): w_i − w^t
            if self.gamma_all is not None:
                idx = torch.as_tensor(cids, device=wk.device)
                self.gamma_all[k][idx] += steps / eta
                gamma = self.gamma_all[k]
                gamma_avg = (gamma[self.ctx.members] if self.ctx.newcomers else gamma).mean(dim=0)
            else:
                self.gamma_mean[k] += steps.sum(dim=0) / (n * eta)
                gamma_avg = self.gamma_mean[k]
            z[k] = mean_w[k] + eta * gamma_avg
        for cid in cids:
            info = replies[cid].info
            if "p_nnz" in info:
                self.p_stats[cid] = (int(info["p_nnz"]), int(info["p_numel"]))
        self.global_model = self._prox(z)

    def _prox(self, z: Params) -> Params:
        """SVT with τ = ηλ on every low-rank candidate; vectors and excluded matrices pass through."""
        tau = self.hp.eta * self.hp.lam
        if tau <= 0:
            self.layers = {}
            return z
        start = time.perf_counter()
        out = dict(z)
        layers: dict[str, lowrank.LayerSVT] = {}
        for name in self.low_rank_names:
            _, layer = lowrank.threshold(z[name], tau)
            layers[name] = layer
            # the server keeps exactly what clients decode, so both sides share the same w^t
            out[name] = lowrank.from_matrix(layer.left @ layer.right, layer.shape)
        self.svd_seconds.append(time.perf_counter() - start)
        self.layers = layers
        return out

    # ---- evaluation --------------------------------------------------------------------------
    def global_params(self) -> Params:
        return self.global_model

    def eval_message(self, rnd: int, cid: int) -> Message:
        """The GKR, factorized like the training downlink."""
        msg = self.broadcast(rnd, cid)
        msg.info[GLOBAL] = True
        return msg

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        p = client.state.get("P")
        if p is None:
            if self.hp.p_init == "zeros":
                return received
            p = self._p_init()
        stats = buffer_names(self.ctx.model)  # statistics do not add: the personal model's are P's
        return {k: (p[k] if k in stats else w + p[k]) for k, w in received.items()}

    def ranks(self) -> dict[str, tuple[int, int]]:
        """(rank, max rank) of every thresholded matrix tensor of the current GKR."""
        out = {}
        for name in self.low_rank_names:
            layer = self.layers.get(name)
            if layer is not None:
                out[name] = (layer.rank, layer.max_rank)
            else:
                full = min(lowrank.matrix_shape(self.global_model[name].shape))
                out[name] = (full, full)
        return out

    def gkr_params(self) -> int:
        """Scalars of the GKR stored as factors where smaller (= its factorized downlink size)."""
        total = 0
        for name, value in self.global_model.items():
            layer = self.layers.get(name)
            total += layer.count() if layer is not None else value.numel()
        return total

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        ranks = self.ranks()
        metrics: dict[str, float] = {}
        if ranks:
            metrics["model/rank_mean"] = sum(r for r, _ in ranks.values()) / len(ranks)
            metrics["model/rank_kept_ratio"] = (sum(r for r, _ in ranks.values())
                                                / max(1, sum(m for _, m in ranks.values())))
            metrics.update({f"model/rank/{name}": float(r) for name, (r, _) in ranks.items()})
        gkr = self.gkr_params()
        metrics["model/params"] = float(gkr)
        if self.p_stats:
            stats = list(self.p_stats.values())
            mean_nnz = sum(nz for nz, _ in stats) / len(stats)
            metrics["model/mixed_params"] = gkr + mean_nnz
            metrics["model/sparsity"] = sum(1.0 - nz / max(1, size) for nz, size in stats) / len(stats)
        return metrics
