"""The federation as the engine sees it, and the two entry points that make it.

:func:`resolve_data_config` validates and completes the ``data`` section before any work;
:func:`load_federated` loads the source, takes the partition from the cache (or makes and caches
it) and builds every client's train/val/test tensors, transforms applied, on the requested device.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from ..config import ALL_CLIENTS, DEFAULT_NUM_CLIENTS, DataConfig
from ..schema import ConfigError
from .cache import cache_path, load_partition, partition_key, save_partition
from .partition import CLUSTERED_KINDS, Partition, draw_clients, make_partition
from .sources import REGRESSION, SourceData, list_sources, params_dict, source_spec
from .transforms import rotate_samples, rotation_degrees, shift_labels, swap_labels

log = logging.getLogger(__name__)

POOLED_KINDS = ("iid", "dirichlet", "shards", "label_swap", "label_shift", "rotation")


@dataclass
class ClientData:
    """One client's splits as tensors on the run's device (x float32; y int64, or float32 targets)."""
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    cluster: int | None = None  # true cluster id when the partition has one

    @property
    def n_train(self) -> int:
        return int(self.y_train.shape[0])

    @property
    def n_val(self) -> int:
        return int(self.y_val.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.y_test.shape[0])

    def to(self, device: str | torch.device) -> "ClientData":
        device = torch.device(device)
        tensors = {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        if all(v.device == device for v in tensors.values()):
            return self   # already there (data built on demand on the CPU: every client, every round)
        return dataclasses.replace(self, **{k: v.to(device) for k, v in tensors.items()})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))


@dataclass
class FederatedData:
    clients: "list[ClientData] | OnDemandClients"
    num_classes: int                  # 0 for regression
    input_shape: tuple[int, ...]      # per-sample shape, e.g. (64,), (1, 28, 28), (3, 32, 32), (60,)
    task: str                         # "classification" or "regression"
    source: str
    true_clusters: np.ndarray | None  # (num_clients,) int, or None
    partition_hash: str               # the cache key
    partition_kind: str = ""
    client_ids: list[str] | None = None  # a natural partition's own id of each client (file sources)
    load_s: float = 0.0               # seconds loading took (a file read by the config's check included)
    load_note: str = ""               # how the file was read (LEAF, CSV: parsed into the cache, or read from it)

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def to(self, device: str | torch.device) -> "FederatedData":
        if isinstance(self.clients, OnDemandClients):
            return dataclasses.replace(self, clients=self.clients.on(device))
        return dataclasses.replace(self, clients=[c.to(device) for c in self.clients])

    def materialized(self) -> "FederatedData":
        """Every client's data built now (the same tensors as built on demand)."""
        if isinstance(self.clients, OnDemandClients):
            return dataclasses.replace(self, clients=self.clients.build_all())
        return self

    def keep_at_most(self, nbytes: float) -> None:
        """Built on demand: keep at most ``nbytes`` of recently used clients' data."""
        if isinstance(self.clients, OnDemandClients):
            self.clients.capacity = nbytes

    def prefetch(self, cids: Sequence[int]) -> None:
        """Built on demand: build these clients' data now, together (see :meth:`OnDemandClients.prefetch`)."""
        if isinstance(self.clients, OnDemandClients):
            self.clients.prefetch(cids)

    def client_sizes(self) -> list[int]:
        """Training samples per client (without building any client's data)."""
        if isinstance(self.clients, OnDemandClients):
            return self.clients.sizes("train").tolist()
        return [c.n_train for c in self.clients]

    def client_nbytes(self) -> np.ndarray:
        """Bytes of each client's tensors (built or not)."""
        if isinstance(self.clients, OnDemandClients):
            return self.clients.nbytes()
        return np.array([c.nbytes for c in self.clients], dtype=np.int64)

    def summary(self) -> dict:
        """Sizes and label statistics, plain Python values (for logs, MLflow params, ``pfl datasets``)."""
        def stats(values: list[int]) -> dict:
            arr = np.asarray(values)
            return {"min": int(arr.min()), "median": float(np.median(arr)), "max": int(arr.max()),
                    "total": int(arr.sum())}

        out: dict = {
            "source": self.source, "task": self.task, "partition": self.partition_kind,
            "num_clients": self.num_clients, "input_shape": list(self.input_shape),
            "num_classes": self.num_classes, "partition_hash": self.partition_hash,
            "samples": {split: stats([int(getattr(c, f"y_{split}").shape[0]) for c in self.clients])
                        for split in ("train", "val", "test")},
            "true_clusters": None if self.true_clusters is None else self.true_clusters.tolist(),
            "num_true_clusters": None if self.true_clusters is None else int(len(np.unique(self.true_clusters))),
        }
        if self.client_ids is not None:
            out["client_ids"] = list(self.client_ids)
        if self.task == "classification" and self.clients:
            counts = []
            for c in self.clients:
                y = torch.cat([c.y_train, c.y_val, c.y_test]).cpu()
                counts.append(torch.bincount(y, minlength=self.num_classes).tolist())
            out["label_counts"] = counts
            present = [sum(1 for v in row if v > 0) for row in counts]
            out["classes_per_client"] = {"min": min(present), "median": float(np.median(present)),
                                         "max": max(present)}
        return out


