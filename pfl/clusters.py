"""Clustering metrics and read-outs: connected components of a threshold graph, the silhouette-chosen
threshold, cluster counts and the adjusted Rand index against true clusters, assignment tables."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


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


__all__ = ["MIN_SILHOUETTE", "assignment_metrics", "cluster_metrics", "connected_components", "relabel",
           "silhouette_threshold", "write_assignment_table"]
