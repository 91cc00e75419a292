"""``data.source: files``: a researcher's own data from NumPy, Parquet, CSV, per-client folders or LEAF.

The format comes from the path (``.npz``, ``.parquet``/``.pq``, ``.csv``/``.csv.gz``, ``.json`` or
a folder: LEAF ``train/``+``test/`` or ``*.json``, else one ``<client id>.npz``/``.parquet`` per
client) or from ``data.params.format``. What the partition needs (labels, client and cluster ids)
is read at validation time, so a missing column, a non-integer label, too many clients or a client
too small for its splits fail before any work, with the key to change. Features are read when the
federation is built (:meth:`~pfl.data.readers.Table.read_rows`), refusing non-finite values and
ragged rows.

Choices (docs/your-data.md):

* classification when the labels are integers, regression when they are floats (``task``
  overrides); classes are 0..max(label);
* ``partition.kind: auto`` is ``natural`` when the data has client ids (a client column, a folder
  of client files, LEAF users), else ``dirichlet`` (``iid`` for regression); a natural federation
  has every client of the data by default, in sorted id order (numbers numerically), clients below
  ``min_client_samples`` left out; ``data.num_clients: N`` draws N of them with the experiment seed
  (:func:`pfl.data.federated.load_federated`; this module always returns every usable client);
* LEAF's own train/test split is kept for natural partitions: a client's test set is its LEAF
  test samples, validation is ``val_fraction`` of its LEAF training samples; ``min_client_samples``
  then counts training samples, the ones its splits divide;
* a natural partition leaves out clients without samples and, where the data keeps its own split,
  clients with samples on one side only, saying how many and why once (``drop_incomplete_clients:
  false`` refuses them by name instead): real LEAF dumps hold such writers;
* uint8 features (images) are divided by 255, everything else is used as stored (``scale``);
* the partition cache key includes a sha256 of exactly what a partition is made from (labels,
  client, cluster and split ids), so an edited file never gets a stale partition, while features,
  which no partition depends on, are always read fresh from the file — LEAF JSON and CSV from the
  Parquet file they were parsed into once, keyed by a sha256 of their content (:mod:`.converted`);
* the time reading took (``Inspected.read_s``, also when the config's check did it) is counted
  once, in the first federation loaded from it (``time/data_load_s``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..schema import ConfigError, hp
from ..paths import absolute_path, shipped_path
from .converted import read_csv
from .leaf import read_leaf
from .readers import Table, read_client_folder, read_npz, read_parquet
from .sources import CLASSIFICATION, REGRESSION, SourceData, SourceSpec, register_source
from .tables import PATH_KEY, group_ids, labels_of, row_at, rows_by_group

log = logging.getLogger(__name__)

FORMATS = ("auto", "npz", "parquet", "csv", "leaf")
_SUFFIXES = {".npz": "npz", ".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".gz": "csv", ".json": "leaf"}


@dataclass
class FilesParams:
    """Where the data is and how to read it."""
    path: str | None = hp(None, "a file (.npz, .parquet, .csv, LEAF .json) or a folder (per-client "
                                ".npz/.parquet files, LEAF train/ and test/); relative to the current directory")
    format: str = hp("auto", "file format; auto = from the suffix / folder content", choices=FORMATS)
    label_column: str = hp("label", "label column (Parquet, CSV); .npz files hold x and y")
    feature_columns: list[str] | None = hp(None, "feature columns; null = every column except label, client "
                                                 "and cluster (or the one list/image column)")
    client_column: str = hp("client", "column (or .npz array) of client ids, for natural partitions")
    cluster_column: str = hp("cluster", "column (or .npz array) of true cluster ids, per row or per client "
                                        "(only for cluster metrics)")
    task: str = hp("auto", "auto = classification for integer labels, regression for floats",
                   choices=("auto", CLASSIFICATION, REGRESSION))
    input_shape: list[int] | None = hp(None, "one sample's shape, e.g. [1, 28, 28] for 784 pixel columns; "
                                             "null = as stored")
    scale: float | None = hp(None, "divide every feature by this; null = 255 for uint8 features (images), "
                                   "else 1", low=0.0, low_open=True)
    min_client_samples: int = hp(0, "natural partitions: leave out clients with fewer samples (training samples "
                                    "where the data keeps its own test split; 0 = keep every client; one too small "
                                    "for its splits is an error)", low=0)
    drop_incomplete_clients: bool = hp(True, "natural partitions: leave out clients without samples, or with samples "
                                             "only in train/ or only in test/ (LEAF), and say how many; false = "
                                             "refuse them by name")

    def make_paths_absolute(self) -> None:
        self.path = absolute_path(self.path)

    def validate(self, path: str) -> None:
        if not self.path:
            raise ConfigError(f"{path}.path", "the files source needs data.params.path (a file or a folder)")
        if self.input_shape is not None and any(s < 1 for s in self.input_shape):
            raise ConfigError(f"{path}.input_shape", f"sizes must be >= 1, got {self.input_shape}")


def detect(p: FilesParams) -> tuple[str, Path, list[Path]]:
    """(format, path, per-client files): format is npz, parquet, csv, leaf or folder."""
    path = shipped_path(p.path)
    if not path.exists():
        raise ConfigError(PATH_KEY, f"no such file or folder: {p.path}")
    if path.is_file():
        fmt = p.format if p.format != "auto" else _SUFFIXES.get(path.suffix.lower())
        if fmt is None:
            raise ConfigError("data.params.format", f"cannot tell the format of {p.path} from its suffix "
                                                    f"{path.suffix!r}; allowed: {', '.join(FORMATS[1:])} "
                                                    "(.npz, .parquet, .pq, .csv, .csv.gz, .json)")
        return fmt, path, []
    if p.format in ("auto", "leaf") and ((path / "train").is_dir() or list(path.glob("*.json"))):
        return "leaf", path, []
    kinds = {"npz": sorted(path.glob("*.npz")), "parquet": sorted(path.glob("*.parquet"))}
    if p.format in kinds:
        files = kinds[p.format]
    else:
        files = kinds["npz"] or kinds["parquet"]
    if not files:
        raise ConfigError("data.params.format", f"{p.path} is a folder without per-client .npz/.parquet files or "
                                                "LEAF JSON (train/, test/, *.json); allowed formats: "
                                                f"{', '.join(FORMATS[1:])}")
    return "folder", path, files


@dataclass
class Inspected:
    """What validation and partitioning need of the data (features not read)."""
    table: Table
    y: np.ndarray
    task: str
    num_classes: int
    input_shape: tuple[int, ...]
    ids: list | None                 # client ids, sorted (None: no client column); never a client without rows
    rows: list[np.ndarray] | None    # rows of each client, in file order
    clusters: np.ndarray | None      # true cluster of each client (None: none given)
    fingerprint: str
    n_test: np.ndarray | None = None  # each client's rows in the data's own test split (None: no such split)
    read_s: float = 0.0               # seconds reading (and for LEAF, CSV: parsing, converting) took
    read_done: float = 0.0            # time.perf_counter() when it ended
    unclaimed: bool = True            # read_s not yet counted in a federation's load time

    def n_train(self) -> np.ndarray:
        """Each client's samples that its train/val splits divide (all of them without a test split)."""
        n = np.array([len(r) for r in self.rows or []], dtype=np.int64)
        return n if self.n_test is None else n - self.n_test

    def one_sided(self) -> tuple[np.ndarray, np.ndarray]:
        """(clients with samples in the test split only, in the training split only)."""
        if self.n_test is None:
            none = np.zeros(len(self.ids or []), dtype=bool)
            return none, none
        return self.n_train() == 0, self.n_test == 0

    def kept(self, min_samples: int, drop_incomplete: bool = True) -> list[int]:
        keep = self.n_train() >= min_samples
        if drop_incomplete:
            test_only, train_only = self.one_sided()
            keep &= ~(test_only | train_only)
        return np.flatnonzero(keep).tolist()

    def left_out(self, p) -> tuple[int, int, str]:
        """(clients a natural partition leaves out, clients in the data, why: counts by reason)."""
        test_only, train_only = self.one_sided()
        small = (self.n_train() < p.min_client_samples) & ~(test_only | train_only)
        counts = [(len(self.table.empty_clients), "with no samples"),
                  (int(test_only.sum()), "with samples in test/ only"),
                  (int(train_only.sum()), "with samples in train/ only"),
                  (int(small.sum()), f"with fewer than {p.min_client_samples} "
                                     f"{'training ' if self.n_test is not None else ''}samples "
                                     "(data.params.min_client_samples)")]
        total = len(self.ids or []) + len(self.table.empty_clients)
        return sum(k for k, _ in counts), total, ", ".join(f"{k:,} {what}" for k, what in counts if k)

    def note(self, p) -> str | None:
        """The one line a natural partition says about the clients it leaves out (None: none)."""
        dropped, total, why = self.left_out(p)
        if not dropped:
            return None
        incomplete = len(self.table.empty_clients) + int(sum(m.sum() for m in self.one_sided()))
        refuse = "; data.params.drop_incomplete_clients: false refuses such clients instead" if incomplete else ""
        return f"{dropped:,} of {total:,} clients of {self.table.where} left out: {why}{refuse}"


