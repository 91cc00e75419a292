"""Readers of the file formats behind ``data.source: files``: each makes a :class:`Table`.

* NumPy ``.npz``: arrays ``x`` (N, ...) and ``y`` (N,), optionally a client-id and a cluster array
  (named by ``client_column`` / ``cluster_column``);
* Parquet and CSV: a label column, features (see :mod:`.tables`), optional client and cluster
  columns. Parquet is read column-projected: the label/client/cluster columns first (which is all
  a partition needs), the features later, row group by row group (:meth:`Table.read_rows`). A CSV
  file is parsed here (:func:`parse_csv`) once, into Parquet in the cache (:mod:`.converted`);
* a folder of per-client ``<client id>.npz`` / ``.parquet`` files (the file is the client; an
  empty file is a client without samples, ``Table.empty_clients``);
* LEAF's JSON: :mod:`.leaf` (also converted once, :mod:`.converted`).

When the client column is not there, the readers can say which columns look like client ids
(``Table.client_hint``), and say it instead of an error that would blame a feature column.
"""

from __future__ import annotations

import functools
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..schema import ConfigError
from .tables import (PATH_KEY, FeaturePlan, Where, candidate_columns, check_finite, features_of,
                     missing_client_column, plan_features, require_column, row_at, sorted_ids)

#: rows per chunk when features are read lazily: at most CHUNK_ROWS, about CHUNK_BYTES of features
#: (a chunk is held twice or more while it is decoded: 65,536 rows of 784 floats held 5x the features)
CHUNK_ROWS = 65536
CHUNK_BYTES = 8 * 2**20


