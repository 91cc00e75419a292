"""Partitioners: which pooled samples each client gets, and each client's train/val/test split.

A :class:`Partition` is nothing but index arrays into the source's sample pool (plus true cluster
ids and per-client transform ids), which is what the cache stores. All randomness comes from numpy
Generators seeded by (experiment seed, stage tag), so a partition does not depend on torch's global
RNG, and changing e.g. ``val_fraction`` changes the splits but not which samples a client holds.

Kinds (``data.partition.kind``):

* ``iid``: a random permutation cut into client shares, equal or power-law sized;
* ``dirichlet``: for every class, client shares q ~ Dir(α·1_m) of that class's samples; clients left
  below ``min_samples`` after a few redraws are topped up from the largest clients (never an
  unbounded redraw loop, which would spin forever at α = 0.01 with 100 clients);
* ``shards``: McMahan-style pathological split, each client holding ``classes_per_client`` label
  shards, distinct labels wherever the class counts allow;
* ``label_swap`` / ``label_shift`` / ``rotation``: a Dirichlet (α > 0) or iid (α = 0) split, then K
  contiguous client groups (client i in group ⌊i·K/m⌋) whose labels are swapped / shifted or whose
  images are rotated per group
  (see :mod:`pfl.data.transforms`);
* ``natural``: the per-client source's own devices (a file's client ids; LEAF's own test split
  is kept, validation then comes from each client's LEAF training samples); of data with its own
  clients, ``data.num_clients`` of them drawn with the seed (:func:`draw_clients`).

Power-law sizes: client weights are Pareto distributed with tail exponent ``power``
(P(W > w) = w^(−power), w ≥ 1); every client first gets ``min_samples`` and the rest of the pool is
shared in proportion to the weights.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from dataclasses import dataclass

import numpy as np

from ..config import DataConfig
from ..schema import ConfigError
from .sources import SourceData
from .synthetic import contiguous_clusters

log = logging.getLogger(__name__)

DIRICHLET_REDRAWS = 10
CLUSTERED_KINDS = ("label_swap", "label_shift", "rotation")


@dataclass
class Partition:
    """Per-client index arrays into the source's pool, per split."""
    train: list[np.ndarray]
    val: list[np.ndarray]
    test: list[np.ndarray]
    clusters: np.ndarray | None = None    # (m,) true cluster ids, when the partition has them
    transforms: np.ndarray | None = None  # (m,) transform id per client (its cluster in CLUSTERED_KINDS), -1 = none

    @property
    def num_clients(self) -> int:
        return len(self.train)


def rng_for(seed: int, tag: str) -> np.random.Generator:
    """A generator for one stage of data preparation; crc32 gives a stable integer for the tag."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), zlib.crc32(tag.encode())]))


def largest_remainder(ideal: np.ndarray, total: int, cap: np.ndarray | None = None) -> np.ndarray:
    """Integers near ``ideal`` that sum to ``total`` (or to what ``cap`` allows), each ≤ ``cap``.

    Start from the floors, then hand out the missing units one at a time to the entries furthest
    below their ideal share that still have room.
    """
    ideal = np.asarray(ideal, dtype=np.float64)
    if cap is None:
        cap = np.full(ideal.shape, np.iinfo(np.int64).max, dtype=np.int64)
    out = np.minimum(np.floor(ideal).astype(np.int64), cap)
    out = np.maximum(out, 0)
    remaining = int(total - out.sum())
    while remaining > 0:
        open_ = np.flatnonzero(cap - out > 0)
        if open_.size == 0:
            break
        order = open_[np.argsort(-(ideal[open_] - out[open_]), kind="stable")]
        take = order[:remaining]
        out[take] += 1
        remaining -= take.size
    return out


def _grouped_ranks(labels: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random order of positions grouped by class, each position's class, and its rank within it."""
    classes, inv, counts = np.unique(labels, return_inverse=True, return_counts=True)
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(inv[perm], kind="stable")]
    cls = inv[order]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return order, cls, np.arange(len(labels)) - starts[cls]


