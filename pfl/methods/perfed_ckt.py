"""PerFed-CKT (Cho, Wang, Chiruvolu, Joshi 2021; COMET in the journal version): clustered knowledge
transfer between clients of different architectures that never exchange parameters.

Every client keeps its own model (architectures may differ) and trains on

    CE(own data) + λ · mean_j ρ( s(w_k, x_j), μ_σ(k)[j] ),   x_j from a public unlabeled set,

where μ_c is the mean public-set logit matrix of the clients in cluster c. Per round the server sends
each sampled client its cluster's centroid on this round's public rows; the client trains, then
uploads its own logits on those rows (eval mode); the server k-means-clusters all stored logit
matrices (stale ones kept) and assigns every client the nearest centroid. Only N_t×C logits cross
the wire, orders of magnitude below a model. Notes: docs/methods/perfed_ckt.md.

Decisions where the spec is [DESIGN] or silent (the paper body was not recoverable):

* ρ (``reg``): ``kl`` (default) = T²·KL(softmax(μ/T) ‖ softmax(s/T)) per public sample;
  ``mse_logits`` = ‖s − μ‖²/C; ``mse_probs`` = ‖softmax(s/T) − softmax(μ/T)‖². Averaged over the
  public minibatch; μ is a constant (no gradient into server values).
* One fresh public minibatch (``public_batch`` rows, 0 = the private batch size, without
  replacement) per private SGD step, drawn by the client's own generator with tag ``public`` so the
  private batch order is exactly Local's.
* λ = 0, or no centroid received (first participation, ``warmup_rounds``): the step is plain CE
  (the extra term is not even built), so λ = 0 reproduces Local bit for bit: every architecture is
  initialised once with ``ctx.init_params(model=m)`` (no per-client parts), which for ``cfg.model``
  is exactly Local's start. At λ = 0 logits are still uploaded and clustered (so the cluster
  metrics of pure local models can be compared), which costs the same bytes as λ > 0.
* Architectures: ``architectures`` is a list small → large (``"name"`` or ``{name, params}``); empty
  (default) = ``[model.name]`` with ``model.params``, the model Local and FedAvg use, so a
  comparison with them is like for like. Heterogeneous models are opt-in (e.g. [cnn_fpfc, mlp,
  cnn_fedavg]: 6.6 k / 199 k / 582 k parameters on 28×28); compare them with Local on the same mix
  (this method at λ = 0). Assignment per docs/methods/perfed_ckt.md §6: score_k = n_k·u_k, u_k ~ U(0,1) from
  ``ctx.rng("arch")``, clients sorted by score and cut into A near-equal groups, the highest-score
  group gets the last (largest) model. The assignment models an exogenous device property, so the
  server may use the clients' sample counts for it at setup (nothing else of a client is read).
* The public set (pfl/methods/public_set.py) is disjoint from every client's data by default, the
  samples left unused by ``data.max_samples``; ``ckt/public_overlap`` logs the rows it shares with
  client data (a warning when that cannot be zero).
* Public rows per round (``public_per_round`` N_t < N): a sorted random subset seeded by
  (seed, round, "public_rows"), known to both sides without sending indices. The server stores a
  full N×C matrix per client with NaN for rows it has not received yet. k-means sees each matrix
  with unknown entries filled by the mean over the stored clients that know the entry (so they add
  no spread); a centroid entry is the mean over the cluster members that know it, else over all
  stored clients; rows no stored client knows are sent as NaN and ignored by the client (the byte
  count is still exactly N_t·C·b). With N_t = N (default) none of this applies after round 0.
* Clustering: sklearn KMeans(n_clusters=min(k, #stored), n_init=10, random_state from
  (seed, round)) on the stored matrices in ``cluster_space`` (``logits``; ``centered_logits`` =
  minus the per-sample mean over classes; ``probs`` = softmax(·/T)); the centroid sent is always the
  members' mean in logit space. ``downlink=all_centroids`` sends all centroids; the client picks the
  nearest one (same ``cluster_space`` distance, its current model in eval mode) before training.
* ``logit_dtype=fp16`` halves both directions; the server stores the fp16-rounded values as fp32.
* Metrics over the clients that have uploaded at least once: ``cluster/num``, ``cluster/ari`` (vs
  the partition's true clusters), ``cluster/ari_arch`` (vs architecture ids), ``cluster/size_max``,
  ``cluster/size_min``, ``cluster/singletons``, ``ckt/stored``, ``ckt/public_rows``,
  ``ckt/public_overlap``.
* There is no global model (``global_params`` is None, so ``global/*`` is not logged).
"""