def _allowed_kinds(per_client: bool) -> str:
    return "auto, natural" if per_client else "auto, " + ", ".join(POOLED_KINDS)


def resolve_data_config(cfg: DataConfig) -> None:
    """Validate ``cfg`` and complete it in place (``params`` with defaults, ``partition.kind``)."""
    spec = source_spec(cfg.source)
    params = spec.parse(cfg.params)
    fix_paths = getattr(params, "make_paths_absolute", None)
    if fix_paths is not None:  # file sources keep absolute paths: a Ray trial runs in another directory
        fix_paths()
    cfg.params = params_dict(spec, params)
    part = cfg.partition
    has_clients = spec.per_client or (spec.has_clients is not None and spec.has_clients(params))
    if part.kind == "auto":
        if spec.default_kind is not None:
            part.kind = spec.default_kind(params)
        else:
            part.kind = "natural" if spec.per_client else "dirichlet"
    if spec.per_client and part.kind != "natural":
        raise ConfigError("data.partition.kind",
                          f"{part.kind!r} splits a sample pool, but {cfg.source} generates each client's data "
                          f"itself; allowed kinds for {cfg.source}: {_allowed_kinds(True)}")
    if not has_clients and part.kind == "natural":
        if spec.explain_no_clients is not None:
            spec.explain_no_clients(params)
        if spec.has_clients is not None:
            raise ConfigError("data.partition.kind",
                              f"'natural' needs client ids, and the data has none (data.params.client_column names "
                              f"the column of client ids); allowed kinds for it: {_allowed_kinds(False)}")
        per_client = ", ".join(s.name for s in list_sources() if s.per_client or s.has_clients is not None)
        raise ConfigError("data.partition.kind",
                          f"'natural' needs a source with its own devices ({per_client}); allowed kinds for "
                          f"{cfg.source}: {_allowed_kinds(False)}")
    _resolve_num_clients(cfg, spec, params)
    shape, num_classes = spec.shape(params)
    if spec.per_client:
        k = getattr(params, "num_clusters", None)
        if k is not None and k > cfg.num_clients:
            raise ConfigError("data.params.num_clusters",
                              f"{k} clusters need at least {k} clients (data.num_clients = {cfg.num_clients})")
        if cfg.max_samples is not None:
            raise ConfigError("data.max_samples", f"{cfg.source} generates its data; shrink it with "
                                                  f"data.params.size_scale instead (set data.max_samples: null)")
    elif part.kind != "natural":
        _check_pooled_kind(cfg, spec.image or len(shape) == 3, num_classes)
    spec.check(params)
    if spec.check_config is not None:
        spec.check_config(cfg)


def _own_clients(cfg: DataConfig, spec) -> bool:
    """Whether the run's clients are the data's own (a natural partition of files or hf data)."""
    return cfg.partition.kind == "natural" and not spec.per_client and spec.count_clients is not None