def chunk_rows(row_bytes: int) -> int:
    """Rows per chunk for rows of ``row_bytes`` bytes of features."""
    return int(max(1, min(CHUNK_ROWS, CHUNK_BYTES // max(1, row_bytes))))


@dataclass
class Table:
    """A data file's content, features possibly not yet read."""
    where: str                         # the file or folder, for messages
    num_rows: int
    labels: pa.Array                   # the label column as stored
    clients: pa.Array | None           # a client id per row (None: no client column)
    clusters: pa.Array | None          # a true cluster id per row, or per client (folders)
    plan: FeaturePlan
    sample_shape: tuple[int, ...]      # one sample's stored shape
    x: np.ndarray | None = None        # (N, *sample_shape) when the features are in memory
    # else: (first row, features) of each chunk; ``need(start, rows)`` False: the chunk may be skipped
    chunks: Callable[..., Iterator[tuple[int, np.ndarray]]] | None = None
    test: np.ndarray | None = None     # (N,) bool: rows in the data's own test split (LEAF)
    cluster_per_client: bool = False   # clusters holds one id per client id (sorted), not per row
    client_names: list[str] | None = None  # folders, LEAF: the id of client i (clients holds 0..K-1)
    dtype: np.dtype = np.dtype(np.float32)  # the stored features' type (uint8 for images)
    empty_clients: list[str] = field(default_factory=list)  # folders, LEAF: clients without any sample
    client_files: dict[str, list[str]] | None = None  # folders, LEAF: the files that name each client
    # without a client column: the error naming the columns that look like client ids (None: none do)
    client_hint: Callable[[], ConfigError | None] | None = None
    origin: str = ""  # how it was read, for the run's summary (LEAF, CSV: parsed into the cache / read from it)

    def iter_features(self, need: Callable[[int, int], bool] | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, features) chunk by chunk; with ``need``, chunks it declines may be skipped."""
        if self.x is not None:
            for start in range(0, self.num_rows, CHUNK_ROWS):
                if need is None or need(start, min(CHUNK_ROWS, self.num_rows - start)):
                    yield start, self.x[start:start + CHUNK_ROWS]
        else:
            yield from self.chunks(need)

    def read_rows(self, order: np.ndarray, featurize: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Featurized rows ``order`` (distinct row numbers), in that order, as one float32 array.

        The file is read chunk by chunk and each chunk's rows are written straight to their place,
        so memory holds the result plus one chunk, never the whole table and a copy of it. Chunks
        without a row of ``order`` are skipped where the format allows (Parquet row groups, tables
        in memory), so reading one client's rows reads its row groups; every chunk read is checked
        for non-finite values, used rows or not."""
        dest = np.full(self.num_rows, -1, dtype=np.int64)
        dest[order] = np.arange(len(order))
        if len(order) and not np.array_equal(dest[order], np.arange(len(order))):
            raise ValueError("read_rows needs distinct rows")
        used = np.concatenate([[0], np.cumsum(dest >= 0)])  # rows of ``order`` before each row

        def need(start: int, rows: int) -> bool:
            return bool(used[min(start + rows, self.num_rows)] > used[start])

        out: np.ndarray | None = None
        for start, chunk in self.iter_features(need):
            check_finite(chunk, start, self.plan, self.where)
            where_to = dest[start:start + len(chunk)]
            keep = where_to >= 0
            if keep.all():  # every row used (a natural partition): no copy of the chunk first
                rows = featurize(chunk)
            else:
                rows = featurize(chunk[keep])
                where_to = where_to[keep]
            if out is None:
                out = np.empty((len(order),) + rows.shape[1:], dtype=np.float32)
            out[where_to] = rows
        if out is None:
            out = np.empty((len(order),) + tuple(featurize(np.zeros((0,) + self.sample_shape)).shape[1:]),
                           dtype=np.float32)
        return out


def _reserved(params) -> set[str]:
    return {params.label_column, params.client_column, params.cluster_column}


# ---- NumPy --------------------------------------------------------------------------------------

def _npz_shape(path: Path, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """An array's shape and dtype from its .npy header, without reading the data."""
    with zipfile.ZipFile(path) as zf, zf.open(f"{name}.npy") as fh:
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(fh)
    return tuple(shape), np.dtype(dtype)


def read_npz(path: Path, params, with_features: bool = True) -> Table:
    where = str(path)
    try:
        npz = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise ConfigError(PATH_KEY, f"{where} is not a readable .npz file ({str(err).splitlines()[0]})") from None
    with npz:
        names = set(npz.files)
        for need in ("x", "y"):
            if need not in names:
                key = "data.params.label_column" if need == "y" else "data.params.feature_columns"
                raise ConfigError(key, f"{where} has no array {need!r}; arrays found: {', '.join(sorted(names))} "
                                       "(an .npz file holds x and y, optionally client and cluster)")
        try:
            y = npz["y"]
            clients = npz[params.client_column] if params.client_column in names else None
            clusters = npz[params.cluster_column] if params.cluster_column in names else None
            x = npz["x"] if with_features else None
        except ValueError as err:  # object arrays need pickle, which is never allowed here
            raise ConfigError(PATH_KEY, f"{where}: {str(err).splitlines()[0]}") from None
    shape, dtype = (x.shape, x.dtype) if x is not None else _npz_shape(path, "x")
    if y.ndim != 1 or shape[0] != len(y):
        raise ConfigError(PATH_KEY, f"{where}: x has {shape[0]} rows and y shape {y.shape}; y needs one value per "
                                    "row")
    if clients is not None and clients.shape != y.shape:
        raise ConfigError("data.params.client_column", f"{where}: {params.client_column!r} has shape "
                                                       f"{clients.shape}; it needs one client id per row")
    if len(shape) < 2:
        shape = (shape[0], 1)
        x = None if x is None else x.reshape(-1, 1)
    if dtype.kind not in "uifb":
        raise ConfigError(PATH_KEY, f"{where}: x holds {dtype}, not numbers")
    if clusters is not None and clusters.ndim == 0:  # one cluster for the whole file (a client's file)
        clusters = np.full(len(y), clusters.item())
    per_client = clusters is not None and clients is not None and len(clusters) != len(y)
    hint = None if clients is not None else functools.partial(_npz_client_hint, path, params, len(y))
    return Table(where, len(y), pa.array(y), None if clients is None else pa.array(clients),
                 None if clusters is None else pa.array(clusters),
                 FeaturePlan("list", ("x",), tuple(shape[1:])), tuple(shape[1:]), x=x,
                 cluster_per_client=per_client, dtype=np.dtype(dtype), client_hint=hint)


def _npz_client_hint(path: Path, params, n: int) -> ConfigError | None:
    columns = {}
    with np.load(path, allow_pickle=False) as npz:
        for name in npz.files:
            shape, dtype = _npz_shape(path, name)
            if name not in ("x", "y", params.cluster_column) and shape == (n,) and dtype.kind in "iuU":
                columns[name] = pa.array(npz[name])
    return missing_client_column(columns, n, params.client_column, str(path))


# ---- Parquet and CSV ----------------------------------------------------------------------------

def _table_parts(schema: pa.Schema, params, where: str, hint: Callable[[], ConfigError | None]) -> FeaturePlan:
    require_column(schema, params.label_column, "data.params.label_column", where)
    try:
        return plan_features(schema, params.feature_columns, _reserved(params), where)
    except ConfigError:
        # client ids under another name become a text "feature" that cannot be one: say so
        if params.feature_columns is None and params.client_column not in schema.names:
            better = hint()
            if better is not None:
                raise better from None
        raise


def _client_hint(schema: pa.Schema, params, where: str, read: Callable[[list[str]], pa.Table]):
    """``Table.client_hint`` of a table whose client column is missing (``read`` reads columns)."""
    if params.client_column in schema.names:
        return None

    def hint() -> ConfigError | None:
        names = candidate_columns(schema, _reserved(params))
        table = read(names)
        return missing_client_column({n: table.column(n) for n in names}, table.num_rows, params.client_column,
                                     where)
    return hint


def _first_shape(sample: np.ndarray) -> tuple[int, ...]:
    return tuple(sample.shape[1:])


def table_from_arrow(table: pa.Table, params, where: str, with_x: bool = True) -> Table:
    """A :class:`Table` of an in-memory Arrow table (CSV, a Hugging Face data set)."""
    hint = _client_hint(table.schema, params, where, table.select)
    plan = _table_parts(table.schema, params, where, hint)
    n = table.num_rows
    first = features_of(table.slice(0, min(n, 1)), plan, 0, where)
    shape = _first_shape(first)
    col = lambda name: table.column(name).combine_chunks() if name in table.column_names else None  # noqa: E731
    step = chunk_rows(first.itemsize * int(np.prod(shape)))

    def chunks(need=None) -> Iterator[tuple[int, np.ndarray]]:
        for start in range(0, n, step):
            if need is None or need(start, min(step, n - start)):
                yield start, features_of(table.slice(start, step), plan, start, where, shape)

    return Table(where, n, col(params.label_column), col(params.client_column), col(params.cluster_column),
                 FeaturePlan(plan.kind, plan.columns, shape), shape, chunks=chunks, dtype=first.dtype,
                 client_hint=hint)


def read_parquet(path: Path, params) -> Table:
    where = str(path)
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise ConfigError(PATH_KEY, f"{where} is not a readable Parquet file ({str(err).splitlines()[0]})") from None
    schema = pf.schema_arrow
    hint = _client_hint(schema, params, where, lambda names: pq.read_table(path, columns=names))
    plan = _table_parts(schema, params, where, hint)
    meta = [c for c in (params.label_column, params.client_column, params.cluster_column) if c in schema.names]
    small = pf.read(columns=meta)  # labels, client and cluster ids: all a partition needs
    n = small.num_rows
    if n:
        first = features_of(next(pf.iter_batches(batch_size=1, columns=list(plan.columns))), plan, 0, where)
    else:  # no row to look at: number columns still say the shape, other kinds are unknown
        first = np.zeros((0,) + (plan.sample_shape or (1,)), dtype=np.float32)
    shape = _first_shape(first)
    groups = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
    step = chunk_rows(first.itemsize * int(np.prod(shape)))

    def chunks(need=None) -> Iterator[tuple[int, np.ndarray]]:
        # whole row groups, several at a time (Arrow decodes them in parallel), up to ``step`` rows
        # (about CHUNK_BYTES of features); with ``need``, only the groups holding a wanted row
        firsts = np.concatenate([[0], np.cumsum(groups)]).astype(np.int64)
        wanted = [need is None or need(int(firsts[g]), groups[g]) for g in range(len(groups))]
        with pq.ParquetFile(path) as reader:
            i = 0
            while i < len(groups):
                if not wanted[i]:
                    i += 1
                    continue
                take = [i]
                rows = groups[i]
                while (i + len(take) < len(groups) and wanted[i + len(take)]
                       and rows + groups[i + len(take)] <= step):
                    rows += groups[i + len(take)]
                    take.append(i + len(take))
                part = reader.read_row_groups(take, columns=list(plan.columns), use_threads=True)
                yield int(firsts[i]), features_of(part, plan, int(firsts[i]), where, shape)
                i += len(take)

    col = lambda name: small.column(name).combine_chunks() if name in small.column_names else None  # noqa: E731
    return Table(where, n, col(params.label_column), col(params.client_column), col(params.cluster_column),
                 FeaturePlan(plan.kind, plan.columns, shape), shape, chunks=chunks, dtype=first.dtype,
                 client_hint=hint)


#: a cell that is a number as a CSV writer spells one (NaN and infinities included)
_NUMBER = r"^\s*[-+]?(\d+\.?\d*([eE][-+]?\d+)?|\.\d+([eE][-+]?\d+)?|nan|inf|infinity)\s*$"


def parse_csv(path: Path, params) -> tuple[pa.Table, Table]:
    """The CSV file as Arrow parsed it (held in memory) and its :class:`Table`, whose features
    :func:`~.tables.features_of` makes from it; :func:`pfl.data.converted.read_csv` caches it."""
    import pyarrow.csv as pcsv

    # only an empty cell is missing: Arrow's default also reads 'NaN' and 'NA' as missing, which
    # would report a NaN as an empty cell
    options = pcsv.ConvertOptions(null_values=[""])
    try:
        table = pcsv.read_csv(path, convert_options=options)
    except (OSError, pa.ArrowException) as err:
        text = str(err).splitlines()[0]
        hint = " (ragged rows: every line needs the same number of fields)" if "columns" in text else ""
        raise ConfigError(PATH_KEY, f"{path}: not a readable CSV file: {text}{hint}") from None
    where = Where.of(str(path), first_line=2)  # row 0 is the line after the header
    _refuse_text_in_numbers(table, params, where)
    return table, table_from_arrow(table, params, where)


def _refuse_text_in_numbers(table: pa.Table, params, where: Where) -> None:
    """A number column with a few cells of text ('NA', '?', ' ') is read as a text column; name the
    first such cell rather than call the whole column text."""
    names = list(params.feature_columns) if params.feature_columns is not None else \
        [n for n in table.column_names if n not in (params.client_column, params.cluster_column)]
    for name in dict.fromkeys(names + [params.label_column]):
        if name not in table.column_names or not pa.types.is_string(table.schema.field(name).type):
            continue
        col = table.column(name).combine_chunks()
        numeric = pc.match_substring_regex(col, _NUMBER, ignore_case=True).to_numpy(zero_copy_only=False)
        if numeric.sum() <= len(numeric) // 2:  # mostly words: a text column (ids, names), said elsewhere
            continue
        row = int(np.flatnonzero(~numeric)[0])
        value = col[row].as_py()
        what = "is empty" if not value.strip() else f"holds {value!r}, not a number"
        raise ConfigError(PATH_KEY, f"{where}: {row_at(where, row)}, column {name!r} {what}, where the column's "
                                    "other cells are numbers; fill or drop missing values first")


# ---- per-client folders -------------------------------------------------------------------------

def _is_empty(f: Path) -> bool:
    """Whether a client's file holds no rows (such a file may lack columns or a shape too)."""
    if f.suffix == ".parquet":
        try:
            return pq.ParquetFile(f).metadata.num_rows == 0
        except (OSError, pa.ArrowException):
            return False  # unreadable: read_parquet says why
    return False


def read_client_folder(folder: Path, files: list[Path], params) -> Table:
    """Each file is one client (its id the file name's stem); rows in sorted-id order. A file
    without rows is a client without samples (``Table.empty_clients``), whatever shape it has."""
    by_id = {f.stem: f for f in files}
    files = [by_id[i] for i in sorted_ids(list(by_id))]
    parts, empty = [], []
    for k, f in enumerate(files):
        t = None if _is_empty(f) else read_npz(f, params) if f.suffix == ".npz" else read_parquet(f, params)
        if t is None or t.num_rows == 0:
            empty.append(f)
            continue
        if t.x is None:
            t.x = np.concatenate([c for _, c in t.iter_features()])
        parts.append((k, f, t))
    if not parts:
        raise ConfigError(PATH_KEY, f"{folder}: all {len(files):,} client files are empty")
    tables = [t for _, _, t in parts]
    shapes = {t.sample_shape for t in tables}
    if len(shapes) > 1:
        first, other = tables[0], next(t for t in tables if t.sample_shape != tables[0].sample_shape)
        raise ConfigError(PATH_KEY, f"{other.where} holds samples of shape {other.sample_shape}, {first.where} "
                                    f"{first.sample_shape}; every client needs the same sample shape")
    clients = pa.array(np.repeat([k for k, _, _ in parts], [t.num_rows for t in tables]))
    clusters = None
    if any(t.clusters is not None for t in tables):
        missing = [t.where for t in tables if t.clusters is None]
        if missing:
            raise ConfigError("data.params.cluster_column", f"{missing[0]} has no {params.cluster_column!r} while "
                                                            "other clients have one")
        clusters = pa.concat_arrays([t.clusters for t in tables])
    labels = pa.concat_arrays([t.labels.cast(tables[0].labels.type) for t in tables])
    x = np.concatenate([t.x for t in tables])
    starts = np.concatenate([[0], np.cumsum([t.num_rows for t in tables])[:-1]]).astype(np.int64)
    where = Where.of(str(folder), parts=(starts, [f"{f.name} row" for _, f, _ in parts]))
    return Table(where, len(x), labels, clients, clusters, tables[0].plan, tables[0].sample_shape, x=x,
                 client_names=[f.stem for f in files], dtype=x.dtype, empty_clients=[f.stem for f in empty],
                 client_files={f.stem: [f.name] for f in files})


__all__ = ["CHUNK_BYTES", "CHUNK_ROWS", "Table", "chunk_rows", "parse_csv", "read_client_folder", "read_npz",
           "read_parquet", "table_from_arrow"]