_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 2


def _stat_key(path: Path, files: list[Path]) -> tuple:
    paths = files or ([path] if path.is_file() else sorted(q for q in path.rglob("*") if q.is_file()))
    return tuple((str(q), q.stat().st_size, q.stat().st_mtime_ns) for q in paths)


def inspect(p: FilesParams) -> Inspected:
    """The data's labels, clients and shape, cached per (file state, reading parameters)."""
    fmt, path, files = detect(p)
    key = (fmt, p.label_column, tuple(p.feature_columns or ()), p.client_column, p.cluster_column, p.task,
           tuple(p.input_shape or ()), _stat_key(path, files))
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    readers = {"npz": lambda: read_npz(path, p, with_features=False), "parquet": lambda: read_parquet(path, p),
               "csv": lambda: read_csv(path, p), "leaf": lambda: read_leaf(path, p),
               "folder": lambda: read_client_folder(path, files, p)}
    start = time.perf_counter()
    table = readers[fmt]()
    if fmt == "npz":  # the features are read only when the federation is built
        table.chunks = functools.partial(_npz_chunks, path, p)
    result = inspect_table(table, p)
    result.read_done = time.perf_counter()
    result.read_s = result.read_done - start
    _CACHE[key] = result
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return result


def _npz_chunks(path: Path, p: FilesParams, need=None):
    yield from read_npz(path, p).iter_features(need)