def _resolve_num_clients(cfg: DataConfig, spec, params) -> None:
    """``data.num_clients`` as a number: every client of data with its own clients unless a number
    says fewer; else the default 20. Before any partition key or note uses it."""
    n = cfg.num_clients
    if isinstance(n, int):
        return
    if _own_clients(cfg, spec):
        cfg.num_clients = spec.count_clients(params)
    elif n == ALL_CLIENTS:
        raise ConfigError("data.num_clients",
                          f"{ALL_CLIENTS} means every client of data with its own clients (files or hf, partition "
                          f"kind natural); {cfg.source} with partition kind {cfg.partition.kind} makes as many "
                          f"clients as data.num_clients says; allowed: a whole number >= 1 (default "
                          f"{DEFAULT_NUM_CLIENTS})")
    else:
        cfg.num_clients = DEFAULT_NUM_CLIENTS


def _check_pooled_kind(cfg: DataConfig, image: bool, num_classes: int) -> None:
    part = cfg.partition
    if part.kind == "dirichlet" and part.alpha <= 0:
        raise ConfigError("data.partition.alpha", "must be > 0 for the dirichlet partition "
                                                  "(use kind: iid for an iid split)")
    if part.kind == "shards" and part.classes_per_client > num_classes:
        raise ConfigError("data.partition.classes_per_client",
                          f"{part.classes_per_client} is more than the {num_classes} classes of {cfg.source}; "
                          f"allowed range [1, {num_classes}]")
    if part.kind in CLUSTERED_KINDS and part.num_clusters > cfg.num_clients:
        raise ConfigError("data.partition.num_clusters",
                          f"{part.num_clusters} clusters need at least as many clients "
                          f"(data.num_clients = {cfg.num_clients})")
    if part.kind == "label_swap" and 2 * part.num_clusters > num_classes:
        raise ConfigError("data.partition.num_clusters",
                          f"label_swap gives cluster k the labels k and C-2-k exchanged, which are K distinct "
                          f"swaps only when num_classes >= 2*num_clusters; {cfg.source} has C = {num_classes}, "
                          f"so num_clusters must be <= {num_classes // 2}")
    if part.kind == "label_shift" and part.num_clusters > num_classes:
        raise ConfigError("data.partition.num_clusters",
                          f"label_shift gives cluster k the labels (y + k) mod C, distinct only for k < C; "
                          f"{cfg.source} has C = {num_classes}, so num_clusters must be <= {num_classes}")
    if part.kind == "rotation" and not image:
        raise ConfigError("data.partition.kind", f"rotation needs image samples; {cfg.source} has none")
    if cfg.max_samples is not None and cfg.max_samples < cfg.num_clients * part.min_samples:
        raise ConfigError("data.max_samples",
                          f"{cfg.max_samples} samples cannot give each of {cfg.num_clients} clients "
                          f"partition.min_samples = {part.min_samples}; need at least "
                          f"{cfg.num_clients * part.min_samples}")


def _client(src: SourceData, part: Partition, i: int, kind: str, num_clusters: int,
            features: dict[str, torch.Tensor], labels: dict[str, np.ndarray] | None = None) -> ClientData:
    """Client ``i``'s splits from its features (and its labels, when the caller gathered them)."""
    tensors = {}
    for split in ("train", "val", "test"):
        x = features[split]
        y = src.y[getattr(part, split)[i]] if labels is None else labels[split]
        t = -1 if part.transforms is None else int(part.transforms[i])
        if t >= 0 and kind == "label_swap":
            y = swap_labels(y, t, src.num_classes)
        if t >= 0 and kind == "label_shift":
            y = shift_labels(y, t, src.num_classes)
        if t >= 0 and kind == "rotation":
            x = rotate_samples(x, rotation_degrees(t, num_clusters), src.image_shape)
        dtype = np.float32 if src.task == REGRESSION else np.int64
        tensors[f"x_{split}"] = x
        tensors[f"y_{split}"] = torch.from_numpy(np.ascontiguousarray(y, dtype=dtype))
    cluster = None if part.clusters is None else int(part.clusters[i])
    return ClientData(cluster=cluster, **tensors)


SPLITS = ("train", "val", "test")