def stratified_subset(labels: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted positions of a random subset of ``size`` samples with the pool's class proportions."""
    n = len(labels)
    if size >= n:
        return np.arange(n)
    _, counts = np.unique(labels, return_counts=True)
    quota = largest_remainder(counts * (size / n), size, counts)
    order, cls, rank = _grouped_ranks(labels, rng)
    return np.sort(order[rank < quota[cls]])


def stratified_split(labels: np.ndarray | None, n: int, test_fraction: float, val_fraction: float,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions 0..n−1 split into (train, val, test) with every class in the same ratio.

    The split sizes are round(n·fraction), at least one sample each when the client has enough
    (test from 2 samples, validation from 3). Per class, the test and validation counts are the
    class's proportional share, distributed by largest remainder, but a class always keeps one
    sample for training first; a class with a single sample is training-only. ``labels`` None
    (regression) is a plain random split.
    """
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    if labels is None:
        labels = np.zeros(n, dtype=np.int64)
    n_test = int(round(n * test_fraction))
    n_val = int(round(n * val_fraction))
    if test_fraction > 0 and n >= 2:
        n_test = max(n_test, 1)
    if val_fraction > 0 and n >= 3:
        n_val = max(n_val, 1)
    n_test = min(n_test, n - 1)
    n_val = min(n_val, n - 1 - n_test)
    _, counts = np.unique(labels, return_counts=True)
    keep_one = np.maximum(counts - 1, 0)
    t = largest_remainder(counts * (n_test / n), n_test, keep_one)
    v = largest_remainder(counts * (n_val / n), n_val, keep_one - t)
    # every class is a singleton and the split came out empty: give it one sample anyway
    for alloc, target in ((t, n_test), (v, n_val)):
        if target > 0 and alloc.sum() == 0:
            left = counts - t - v
            if left.max() > 0:
                alloc[int(np.argmax(left))] += 1
    order, cls, rank = _grouped_ranks(labels, rng)
    in_test = rank < t[cls]
    in_val = ~in_test & (rank < (t + v)[cls])
    in_train = ~(in_test | in_val)
    return tuple(rng.permutation(order[mask]) for mask in (in_train, in_val, in_test))  # type: ignore[return-value]


def client_sizes(total: int, num_clients: int, sizes: str, power: float, min_samples: int,
                 rng: np.random.Generator) -> np.ndarray:
    """How many samples each client gets under iid/shards splits (sums to ``total``)."""
    floor = min(min_samples, total // num_clients)
    if sizes == "power_law":
        weights = rng.pareto(power, num_clients) + 1.0
    else:
        weights = np.ones(num_clients)
    extra = total - floor * num_clients
    return floor + largest_remainder(weights / weights.sum() * extra, extra)


def iid_split(n: int, sizes: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    perm = rng.permutation(n)
    return np.split(perm, np.cumsum(sizes)[:-1])


def _class_positions(labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)]


def _dirichlet_counts(class_sizes: np.ndarray, num_clients: int, alpha: float,
                      rng: np.random.Generator) -> np.ndarray:
    """(classes, clients) sample counts: each class cut at the cumulative Dir(α) proportions."""
    q = rng.dirichlet(np.full(num_clients, alpha), size=len(class_sizes))
    q = np.nan_to_num(q, nan=0.0)
    for row in np.flatnonzero(q.sum(axis=1) <= 0):  # underflow at tiny α: all mass on one client
        q[row] = 0.0
        q[row, rng.integers(num_clients)] = 1.0
    cuts = np.floor(np.cumsum(q, axis=1) * class_sizes[:, None]).astype(np.int64)
    cuts = np.minimum(cuts, class_sizes[:, None])
    cuts[:, -1] = class_sizes
    return np.diff(cuts, axis=1, prepend=0)


def repair_min_size(parts: list[np.ndarray], min_samples: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Move random samples from the currently largest clients to every client below ``min_samples``.

    Terminates: each transfer either fills the receiving client or brings the donor down to exactly
    ``min_samples``, and the caller guarantees the pool holds num_clients·min_samples samples.
    """
    parts = [np.asarray(p) for p in parts]
    sizes = np.array([len(p) for p in parts])
    moved = 0
    for i in np.argsort(sizes, kind="stable"):
        need = min_samples - sizes[i]
        while need > 0:
            donor = int(np.argmax(sizes))
            give = int(min(need, sizes[donor] - min_samples))
            if give <= 0:
                break
            pick = rng.permutation(sizes[donor])
            parts[i] = np.concatenate([parts[i], parts[donor][pick[:give]]])
            parts[donor] = parts[donor][pick[give:]]
            sizes[i] += give
            sizes[donor] -= give
            need -= give
            moved += give
    if moved:
        log.info("dirichlet partition: moved %d samples to clients below min_samples=%d", moved, min_samples)
    return parts


def dirichlet_split(labels: np.ndarray, num_clients: int, alpha: float, min_samples: int,
                    rng: np.random.Generator) -> list[np.ndarray]:
    by_class = _class_positions(labels, rng)
    class_sizes = np.array([len(c) for c in by_class])
    best, best_short = None, None
    # a few redraws make the repair rarely needed at moderate α; never loop unboundedly
    for _ in range(DIRICHLET_REDRAWS):
        counts = _dirichlet_counts(class_sizes, num_clients, alpha, rng)
        short = int(np.maximum(min_samples - counts.sum(axis=0), 0).sum())
        if best_short is None or short < best_short:
            best, best_short = counts, short
        if short == 0:
            break
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for positions, row in zip(by_class, best):
        for client, chunk in enumerate(np.split(positions, np.cumsum(row)[:-1])):
            if chunk.size:
                parts[client].append(chunk)
    merged = [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in parts]
    return repair_min_size(merged, min_samples, rng)


def _first_repeat(row: np.ndarray) -> int:
    """Position of the first label in ``row`` that already occurred earlier in it, or -1."""
    seen: set[int] = set()
    for pos, label in enumerate(row.tolist()):
        if label in seen:
            return pos
        seen.add(label)
    return -1


def _dedupe_shards(owned: np.ndarray, rng: np.random.Generator) -> None:
    """Swap shards between clients until no client holds two shards of one label, where possible.

    A swap gives client i a label it lacks and client j the duplicated label, which j lacks, so the
    number of duplicates drops by one per swap: the loop ends after at most that many swaps.
    """
    while True:
        srt = np.sort(owned, axis=1)
        dup_rows = np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))
        progress = False
        for i in rng.permutation(dup_rows):
            row = owned[i]
            slot = _first_repeat(row)
            if slot < 0:  # an earlier swap of this pass already fixed it
                continue
            label = row[slot]
            holds_label = (owned == label).any(axis=1)
            ok = ~np.isin(owned, row) & ~holds_label[:, None]
            candidates = np.argwhere(ok)
            if len(candidates) == 0:
                continue
            j, b = candidates[rng.integers(len(candidates))]
            owned[i, slot], owned[j, b] = owned[j, b], label
            progress = True
        if not progress:
            return


