"""Personalized evaluation (every client's model on its own splits) and clustering metrics.

Metric names (stable, logged to MLflow with ``step=round``):

* ``val/acc_mean``, ``val/loss_mean`` — personalized models on each client's validation split;
* ``test/acc_mean``, ``test/acc_std``, ``test/acc_p10``, ``test/acc_worst``, ``test/acc_weighted``
  (sample-weighted), ``test/loss_mean``; regression reports ``*/rmse_mean`` instead of accuracy;
* ``global/test_acc``, ``global/test_loss``, ``global/val_acc`` — the global model (when the method
  has one) on every client's split, averaged over clients;
* ``cluster/num``, ``cluster/ari`` — for clustering methods (see :func:`cluster_metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from .training import evaluate

if TYPE_CHECKING:
    from .methods import ClientHandle, Method


@dataclass
class EvalOutput:
    metrics: dict[str, float]
    table: list[dict[str, float]]  # one row per client


def _summary(prefix: str, values: np.ndarray, weights: np.ndarray | None = None,
             full: bool = False) -> dict[str, float]:
    values = values[np.isfinite(values)] if values.size else values
    if values.size == 0:
        return {}
    out = {f"{prefix}_mean": float(values.mean())}
    if full:
        out[f"{prefix}_std"] = float(values.std())
        out[f"{prefix}_p10"] = float(np.percentile(values, 10))
        out[f"{prefix}_worst"] = float(values.min())
    return out


def evaluate_clients(method: "Method", clients: Sequence["ClientHandle"], task: str,
                     eval_global: bool = True) -> EvalOutput:
    """Evaluate each client's personalized model (and the global model) on its val/test splits."""
    glob = method.global_params() if eval_global else None
    rows = []
    for client in clients:
        params = method.personal_params(client)
        fwd = method.eval_forward(client)
        d = client.data
        val = evaluate(client.model, params, d.x_val, d.y_val, task, forward=fwd)
        test = evaluate(client.model, params, d.x_test, d.y_test, task, forward=fwd)
        row = {"client": client.cid, "n_train": len(d.y_train), "n_test": test.n,
               "cluster": -1 if d.cluster is None else int(d.cluster),
               "val_loss": val.loss, "val_acc": val.acc, "test_loss": test.loss, "test_acc": test.acc}
        if glob is not None:
            if params is glob and fwd is None:  # same model: reuse instead of evaluating twice
                gval, gtest = val, test
            else:
                gval = evaluate(client.model, glob, d.x_val, d.y_val, task)
                gtest = evaluate(client.model, glob, d.x_test, d.y_test, task)
            row.update(global_val_acc=gval.acc, global_test_acc=gtest.acc,
                       global_test_loss=gtest.loss, global_val_loss=gval.loss)
        rows.append(row)
    col = lambda key: np.array([r[key] for r in rows], dtype=float)  # noqa: E731

    def mean(values: np.ndarray) -> float:  # nan (not a warning) when no client has that split
        finite = values[np.isfinite(values)]
        return float(finite.mean()) if finite.size else float("nan")

    n_test = col("n_test")
    metrics: dict[str, float] = {}
    metrics.update(_summary("val/loss", col("val_loss")))
    metrics.update(_summary("test/loss", col("test_loss")))
    if task == "classification":
        metrics.update(_summary("val/acc", col("val_acc")))
        metrics.update(_summary("test/acc", col("test_acc"), full=True))
        if n_test.sum() > 0:
            metrics["test/acc_weighted"] = float((col("test_acc") * n_test).sum() / n_test.sum())
        if glob is not None:
            metrics["global/test_acc"] = mean(col("global_test_acc"))
            metrics["global/val_acc"] = mean(col("global_val_acc"))
    else:
        metrics.update(_summary("val/rmse", np.sqrt(col("val_loss"))))
        metrics.update(_summary("test/rmse", np.sqrt(col("test_loss")), full=True))
        if glob is not None:
            metrics["global/test_rmse"] = mean(np.sqrt(col("global_test_loss")))
    if glob is not None:
        metrics["global/test_loss"] = mean(col("global_test_loss"))
    return EvalOutput(metrics, rows)


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


def assignment_metrics(labels: Sequence[int] | np.ndarray, data) -> dict[str, float]:
    """Cluster metrics of a per-client assignment against ``data.true_clusters``."""
    return cluster_metrics(np.asarray(labels, dtype=int), data.true_clusters)


def write_assignment_table(outdir: str, filename: str, labels: Sequence[int], data) -> str:
    """CSV of a final assignment: client, true cluster (-1 when unknown), found cluster, n_train."""
    import csv
    import os

    path = os.path.join(outdir, filename)
    true = data.true_clusters
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["client", "true_cluster", "found_cluster", "n_train"])
        for cid, label in enumerate(labels):
            writer.writerow([cid, -1 if true is None else int(true[cid]), int(label),
                             len(data.clients[cid].y_train)])
    return path
