"""LEAF folders and CSV files parsed once, into Parquet in pfl's cache, and read from there.

Parsing text is most of what loading such data costs (FEMNIST-sized LEAF JSON: seconds to tens
of seconds, and the data several times over in Python objects), so the first load converts it into
one Parquet file in the folder of the partition cache (:func:`pfl.data.cache.cache_dir`:
``$PFL_CACHE_DIR``, default ``~/.cache/pfl/partitions``), named ``table-<key>.parquet``; every
later load — the driver's, every
sweep trial's on the same machine, every ``pfl run`` — reads that file column-projected, through
:func:`~pfl.data.readers.read_parquet`: the labels, client ids and LEAF's split when the config is
checked (all a partition needs), the features row group by row group when clients are built. A
trial on another node, with its own cache folder, converts once more there.

**Key.** The sha256 of a format version, the format, the reading parameters that change the table
(CSV: the label, feature, client and cluster columns; LEAF: none) and a sha256 of every source
file's name (relative to the LEAF folder) and bytes. Content, not (path, size, mtime): an edit
that keeps size and mtime (a restored timestamp, two writes within the file system's timestamp
granularity) still gets a new entry, and a copy at another path (a Ray node's unpacked package, on
a shared cache folder) finds the same one; hashing took 0.4 s of a 1.8 s cached load of a 616 MiB
LEAF folder, whose parse took 8 s (docs/your-data.md §7). The path is not in the key: messages
name the path the data was read from. Two processes converting the same file at once both write
it (the later rename wins, both files equal): no lock.

**Conversion** checks everything a reader checks — ragged rows, text, empty cells, NaN/inf
features, naming the CSV line or the LEAF file, user and sample — so a bad file fails on its first
load and is never cached (labels are checked when read, as for every format: their check depends
on ``data.params.task``). It holds one source file's parse (LEAF) or the CSV's Arrow table, and one
row group, never the data set as Python floats: rows are written in groups of about
:data:`ROW_GROUP_BYTES` as they come, LEAF's in file order (a user's samples in the order of its
files). Written to a temporary name and renamed, so a concurrent reader never sees half a file. A
cache folder that cannot be created or written: the same conversion into memory, said in one log
line, in every process again (as the partition cache does).

**Layout.** Columns ``label`` (LEAF: float64, cast back to ``label_type`` when read), ``client``,
``cluster`` (CSV, when present), ``test`` (LEAF's train/test) and ``x`` (a fixed-size list, one
sample per row, in its stored type); file metadata ``pfl.table`` (JSON): the sample shape, the
feature plan for messages, the CSV's first line or LEAF's pieces (where each file's user starts),
the clients without samples, each client's files, and the CSV's client-column hint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..schema import ConfigError
from .cache import cache_dir
from .readers import Table, parse_csv, read_parquet
from .tables import PATH_KEY, FeaturePlan, Where, check_finite, features_of

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
#: bytes of features per row group: one is what conversion holds, and what building one client reads
ROW_GROUP_BYTES = 8 * 2**20
_COLUMNS = SimpleNamespace(label_column="label", client_column="client", cluster_column="cluster",
                           feature_columns=["x"])
_WHAT = {"leaf": "LEAF JSON", "csv": "CSV"}


class Sink:
    """Rows of a converted table, written to ``out`` in row groups of about :data:`ROW_GROUP_BYTES`
    as they come (:meth:`add`), so that conversion holds one row group, never the table."""

    def __init__(self, out):
        self.out = out
        self.writer: pq.ParquetWriter | None = None
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.group_rows = 0
        self.num_rows = 0

    def add(self, columns: dict[str, pa.Array], x: np.ndarray) -> None:
        """Rows: their small columns and their samples, (rows, *sample) in stored form."""
        flat = np.ascontiguousarray(x).reshape(len(x), -1)
        width = flat.shape[1]
        arrays = dict(columns, x=pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), width))
        self.pending.append(pa.table(arrays))
        self.pending_rows += len(flat)
        self.num_rows += len(flat)
        self.group_rows = self.group_rows or max(1, ROW_GROUP_BYTES // max(1, flat.itemsize * width))
        if self.pending_rows >= self.group_rows:
            self._write(whole_groups=True)

    def _write(self, whole_groups: bool) -> None:
        if not self.pending:
            return
        table = pa.concat_tables(self.pending)
        if self.writer is None:
            # dictionaries also for x: pixels (LEAF's FEMNIST) take 256 values, a byte each instead of four
            self.writer = pq.ParquetWriter(self.out, table.schema,
                                           write_statistics=[c for c in table.column_names if c != "x"])
        rows = (table.num_rows // self.group_rows) * self.group_rows if whole_groups else table.num_rows
        if rows:
            self.writer.write_table(table.slice(0, rows), row_group_size=self.group_rows)
        rest = table.slice(rows)
        self.pending = [rest] if rest.num_rows else []
        self.pending_rows = rest.num_rows

    def close(self, meta: dict) -> None:
        """The last rows and the table's metadata (:func:`read_converted` reads it back)."""
        self._write(whole_groups=False)
        if self.writer is None:
            raise ValueError("a converted table needs at least one row")
        self.writer.add_key_value_metadata({"pfl.table": json.dumps({"version": FORMAT_VERSION, **meta})})
        self.writer.close()