def inspect_table(table: Table, p) -> Inspected:
    where = table.where
    y, task = labels_of(table.labels, p.task, p.label_column, where)
    num_classes = int(y.max()) + 1 if task == CLASSIFICATION and len(y) else 0
    shape = tuple(table.sample_shape)
    if p.input_shape is not None:
        if int(np.prod(p.input_shape)) != int(np.prod(shape)):
            raise ConfigError("data.params.input_shape", f"{list(p.input_shape)} holds {int(np.prod(p.input_shape))} "
                                                         f"values, a sample of {where} {int(np.prod(shape))} "
                                                         f"(shape {list(shape)})")
        shape = tuple(p.input_shape)
    ids = rows = clusters = None
    index = None
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(y).tobytes())
    if table.clients is not None:
        ids, index = group_ids(table.clients, p.client_column, where, "data.params.client_column")
        if table.client_names is not None:
            ids = [table.client_names[i] for i in ids]
        rows = rows_by_group(index, len(ids))
        digest.update(index.tobytes())
        digest.update("\x00".join(map(str, ids)).encode())
        if table.clusters is not None:
            clusters = _client_clusters(table, index, ids, p, where)
            digest.update(clusters.tobytes())
    elif table.clusters is not None:
        log.info("%s: cluster ids without client ids are not used (a cluster is a group of clients)", where)
    n_test = None
    if table.test is not None:
        digest.update(table.test.tobytes())
        if index is not None:
            n_test = np.bincount(index, weights=table.test, minlength=len(ids)).astype(np.int64)
    digest.update(repr((len(y), shape, task)).encode())
    return Inspected(table, y, task, num_classes, shape, ids, rows, clusters, digest.hexdigest(), n_test)


