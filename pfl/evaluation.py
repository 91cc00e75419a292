"""Personalized evaluation (every client's model on its own splits) and clustering metrics.

Metric names (stable, logged to MLflow with ``step=round``):

* ``val/acc_mean``, ``val/loss_mean`` — personalized models on each client's validation split;
* ``test/acc_mean``, ``test/acc_std``, ``test/acc_p10``, ``test/acc_worst``, ``test/acc_weighted``
  (sample-weighted), ``test/loss_mean``; regression reports ``*/rmse_mean`` instead of accuracy;
* ``global/test_acc``, ``global/test_loss``, ``global/val_acc`` — the global model (when the method
  has one) on every client's split, averaged over clients;
* ``cluster/num``, ``cluster/ari`` — for clustering methods (see :func:`cluster_metrics`);
* ``<name>_acc`` (``<name>_rmse``) — a method's extra evaluation models, e.g. ``fpfc/readout_acc``.

Evaluation runs on each client's side (:func:`evaluate_plan`, with the models its
:class:`~pfl.methods.base.EvalPlan` names); :func:`summarize` turns the rows into the metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch


if TYPE_CHECKING:
    from .methods.base import ClientHandle, EvalPlan


def _summary(prefix: str, values: np.ndarray, full: bool = False) -> dict[str, float]:
    values = values[np.isfinite(values)] if values.size else values
    if values.size == 0:
        return {}
    out = {f"{prefix}_mean": float(values.mean())}
    if full:
        out[f"{prefix}_std"] = float(values.std())
        out[f"{prefix}_p10"] = float(np.percentile(values, 10))
        out[f"{prefix}_worst"] = float(values.min())
    return out


def evaluate_plan(client: "ClientHandle", plan: "EvalPlan", task: str, eval_global: bool = True) -> dict[str, float]:
    """One client's row: its personalized model (and the global and extra models of ``plan``) on
    its own validation and test splits. Runs client-side: only this client's data is read."""
    d = client.data
    params, fwd = plan.personal, plan.forward
    val = client.evaluate(params, d.x_val, d.y_val, forward=fwd)
    test = client.evaluate(params, d.x_test, d.y_test, forward=fwd)
    row = {"client": client.cid, "n_train": len(d.y_train), "n_test": test.n,
           "cluster": -1 if d.cluster is None else int(d.cluster),
           "val_loss": val.loss, "val_acc": val.acc, "test_loss": test.loss, "test_acc": test.acc}
    glob = plan.global_model if eval_global else None
    if glob is not None:
        if glob is params and fwd is None:  # the same model: reuse instead of evaluating twice
            gval, gtest = val, test
        else:
            gval = client.evaluate(glob, d.x_val, d.y_val)
            gtest = client.evaluate(glob, d.x_test, d.y_test)
        row.update(global_val_acc=gval.acc, global_test_acc=gtest.acc,
                   global_test_loss=gtest.loss, global_val_loss=gval.loss)
    for name, extra in plan.extra.items():
        res = client.evaluate(extra, d.x_test, d.y_test)
        row[f"{name}:test_loss"] = res.loss
        row[f"{name}:test_acc"] = res.acc
    return row


def summarize(rows: Sequence[dict], task: str) -> dict[str, float]:
    """The logged metrics (see the module docstring) from every client's row."""
    def col(key: str) -> np.ndarray:
        return np.array([r.get(key, np.nan) for r in rows], dtype=float)

    def mean(values: np.ndarray) -> float:  # nan (not a warning) when no client has that split
        finite = values[np.isfinite(values)]
        return float(finite.mean()) if finite.size else float("nan")

    n_test = col("n_test")
    has_global = any("global_test_loss" in r for r in rows)
    metrics: dict[str, float] = {}
    metrics.update(_summary("val/loss", col("val_loss")))
    metrics.update(_summary("test/loss", col("test_loss")))
    if task == "classification":
        metrics.update(_summary("val/acc", col("val_acc")))
        metrics.update(_summary("test/acc", col("test_acc"), full=True))
        if n_test.sum() > 0:
            metrics["test/acc_weighted"] = float(np.nansum(col("test_acc") * n_test) / n_test.sum())
        if has_global:
            metrics["global/test_acc"] = mean(col("global_test_acc"))
            metrics["global/val_acc"] = mean(col("global_val_acc"))
    else:
        metrics.update(_summary("val/rmse", np.sqrt(col("val_loss"))))
        metrics.update(_summary("test/rmse", np.sqrt(col("test_loss")), full=True))
        if has_global:
            metrics["global/test_rmse"] = mean(np.sqrt(col("global_test_loss")))
    if has_global:
        metrics["global/test_loss"] = mean(col("global_test_loss"))
    extras = dict.fromkeys(k.split(":")[0] for r in rows for k in r if ":" in k)
    for name in extras:
        if task == "classification":
            metrics[f"{name}_acc"] = mean(col(f"{name}:test_acc"))
        else:
            metrics[f"{name}_rmse"] = mean(np.sqrt(col(f"{name}:test_loss")))
    return metrics


RUN_METRICS = ("train/loss", "lr", "time/round_s", "time/elapsed_s")
EVAL_METRICS = {
    "classification": ("val/loss_mean", "test/loss_mean", "val/acc_mean", "test/acc_mean", "test/acc_std",
                       "test/acc_p10", "test/acc_worst", "test/acc_weighted", "global/test_acc",
                       "global/val_acc", "global/test_loss"),
    "regression": ("val/loss_mean", "test/loss_mean", "val/rmse_mean", "test/rmse_mean", "test/rmse_std",
                   "test/rmse_p10", "test/rmse_worst", "global/test_rmse", "global/test_loss"),
}
ASYNC_METRICS = ("time/sim_clock", "async/arrivals")
#: under an attack (pfl/federation/attacks.py) and with newcomers (pfl/federation/newcomers.py)
ATTACK_METRICS = ("attack/benign_clients", "attack/diverged")
NEWCOMER_METRICS = ("newcomer/*", "comm/join_up_bytes", "comm/join_down_bytes")