from __future__ import annotations

import csv
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from ..federation.context import derive_seed
from ..federation.messages import Logits, Message
from ..schema import ConfigError, hp
from ..training import Params
from . import register
from .base import ClientHandle, Method
from .public_set import SAME_HELDOUT, build_public_set, check_public_source

REGS = ("kl", "mse_logits", "mse_probs")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@dataclass
class PerFedCKTHparams:
    """PerFed-CKT: logits-only co-distillation towards the client's k-means cluster centroid."""
    k: int = hp(2, "number of clusters K (1 = unclustered co-distillation towards the mean)", low=1)
    lam: float = hp(0.1, "weight λ of the distillation regulariser (0 = Local; 0.1 from a sweep over seeds, "
                    "docs/methods/perfed_ckt.md §8)", low=0.0)
    temperature: float = hp(1.0, "softmax temperature T of kl / mse_probs (and cluster_space=probs)",
                            low=0.0, low_open=True)
    reg: str = hp("kl", "regulariser ρ(student logits, centroid): T²·KL(teacher‖student), squared "
                  "logit distance / C, or squared probability distance", choices=REGS)
    public_batch: int = hp(0, "public rows per SGD step (0 = federation.batch_size; all rows if that is 0)",
                           low=0)
    cluster_space: str = hp("logits", "what k-means clusters: raw logits, logits minus their per-sample "
                            "class mean, or softmax probabilities", choices=("logits", "centered_logits", "probs"))
    downlink: str = hp("assigned", "send the client its assigned centroid, or all centroids and let it "
                       "pick the nearest (K× the downlink)", choices=("assigned", "all_centroids"))
    warmup_rounds: int = hp(0, "first rounds in which no centroid is sent (CE only; logits still uploaded)",
                            low=0)
    logit_dtype: str = hp("fp32", "wire precision of logits and centroids", choices=tuple(DTYPES))
    public_source: str = hp(SAME_HELDOUT, "public unlabeled set: 'same_heldout' (task source, samples no "
                            "client holds when data.max_samples leaves some) or a data source name "
                            "with the task's input shape (e.g. mnist for fmnist)")
    public_size: int = hp(2000, "public set size N (capped at the pool size)", low=1)
    public_per_round: int = hp(0, "public rows N_t used (and sent) per round (0 = all N)", low=0)
    architectures: list = hp(default_factory=list,
                             doc="client models small → large: names or {name, params}; [] = model.name "
                                 "(the model Local and FedAvg use; mixed models are opt-in)")

    def validate(self, path: str) -> None:
        from ..models import model_spec
        from ..schema import from_dict

        check_public_source(self.public_source)
        if self.public_per_round > self.public_size:
            raise ConfigError(f"{path}.public_per_round", f"{self.public_per_round} is more than "
                                                          f"public_size = {self.public_size}")
        for i, arch in enumerate(self.architectures):
            where = f"{path}.architectures[{i}]"
            if isinstance(arch, str):
                name, params = arch, {}
            elif isinstance(arch, dict) and set(arch) <= {"name", "params"} and "name" in arch:
                name, params = arch["name"], arch.get("params") or {}
            else:
                raise ConfigError(where, f"expected a model name or {{name, params}}, got {arch!r}")
            try:
                spec = model_spec(str(name))
            except ConfigError as err:
                raise ConfigError(where, str(err).split(": ", 1)[-1]) from None
            if not isinstance(params, dict):
                raise ConfigError(f"{where}.params", f"expected a mapping, got {params!r}")
            from_dict(spec.params, params, f"{where}.params")


@dataclass
class Architecture:
    name: str
    params: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name + (f"{self.params}" if self.params else "")


def parse_architectures(hparams: PerFedCKTHparams, cfg: Any) -> list[Architecture]:
    if hparams.architectures:
        return [Architecture(a) if isinstance(a, str) else Architecture(a["name"], dict(a.get("params") or {}))
                for a in hparams.architectures]
    return [Architecture(cfg.model.name, dict(cfg.model.params or {}))]