def shard_split(labels: np.ndarray, num_clients: int, classes_per_client: int, weights: np.ndarray,
                rng: np.random.Generator) -> list[np.ndarray]:
    """Each client holds ``classes_per_client`` single-label shards.

    The label-sorted pool is cut into num_clients·classes_per_client shards (each class into a number
    of shards proportional to its size, so no shard straddles two labels), shards are dealt at random
    and then swapped until labels within a client are distinct. A class's samples are divided among
    its shards in proportion to the owners' ``weights`` (equal weights: equal shards).
    """
    classes, counts = np.unique(labels, return_counts=True)
    total_shards = num_clients * classes_per_client
    per_class = largest_remainder(counts * (total_shards / counts.sum()), total_shards, counts)
    if per_class.sum() < total_shards:
        raise ConfigError("data.num_clients", f"shards needs at least num_clients·classes_per_client = "
                                              f"{total_shards} samples, the pool has {counts.sum()}")
    shard_labels = rng.permutation(np.repeat(np.arange(len(classes)), per_class))
    owned = shard_labels.reshape(num_clients, classes_per_client)
    _dedupe_shards(owned, rng)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, positions in enumerate(_class_positions(labels, rng)):
        owners = np.nonzero(owned == c)[0]  # one entry per shard (a client may own two)
        if owners.size == 0:
            continue
        w = weights[owners]
        sizes = largest_remainder(w / w.sum() * len(positions), len(positions))
        for owner, chunk in zip(owners, np.split(positions, np.cumsum(sizes)[:-1])):
            parts[owner].append(chunk)
    unused = int(counts[per_class == 0].sum())
    if unused:
        log.info("shards: %d samples of classes without a shard are not used", unused)
    return [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in parts]


