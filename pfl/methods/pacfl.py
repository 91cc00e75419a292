"""PACFL — one-shot clustering by principal angles between data subspaces (Vahidian et al. 2023).

One-shot stage. A client sends, once, a basis of its data: for every label it holds, the top
``n_basis`` (= p) left singular vectors of the matrix of that label's raw flattened training samples
(features × samples), stacked into U_k (features × p·#labels; fewer columns for a label with fewer
than p samples; regression data: one SVD of all samples). The server turns the bases into a
proximity matrix of angles in degrees:

* ``angle: reference`` — the smallest angle between any basis vector of U_k and any of U_j,
  arccos(max |U_kᵀU_j|) (the reference takes the minimum of arccos of the signed entries; singular
  vectors have an arbitrary sign, so we take the absolute value: identical subspaces give 0°
  whatever sign the SVD routine picked);
* ``angle: principal`` — the smallest principal angle, arccos of the largest singular value of
  Q_kᵀQ_j, Q an orthonormal basis of span(U) (the stacked per-label bases are not orthonormal
  together). Two subspaces whose dimensions add up to more than the number of features always
  intersect (angle 0): with p·#labels columns this needs p·C < D/2 (e.g. p = 1 on 8×8 digits).

Agglomerative clustering then merges clusters while the linkage distance is ≤ β (``beta``, in
degrees); ``linkage: average`` is UPGMA (the spec); the reference code's "average" updates the
merged row as the plain mean of the two rows, which is ``weighted`` (WPGMA) here. After that, FedAvg
inside each cluster (sample-weighted, participants only).

How the one-shot upload is counted (the simulator only talks to sampled clients): the first time a
client is sampled, the server's downlink is an empty message asking for the basis (0 bytes) and the
client's uplink is the basis (features × q × 4 bytes, measured by the ledger like any message); it
does not train in that round. With full participation this is exactly the paper's one-shot stage
in round 0. With partial participation the bases arrive over the first rounds; each time new ones
arrive the server re-clusters all clients it has bases for (so once every client has reported, the
partition is the one-shot partition on all of them), and each new cluster starts from the
sample-weighted average of its members' previous cluster models (the initial model if none had
one). A client without a basis yet is evaluated with the initial model and counted as its own
cluster in ``cluster/num`` / ``cluster/ari``.

Newcomers (after training; docs/methods/fpfc.md §8, "PACFL ... as their paper"): a newcomer uploads its
basis once (one join step) and the server assigns it to the existing cluster at the smallest linkage
distance (the mean angle to its members for average/weighted linkage, the smallest for single, the
largest for complete); the trained clients' clusters do not change. It is evaluated with that
cluster's model.

β is dataset dependent (reference: 3.5° in its options, 4.9° for CIFAR-10; the FPFC repository
used 4 on its synthetic data and 2 on MNIST). Because PACFL only looks at the inputs x, it cannot see
concept shift that leaves P(x) unchanged: label-swapped clusters, and the FPFC synthetic data
(x ~ U[0,1)^d in every cluster; only the labelling differs, visible only through which x fall under
which label) are hard or impossible cases; rotations are the natural case.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..aggregation import weighted_average
from ..clusters import assignment_metrics, relabel, write_assignment_table
from ..federation.messages import Message, State
from ..schema import hp
from ..training import Params
from . import register
from .base import ClientHandle, Method, ModelSize, members_of


@dataclass
class PACFLHparams:
    """PACFL: one-shot clustering of clients by the angles between their data subspaces."""
    n_basis: int = hp(5, "p: left singular vectors kept per label", low=1)
    beta: float = hp(3.5, "merge clusters while their linkage distance is ≤ β (degrees; dataset "
                     "dependent)", low=0.0, high=90.0, low_open=True)
    angle: str = hp("reference", "proximity of two clients: reference = smallest angle between basis "
                    "vectors, principal = smallest principal angle", choices=("reference", "principal"))
    linkage: str = hp("average", "agglomerative linkage (weighted = the reference code's update)",
                      choices=("average", "weighted", "complete", "single"))
    weighting: str = hp("samples", "FedAvg weights inside a cluster", choices=("samples", "uniform"))


def data_basis(x: torch.Tensor, y: torch.Tensor | None, p: int) -> torch.Tensor:
    """Stacked top-p left singular vectors of each label's (features × samples) matrix."""
    flat = x.reshape(len(x), -1).to(torch.float64)
    groups = [flat] if y is None else [flat[y == c] for c in torch.unique(y)]
    cols = []
    for g in groups:
        if len(g) == 0:
            continue
        u, _, _ = torch.linalg.svd(g.T, full_matrices=False)
        cols.append(u[:, :min(p, len(g))])
    return torch.cat(cols, dim=1).to(torch.float32)