def _client_features(src: SourceData, part: Partition):
    """Every client's feature tensors, client by client. A source that reads its features on
    demand reads them once, in client order, and each client's splits are views of that array."""
    if src.read_rows is None:
        for i in range(part.num_clients):
            yield {s: torch.from_numpy(src.featurize(src.x[getattr(part, s)[i]])) for s in SPLITS}
        return
    pieces = [getattr(part, s)[i] for i in range(part.num_clients) for s in SPLITS]
    every = torch.from_numpy(src.read_rows(np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)))
    ends = np.cumsum([len(p) for p in pieces])
    for i in range(part.num_clients):
        yield {s: every[ends[3 * i + j] - len(pieces[3 * i + j]):ends[3 * i + j]] for j, s in enumerate(SPLITS)}


class OnDemandClients(Sequence[ClientData]):
    """Every client's :class:`ClientData`, built when it is first asked for and kept while the
    most recently used clients fit in ``capacity`` bytes (an LRU; the client just built always
    stays). Indexing gives the same tensors as building every client at once."""

    def __init__(self, src: SourceData, part: Partition, kind: str, num_clusters: int,
                 device: str | torch.device = "cpu", capacity: float = math.inf):
        self.src, self.part, self.kind, self.num_clusters = src, part, kind, num_clusters
        self.device = torch.device(device)
        self.capacity = capacity
        self._kept: OrderedDict[int, ClientData] = OrderedDict()
        self._bytes = 0
        self.built = 0   # clients built so far (the benchmark reports it)

    def __len__(self) -> int:
        return self.part.num_clients

    def __iter__(self) -> Iterator[ClientData]:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = operator.index(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"client {i} of {len(self)}")
        client = self._kept.get(i)
        if client is not None:
            self._kept.move_to_end(i)
            return client
        return self._keep(i, self.build([i])[0])

    def _keep(self, i: int, client: ClientData) -> ClientData:
        self._kept[i] = client
        self._bytes += client.nbytes
        while self._bytes > self.capacity and len(self._kept) > 1:
            _, old = self._kept.popitem(last=False)
            self._bytes -= old.nbytes
        return client

    def prefetch(self, cids: Sequence[int]) -> None:
        """Build the clients of ``cids`` not kept yet together: one read of a file source for all
        of them (the exchange does this for each round's clients)."""
        todo = [int(i) for i in dict.fromkeys(cids) if int(i) not in self._kept]
        if len(todo) > 1 and self.src.read_rows is not None:
            for i, client in zip(todo, self.build(todo)):
                self._keep(i, client)

    def build(self, cids: list[int]) -> list[ClientData]:
        self.built += len(cids)
        src, part = self.src, self.part
        if src.read_rows is None:
            feats = [{s: torch.from_numpy(src.featurize(src.x[getattr(part, s)[i]])) for s in SPLITS} for i in cids]
        else:  # one read of the clients' rows (and one gather of their labels), split as the bulk read splits them
            pieces = [getattr(part, s)[i] for i in cids for s in SPLITS]
            every = np.concatenate(pieces)
            lengths = [len(p) for p in pieces]
            rows = torch.from_numpy(src.read_rows(every)).split(lengths)
            ys = np.split(src.y[every], np.cumsum(lengths)[:-1])
            return [_client(src, part, i, self.kind, self.num_clusters, dict(zip(SPLITS, rows[3 * k:3 * k + 3])),
                            dict(zip(SPLITS, ys[3 * k:3 * k + 3]))).to(self.device) for k, i in enumerate(cids)]
        return [_client(src, part, i, self.kind, self.num_clusters, f).to(self.device) for i, f in zip(cids, feats)]

    def build_all(self) -> list[ClientData]:
        return [_client(self.src, self.part, i, self.kind, self.num_clusters, features).to(self.device)
                for i, features in enumerate(_client_features(self.src, self.part))]

    def on(self, device: str | torch.device) -> "OnDemandClients":
        if torch.device(device) == self.device:
            return self
        return OnDemandClients(self.src, self.part, self.kind, self.num_clusters, device, self.capacity)

    def sizes(self, split: str) -> np.ndarray:
        return np.array([len(a) for a in getattr(self.part, split)], dtype=np.int64)

    def nbytes(self) -> np.ndarray:
        """Bytes each client's tensors take once built: float32 features, int64 or float32 labels."""
        n = sum(self.sizes(s) for s in SPLITS)
        label = 4 if self.src.task == REGRESSION else 8
        return n * (4 * int(np.prod(self.src.input_shape)) + label)