def _check_pool(n: int, cfg: DataConfig) -> None:
    need = cfg.num_clients * cfg.partition.min_samples
    if n < need:
        raise ConfigError("data.num_clients",
                          f"{n} pooled samples cannot give each of {cfg.num_clients} clients "
                          f"partition.min_samples = {cfg.partition.min_samples} samples; lower data.num_clients "
                          f"or data.partition.min_samples, or raise data.max_samples")


def assign_clients(cfg: DataConfig, labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Positions (into ``labels``) held by each client, for the pooled partition kinds."""
    part, m = cfg.partition, cfg.num_clients
    n = len(labels)
    _check_pool(n, cfg)
    kind = part.kind
    if kind == "dirichlet" or (kind in CLUSTERED_KINDS and part.alpha > 0):
        return dirichlet_split(labels, m, part.alpha, part.min_samples, rng)
    if kind in ("iid",) + CLUSTERED_KINDS:
        return iid_split(n, client_sizes(n, m, part.sizes, part.power, part.min_samples, rng), rng)
    if kind == "shards":
        sizes = client_sizes(n, m, part.sizes, part.power, part.min_samples, rng)
        return shard_split(labels, m, part.classes_per_client, sizes / sizes.sum(), rng)
    raise ValueError(f"partition kind {kind!r} does not apply to a pooled source")


def draw_clients(src: SourceData, num_clients: int, seed: int) -> SourceData:
    """``src`` with ``num_clients`` of its own clients, drawn with the experiment ``seed`` (the same
    ones for the same seed every time), kept in their id order; all of them when it asks for as many."""
    total = len(src.devices)
    if num_clients >= total:
        return src
    chosen = np.sort(rng_for(seed, "pfl.data.clients").choice(total, size=num_clients, replace=False))
    return dataclasses.replace(
        src, devices=[src.devices[k] for k in chosen],
        clusters=None if src.clusters is None else np.asarray(src.clusters)[chosen],
        client_ids=None if src.client_ids is None else [src.client_ids[k] for k in chosen])


def make_partition(cfg: DataConfig, src: SourceData, seed: int) -> Partition:
    """The partition of ``src`` described by ``cfg`` (already resolved) for experiment ``seed``."""
    labels = src.y if src.task == "classification" else None
    clusters = transforms = None
    fixed_test = None
    if src.devices is not None and cfg.partition.kind == "natural":
        groups = src.devices
        clusters = None if src.clusters is None else np.asarray(src.clusters, dtype=np.int64)
        fixed_test = src.test_rows
    else:
        pool = np.arange(len(src.y))
        if cfg.max_samples is not None and cfg.max_samples < len(pool):
            pool = stratified_subset(src.y, cfg.max_samples, rng_for(seed, "pfl.data.subset"))
        positions = assign_clients(cfg, src.y[pool], rng_for(seed, "pfl.data.partition"))
        groups = [pool[p] for p in positions]
        if cfg.partition.kind in CLUSTERED_KINDS:
            clusters = contiguous_clusters(cfg.num_clients, cfg.partition.num_clusters)
            transforms = clusters.copy()
    split_rng = rng_for(seed, "pfl.data.split")
    if src.split is not None and fixed_test is None and cfg.partition.kind == "natural":
        train, val, test = src.split(groups, cfg.test_fraction, cfg.val_fraction, split_rng)
        return Partition(train, val, test, clusters, transforms)
    train, val, test = [], [], []
    for idx in groups:
        idx = np.asarray(idx, dtype=np.int64)
        if fixed_test is not None:  # the data's own test split (LEAF) is kept; validation from the rest
            test.append(idx[fixed_test[idx]])
            idx = idx[~fixed_test[idx]]
        tr, va, te = stratified_split(None if labels is None else labels[idx], len(idx),
                                      0.0 if fixed_test is not None else cfg.test_fraction, cfg.val_fraction,
                                      split_rng)
        train.append(idx[tr])
        val.append(idx[va])
        if fixed_test is None:
            test.append(idx[te])
    return Partition(train, val, test, clusters, transforms)