def orthonormal(bases: torch.Tensor) -> torch.Tensor:
    """Orthonormal bases of the column spaces of a stack (B, D, q); directions with tiny singular
    values (dependent or padded columns) become zero columns."""
    u, s, _ = torch.linalg.svd(bases, full_matrices=False)
    keep = s > s[..., :1] * 1e-6
    return u * keep[..., None, :]


def proximity(left: list[torch.Tensor], right: list[torch.Tensor], angle: str = "reference") -> torch.Tensor:
    """Angles in degrees between every basis of ``left`` and every basis of ``right`` (len(left) × len(right)).

    Bases are zero-padded to a common number of columns: a zero column adds only zero products,
    which change neither the largest |entry| nor the largest singular value.
    """
    q = max(u.shape[1] for u in left + right)
    pad = lambda us: torch.stack([torch.nn.functional.pad(u.double(), (0, q - u.shape[1])) for u in us])  # noqa: E731
    if angle == "reference":
        gram = torch.einsum("adk,bdl->abkl", pad(left), pad(right))
        cos = gram.abs().amax(dim=(-2, -1))
    else:
        # the stacked per-label bases are not orthonormal together: orthonormalise first, else the
        # singular values of the product are not cosines (they can exceed 1)
        ql, qr = orthonormal(pad(left)), orthonormal(pad(right))
        cos = torch.linalg.svdvals(torch.einsum("adk,bdl->abkl", ql, qr))[..., 0]
    return torch.rad2deg(torch.arccos(cos.clamp(-1.0, 1.0))).float()


def cluster_by_threshold(dist: np.ndarray, beta: float, linkage: str = "average") -> np.ndarray:
    """Agglomerative clustering of a distance matrix, merging while the linkage distance ≤ β."""
    from scipy.cluster.hierarchy import fcluster
    from scipy.cluster.hierarchy import linkage as build
    from scipy.spatial.distance import squareform

    if len(dist) == 1:
        return np.zeros(1, dtype=int)
    sym = (np.asarray(dist, dtype=float) + np.asarray(dist, dtype=float).T) / 2
    np.fill_diagonal(sym, 0.0)
    tree = build(squareform(np.clip(sym, 0.0, None), checks=False), method=linkage)
    return relabel(fcluster(tree, t=beta, criterion="distance"))