_SAID: set[str] = set()


def _say_once(note: str) -> None:
    """Print a note about the data once per process: a pipeline loads the same data for every run,
    and the person needs to hear it once, on stdout with the CLI's own notes (stderr is kept for
    the one line of an error)."""
    log.info(note)
    if note not in _SAID:
        _SAID.add(note)
        print(f"note: {note}", flush=True)


def _clients_note(used: int, total: int, where: str, seed: int) -> str:
    """The line that says which of the data's own clients a run uses."""
    if used >= total:
        return (f"{total:,} client{'s' if total != 1 else ''} from {where} (every client of the data; "
                "data.num_clients selects fewer)")
    return (f"{used:,} of {total:,} clients of {where}, drawn with seed {seed} (data.num_clients; "
            f"{ALL_CLIENTS} = every one)")


def held_partition(cfg: DataConfig, seed: int, say: bool = False,
                   src: SourceData | None = None) -> tuple[SourceData, Partition, str, bool]:
    """What the run's clients hold: the source (with its own clients drawn by ``seed``), the partition
    (the cache's when it has one, else made), the partition's key and whether it was made here.
    ``say``: the source's notes are logged (once each), before the partition is made; ``src``: the
    source as ``cfg`` loads it, when the caller has it already."""
    spec = source_spec(cfg.source)
    src = spec.load(cfg.params, cfg.num_clients) if src is None else src
    content = src.fingerprint
    if cfg.partition.kind == "natural":
        notes = list(src.notes)
        if _own_clients(cfg, spec) and src.devices is not None:
            total = len(src.devices)
            src = draw_clients(src, cfg.num_clients, seed)
            notes.append(_clients_note(len(src.devices), total, src.where or cfg.source, seed))
            if len(src.devices) < total:  # a partition of drawn clients: never one of an older pfl's first N
                content = f"{content}|clients drawn with the seed"
        for note in notes if say else ():
            _say_once(note)
    key = partition_key(cfg, seed, content)
    part = load_partition(cache_path(key), len(src.y), cfg.num_clients) if cfg.cache else None
    if part is not None:
        log.debug("partition %s read from %s", key[:12], cache_path(key))
        return src, part, key, False
    return src, make_partition(cfg, src, seed), key, True


def load_federated(cfg: DataConfig, seed: int, device: str | torch.device = "cpu",
                   on_demand: bool = False) -> FederatedData:
    """The federation described by ``cfg`` under experiment ``seed``, with tensors on ``device``
    (built when first asked for with ``on_demand``, see :class:`OnDemandClients`)."""
    resolve_data_config(cfg)
    start = time.perf_counter()
    src, part, key, fresh = held_partition(cfg, seed, say=True)
    natural = cfg.partition.kind == "natural"
    lazy = OnDemandClients(src, part, cfg.partition.kind, cfg.partition.num_clusters, device)
    clients = lazy if on_demand else lazy.build_all()
    if fresh and cfg.cache:  # only a federation that could be built (or, on demand, indexed) is cached
        try:
            save_partition(cache_path(key), part, len(src.y), cfg, seed)
        except OSError as err:  # a read-only cache directory must not stop the run
            log.warning("could not write partition cache %s: %s", cache_path(key), err)
    earlier = src.read_s if src.read_done < start else 0.0  # read by the config's check, before this call
    data = FederatedData(clients=clients, num_classes=src.num_classes, input_shape=tuple(src.input_shape),
                         task=src.task, source=cfg.source, true_clusters=part.clusters, partition_hash=key,
                         partition_kind=cfg.partition.kind, client_ids=src.client_ids if natural else None,
                         load_s=time.perf_counter() - start + earlier, load_note=src.origin)
    log.info("data %s/%s: %d clients, %d training samples (%.2fs)", cfg.source, cfg.partition.kind,
             len(clients), sum(data.client_sizes()), data.load_s)
    return data
