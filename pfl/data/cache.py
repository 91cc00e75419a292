"""Partition cache: one Parquet file per (data config, seed), named by the sha256 of both.

A file holds one row per client: its true cluster (null when none), its transform id (-1 = none)
and its train/val/test index lists into the source's sample pool. The data arrays themselves are
never cached: file sources are read anyway and the generators are fast and deterministic.

The key covers the whole ``data`` section except ``cache`` (with ``data.params`` completed, so an
explicit default and an omitted one hash alike), the experiment seed and a format version that is
bumped whenever partitioning code changes its output. Files are written to a temporary name and
renamed, so concurrent trials never read a half-written file; a file that does not match the pool
it is meant for (or cannot be read) is ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..config import DataConfig
from ..schema import to_dict
from .partition import Partition

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SPLITS = ("train", "val", "test")


def partition_key(cfg: DataConfig, seed: int, content: str | None = None) -> str:
    """sha256 hex digest identifying the partition of ``cfg`` (resolved) under ``seed``;
    ``content`` is a file source's hash of what its partitions are made from."""
    section = to_dict(cfg)
    section.pop("cache", None)
    body = {"format": FORMAT_VERSION, "seed": int(seed), "data": section}
    if content is not None:
        body["content"] = content
    payload = json.dumps(body, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def cache_dir() -> Path:
    env = os.environ.get("PFL_CACHE_DIR")
    return Path(env).expanduser() if env else Path("~/.cache/pfl/partitions").expanduser()


def cache_path(key: str) -> Path:
    return cache_dir() / f"{key}.parquet"


def _list_column(arrays: list[np.ndarray]) -> pa.ListArray:
    offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int32)
    values = np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, dtype=np.int64)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _from_list_column(column: pa.ChunkedArray) -> list[np.ndarray]:
    arr = column.combine_chunks()
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False).astype(np.int64)
    return [values[offsets[i]:offsets[i + 1]] for i in range(len(arr))]


def save_partition(path: Path, part: Partition, pool_size: int, cfg: DataConfig, seed: int) -> None:
    m = part.num_clients
    clusters = pa.array(part.clusters.tolist() if part.clusters is not None else [None] * m, type=pa.int32())
    transforms = part.transforms if part.transforms is not None else np.full(m, -1)
    table = pa.table({
        "client": pa.array(np.arange(m, dtype=np.int32)),
        "cluster": clusters,
        "transform": pa.array(np.asarray(transforms, dtype=np.int32)),
        **{split: _list_column(getattr(part, split)) for split in SPLITS},
    })
    meta = {"pfl.format": str(FORMAT_VERSION), "pfl.pool_size": str(pool_size), "pfl.seed": str(seed),
            "pfl.data": json.dumps(to_dict(cfg), sort_keys=True, default=str)}
    table = table.replace_schema_metadata(meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes owner-only files; a shared cache must stay readable
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_partition(path: Path, pool_size: int, num_clients: int) -> Partition | None:
    """The cached partition, or None when absent, unreadable or made for a different pool."""
    if not path.is_file():
        return None
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as err:
        log.warning("ignoring unreadable partition cache %s: %s", path, err)
        return None
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    if (meta.get("pfl.format") != str(FORMAT_VERSION) or meta.get("pfl.pool_size") != str(pool_size)
            or table.num_rows != num_clients):
        log.warning("ignoring partition cache %s: made for another pool or format", path)
        return None
    splits = {split: _from_list_column(table.column(split)) for split in SPLITS}
    if any(len(a) and (a.min() < 0 or a.max() >= pool_size) for arrays in splits.values() for a in arrays):
        log.warning("ignoring partition cache %s: indices out of range", path)
        return None
    cluster_col = table.column("cluster").to_pylist()
    clusters = None if all(c is None for c in cluster_col) else np.asarray(cluster_col, dtype=np.int64)
    transforms = table.column("transform").to_numpy().astype(np.int64)
    return Partition(splits["train"], splits["val"], splits["test"], clusters,
                     None if (transforms < 0).all() else transforms)
