"""The partition at a glance: every client's split sizes and its training labels (a regression
source: a histogram of its training targets), as a table (``pfl datasets --show``) and as the
picture every run logs (``plots/partition.png``, :func:`pfl.plots.plot_partition`).

Labels are read without building any client's features: for data built on demand, from the
source's labels and the partition's indices, with the partition's label transform (label_swap,
label_shift) applied as :func:`pfl.data.federated._client` applies it — so a 100,000-client
population's view costs its labels only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .federated import SPLITS, FederatedData, OnDemandClients
from .transforms import shift_labels, swap_labels

#: equal-width bins of a regression source's target histograms
TARGET_BINS = 10


def split_labels(data: FederatedData, i: int, split: str) -> np.ndarray:
    """Client ``i``'s labels (targets) of ``split``, as its tensors hold them."""
    clients = data.clients
    if isinstance(clients, OnDemandClients):
        src, part = clients.src, clients.part
        y = np.asarray(src.y[getattr(part, split)[i]])
        t = -1 if part.transforms is None else int(part.transforms[i])
        if t >= 0 and clients.kind == "label_swap":
            y = swap_labels(y, t, src.num_classes)
        if t >= 0 and clients.kind == "label_shift":
            y = shift_labels(y, t, src.num_classes)
        return np.asarray(y)
    return getattr(clients[i], f"y_{split}").detach().cpu().numpy()


@dataclass
class PartitionView:
    """``sizes``: (m, 3) samples per client and split (train, val, test); ``counts``: (m, columns)
    training samples per class, or per target bin for a regression source (``columns`` names them)."""
    source: str
    kind: str
    task: str
    sizes: np.ndarray
    counts: np.ndarray
    columns: list[str]
    client_ids: list[str] | None = None

    @property
    def num_clients(self) -> int:
        return len(self.sizes)

    @property
    def what(self) -> str:
        return ("training samples per class" if self.task == "classification"
                else "training targets per bin (histogram)")


def partition_view(data: FederatedData, bins: int = TARGET_BINS) -> PartitionView:
    """The view of ``data`` (see the module docstring)."""
    m = data.num_clients
    labels = [{s: split_labels(data, i, s) for s in SPLITS} for i in range(m)]
    sizes = np.array([[len(row[s]) for s in SPLITS] for row in labels], dtype=np.int64).reshape(m, len(SPLITS))
    if data.task == "classification":
        c = max(int(data.num_classes), 1)
        counts = np.array([np.bincount(row["train"].astype(np.int64), minlength=c)[:c] for row in labels],
                          dtype=np.int64).reshape(m, c)
        columns = [str(k) for k in range(c)]
    else:
        every = np.concatenate([row["train"].ravel() for row in labels]) if m else np.zeros(0)
        lo, hi = (float(every.min()), float(every.max())) if every.size else (0.0, 1.0)
        edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
        counts = np.array([np.histogram(row["train"].ravel(), bins=edges)[0] for row in labels],
                          dtype=np.int64).reshape(m, bins)
        columns = [f"{a:.3g}..{b:.3g}" for a, b in zip(edges[:-1], edges[1:])]
    return PartitionView(data.source, data.partition_kind, data.task, sizes, counts, columns, data.client_ids)


def format_view(view: PartitionView, max_clients: int = 100) -> str:
    """The view as a fixed-width table: one row per client (the first ``max_clients``; 0 = all),
    its split sizes, then its counts; a total row last."""
    head = ["client", *SPLITS, "|", *view.columns]
    total = ["total", *(str(int(v)) for v in view.sizes.sum(0)), "|", *(str(int(v)) for v in view.counts.sum(0))]
    shown = view.num_clients if max_clients <= 0 else min(view.num_clients, max_clients)
    rows = []
    for i in range(shown):
        name = view.client_ids[i] if view.client_ids else str(i)
        rows.append([name, *(str(int(v)) for v in view.sizes[i]), "|", *(str(int(v)) for v in view.counts[i])])
    widths = [max(len(r[j]) for r in [head, total, *rows]) for j in range(len(head))]

    def line(cells: list[str]) -> str:
        return " ".join(cell.rjust(w) for cell, w in zip(cells, widths)).rstrip()

    title = (f"{view.source}, partition {view.kind or '?'}: {view.num_clients} clients; columns after | are "
             f"{view.what}")
    out = [title, line(head), *(line(r) for r in rows)]
    if shown < view.num_clients:
        out.append(f"... {view.num_clients - shown} more clients (--max-clients 0 prints every one)")
    out.append(line(total))
    return "\n".join(out)


__all__ = ["PartitionView", "TARGET_BINS", "format_view", "partition_view", "split_labels"]