def _client_clusters(table: Table, index: np.ndarray, ids: list, p: FilesParams, where: str) -> np.ndarray:
    """One true cluster id per client (from per-row ids, which must agree within a client)."""
    key = "data.params.cluster_column"
    _, cid = group_ids(table.clusters, p.cluster_column, where, key)
    if table.cluster_per_client:
        if len(cid) != len(ids):
            raise ConfigError(key, f"{where}: {len(cid)} cluster ids for {len(ids)} clients; give one per row "
                                   "or one per client (in sorted client-id order)")
        return cid
    first = np.full(len(ids), -1, dtype=np.int64)
    first[index[::-1]] = cid[::-1]  # the cluster of each client's first row
    bad = np.flatnonzero(first[index] != cid)
    if bad.size:
        row = int(bad[0])
        raise ConfigError(key, f"{where}: client {ids[index[row]]!r} has rows in two clusters "
                               f"({row_at(where, row)}); a true cluster groups whole clients")
    return first


def _need(cfg, fixed_test: bool) -> tuple[int, str]:
    """The fewest samples a client's splits need, and why."""
    if fixed_test:
        return 1 + (cfg.val_fraction > 0), "training samples (one for training, one for validation)"
    need = 1 + (cfg.val_fraction > 0) + (cfg.test_fraction > 0)
    return need, (f"samples for its train/val/test splits (data.val_fraction={cfg.val_fraction}, "
                  f"data.test_fraction={cfg.test_fraction})")


def check_config(cfg) -> None:
    """Cross-field checks of a resolved ``data`` section with this source (before any work)."""
    p = FilesParams(**cfg.params)
    check_inspected(inspect(p), p, cfg)


def check_inspected(info: Inspected, p, cfg) -> None:
    """What a data section asks of inspected data: kinds that fit the task, enough clients, and
    clients large enough for their splits (also used by the hf source)."""
    kind = cfg.partition.kind
    if info.task == REGRESSION and kind not in ("natural", "iid", "rotation"):
        raise ConfigError("data.partition.kind", f"{kind!r} splits by class label, but {info.table.where} holds "
                                                 "regression targets; allowed: natural (with client ids), iid, rotation")
    if kind != "natural":
        return
    if cfg.max_samples is not None:
        raise ConfigError("data.max_samples", "a natural partition keeps every sample of its clients; set "
                                              "data.max_samples: null and choose fewer clients with data.num_clients")
    refuse_incomplete(info, p)
    kept = info.kept(p.min_client_samples)
    dropped, _, why = info.left_out(p)
    left = f" ({dropped:,} left out: {why})" if dropped else ""
    if not kept:
        raise ConfigError(PATH_KEY, f"{info.table.where} has no client a natural partition can use{left}")
    if cfg.num_clients > len(kept):
        raise ConfigError("data.num_clients", f"{info.table.where} has {len(kept)} clients{left}; allowed range "
                                              f"[1, {len(kept)}], or all")
    fixed = info.n_test is not None
    need, what = _need(cfg, fixed)
    n_train = info.n_train()
    # every client a draw of data.num_clients may take, so that a config is valid for every seed
    small = [k for k in kept if n_train[k] < need]
    if small:
        k = small[0]
        # with the data's own test split min_client_samples counts training samples, so the hint works
        raise ConfigError(PATH_KEY, f"client {info.ids[k]!r} has {n_train[k]} {'training ' if fixed else ''}"
                                    f"samples, fewer than the {need} {what}; set "
                                    f"data.params.min_client_samples: {need} to leave such clients out")


def refuse_incomplete(info: Inspected, p) -> None:
    """With ``drop_incomplete_clients: false``, one line naming the clients without samples or with
    samples on one side only, and the files that hold them."""
    if getattr(p, "drop_incomplete_clients", True):
        return
    test_only, train_only = info.one_sided()
    bad = [(c, "has no samples") for c in info.table.empty_clients]
    bad += [(info.ids[k], "has samples in test/ only") for k in np.flatnonzero(test_only)]
    bad += [(info.ids[k], "has samples in train/ only") for k in np.flatnonzero(train_only)]
    if not bad:
        return
    files = info.table.client_files or {}

    def named(client, why: str) -> str:
        held = files.get(str(client))
        return f"{client!r} {why}" + (f" ({', '.join(held)})" if held else "")

    shown = "; ".join(named(*b) for b in bad[:5]) + (f"; and {len(bad) - 5:,} more" if len(bad) > 5 else "")
    total = len(info.ids or []) + len(info.table.empty_clients)
    raise ConfigError("data.params.drop_incomplete_clients",
                      f"{len(bad):,} of {total:,} clients of {info.table.where} cannot be used: {shown}; set "
                      "data.params.drop_incomplete_clients: true to leave them out")


