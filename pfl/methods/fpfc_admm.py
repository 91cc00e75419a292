"""FPFC's server-side ADMM: the stacked pair updates, the newcomers' join rounds, the θ-norm picture, and
the server memory FPFC declares (:class:`FPFCMemory`).

The pair math is module level so tests and benchmarks can compare it with a plain loop; see
:mod:`pfl.methods.fpfc` for the method and the decisions behind it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..federation.messages import Message, Model
from ..models import flatten_params, unflatten_params
from .base import ClientHandle, ModelSize, members_of, samples_everyone

Prox = Callable[[torch.Tensor], torch.Tensor]


# ---- server math (module level so tests can compare it with a plain loop) -----------------------

def zeta(W: torch.Tensor, theta: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, rho: float,
         cols: torch.Tensor | None = None) -> torch.Tensor:
    """ζ_i = (1/m) Σ_j (w_j + θ_ij − v_ij/ρ) for the rows ``idx`` (θ_ii = v_ii = 0 supply w_i).

    ``cols``: the devices j of the federation (default all m; the pairs to other devices must hold
    θ = v = 0, as they do when :func:`pair_update` is given the same ``cols``).
    """
    pull = theta.index_select(0, idx).sum(1)
    dual = v.index_select(0, idx).sum(1)
    if cols is None:
        return W.mean(0) + (pull - dual / rho) / W.shape[0]
    return W.index_select(0, cols).mean(0) + (pull - dual / rho) / len(cols)


def pair_update(W: torch.Tensor, theta: torch.Tensor, v: torch.Tensor, rows: Sequence[int],
                prox: Prox, rho: float, mode: str = "once", cols: Sequence[int] | None = None) -> None:
    """In place: θ, v of every pair touching ``rows`` (θ_ij = prox(δ), v_ij += ρ(w_i − w_j − θ_ij)).

    ``once`` computes the rows of ``rows`` together and mirrors them into the columns. A pair with
    both ends in ``rows`` appears twice, as (i, j) and (j, i); its two δ are exact negatives and the
    prox is odd, so both give the same (antisymmetric) result and writing either is one update.
    ``official_sequential`` walks the rows in order, each seeing the duals its predecessors wrote.
    ``cols`` restricts the partners j to those devices (default: all m); the other pairs are left
    as they are.
    """
    if cols is not None:
        _pair_update_cols(W, theta, v, list(rows), list(cols), prox, rho, mode)
    elif mode == "once":
        # in-place arithmetic on the gathered rows: the server step is memory-bound
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=W.device)
        diff = W[idx].unsqueeze(1) - W.unsqueeze(0)                  # (|A|, m, p)
        new_v = v.index_select(0, idx)
        delta = new_v.div(rho).add_(diff) if rho != 1 else new_v + diff
        new_theta = prox(delta)
        del delta
        new_v.add_(diff.sub_(new_theta), alpha=rho)
        theta.index_copy_(0, idx, new_theta)
        v.index_copy_(0, idx, new_v)
        theta.index_copy_(1, idx, new_theta.neg_().transpose(0, 1))
        v.index_copy_(1, idx, new_v.neg_().transpose(0, 1))
    elif mode == "official_sequential":
        for i in rows:
            diff = W[i] - W                                          # (m, p)
            new_theta = prox(diff + v[i] / rho)
            new_v = v[i] + rho * (diff - new_theta)
            theta[i] = new_theta
            v[i] = new_v
            theta[:, i] = -new_theta
            v[:, i] = -new_v
    else:
        raise ValueError(f"unknown pair_update mode {mode!r}; allowed: once, official_sequential")


def _pair_update_cols(W: torch.Tensor, theta: torch.Tensor, v: torch.Tensor, rows: list[int], cols: list[int],
                      prox: Prox, rho: float, mode: str) -> None:
    """:func:`pair_update` with the partners restricted to ``cols`` (advanced indexing)."""
    if mode not in ("once", "official_sequential"):
        raise ValueError(f"unknown pair_update mode {mode!r}; allowed: once, official_sequential")
    col = torch.as_tensor(cols, dtype=torch.long, device=W.device)
    groups = [rows] if mode == "once" else [[i] for i in rows]
    for group in groups:
        idx = torch.as_tensor(group, dtype=torch.long, device=W.device)
        diff = W[idx].unsqueeze(1) - W[col].unsqueeze(0)                # (|rows|, |cols|, p)
        old_v = v[idx[:, None], col[None, :]]
        new_theta = prox(diff + old_v / rho)
        new_v = old_v + rho * (diff - new_theta)
        theta[idx[:, None], col[None, :]] = new_theta
        v[idx[:, None], col[None, :]] = new_v
        theta[col[:, None], idx[None, :]] = -new_theta.transpose(0, 1)
        v[col[:, None], idx[None, :]] = -new_v.transpose(0, 1)


class Residuals:
    """The ADMM residuals of the fusion constraints w_i − w_j = θ_ij over a round (Boyd et al. 2011
    §3.3), over the pairs i < j of the federation's devices:

    * primal r = (Σ_{i<j} ‖w_i − w_j − θ_ij‖²)^½, how far the pair variables are from the models;
    * dual s = ρ‖Dᵀ(θ^k − θ^{k−1})‖ with D the pairs' incidence: (Dᵀθ)_i = Σ_j θ_ij (θ antisymmetric),
      so per device the change of its pairs' θ over the round (the change of its ADMM target ζ_i, × m).

    The scales they are compared with (Boyd's ε_rel terms) are max(‖Dw‖, ‖θ‖) for r and
    max(‖Dᵀv‖, ρ‖Dᵀθ‖) for s. Boyd scales s by the dual force ‖Dᵀv‖ alone, which vanishes when the
    devices have split (every pair in SCAD's flat region has v = 0) while they still move; ρ‖Dᵀθ‖
    (= ρ·m‖w_i − w̄‖ there) is the size of what s measures the change of, so the larger of the two
    keeps the ratio meaningful in both regimes.

    Pairs change only in pair updates, so the squared primal residual of every pair is cached and
    only the updated rows are recomputed (|A|·m·p work, like the update itself); :meth:`reset`
    drops the cache whenever W or θ change otherwise (a join, a restore). Dᵀθ of the previous report
    is the method's state (``theta_rowsum``), so a restored lineage reports the same residuals.
    """

    def __init__(self) -> None:
        self.pair_sq: torch.Tensor | None = None    # (m, m) ‖w_i − w_j − θ_ij‖²

    def reset(self) -> None:
        self.pair_sq = None

    def update_rows(self, W: torch.Tensor, theta: torch.Tensor, rows: Sequence[int]) -> None:
        """After a pair update of the rows ``rows`` (and their mirrored columns)."""
        if self.pair_sq is None:
            self.pair_sq = pair_residual_sq(W, theta)
            return
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=W.device)
        fresh = pair_residual_sq(W, theta, idx)
        self.pair_sq[idx] = fresh
        self.pair_sq[:, idx] = fresh.T

    def report(self, W: torch.Tensor, theta: torch.Tensor, v: torch.Tensor, rho: float,
               rowsum_before: torch.Tensor, present: Sequence[int] | None = None) -> tuple[dict[str, float], torch.Tensor]:
        """The residuals and their scales, and Dᵀθ now (the next report's ``rowsum_before``);
        ``present``: the devices of the federation (None: all m; pairs to others do not exist)."""
        if self.pair_sq is None:
            self.pair_sq = pair_residual_sq(W, theta)
        rowsum = theta.sum(1)
        if present is None:
            pair_sq, w, th, sel = self.pair_sq, W, theta, slice(None)
        else:
            sel = torch.as_tensor(list(present), dtype=torch.long, device=W.device)
            pair_sq, w, th = self.pair_sq[sel][:, sel], W[sel], theta[sel][:, sel]
        # Σ_{i<j} ‖w_i − w_j‖² = k Σ_i ‖w_i − w̄‖² over the k devices; θ and v vanish outside their pairs
        spread_sq = w.shape[0] * float(((w - w.mean(0)) ** 2).sum())
        theta_sq = 0.5 * float(torch.linalg.vector_norm(th)) ** 2
        out = {"fpfc/primal_residual": (0.5 * float(pair_sq.sum())) ** 0.5,
               "fpfc/dual_residual": rho * float(torch.linalg.vector_norm((rowsum - rowsum_before)[sel])),
               "fpfc/primal_scale": max(spread_sq, theta_sq) ** 0.5,
               "fpfc/dual_scale": max(float(torch.linalg.vector_norm(v.sum(1)[sel])),
                                      rho * float(torch.linalg.vector_norm(rowsum[sel])))}
        return out, rowsum


def pair_residual_sq(W: torch.Tensor, theta: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """‖w_i − w_j − θ_ij‖² for the rows ``rows`` (default all), shape (len(rows), m)."""
    if rows is None:
        return torch.linalg.vector_norm(W.unsqueeze(1) - W.unsqueeze(0) - theta, dim=-1) ** 2
    diff = W.index_select(0, rows).unsqueeze(1) - W.unsqueeze(0)
    return torch.linalg.vector_norm(diff.sub_(theta.index_select(0, rows)), dim=-1) ** 2


def glued_clusters(dist: torch.Tensor, labels, lam: float) -> float:
    """Pairs of read-out clusters (of two devices or more each) held together by the penalty: more than
    half of the device pairs between them have ‖θ_ij‖ < λ, SCAD's soft-threshold region, where the
    penalty pulls with its full force. Such clusters are a compromise between their models that a
    smaller λ releases. (A few close pairs between small fragments do not count: they are the noise
    of a fragmented read-out, not clusters pulled together.)"""
    lab = torch.as_tensor(np.asarray(labels), device=dist.device, dtype=torch.long)
    onehot = torch.nn.functional.one_hot(lab).to(torch.float64)              # (m, K)
    close = (dist < lam).to(torch.float64)
    between = onehot.T @ close @ onehot                                       # (K, K) close pairs
    sizes = onehot.sum(0)
    share = between / torch.outer(sizes, sizes)
    big = sizes >= 2
    glued = torch.triu((share > 0.5) & big[:, None] & big[None, :], diagonal=1)
    return float(glued.sum())


def theta_gap(dist: np.ndarray, true) -> dict[str, float]:
    """The largest ‖θ_ij‖ inside a true cluster and the smallest between true clusters (pairs that do
    not exist, at +inf, left out): any read-out threshold between the two recovers the clusters."""
    same = np.equal.outer(true, true)
    np.fill_diagonal(same, False)
    exists = np.isfinite(dist)
    within, between = dist[same & exists], dist[~np.equal.outer(true, true) & exists]
    out = {}
    if within.size:
        out["fpfc/theta_max_within"] = float(within.max())
    if between.size:
        out["fpfc/theta_min_between"] = float(between.min())
    return out


def pairwise_norms(theta: torch.Tensor) -> torch.Tensor:
    """‖θ_ij‖ for all pairs, (m, m)."""
    return torch.linalg.vector_norm(theta, dim=-1)


def plot_theta_norms(theta: torch.Tensor, true, lam: float, nu: float,
                     path: str | Path) -> Path:  # pragma: no mutate block (a file for a reader)
    """The heat map of ‖θ_ij‖ ordered by true cluster (an FPFC run's artifact)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dist = pairwise_norms(theta).cpu().numpy()
    order = np.argsort(true, kind="stable") if true is not None else np.arange(len(dist))
    fig, ax = plt.subplots(figsize=(5.5, 4.6), dpi=100)
    image = ax.imshow(dist[np.ix_(order, order)], cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="‖θ_ij‖")
    if true is not None:
        edges = np.flatnonzero(np.diff(np.asarray(true)[order])) + 0.5
        for e in edges:
            ax.axhline(e, color="white", lw=0.6)
            ax.axvline(e, color="white", lw=0.6)
    ax.set_title(f"pairwise ‖θ_ij‖ (λ={lam}, ν={nu:.3g}), ordered by true cluster")
    ax.set_xlabel("device")
    ax.set_ylabel("device")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


class FPFCMemory:
    """FPFC's declared server memory (:meth:`pfl.methods.base.Method.server_bytes`), mixed into
    :class:`pfl.methods.fpfc.FPFC`: with p the clustered parameters (the model, or its head with
    ``shared_layers: body``), W, θ, v and Dᵀθ are m·p, m²·p, m²·p and m·p values of the model's
    dtype, n_i m float64; ``stale_body`` adds every device's body average, m·(P − p).

    A round holds temporaries of the same order (:meth:`server_work_bytes`): :func:`pair_update`'s
    w_i − w_j, the rows of v, δ and prox(δ), four (|A|, m, p) tensors for |A| sampled devices, and
    the residuals' first pass (:func:`pair_residual_sq` of all rows), two (m, m, p) ones. On an H100
    (m = 300, p = 7,850) a round's peak was 2.0× the state with 30 devices a round, 3.0× with all."""

    server_memory_note = "pairwise θ and v, 2·m²·p values with p the clustered parameters"
    memory_options = {"shared_layers": "body"}

    @staticmethod
    def _clustered(size: ModelSize, hp_) -> int:
        return size.head if hp_.shared_layers == "body" else size.params

    @classmethod
    def server_bytes(cls, m: int, size: ModelSize, cfg) -> int:
        hp_ = cfg.method.hparams
        p = cls._clustered(size, hp_)
        body_of = m * (size.params - p) if hp_.stale_body else 0
        return size.itemsize * (2 * m * m * p + 2 * m * p + body_of) + 8 * m

    @classmethod
    def server_work_bytes(cls, m: int, size: ModelSize, cfg) -> int:
        sampled = members_of(m, cfg) if samples_everyone(m, cfg) else cfg.federation.clients_per_round
        return size.itemsize * max(2 * m, 4 * sampled) * m * cls._clustered(size, cfg.method.hparams)


class FPFCJoin:
    """FPFC's newcomer rule (docs/methods/fpfc.md §8), mixed into :class:`pfl.methods.fpfc.FPFC`."""

    newcomer_rule = ("trains alone (newcomers.local_rounds), uploads, then newcomer-only ADMM rounds "
                     "against the trained devices until its upload settles (newcomers.tol)")

    def join_begin(self, rnd: int, newcomers: list[int]) -> None:
        self.joined = sorted(newcomers)
        self.settled = []

    def join_active(self, step: int) -> list[int]:
        return [c for c in self.joined if c not in set(self.settled)]

    def join_message(self, rnd: int, step: int, cid: int) -> Message:
        """Step 0: the body only (the newcomer trains alone first); then its ζ against the trained
        devices (and the body). With ``join_start: fused`` the first ζ comes from θ = v = 0 rows."""
        parts = {"body": Model(dict(self.body))} if self.shared else {}
        if step == 0:
            return Message.of(parts, rho=self.hp.rho, local=True)
        dev = self.W.device
        cols = torch.as_tensor(sorted(set(self.ctx.members) | {cid}), dtype=torch.long, device=dev)
        z = zeta(self.W, self.theta, self.v, torch.as_tensor([cid], device=dev), self.hp.rho, cols)[0]
        parts["zeta"] = Model(unflatten_params(z, self.template, self.clustered))
        return Message.of(parts, rho=self.hp.rho)

    def join_update(self, rnd: int, step: int, client: ClientHandle, msg: Message | None) -> Message:
        if msg.info.get("local"):
            reply = None
            for k in range(self.ctx.cfg.newcomers.local_rounds):
                reply = self._train(rnd, client, msg, pull=False, tag=f"join_local{k}")
            return reply
        return self._train(rnd, client, msg, pull=True, tag="join")

    def join_aggregate(self, rnd: int, step: int, replies: dict[int, Message]) -> None:
        """Only the newcomers' rows move: their uploads, and their pairs with the trained devices
        (not after the first upload with ``join_start: fused``: the rows stay θ = v = 0 once)."""
        if not replies:
            return
        cids = sorted(replies)
        idx = torch.as_tensor(cids, dtype=torch.long, device=self.W.device)
        old = self.W[idx].clone()
        self.W[idx] = torch.stack([flatten_params(replies[c].tensors("w"), self.clustered) for c in cids])
        self.n_seen[idx] = torch.tensor([float(replies[c].info.get("n", 1)) for c in cids],
                                        dtype=torch.float64, device=self.W.device)
        self._residuals.reset()
        if step > 0 or self.hp.join_start == "upload":
            pair_update(self.W, self.theta, self.v, cids, self.prox(), self.hp.rho, "once", self.ctx.members)
        tol = self.ctx.cfg.newcomers.tol
        if step >= 1 and tol > 0:
            change = torch.linalg.vector_norm(self.W[idx] - old, dim=1)
            scale = torch.linalg.vector_norm(old, dim=1).clamp_min(1e-12)
            self.settled += [c for c, ok in zip(cids, (change <= tol * scale).tolist()) if ok]
        self._labels = None  # θ moved (see FPFC.aggregate)


__all__ = ["FPFCJoin", "FPFCMemory", "Prox", "Residuals", "glued_clusters", "pair_residual_sq", "pair_update",
           "pairwise_norms", "plot_theta_norms", "theta_gap", "zeta"]