def assign_architectures(n_train: np.ndarray, num_archs: int,
                         rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Architecture id per client: score n_k·u_k, sorted, cut into equal groups (top → largest)."""
    scores = n_train * rng.uniform(size=len(n_train))
    order = np.argsort(scores, kind="stable")
    arch = np.empty(len(n_train), dtype=np.int64)
    for a, group in enumerate(np.array_split(order, num_archs)):
        arch[group] = a
    return arch, scores


def regulariser(student: torch.Tensor, teacher: torch.Tensor, kind: str, temperature: float = 1.0) -> torch.Tensor:
    """Mean over rows of ρ(student row, teacher row); ``teacher`` is treated as a constant."""
    teacher = teacher.detach()
    t = temperature
    if kind == "kl":
        p = F.softmax(teacher / t, dim=1)
        per_row = (p * (F.log_softmax(teacher / t, dim=1) - F.log_softmax(student / t, dim=1))).sum(1)
        return t * t * per_row.mean()
    if kind == "mse_logits":
        return (student - teacher).pow(2).mean()  # = mean over rows of ‖s − μ‖²/C
    if kind == "mse_probs":
        diff = F.softmax(student / t, dim=1) - F.softmax(teacher / t, dim=1)
        return diff.pow(2).sum(1).mean()
    raise ValueError(f"unknown regulariser {kind!r}; allowed: {', '.join(REGS)}")


def _feature_space(z: torch.Tensor, space: str, temperature: float) -> torch.Tensor:
    """(..., N, C) logits → what k-means / centroid picking measures distances in."""
    if space == "centered_logits":
        return z - z.mean(dim=-1, keepdim=True)
    if space == "probs":
        return F.softmax(z / temperature, dim=-1)
    return z


@register
class PerFedCKT(Method):
    name = "perfed_ckt"
    Hparams = PerFedCKTHparams
    quick = {"method.architectures": [{"name": "mlp", "params": {"hidden": [16]}}, "cnn_fpfc"],
             "method.public_size": 40}
    description = "Clustered knowledge transfer on public-set logits, heterogeneous models (Cho et al. 2021)"
    # its uplink is public-set logits, not a model: the model-replacing attacks are not defined for it
    attackable_uplink = False
    uplink_note = "it uploads public-set logits"
    cohort = "sequential"
    metric_names = ("ckt/public_rows", "ckt/public_overlap", "ckt/stored", "cluster/num", "cluster/ari",
                    "cluster/ari_arch", "cluster/size_max", "cluster/size_min", "cluster/singletons")

    # ---- setup -------------------------------------------------------------------------------
    def configure(self) -> None:
        from ..models import build_model, num_params

        ctx, data = self.ctx, self.ctx.meta
        if data.task != "classification":
            raise ConfigError("method.name", "perfed_ckt needs a classification task (it distils class logits)")
        self.archs = parse_architectures(self.hp, ctx.cfg)
        self.arch_models: list[torch.nn.Module] = []
        self.arch_init: list[Params] = []
        for i, arch in enumerate(self.archs):
            try:
                model = build_model(arch.name, arch.params, data.input_shape, data.num_classes).to(ctx.device)
            except ConfigError as err:
                raise ConfigError(f"method.architectures[{i}]", str(err)) from None
            self.arch_models.append(model)
            # no per-client parts: for cfg.model this is exactly Local's initialisation
            self.arch_init.append(ctx.init_params(model=model))
        self.arch_params = [num_params(m) for m in self.arch_models]
        n_train = np.array(data.client_sizes, dtype=float)
        self.arch_of, self.arch_scores = assign_architectures(n_train, len(self.archs), ctx.rng("arch"))

        self.public = build_public_set(ctx, self.hp.public_source, self.hp.public_size)
        self.n_public = len(self.public)
        per_round = self.hp.public_per_round
        self.n_rows = self.n_public if per_round == 0 else min(per_round, self.n_public)
        self.wire_dtype = DTYPES[self.hp.logit_dtype]

    def client_model(self, cid: int) -> torch.nn.Module:
        return self.arch_models[int(self.arch_of[cid])]

    def setup(self) -> None:
        ctx, m, c = self.ctx, self.ctx.num_clients, self.ctx.meta.num_classes
        self.logits = torch.full((m, self.n_public, c), float("nan"), device=ctx.device)
        self.known = torch.zeros(m, dtype=torch.bool, device=ctx.device)
        self.assign = torch.full((m,), -1, dtype=torch.long, device=ctx.device)
        self.centroids = torch.zeros((0, self.n_public, c), device=ctx.device)
        self.cluster_round = -1

    def init_client(self, client: ClientHandle) -> None:
        a = int(self.arch_of[client.cid])
        client.state["params"] = {k: v.clone() for k, v in self.arch_init[a].items()}

    def rows(self, rnd: int) -> torch.Tensor:
        """This round's public row indices (sorted), derived from (seed, round) on both sides."""
        if self.n_rows == self.n_public:
            return torch.arange(self.n_public, device=self.ctx.device)
        picked = self.ctx.rng(rnd, "public_rows").choice(self.n_public, size=self.n_rows, replace=False)
        return torch.from_numpy(np.sort(picked)).to(self.ctx.device)

    # ---- server ------------------------------------------------------------------------------
    def broadcast(self, rnd: int, cid: int) -> Message | None:
        if rnd < self.hp.warmup_rounds or not bool(self.known[cid]) or len(self.centroids) == 0:
            return None
        rows = self.rows(rnd)
        if self.hp.downlink == "all_centroids":
            return Message.of({"centroids": Logits({"centroids": self.centroids[:, rows].to(self.wire_dtype)})})
        own = self.centroids[int(self.assign[cid]), rows].to(self.wire_dtype)
        return Message.of({"centroid": Logits({"centroid": own})})

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        rows = self.rows(rnd)
        for cid, msg in replies.items():
            self.logits[cid, rows] = msg.tensors("logits")["logits"].to(self.logits.dtype)
            self.known[cid] = True
        if replies:
            self.recluster(rnd)

    def recluster(self, rnd: int) -> None:
        """k-means on every stored logit matrix; new assignment and (logit-space) centroids."""
        from sklearn.cluster import KMeans

        stored = torch.nonzero(self.known).flatten()
        z = self.logits[stored]                                   # (s, N, C), NaN = not received yet
        mask = torch.isfinite(z)
        filled = torch.where(mask, z, torch.zeros_like(z))
        count = mask.sum(0)
        col_mean = filled.sum(0) / count.clamp(min=1)             # per entry, over clients that know it
        imputed = torch.where(mask, z, col_mean.expand_as(z))
        feats = _feature_space(imputed, self.hp.cluster_space, self.hp.temperature)
        feats = feats.reshape(len(stored), -1).double().cpu().numpy()
        n_clusters = min(self.hp.k, len(stored))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # duplicate points (e.g. identical clients) are fine
            km = KMeans(n_clusters=n_clusters, n_init=10,
                        random_state=derive_seed(self.ctx.seed, rnd, "kmeans") % 2**32).fit(feats)
        labels = torch.as_tensor(km.labels_, dtype=torch.long, device=z.device)
        onehot = F.one_hot(labels, n_clusters).to(z.dtype)       # (s, K)
        member_sum = torch.einsum("sk,snc->knc", onehot, filled)
        member_cnt = torch.einsum("sk,snc->knc", onehot, mask.to(z.dtype))
        global_mean = torch.where(count > 0, col_mean, torch.full_like(col_mean, float("nan")))
        self.centroids = torch.where(member_cnt > 0, member_sum / member_cnt.clamp(min=1),
                                     global_mean.expand(n_clusters, -1, -1))
        self.assign = torch.full_like(self.assign, -1)
        self.assign[stored] = labels
        self.cluster_round = rnd

    # ---- client ------------------------------------------------------------------------------
    def _public_logits(self, client: ClientHandle, params: Params, x: torch.Tensor) -> torch.Tensor:
        model = client.model
        was_training = model.training
        model.eval()  # the zoo has no BN/dropout today; eval mode keeps this right if one ever does
        with torch.no_grad():
            out = torch.cat([functional_call(model, params, (x[s:s + 4096],)) for s in range(0, len(x), 4096)])
        model.train(was_training)
        return out

    def _target(self, client: ClientHandle, msg: Message | None, rows: torch.Tensor) -> torch.Tensor | None:
        if msg is None:
            return None
        if "centroid" in msg:
            return msg.tensors("centroid")["centroid"].float()
        cents = msg.tensors("centroids")["centroids"].float()                        # (K, N_t, C)
        own = self._public_logits(client, client.state["params"], self.public.x[rows])
        valid = torch.isfinite(cents).all(dim=0).all(dim=1)
        space, t = self.hp.cluster_space, self.hp.temperature
        diff = _feature_space(cents[:, valid], space, t) - _feature_space(own[valid], space, t)
        return cents[int(diff.pow(2).sum(dim=(1, 2)).argmin())]

    def distillation_loss(self, client: ClientHandle, rnd: int, x_pub: torch.Tensor,
                          target: torch.Tensor) -> Callable[[Params], torch.Tensor] | None:
        """λ·ρ on a fresh public minibatch per call (one call per SGD step)."""
        valid = torch.nonzero(torch.isfinite(target).all(dim=1)).flatten()
        if self.hp.lam == 0 or len(valid) == 0:
            return None
        batch = self.hp.public_batch or self.ctx.cfg.federation.batch_size
        batch = len(valid) if batch <= 0 else min(batch, len(valid))
        gen = client.generator(rnd, "public")
        model, lam, kind, t = client.model, self.hp.lam, self.hp.reg, self.hp.temperature

        def extra_loss(params: Params) -> torch.Tensor:
            pick = valid[torch.randperm(len(valid), generator=gen)[:batch].to(valid.device)]
            student = functional_call(model, params, (x_pub[pick],))
            return lam * regulariser(student, target[pick], kind, t)

        return extra_loss

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        rows = self.rows(rnd)
        x_pub = self.public.x[rows]
        target = self._target(client, msg, rows)
        extra = None if target is None else self.distillation_loss(client, rnd, x_pub, target)
        result = client.train(client.state["params"], rnd, extra_loss=extra)
        client.state["params"] = result.params
        client.state["train_loss"] = result.mean_loss
        logits = self._public_logits(client, result.params, x_pub)
        return Message.of({"logits": Logits({"logits": logits.to(self.wire_dtype)})}, n=client.n_train,
                          train_loss=result.mean_loss)

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        return client.state["params"]

    # ---- reporting ---------------------------------------------------------------------------
    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        from sklearn.metrics import adjusted_rand_score

        from ..clusters import cluster_metrics

        out = {"ckt/public_rows": float(self.n_rows), "ckt/public_overlap": float(self.public.overlap),
               "ckt/stored": float(int(self.known.sum()))}
        stored = torch.nonzero(self.known & (self.assign >= 0)).flatten().cpu().numpy()
        if len(stored) == 0:
            return out
        labels = self.assign.cpu().numpy()[stored]
        true = self.ctx.meta.true_clusters
        out.update(cluster_metrics(labels, None if true is None else np.asarray(true)[stored]))
        out["cluster/ari_arch"] = float(adjusted_rand_score(self.arch_of[stored], labels))
        sizes = np.bincount(labels)
        sizes = sizes[sizes > 0]
        out.update({"cluster/size_max": float(sizes.max()), "cluster/size_min": float(sizes.min()),
                    "cluster/singletons": float((sizes == 1).sum())})
        return out

    def artifacts(self, outdir: str) -> list[str]:  # pragma: no mutate block (a file for a reader)
        out = Path(outdir)
        arch_path = out / "perfed_ckt_architectures.csv"
        true = self.ctx.meta.true_clusters
        with arch_path.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["client", "arch_id", "arch", "num_params", "n_train", "score"])
            for cid, a in enumerate(self.arch_of):
                w.writerow([cid, int(a), self.archs[int(a)].label, self.arch_params[int(a)],
                            self.ctx.meta.client_sizes[cid], f"{self.arch_scores[cid]:.4f}"])
        cluster_path = out / "perfed_ckt_clusters.csv"
        assign = self.assign.cpu().numpy()
        with cluster_path.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["client", "cluster", "true_cluster", "arch_id", "uploaded", "cluster_round"])
            for cid in range(len(assign)):
                w.writerow([cid, int(assign[cid]), -1 if true is None else int(true[cid]),
                            int(self.arch_of[cid]), int(bool(self.known[cid])), self.cluster_round])
        return [str(arch_path), str(cluster_path)]