def content_digest(files: list[Path], root: Path | None) -> str:
    """sha256 of every file's name (relative to ``root``, else its own name) and bytes."""
    digest = hashlib.sha256()
    for f in files:
        name = f.name if root is None else f.relative_to(root).as_posix()
        try:
            with open(f, "rb") as fh:
                inner = hashlib.file_digest(fh, "sha256").hexdigest()
        except OSError as err:
            raise ConfigError(PATH_KEY, f"{f} cannot be read ({err.strerror or err})") from None
        digest.update(f"{name}\x00{inner}\x00".encode())
    return digest.hexdigest()


def table_key(kind: str, files: list[Path], root: Path | None, params: dict) -> str:
    body = {"format": FORMAT_VERSION, "kind": kind, "params": params, "content": content_digest(files, root)}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def table_path(key: str) -> Path:
    return cache_dir() / f"table-{key}.parquet"


def read_converted(source, where: str) -> Table:
    """The :class:`Table` of a converted file (a path, or a buffer), named ``where`` in messages;
    nothing but the labels, client, cluster and test columns is read here."""
    pf = pq.ParquetFile(source)
    meta = json.loads(pf.metadata.metadata[b"pfl.table"])
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"format {meta.get('version')}, not {FORMAT_VERSION}")
    table = read_parquet(source, _COLUMNS)
    parts = meta.get("parts")
    table.where = Where.of(where, first_line=meta.get("first_line"),
                           parts=None if parts is None else (np.asarray(parts[0], dtype=np.int64), parts[1]))
    if meta.get("label_type"):
        table.labels = table.labels.cast(pa.type_for_alias(meta["label_type"]))
    shape = tuple(meta["shape"])
    table.sample_shape = shape
    table.plan = FeaturePlan(meta["plan"][0], tuple(meta["plan"][1]), shape)  # for messages: the source's columns
    if "test" in pf.schema_arrow.names:
        table.test = pf.read(columns=["test"]).column("test").to_numpy().astype(bool)
    table.empty_clients = list(meta.get("empty_clients", []))
    table.client_files = meta.get("client_files")
    hint = meta.get("client_hint")
    table.client_hint = None if hint is None else (lambda: ConfigError(*hint))
    return table


def converted(kind: str, path: Path, files: list[Path], root: Path | None, params: dict,
              convert: Callable[[Sink], dict]) -> Table:
    """``path`` as a :class:`Table`: from its converted file in the cache, else converted now by
    ``convert`` (which adds the rows to a :class:`Sink` and returns the table's metadata) and
    cached; in memory when the cache folder cannot be written. ``Table.origin`` says which."""
    what = _WHAT.get(kind, kind)
    target = table_path(table_key(kind, files, root, params))
    if target.is_file():
        try:
            table = read_converted(target, str(path))
            table.origin = "read from the cache"
            log.debug("%s read from %s", path, target)
            return table
        except (OSError, ValueError, KeyError, pa.ArrowException) as err:  # damaged or foreign: made again
            log.warning("ignoring unreadable data cache %s: %s", target, err)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".tmp")
        os.close(fd)
    except OSError as err:
        log.warning("could not write the data cache in %s (%s): parsing %s in memory, in every process",
                    target.parent, err.strerror or err, path)
        return _in_memory(path, convert, f"parsed {what} (the cache folder is not writable)")
    try:
        sink = Sink(tmp)
        sink.close(convert(sink))
        os.chmod(tmp, 0o644)  # mkstemp makes owner-only files; a shared cache must stay readable
        os.replace(tmp, target)
    except OSError as err:  # a full disk: the run goes on without the cache
        log.warning("could not write the data cache %s (%s): parsing %s in memory", target, err.strerror or err, path)
        return _in_memory(path, convert, f"parsed {what} (the cache could not be written)")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    table = read_converted(target, str(path))
    table.origin = f"parsed {what} into the cache"
    return table


def _in_memory(path: Path, convert: Callable[[Sink], dict], origin: str) -> Table:
    out = pa.BufferOutputStream()
    sink = Sink(out)
    sink.close(convert(sink))
    table = read_converted(out.getvalue(), str(path))
    table.origin = origin
    return table


# ---- CSV ----------------------------------------------------------------------------------------

def read_csv(path: Path, params) -> Table:
    """A CSV file (:func:`~pfl.data.readers.parse_csv` the first time) from the cache."""
    keyed = {k: getattr(params, k) for k in ("label_column", "feature_columns", "client_column", "cluster_column")}
    return converted("csv", path, [path], None, keyed, lambda sink: _convert_csv(path, params, sink))


def _convert_csv(path: Path, params, sink: Sink) -> dict:
    arrow, table = parse_csv(path, params)
    where, plan, shape = table.where, table.plan, table.sample_shape
    step = max(1, ROW_GROUP_BYTES // (8 * max(1, int(np.prod(shape)))))
    small = {"label": table.labels, "client": table.clients, "cluster": table.clusters}
    for start in range(0, max(table.num_rows, 1), step):
        x = features_of(arrow.slice(start, step), plan, start, where, shape)  # ragged rows, empty cells
        check_finite(x, start, plan, where)                                   # NaN, inf: by their line
        sink.add({k: v.slice(start, len(x)) for k, v in small.items() if v is not None}, x)
    hint = table.client_hint() if table.client_hint is not None else None
    return {"shape": list(shape), "plan": [plan.kind, list(plan.columns)], "first_line": where.first_line,
            "client_hint": None if hint is None else [hint.field, hint.message]}


__all__ = ["ROW_GROUP_BYTES", "Sink", "content_digest", "converted", "read_converted", "read_csv", "table_key",
           "table_path"]