def reported_metrics(cfg) -> tuple[str, ...]:
    """Every metric name a run of ``cfg`` can report (``*`` matches any tail): the loop's own, the
    ledger's, the evaluation's for the task, and the method's :attr:`metric_names`."""
    from .data import source_spec
    from .federation.comm import CommLedger
    from .methods import get_method

    task = source_spec(cfg.data.source).task
    names = [*RUN_METRICS, *CommLedger().metrics(), *EVAL_METRICS[task], *get_method(cfg.method.name).metric_names]
    if cfg.federation.driver == "async":
        names += ASYNC_METRICS
    if cfg.attack.kind != "none":
        names += ATTACK_METRICS
    if cfg.newcomers.fraction > 0:
        names += NEWCOMER_METRICS
    if any(spec.get("name") in ("fp16", "bf16") for spec in (cfg.compression.uplink, cfg.compression.downlink)):
        names.append("comm/fp16_flushed")  # pfl.compression.codec: non-zeros a half-precision encoding lost
    return tuple(dict.fromkeys(names))


def metric_known(name: str, catalog: Sequence[str]) -> bool:
    import fnmatch

    return any(name == pattern or ("*" in pattern and fnmatch.fnmatchcase(name, pattern)) for pattern in catalog)


# ---- clustering ------------------------------------------------------------------------------

def connected_components(adjacency: np.ndarray | torch.Tensor) -> np.ndarray:
    """Component labels (0..K-1, in order of first appearance) of an undirected boolean graph."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import connected_components as cc

    adj = adjacency.cpu().numpy() if isinstance(adjacency, torch.Tensor) else np.asarray(adjacency)
    _, labels = cc(csr_matrix(adj.astype(bool)), directed=False)
    return relabel(labels)


#: Kaufman & Rousseeuw's reading of the silhouette: at or below 0.25 "no substantial structure"
MIN_SILHOUETTE = 0.25


def silhouette_threshold(dist: np.ndarray, min_score: float = MIN_SILHOUETTE) -> float | None:
    """The threshold ν whose components of {dist < ν} have the best silhouette on ``dist``.

    The candidates are the cuts of the single-linkage hierarchy with 2 to m − 1 components
    (components only change at its merge heights, so ν is put halfway between consecutive ones).
    Returns None when no cut scores above ``min_score``: the distances show no clustering that a
    threshold can read out, and the caller keeps its fixed ν.
    """
    from scipy.cluster.hierarchy import linkage
    from scipy.spatial.distance import squareform
    from sklearn.metrics import silhouette_score

    dist = np.asarray(dist, dtype=float)
    dist = (dist + dist.T) / 2
    np.fill_diagonal(dist, 0.0)
    m = len(dist)
    if m < 3:
        return None
    heights = np.unique(linkage(squareform(dist, checks=False), "single")[:, 2])
    best, best_nu = min_score, None
    for low, high in zip(heights[:-1], heights[1:]):
        nu = (low + high) / 2
        labels = connected_components(dist < nu)
        k = labels.max() + 1
        if 2 <= k <= m - 1:
            score = silhouette_score(dist, labels, metric="precomputed")
            if score > best:
                best, best_nu = score, float(nu)
    return best_nu


def relabel(labels: Sequence[int] | np.ndarray) -> np.ndarray:
    """Labels renumbered 0, 1, ... in order of first appearance (stable, comparable across runs)."""
    mapping: dict[int, int] = {}
    return np.array([mapping.setdefault(int(v), len(mapping)) for v in labels], dtype=int)


def cluster_metrics(labels: Sequence[int] | np.ndarray, true: Sequence[int] | np.ndarray | None) -> dict[str, float]:
    """``cluster/num`` and, when true ids are known, ``cluster/ari`` (adjusted Rand index)."""
    from sklearn.metrics import adjusted_rand_score

    labels = np.asarray(labels)
    out = {"cluster/num": float(len(np.unique(labels)))}
    if true is not None:
        out["cluster/ari"] = float(adjusted_rand_score(np.asarray(true), labels))
    return out


def assignment_metrics(labels: Sequence[int] | np.ndarray, meta,
                       clients: Sequence[int] | None = None) -> dict[str, float]:
    """Cluster metrics of a per-client assignment against ``meta.true_clusters``; ``labels[k]`` belongs
    to client ``clients[k]`` (default: client k, all clients)."""
    true = meta.true_clusters
    if true is not None and clients is not None:
        true = np.asarray(true)[list(clients)]
    return cluster_metrics(np.asarray(labels, dtype=int), true)


def write_assignment_table(outdir: str, filename: str, labels: Sequence[int], meta,
                           clients: Sequence[int] | None = None) -> str:
    """CSV of a final assignment: client, true cluster (-1 when unknown), found cluster, n_train;
    ``labels[k]`` belongs to client ``clients[k]`` (default: client k)."""
    import csv
    import os

    path = os.path.join(outdir, filename)
    true = meta.true_clusters
    ids = range(len(labels)) if clients is None else clients
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["client", "true_cluster", "found_cluster", "n_train"])
        for cid, label in zip(ids, labels):
            writer.writerow([cid, -1 if true is None else int(true[cid]), int(label), meta.client_sizes[cid]])
    return path