def explain_missing_clients(info: Inspected) -> None:
    """Raise the error naming the columns that look like client ids, if any does (a natural
    partition asked of data without its client column)."""
    hint = info.table.client_hint() if info.table.client_hint is not None else None
    if hint is not None:
        raise hint


def _featurize(x: np.ndarray, scale: float, shape: tuple[int, ...]) -> np.ndarray:
    out = x.astype(np.float32, copy=x.dtype != np.float32)
    if scale != 1.0:
        out = out / np.float32(scale) if out is x else np.divide(out, np.float32(scale), out=out)
    return out.reshape((len(x),) + shape)


def load(p: FilesParams, num_clients: int) -> SourceData:
    return source_data(inspect(p), p, num_clients)


def usable_clients(info: Inspected, p) -> list[int]:
    """The clients a natural partition can use (positions into ``info.ids``), in id order."""
    return info.kept(p.min_client_samples, getattr(p, "drop_incomplete_clients", True))


def source_data(info: Inspected, p, num_clients: int) -> SourceData:
    """The :class:`SourceData` of inspected data (features read on demand; also the hf source's),
    with every usable client (a natural partition draws ``data.num_clients`` of them)."""
    table = info.table
    scale = p.scale if p.scale is not None else (255.0 if table.dtype == np.uint8 else 1.0)
    featurize = functools.partial(_featurize, scale=float(scale), shape=info.input_shape)
    devices = clusters = client_ids = None
    if info.rows is not None:
        chosen = usable_clients(info, p)
        devices = [info.rows[k] for k in chosen]
        client_ids = [str(info.ids[k]) for k in chosen]
        clusters = None if info.clusters is None else info.clusters[chosen]
    image = info.input_shape if len(info.input_shape) == 3 else None
    # the reading counted once per process; a later load of the same data finds it in memory
    read_s, origin = (info.read_s, table.origin) if info.unclaimed else (0.0, table.origin and "already in memory")
    info.unclaimed = False
    return SourceData(x=None, y=info.y, input_shape=info.input_shape, num_classes=info.num_classes, task=info.task,
                      featurize=featurize, image_shape=image, devices=devices, clusters=clusters,
                      read_rows=functools.partial(table.read_rows, featurize=featurize), client_ids=client_ids,
                      test_rows=table.test, fingerprint=info.fingerprint, where=table.where,
                      notes=() if info.rows is None else tuple(filter(None, [info.note(p)])),
                      read_s=read_s, read_done=info.read_done, origin=origin)


def default_kind(info: Inspected) -> str:
    if info.ids is not None:
        return "natural"
    return "iid" if info.task == REGRESSION else "dirichlet"


register_source(SourceSpec(
    "files", "your own data: .npz, Parquet, CSV, per-client folders or LEAF JSON (docs/your-data.md)",
    FilesParams, "mlp", CLASSIFICATION, per_client=False, image=False,
    shape_fn=lambda p: (inspect(p).input_shape, inspect(p).num_classes), load_fn=load, check_fn=inspect,
    default_kind=lambda p: default_kind(inspect(p)), has_clients=lambda p: inspect(p).ids is not None,
    check_config=check_config, explain_no_clients=lambda p: explain_missing_clients(inspect(p)),
    count_clients=lambda p: len(usable_clients(inspect(p), p))))


__all__ = ["FilesParams", "Inspected", "check_config", "check_inspected", "default_kind", "detect",
           "explain_missing_clients", "inspect", "inspect_table", "load", "refuse_incomplete", "source_data",
           "usable_clients"]
