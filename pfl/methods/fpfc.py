"""FPFC: clustered FL by nonconvex pairwise fusion, solved by inexact partial-participation ADMM.

Yu, Liu, Wang, Sun, "Clustered Federated Learning based on Nonconvex Pairwise Fusion" (Information
Sciences 2024); notes: docs/methods/fpfc.md (§ numbers below refer to it).

Every device i keeps its own model w_i (the clustered block, p values). The server keeps, for every
pair, θ_ij ≈ w_i − w_j and its scaled dual v_ij, as dense antisymmetric (m, m, p) tensors, and the
latest uploaded w_j of every device (m, p). One round with sampled set A:

1. ``begin_round``: ζ_i = (1/m) Σ_j (w_j + θ_ij − v_ij/ρ) for all i ∈ A in one stacked op;
2. ``broadcast``: ζ_i (+ the shared body when configured); ρ goes along as control data;
3. ``local_update``: from its own w_i, the device takes the federation's local steps on
   f_i(w) + (ρ/2)‖w − ζ_i‖² (the shared SGD loop; the pull ρ(w − ζ_i) is a gradient hook on the
   clustered parameters only) and uploads w_i;
4. ``aggregate``: every pair touching A gets θ_ij = prox(w_i − w_j + v_ij/ρ) (smoothed SCAD,
   :func:`pfl.prox.scad_prox`, or group soft-thresholding for ``penalty: l1`` = FPFC-L1) and
   v_ij += ρ(w_i − w_j − θ_ij), rows of A at once; other pairs are left unchanged.

Read-out (§3): clusters are the connected components of {‖θ_ij‖ < ν}; a device's read-out model is
the n_i-weighted average of the uploaded models of its component. ``test/acc_mean`` is measured
with each device's own w_i (the personalised models); ``fpfc/readout_acc`` with the read-out
models (computed at the last evaluation, or at every one with ``readout_every_eval``).

Newcomers (spec §8; ``newcomers.fraction`` > 0): during training the federation is the members only
(ζ averages over them, pairs to newcomers stay θ = v = 0). After the last round each newcomer trains
alone (``newcomers.local_rounds`` local updates from the common start), uploads, and then runs
newcomer-only ADMM rounds against the frozen trained devices (A_k = {newcomer}; its pairs to the other
newcomers never exist) until its upload changes by less than ``newcomers.tol`` (relative) or
``newcomers.rounds`` steps. ``join_start: fused`` (default, ours) starts its pair rows at θ = v = 0 as
Algorithm 1 starts every pair, so its first ζ is the federation's average; the paper's wording read
literally (``upload``: θ, v computed from the first upload) leaves any newcomer whose local model is
farther than aλ from every trained device in SCAD's flat region — no pull, a cluster of its own —
which on S1 after 200 rounds (λ = 0.6, clusters ≈ 3 from the start) is 45 % of the newcomers
(ARI over all devices 0.87, vs 0.96 fused). The read-out places newcomers by the same ν.

Under a Byzantine attack (:mod:`pfl.federation.attacks`) a malicious upload w_b far from w_i falls in
SCAD's flat region: θ_ib = w_i − w_b, v_ib = 0, and its term in ζ_i is w_i itself — the attacker
only dilutes the honest pull (bounded influence). FPFC-L1 has no flat region: every far attacker
keeps a pull of size λ towards it. What SCAD does not protect: a shared body averaged by a plain mean
(``shared_layers: body``; use ``aggregator: median`` etc.), and the attacker's own ζ_b, which echoes
its upload (ζ_b ≈ w_b): an attacker that computes honestly from it uploads a garbage body even when
only its head is rewritten (``attack.scope: head``).

Registered names: ``fpfc`` and ``fpfc_l1`` (the same class; only the defaults differ: penalty l1,
λ = 0.2, ν = 4 as in the official README). asyncFPFC is not a separate method: it is this method
run by :class:`pfl.federation.async_clock.AsyncSimulator` (``pipelines/reproduce_fpfc.py``'s
``async_fpfc`` entry).

Decisions where the spec is silent or leaves a choice (``[ours]``):

* default λ = 0.8: the spec's check (§11) found the README's 0.6 leaves 30+ unfused devices on S1,
  while 0.8 recovers the 4 clusters (confirmed here from the official N(0, 1) start, ``init_std=1``:
  88.8 % / 4 clusters / ARI 1.00 after 2000 rounds vs 85.1 % / 37 components for 0.6). From the
  zoo's smaller initialisation the order flips (0.6: 88.2 % / 4; 0.8: 82.3 % / 4, the clusters
  staying close together), so tune λ with the initialisation you use. For MNIST/FMNIST set λ = 0.4
  as the README does;
* the read-out ν is 0.1 (README, synthetic). ``nu_select: silhouette`` chooses it at every
  evaluation instead: among the thresholds that give 2..m−1 components (the single-linkage cuts of
  ‖θ_ij‖), the one whose partition has the best silhouette on ‖θ_ij‖, falling back to ν when no cut
  scores above 0.25. It is for settings where no pair fuses exactly and a fixed ν has only a narrow,
  drifting window: FMNIST label swap at λ = 0.4 (all pairs in SCAD's soft-threshold region; the
  official code has no read-out there, docs/methods/fpfc.md §2.7 Q6), used by ``pipelines/reproduce_fpfc.py
  --scenario fmnist_labelswap``. Where pairs do fuse (S1) keep the fixed ν: the silhouette prefers
  merging two clusters that are still close (a 20-device S1 run at round 150: 3 components vs the
  true 4, which ν = 0.1 finds);
* pairs with both ends in A are updated once per round (``pair_update: once``, vectorised);
  ``official_sequential`` reproduces the official loop over i ∈ A (ascending device id here), in
  which such a pair is updated twice;
* the server learns n_i from each upload's control data (used only for the read-out weights;
  devices never seen count with weight 1);
* ``shared_layers: body``: the model's last unit is clustered, the rest is averaged (unweighted,
  over A) FedAvg-style — or combined by a robust rule (``aggregator: median`` etc., the
  hyperparameters every global method shares): the SCAD penalty protects only the clustered part,
  so under an attack on the body a plain mean lets the attackers poison every device's body. The
  server sends the current body average with ζ_i and every device is evaluated with it. ``stale_body: true`` instead gives each device the average of the last round
  it took part in (the official code's behaviour, §2.5);
* ``init_std > 0`` initialises every parameter i.i.d. N(0, init_std²) as the official synthetic
  code does (N(0, 1)); 0 keeps the model zoo's PyTorch-style initialisation. All devices start
  from the same model either way;
* the pairwise state is dense, m²·p floats per tensor: fine for m = 100, p = 610 (24 MB each) or a
  CNN head; clustering a large whole model over many devices needs another layout. The method
  declares it (:class:`~pfl.methods.fpfc_admm.FPFCMemory`), and a run it cannot fit is refused
  before any work, naming the bytes and the options (pfl/server_memory.py);
* the simulated clock (``time/sim_clock``): each synchronous round lasts the slowest sampled
  device's τ_i of :mod:`pfl.federation.async_clock` (parameters ``clock_*``);
* a pipeline may change λ (or ν, ρ, ...) of a live method between rounds by replacing the
  dataclass, ``method.hp = dataclasses.replace(method.hp, lam=0.8)``: every use reads ``self.hp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..aggregation import RobustAggregation, aggregate
from ..clusters import cluster_metrics, connected_components, silhouette_threshold, write_assignment_table
from ..federation.clock import DelayConfig, DelayModel
from ..federation.messages import Message, Model
from ..models import flatten_params, layer_groups, unflatten_params
from ..prox import group_soft_threshold, scad_prox
from ..schema import ConfigError, hp
from ..training import Params, PullTo
from . import register
from .base import ClientHandle, EvalPlan, Method
from .fpfc_admm import (FPFCJoin, FPFCMemory, Prox, Residuals, glued_clusters, pair_update, pairwise_norms,
                        plot_theta_norms, theta_gap, zeta)


@dataclass
class FPFCHparams(RobustAggregation):
    """FPFC's penalty, ADMM and read-out settings (docs/methods/fpfc.md §1–§3, §6); ``aggregator`` & co.
    combine the shared body (``shared_layers: body``) as the global methods combine their models."""
    lam: float = hp(0.8, "fusion penalty λ (S1 from the official N(0,1) start: 0.8; README: synthetic 0.6, MNIST 0.4)",
                    low=0.0)
    rho: float = hp(1.0, "augmented-Lagrangian penalty ρ (SCAD needs (a−1)·ρ > 1)", low=0.0, low_open=True)
    a: float = hp(3.7, "SCAD shape parameter a", low=2.0, low_open=True)
    xi: float = hp(1e-3, "smoothing ξ of SCAD's kink at 0 (must be < λ; 0 = plain SCAD)", low=0.0)
    penalty: str = hp("scad", "fusion penalty: smoothed SCAD (FPFC) or group lasso (FPFC-L1)",
                      choices=("scad", "l1"))
    nu: float = hp(0.1, "read-out threshold ν: devices i, j are linked when ‖θ_ij‖ < ν", low=0.0, low_open=True)
    nu_select: str = hp("fixed", "'fixed': read out at ν; 'silhouette': at every evaluation use the threshold "
                        "whose components have the best silhouette on ‖θ_ij‖ (ν when none scores > 0.25)",
                        choices=("fixed", "silhouette"))
    pair_update: str = hp("once", "pairs with both ends sampled: updated once (vectorised) or twice as "
                          "in the official sequential loop", choices=("once", "official_sequential"))
    shared_layers: str = hp("none", "'none': cluster the whole model; 'body': cluster the last unit, "
                            "average the rest over the participants", choices=("none", "body"))
    stale_body: bool = hp(False, "shared body: each device uses the average of its last round (official "
                          "code) instead of the current one")
    init_std: float = hp(0.0, "> 0: every parameter starts N(0, init_std²) (official synthetic code: 1); "
                         "0: the model's default initialisation", low=0.0)
    readout_every_eval: bool = hp(False, "compute fpfc/readout_acc at every evaluation, not only the last")
    join_start: str = hp("fused", "newcomers: 'fused' starts a newcomer's pairs at θ = v = 0 as Algorithm 1 starts "
                         "every pair (its first ζ is the federation's average); 'upload' computes them from its "
                         "first upload (a newcomer farther than aλ from every trained device then stays alone)",
                         choices=("fused", "upload"))
    clock_c: float = hp(1.0, "simulated time per sample-gradient at speed 1 (time/sim_clock)", low=0.0)
    clock_speed_sigma: float = hp(0.5, "log-std of the simulated device speeds", low=0.0)
    clock_latency: float = hp(0.1, "mean simulated network latency per update", low=0.0)

    def validate(self, path: str) -> None:
        super().validate(path)
        if self.aggregator != "mean" and self.shared_layers == "none":
            # the rule combines only the averaged body; SCAD's pairwise fusion is FPFC's own defence
            raise ConfigError(f"{path}.aggregator", f"{self.aggregator!r} combines FPFC's shared body, and with "
                                                    "shared_layers=none nothing is averaged: use aggregator=mean, "
                                                    "or shared_layers=body")
        if self.penalty != "scad":
            return
        if self.xi >= self.lam:
            raise ConfigError(f"{path}.xi", f"the SCAD smoothing must satisfy ξ < λ, got ξ={self.xi}, "
                                            f"λ={self.lam}")
        if (self.a - 1) * self.rho <= 1:
            raise ConfigError(f"{path}.rho", f"the SCAD proximal map needs (a−1)·ρ > 1, got a={self.a}, "
                                             f"ρ={self.rho}")


@dataclass
class FPFCL1Hparams(FPFCHparams):
    """FPFC-L1: group-lasso fusion (README: λ_L1 = 0.2, ν = 4)."""
    lam: float = hp(0.2, "fusion penalty λ of the group lasso", low=0.0)
    penalty: str = hp("l1", "fusion penalty: smoothed SCAD (FPFC) or group lasso (FPFC-L1)",
                      choices=("scad", "l1"))
    nu: float = hp(4.0, "read-out threshold ν (README value; tune it per run, see the docs/methods/fpfc.md §11)",
                   low=0.0, low_open=True)


# ---- the method ------------------------------------------------------------------------------

@register
class FPFC(FPFCJoin, FPFCMemory, Method):
    name = "fpfc"
    Hparams = FPFCHparams
    description = "Fusion-penalised federated clustering, SCAD or L1 pairwise fusion (Yu et al. 2024)"
    metric_names = ("cluster/num", "cluster/ari", "fpfc/nu", "fpfc/lambda", "fpfc/theta_max_within",
                    "fpfc/theta_min_between", "time/sim_clock", "fpfc/readout_acc", "fpfc/readout_rmse",
                    "fpfc/primal_residual", "fpfc/dual_residual", "fpfc/primal_scale", "fpfc/dual_scale",
                    "fpfc/glued_clusters")
    supports_async = True

    # ---- setup -------------------------------------------------------------------------------
    def configure(self) -> None:
        ctx = self.ctx
        init = ctx.init_params()
        if self.hp.init_std > 0:
            gen = ctx.generator("init", "fpfc_normal")
            init = {k: (torch.randn(t.shape, generator=gen) * self.hp.init_std).to(t.device, t.dtype)
                    for k, t in init.items()}
        self.init = init  # every device's start, regenerated from the run seed by every party
        self.names = list(init)
        groups = layer_groups(ctx.model)
        self.clustered = (list(groups.head) if self.hp.shared_layers == "body" else list(self.names))
        self.shared = [n for n in self.names if n not in set(self.clustered)]
        self.template = {k: init[k] for k in self.clustered}
        self.delays = DelayModel(ctx, DelayConfig.from_hparams(self.hp))

    def setup(self) -> None:
        init, m = self.init, self.ctx.num_clients
        w0 = flatten_params(init, self.clustered)
        p = w0.numel()
        self.W = w0.unsqueeze(0).repeat(m, 1)
        self.theta = w0.new_zeros(m, m, p)
        self.v = w0.new_zeros(m, m, p)
        self.theta_rowsum = w0.new_zeros(m, p)   # Dᵀθ at the last residual report (the dual residual's θ^{k−1})
        self._residuals = Residuals()
        self.body: Params | None = {k: init[k].clone() for k in self.shared} if self.shared else None
        self.body_of = (flatten_params(init, self.shared).unsqueeze(0).repeat(m, 1)
                        if self.shared and self.hp.stale_body else None)
        self.n_seen = torch.zeros(m, dtype=torch.float64, device=w0.device)
        self.joined: list[int] = []     # newcomers that joined after training (their pairs: to members only)
        self.settled: list[int] = []    # newcomers whose join has converged
        self.sim_clock = 0.0
        self.external_clock = False  # set by the asynchronous simulator
        self._zeta: dict[int, torch.Tensor] = {}
        self._labels: np.ndarray | None = None  # the last evaluation's read-out, until θ moves
        self._nu = float(self.hp.nu)
        self._readout: torch.Tensor | None = None

    def init_client(self, client: ClientHandle) -> None:
        client.state["w"] = {k: self.init[k].clone() for k in self.clustered}

    # ---- penalty -----------------------------------------------------------------------------
    def prox(self) -> Prox:
        hp_ = self.hp
        if hp_.penalty == "l1":
            kappa = hp_.lam / hp_.rho
            return lambda delta: group_soft_threshold(delta, kappa)
        return lambda delta: scad_prox(delta, hp_.lam, hp_.rho, hp_.xi, hp_.a)

    # ---- one round ---------------------------------------------------------------------------
    # ---- the federation: members (and newcomers after they joined) -----------------------------
    def _cols(self) -> list[int] | None:
        """The partners j of the training rounds' pair updates: the members (None: all m devices,
        the case without newcomers)."""
        return self.ctx.members if self.ctx.newcomers else None

    def present(self) -> list[int]:
        """The devices in the federation now: the members and the newcomers that joined."""
        return sorted(set(self.ctx.members) | set(self.joined))

    def pair_mask(self) -> torch.Tensor | None:
        """(m, m) bool: pairs that exist (both ends present, not two newcomers); None: all do."""
        if not self.ctx.newcomers:
            return None
        m = self.ctx.num_clients
        member = torch.zeros(m, dtype=torch.bool, device=self.W.device)
        member[self.ctx.members] = True
        joined = torch.zeros(m, dtype=torch.bool, device=self.W.device)
        joined[self.joined] = True
        return (member[:, None] & (member | joined)[None, :]) | (joined[:, None] & member[None, :])

    def distances(self) -> torch.Tensor:
        """‖θ_ij‖ (m, m), with pairs that do not exist at +inf (never linked)."""
        dist = pairwise_norms(self.theta)
        mask = self.pair_mask()
        if mask is not None:
            dist = dist.masked_fill(~mask, float("inf"))
            dist.fill_diagonal_(0.0)
        return dist

    def begin_round(self, rnd: int, sampled: list[int]) -> None:
        if not self.external_clock:
            self.sim_clock += max((self.delays.tau(rnd, c) for c in sampled), default=0.0)
        if not sampled:
            self._zeta = {}
            return
        idx = torch.as_tensor(sampled, dtype=torch.long, device=self.W.device)
        cols = self._cols()
        col = None if cols is None else torch.as_tensor(cols, dtype=torch.long, device=self.W.device)
        rows = zeta(self.W, self.theta, self.v, idx, self.hp.rho, col)
        self._zeta = {cid: rows[pos] for pos, cid in enumerate(sampled)}

    def _shared_for(self, cid: int) -> Params:
        if self.body_of is not None:
            return unflatten_params(self.body_of[cid], self.body, self.shared)
        return self.body

    def broadcast(self, rnd: int, cid: int) -> Message:
        """ζ_i, the target of device i's pull, and the shared body (when there is one)."""
        parts = {"zeta": Model(unflatten_params(self._zeta[cid], self.template, self.clustered))}
        if self.shared:
            parts["body"] = Model(dict(self._shared_for(cid)))
        return Message.of(parts, rho=self.hp.rho)

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        return self._train(rnd, client, msg, pull=True)

    def _train(self, rnd: int, client: ClientHandle, msg: Message, pull: bool, tag: str = "train") -> Message:
        """From the device's own w (and the received body), the local steps on f_i(w) + (ρ/2)‖w − ζ_i‖²
        (``pull``) or on f_i alone; keeps the new w, uploads the model."""
        received = msg.params("zeta", "body")
        rho = float(msg.info["rho"])
        target = {k: received[k] for k in self.clustered} if pull else {}
        start = dict(client.state["w"])
        start.update({k: received[k] for k in self.shared})
        start = {k: start[k] for k in self.names}

        # the augmented-Lagrangian pull ρ(w − ζ_i), on the clustered parameters only (none when alone)
        result = client.train(start, rnd, grad_hook=PullTo(target, rho) if pull else None, tag=tag)
        client.state["w"] = {k: result.params[k] for k in self.clustered}
        # the clustered layers are the device's own w_i, pulled towards ζ_i (sent as the change to it);
        # the body was trained from the received body
        parts = {"w": Model({k: result.params[k] for k in self.clustered}, ref="zeta")}
        if self.shared:
            parts["body"] = Model({k: result.params[k] for k in self.shared}, base="body")
        return Message.of(parts, n=client.n_train, train_loss=result.mean_loss)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        cids = list(replies)
        uploads = [replies[c].params("w", "body") for c in cids]
        idx = torch.as_tensor(cids, dtype=torch.long, device=self.W.device)
        self.W[idx] = torch.stack([flatten_params(u, self.clustered) for u in uploads])
        self.n_seen[idx] = torch.tensor([float(replies[c].info.get("n", 1)) for c in cids], dtype=torch.float64, device=self.W.device)
        pair_update(self.W, self.theta, self.v, cids, self.prox(), self.hp.rho, self.hp.pair_update, self._cols())
        self._residuals.update_rows(self.W, self.theta, cids)
        if self.shared:
            self.body = aggregate(uploads, None, self.hp, names=self.shared,
                                  attack_fraction=self.ctx.cfg.attack.fraction)
            if self.body_of is not None:
                self.body_of[idx] = flatten_params(self.body, self.shared)
        self._labels = None  # θ moved: cluster_assignment reads the clusters of now, not the last evaluation's

    def round_metrics(self, rnd: int) -> dict[str, float]:
        """The ADMM residuals over the round (:class:`pfl.methods.fpfc_admm.Residuals`): what tells
        whether the iterates have reached this λ's solution, which a validation plateau does not."""
        out, self.theta_rowsum = self._residuals.report(self.W, self.theta, self.v, self.hp.rho, self.theta_rowsum,
                                                        self._cols())
        return out

    def load_server_state(self, state: dict) -> None:
        super().load_server_state(state)
        self._residuals.reset()

    # ---- models ------------------------------------------------------------------------------
    def _full(self, clustered: Params, cid: int) -> Params:
        if not self.shared:
            return clustered
        merged = dict(self._shared_for(cid))
        merged.update(clustered)
        return {k: merged[k] for k in self.names}

    def eval_message(self, rnd: int, cid: int) -> Message | None:
        """The device's body (shared layers) and, when computed, its read-out model."""
        parts = {"body": Model(dict(self._shared_for(cid)))} if self.shared else {}
        if self._readout is not None:
            parts["readout"] = Model(unflatten_params(self._readout[cid], self.template, self.clustered))
        return Message.of(parts) if parts else None

    def eval_plan(self, rnd: int, client: ClientHandle, msg: Message | None) -> EvalPlan:
        body = {} if msg is None else msg.params("body")
        personal = {k: ({**body, **client.state["w"]})[k] for k in self.names}
        readout = {} if msg is None else msg.params("readout")
        extra = {"fpfc/readout": {k: ({**body, **readout})[k] for k in self.names}} if readout else {}
        return EvalPlan(personal, extra=extra)

    # ---- clusters and read-out ---------------------------------------------------------------
    def clusters(self, nu: float | None = None) -> np.ndarray:
        """Connected components of {‖θ_ij‖ < ν} over all m devices (labels 0..K−1 in order of first
        appearance; a device not in the federation is a component of its own); ν defaults to
        :meth:`readout_nu`."""
        dist = self.distances()
        return connected_components(dist < (self.readout_nu(dist) if nu is None else nu))

    def readout_nu(self, dist: torch.Tensor | None = None) -> float:
        """The read-out threshold: ``hp.nu``, or with ``nu_select: silhouette`` the best-silhouette cut."""
        if self.hp.nu_select == "silhouette":
            dist = self.distances() if dist is None else dist
            trained = self.ctx.members  # chosen on the trained devices; newcomers are placed by it
            chosen = silhouette_threshold(dist[trained][:, trained].cpu().numpy())
            if chosen is not None:
                return chosen
        return float(self.hp.nu)

    def theta_gap(self) -> dict[str, float]:
        """Largest ‖θ_ij‖ inside a true cluster, smallest between true clusters (any ν between works)."""
        true = self.ctx.meta.true_clusters
        return {} if true is None else theta_gap(self.distances().cpu().numpy(), true)

    def readout_models(self, labels: np.ndarray) -> torch.Tensor:
        """(m, p): every device's n_i-weighted average of the uploaded models of its cluster."""
        lab = torch.as_tensor(labels, dtype=torch.long, device=self.W.device)
        k = int(lab.max()) + 1
        n = self.n_seen.to(self.W.device, self.W.dtype)
        n = torch.where(n > 0, n, torch.ones_like(n))
        onehot = torch.nn.functional.one_hot(lab, k).to(self.W.dtype)      # (m, K)
        sums = onehot.T @ (n.unsqueeze(1) * self.W)                         # (K, p)
        means = sums / (onehot.T @ n).unsqueeze(1)
        return means[lab]

    def readout_params(self, labels: np.ndarray) -> Callable[[int], Params]:
        """Device ``cid``'s read-out model (body included) for a given clustering."""
        models = self.readout_models(labels)
        return lambda cid: self._full(unflatten_params(models[cid], self.template, self.clustered), cid)

    def begin_eval(self, rnd: int, final: bool) -> None:
        self._readout = None
        if final or self.hp.readout_every_eval:
            dist = self.distances()
            self._readout = self.readout_models(connected_components(dist < self.readout_nu(dist)))

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        dist = self.distances()
        self._nu = self.readout_nu(dist)
        labels = connected_components(dist < self._nu)
        self._labels = labels
        present = self.present()
        true = self.ctx.meta.true_clusters
        out = cluster_metrics(labels[present], None if true is None else true[present])
        out["fpfc/nu"] = self._nu
        out["fpfc/lambda"] = float(self.hp.lam)
        out["fpfc/glued_clusters"] = glued_clusters(dist[present][:, present], labels[present], self.hp.lam)
        out.update(self.theta_gap())
        if not self.external_clock:
            out["time/sim_clock"] = self.sim_clock
        return out

    def cluster_assignment(self) -> dict[int, int]:
        labels = self.clusters() if self._labels is None else self._labels
        return {c: int(labels[c]) for c in self.present()}

    def artifacts(self, outdir: str) -> list[str]:  # pragma: no mutate block (a file for a reader)
        out = Path(outdir)
        labels = self.clusters() if self._labels is None else self._labels
        present = self.present()
        table = write_assignment_table(outdir, "fpfc_clusters.csv", labels[present], self.ctx.meta, present)
        return [table, str(self.plot_distances(out / "fpfc_theta_norms.png"))]

    # ---- newcomers (spec §8): newcomer-only ADMM rounds against the trained devices ------------
    def plot_distances(self, path: str | Path) -> Path:  # pragma: no mutate block (a file for a reader)
        return plot_theta_norms(self.theta, self.ctx.meta.true_clusters, self.hp.lam, self._nu, path)


@register
class FPFCL1(FPFC):
    name = "fpfc_l1"
    Hparams = FPFCL1Hparams
    description = "FPFC with group-lasso fusion (FPFC-L1); same as fpfc with penalty=l1"
