"""Readers of the file formats behind ``data.source: files``: each makes a :class:`Table`.

* NumPy ``.npz``: arrays ``x`` (N, ...) and ``y`` (N,), optionally a client-id and a cluster array
  (named by ``client_column`` / ``cluster_column``);
* Parquet and CSV: a label column, features (see :mod:`.tables`), optional client and cluster
  columns. Parquet is read column-projected: the label/client/cluster columns first (which is all
  a partition needs), the features later, row group by row group (:meth:`Table.read_rows`);
* a folder of per-client ``<client id>.npz`` / ``.parquet`` files (the file is the client);
* LEAF's JSON (``{"users": [...], "user_data": {user: {"x": [...], "y": [...]}}}``): one file, a
  folder of them, or LEAF's ``train/`` and ``test/`` folders, whose split is kept (``Table.test``).
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..schema import ConfigError
from .tables import PATH_KEY, FeaturePlan, check_finite, features_of, plan_features, require_column, sorted_ids

#: rows per chunk when features are read lazily (a few tens of MB of features per chunk)
CHUNK_ROWS = 65536


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
        raise ConfigError(PATH_KEY, f"{where}: x has {shape[0]} rows and y shape {y.shape}; y needs one value per row")
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
    return Table(where, len(y), pa.array(y), None if clients is None else pa.array(clients),
                 None if clusters is None else pa.array(clusters),
                 FeaturePlan("list", ("x",), tuple(shape[1:])), tuple(shape[1:]), x=x,
                 cluster_per_client=per_client, dtype=np.dtype(dtype))


# ---- Parquet and CSV ----------------------------------------------------------------------------

def _table_parts(schema: pa.Schema, params, where: str) -> tuple[FeaturePlan, list[str]]:
    require_column(schema, params.label_column, "data.params.label_column", where)
    plan = plan_features(schema, params.feature_columns, _reserved(params), where)
    meta = [c for c in (params.label_column, params.client_column, params.cluster_column) if c in schema.names]
    return plan, meta


def _first_shape(sample: np.ndarray) -> tuple[int, ...]:
    return tuple(sample.shape[1:])


def table_from_arrow(table: pa.Table, params, where: str, with_x: bool = True) -> Table:
    """A :class:`Table` of an in-memory Arrow table (CSV, a Hugging Face data set)."""
    plan, _ = _table_parts(table.schema, params, where)
    n = table.num_rows
    first = features_of(table.slice(0, min(n, 1)), plan, 0, where)
    shape = _first_shape(first)
    col = lambda name: table.column(name).combine_chunks() if name in table.column_names else None  # noqa: E731

    def chunks(need=None) -> Iterator[tuple[int, np.ndarray]]:
        for start in range(0, n, CHUNK_ROWS):
            if need is None or need(start, min(CHUNK_ROWS, n - start)):
                yield start, features_of(table.slice(start, CHUNK_ROWS), plan, start, where, shape)

    return Table(where, n, col(params.label_column), col(params.client_column), col(params.cluster_column),
                 FeaturePlan(plan.kind, plan.columns, shape), shape, chunks=chunks, dtype=first.dtype)


def read_parquet(path: Path, params) -> Table:
    where = str(path)
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise ConfigError(PATH_KEY, f"{where} is not a readable Parquet file ({str(err).splitlines()[0]})") from None
    schema = pf.schema_arrow
    plan, meta = _table_parts(schema, params, where)
    small = pf.read(columns=meta)  # labels, client and cluster ids: all a partition needs
    n = small.num_rows
    first = features_of(next(pf.iter_batches(batch_size=1, columns=list(plan.columns))), plan, 0, where) \
        if n else np.zeros((0, 1), dtype=np.float32)
    shape = _first_shape(first)
    groups = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]

    def chunks(need=None) -> Iterator[tuple[int, np.ndarray]]:
        # whole row groups, several at a time (Arrow decodes them in parallel), about CHUNK_ROWS
        # rows; with ``need``, only the groups holding a wanted row
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
                       and rows + groups[i + len(take)] <= CHUNK_ROWS):
                    rows += groups[i + len(take)]
                    take.append(i + len(take))
                part = reader.read_row_groups(take, columns=list(plan.columns), use_threads=True)
                yield int(firsts[i]), features_of(part, plan, int(firsts[i]), where, shape)
                i += len(take)

    col = lambda name: small.column(name).combine_chunks() if name in small.column_names else None  # noqa: E731
    return Table(where, n, col(params.label_column), col(params.client_column), col(params.cluster_column),
                 FeaturePlan(plan.kind, plan.columns, shape), shape, chunks=chunks, dtype=first.dtype)


def read_csv(path: Path, params) -> Table:
    import pyarrow.csv as pcsv

    try:
        table = pcsv.read_csv(path)
    except (OSError, pa.ArrowException) as err:
        text = str(err).splitlines()[0]
        hint = " (ragged rows: every line needs the same number of fields)" if "columns" in text else ""
        raise ConfigError(PATH_KEY, f"{path}: not a readable CSV file: {text}{hint}") from None
    return table_from_arrow(table, params, str(path))


# ---- per-client folders -------------------------------------------------------------------------

def read_client_folder(folder: Path, files: list[Path], params) -> Table:
    """Each file is one client (its id the file name's stem); rows in sorted-id order."""
    by_id = {f.stem: f for f in files}
    files = [by_id[i] for i in sorted_ids(list(by_id))]
    parts = []
    for f in files:
        t = read_npz(f, params) if f.suffix == ".npz" else read_parquet(f, params)
        if t.x is None:
            x = np.concatenate([c for _, c in t.iter_features()]) if t.num_rows else None
            t.x = x
        parts.append(t)
    shapes = {t.sample_shape for t in parts}
    if len(shapes) > 1:
        first, other = parts[0], next(t for t in parts if t.sample_shape != parts[0].sample_shape)
        raise ConfigError(PATH_KEY, f"{other.where} holds samples of shape {other.sample_shape}, {first.where} "
                                    f"{first.sample_shape}; every client needs the same sample shape")
    ids = [f.stem for f in files]
    clients = pa.array(np.repeat(np.arange(len(files)), [t.num_rows for t in parts]))
    clusters = None
    if any(t.clusters is not None for t in parts):
        missing = [t.where for t in parts if t.clusters is None]
        if missing:
            raise ConfigError("data.params.cluster_column", f"{missing[0]} has no {params.cluster_column!r} while "
                                                            "other clients have one")
        clusters = pa.concat_arrays([t.clusters for t in parts])
    labels = pa.concat_arrays([t.labels.cast(parts[0].labels.type) for t in parts])
    x = np.concatenate([t.x for t in parts])
    return Table(str(folder), len(x), labels, clients, clusters, parts[0].plan, parts[0].sample_shape, x=x,
                 client_names=ids, dtype=x.dtype)


# ---- LEAF JSON ----------------------------------------------------------------------------------

def _leaf_files(path: Path) -> dict[str, list[Path]]:
    if path.is_file():
        return {"train": [path]}
    split = {s: sorted((path / s).glob("*.json")) for s in ("train", "test") if (path / s).is_dir()}
    return split if split else {"train": sorted(path.glob("*.json"))}


def read_leaf(path: Path, params) -> Table:
    """LEAF's users and samples; with train/ and test/ folders, ``test`` marks LEAF's test rows."""
    users: dict[str, dict[str, list]] = {}
    files = _leaf_files(path)
    shape = None
    for split, paths in files.items():
        for f in paths:
            try:
                blob = json.loads(f.read_text())
            except (OSError, ValueError) as err:
                raise ConfigError(PATH_KEY, f"{f} is not readable LEAF JSON ({str(err).splitlines()[0]})") from None
            if not isinstance(blob, dict) or "users" not in blob or "user_data" not in blob:
                found = ", ".join(map(str, blob)) if isinstance(blob, dict) else type(blob).__name__
                raise ConfigError(PATH_KEY, f"{f} is not LEAF JSON: it needs 'users' and 'user_data' (found: {found})")
            for user in blob["users"]:
                data = blob["user_data"].get(user)
                if data is None or "x" not in data or "y" not in data:
                    raise ConfigError(PATH_KEY, f"{f}: user {user!r} has no x/y in user_data")
                if len(data["x"]) != len(data["y"]):
                    raise ConfigError(PATH_KEY, f"{f}: user {user!r} has {len(data['x'])} x and {len(data['y'])} y")
                x = _leaf_x(data["x"], f, user)
                if shape is None:
                    shape = x.shape[1:]
                elif x.shape[1:] != shape:
                    raise ConfigError(PATH_KEY, f"{f}: user {user!r} has samples of shape {x.shape[1:]}, earlier "
                                                f"users {shape} (ragged rows)")
                entry = users.setdefault(str(user), {"x": [], "y": [], "test": []})
                entry["x"].append(x)  # converted per file: never the whole data set as Python floats
                entry["y"].extend(data["y"])
                entry["test"].extend([split == "test"] * len(data["y"]))
            del blob
    if not users:
        raise ConfigError(PATH_KEY, f"{path} holds no LEAF users (looked for *.json, train/*.json, test/*.json)")
    names = sorted_ids(list(users))
    x = np.concatenate([a for u in names for a in users[u]["x"]])
    counts = [len(users[u]["y"]) for u in names]
    y = [v for u in names for v in users[u]["y"]]
    try:
        labels = pa.array(y)
    except (pa.ArrowException, TypeError) as err:
        raise ConfigError("data.params.label_column", f"{path}: LEAF y values are not numbers ({err})") from None
    test = np.array([t for u in names for t in users[u]["test"]], dtype=bool) if "test" in files else None
    return Table(str(path), len(x), labels, pa.array(np.repeat(np.arange(len(names)), counts)), None,
                 FeaturePlan("list", ("x",), tuple(shape)), tuple(shape), x=x, test=test, client_names=names)


def _leaf_x(values: list, f: Path, user: str) -> np.ndarray:
    if values and isinstance(values[0], str):
        raise ConfigError(PATH_KEY, f"{f}: user {user!r} has text samples; pfl reads numeric LEAF features "
                                    "(FEMNIST, synthetic), not text (Shakespeare, Sent140) without a tokenizer")
    try:
        x = np.asarray(values, dtype=np.float32)
    except (ValueError, TypeError):
        lengths = [len(v) if isinstance(v, list) else 1 for v in values]
        row = next((i for i, n in enumerate(lengths) if n != lengths[0]), 0)
        raise ConfigError(PATH_KEY, f"{f}: user {user!r}, sample {row} has {lengths[row]} values, the samples "
                                    f"before it {lengths[0]} (ragged rows)") from None
    return x.reshape(len(values), -1) if x.ndim == 1 else x


__all__ = ["CHUNK_ROWS", "Table", "read_client_folder", "read_csv", "read_leaf", "read_npz", "read_parquet",
           "table_from_arrow"]