@register
class PACFL(Method):
    name = "pacfl"
    Hparams = PACFLHparams
    description = "One-shot clustering by principal angles of data subspaces, then FedAvg per cluster"
    metric_names = ("cluster/num", "cluster/ari", "pacfl/clients_with_basis")
    server_memory_note = "a proximity matrix (m² floats) and every client's data basis (features × n_basis per label)"

    @classmethod
    def server_bytes(cls, m: int, size: ModelSize, cfg) -> int:
        """The (m, m) float32 angles and, per training client, a float32 basis of at most
        min(n_basis, features) columns per label (one group for regression)."""
        cols = min(cfg.method.hparams.n_basis, size.features) * max(size.classes, 1)
        return 4 * m * m + 4 * members_of(m, cfg) * size.features * cols

    def configure(self) -> None:
        self.init: Params = self.ctx.init_params()  # regenerated from the run seed by every party

    def setup(self) -> None:
        m = self.ctx.num_clients
        self.bases: dict[int, torch.Tensor] = {}
        self.prox = torch.full((m, m), float("nan"))  # degrees; nan until both bases are known
        self.labels: dict[int, int] = {}              # client -> cluster, for clients with a basis
        self.models: list[Params] = []
        self.n: dict[int, int] = {}
        self.joined: list[int] = []                   # newcomers (after training)

    def broadcast(self, rnd: int, cid: int) -> Message:
        if cid not in self.labels:
            return Message.of({}, send_basis=True)
        return Message.model(self.models[self.labels[cid]])

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        d = client.data
        if msg.info.get("send_basis"):
            y = d.y_train if self.ctx.meta.task == "classification" else None
            basis = data_basis(d.x_train, y, self.hp.n_basis)
            return Message.of({"basis": State({"basis": basis})}, n=client.n_train)
        result = client.train(msg.tensors(), rnd)
        return Message.model(result.params, base="model", train_loss=result.mean_loss, n=client.n_train)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        groups: dict[int, list[Message]] = {}
        new: dict[int, torch.Tensor] = {}
        for cid, reply in replies.items():
            self.n[cid] = reply.info["n"]
            if "basis" in reply:
                new[cid] = reply.tensors("basis")["basis"]
            else:
                groups.setdefault(self.labels[cid], []).append(reply)
        for c, members in groups.items():
            weights = [r.info["n"] for r in members] if self.hp.weighting == "samples" else None
            self.models[c] = weighted_average([r.tensors() for r in members], weights)
        if new:
            self._add_bases(new)

    def _add_bases(self, new: dict[int, torch.Tensor]) -> None:
        self.bases.update(new)
        known = sorted(self.bases)
        fresh = sorted(new)
        block = proximity([self.bases[c] for c in fresh], [self.bases[c] for c in known], self.hp.angle).cpu()
        rows, cols = torch.as_tensor(fresh), torch.as_tensor(known)
        self.prox[rows[:, None], cols[None, :]] = block
        self.prox[cols[:, None], rows[None, :]] = block.T
        self.prox[rows, rows] = 0.0
        dist = self.prox[cols[:, None], cols[None, :]].double().numpy()
        found = cluster_by_threshold(dist, self.hp.beta, self.hp.linkage)
        models = []
        labels: dict[int, int] = {}
        for c in range(int(found.max()) + 1):
            members = [cid for cid, lab in zip(known, found) if lab == c]
            before = [cid for cid in members if cid in self.labels]
            olds = sorted({self.labels[cid] for cid in before})
            if not olds:
                models.append({k: v.clone() for k, v in self.init.items()})
            elif len(olds) == 1:
                models.append(self.models[olds[0]])
            else:
                models.append(weighted_average([self.models[self.labels[cid]] for cid in before],
                                               [self.n[cid] for cid in before]))
            labels.update({cid: c for cid in members})
        self.labels, self.models = labels, models

    # ---- evaluation ----------------------------------------------------------------------------
    def eval_message(self, rnd: int, cid: int) -> Message | None:
        """Its cluster's model; nothing for a client without a basis yet (it uses θ^0)."""
        c = self.labels.get(cid)
        return None if c is None else Message.model(self.models[c])

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        return self.init if received is None else received

    def cluster_assignment(self) -> dict[int, int]:
        """Cluster per client of the federation (the newcomers once joined); a client without a
        basis yet is a cluster of its own."""
        out: dict[int, int] = {}
        extra = len(self.models)
        for cid in sorted(set(self.ctx.members) | set(self.joined)):
            c = self.labels.get(cid)
            if c is None:
                c, extra = extra, extra + 1
            out[cid] = c
        return out

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        found = self.cluster_assignment()
        metrics = assignment_metrics(list(found.values()), self.ctx.meta, list(found))
        metrics["pacfl/clients_with_basis"] = float(len(self.bases))
        return metrics

    def artifacts(self, outdir: str) -> list[str]:  # pragma: no mutate block (a file for a reader)
        found = self.cluster_assignment()
        return [write_assignment_table(outdir, "pacfl_assignments.csv", list(found.values()), self.ctx.meta,
                                       list(found))]

    # ---- newcomers: one basis upload, the nearest cluster (Vahidian et al.) ----------------------
    newcomer_rule = ("uploads its data basis once; the server puts it in the cluster at the smallest linkage "
                     "distance (angles to the members, the configured linkage)")

    def join_begin(self, rnd: int, newcomers: list[int]) -> None:
        self.joined = sorted(newcomers)

    def join_active(self, step: int) -> list[int]:
        return list(self.joined) if step == 0 else []

    def join_message(self, rnd: int, step: int, cid: int) -> Message:
        return Message.of({}, send_basis=True)

    def join_update(self, rnd: int, step: int, client: ClientHandle, msg: Message | None) -> Message:
        return self.local_update(rnd, client, msg)

    def join_aggregate(self, rnd: int, step: int, replies: dict[int, Message]) -> None:
        """Each newcomer joins the cluster whose linkage distance to it is smallest; the clusters
        of the trained clients stay as they are."""
        known = sorted(c for c in self.bases if c in self.labels)
        if not known or not self.models:
            return
        for cid, reply in sorted(replies.items()):
            self.n[cid] = reply.info["n"]
            basis = reply.tensors("basis")["basis"]
            angles = proximity([basis], [self.bases[c] for c in known], self.hp.angle)[0].double()
            best, best_d = None, float("inf")
            for c in range(len(self.models)):
                d = angles[[k for k, member in enumerate(known) if self.labels[member] == c]]
                if len(d) == 0:
                    continue
                link = {"single": d.min(), "complete": d.max()}.get(self.hp.linkage, d.mean())
                if float(link) < best_d:
                    best, best_d = c, float(link)
            self.labels[cid] = best
