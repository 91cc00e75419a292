"""Columns of a user's table (Parquet, CSV, a Hugging Face data set, NumPy arrays) as pfl's arrays.

A table has a label column, optional client and cluster columns, and features: every other column
(one number each), the columns named in ``feature_columns``, or a single column holding one
sample per row (a list of numbers, or an encoded PNG/JPEG image; Hugging Face image columns are
structs of the encoded bytes and a path). :class:`FeaturePlan` says which case a schema is, and
:func:`features_of` turns one record batch into a ``(rows, *sample_shape)`` array in its stored
form (uint8 for images, else the column type), refusing ragged rows, empty cells and undecodable
images with the row as its user would find it (:func:`row_at`: a CSV's line, a LEAF user's
sample). Non-finite values are refused by :func:`check_finite`.

Everything here raises :class:`~pfl.schema.ConfigError` on the key the user would change
(``data.params.*``); ``where`` (a file name) is part of every message.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..schema import ConfigError

PATH_KEY = "data.params.path"


class Where(str):
    """A data set's name in messages that also knows how its user numbers the rows.

    Row numbers inside pfl are positions in one table, which a user can find only in a single
    Parquet or NumPy file. A CSV's user counts lines (``first_line``: the line of row 0, after
    the header); data put together from several files (LEAF users, per-client files) is found by
    the file and the place in it (``parts``: the first row of each piece and how to name it).
    A ``str`` subclass, so that every message that prints ``where`` keeps working."""
    first_line: int | None = None
    parts: tuple[np.ndarray, list[str]] | None = None

    @classmethod
    def of(cls, name: str, first_line: int | None = None,
           parts: tuple[np.ndarray, list[str]] | None = None) -> "Where":
        out = cls(name)
        out.first_line, out.parts = first_line, parts
        return out


def row_at(where: str, row: int) -> str:
    """Row ``row`` of the table (0-based) as its user would find it: ``line 1236`` in a CSV
    file, ``train/a.json user 'f0003_11' sample 4`` in LEAF, else ``row 1234``."""
    first = getattr(where, "first_line", None)
    if first is not None:
        return f"line {row + first}"
    parts = getattr(where, "parts", None)
    if parts is not None:
        starts, names = parts
        i = int(np.searchsorted(starts, row, side="right")) - 1
        return f"{names[i]} {row - int(starts[i])}"
    return f"row {row}"


@dataclass(frozen=True)
class FeaturePlan:
    """Which columns hold the features and how: ``columns`` (one number each), ``list`` (one
    column of equal-length number lists), ``image`` (one column of encoded images, bytes or a
    Hugging Face {bytes, path} struct)."""
    kind: str
    columns: tuple[str, ...]
    sample_shape: tuple[int, ...] = ()

    def column_name(self, flat_index: int) -> str:
        """The name of feature ``flat_index`` for messages (``x[17]`` inside a list column)."""
        if self.kind == "columns":
            return self.columns[flat_index]
        return f"{self.columns[0]}[{flat_index}]"


def _is_number(tp: pa.DataType) -> bool:
    return pa.types.is_integer(tp) or pa.types.is_floating(tp) or pa.types.is_boolean(tp)


def _is_image(tp: pa.DataType) -> bool:
    if pa.types.is_binary(tp) or pa.types.is_large_binary(tp):
        return True
    return pa.types.is_struct(tp) and {tp.field(i).name for i in range(tp.num_fields)} >= {"bytes"}


def _is_list(tp: pa.DataType) -> bool:
    return pa.types.is_list(tp) or pa.types.is_large_list(tp) or pa.types.is_fixed_size_list(tp)


def require_column(schema: pa.Schema, name: str, key: str, where: str) -> None:
    if name not in schema.names:
        raise ConfigError(key, f"{where} has no column {name!r}; columns found: {', '.join(schema.names)}")


def plan_features(schema: pa.Schema, feature_columns: list[str] | None, reserved: set[str],
                  where: str, key: str = "data.params.feature_columns") -> FeaturePlan:
    """The feature plan of ``schema``: ``feature_columns`` if given, else every column that is not
    in ``reserved`` (the label, client and cluster columns)."""
    if feature_columns is not None:
        for name in feature_columns:
            require_column(schema, name, key, where)
        clash = sorted(set(feature_columns) & reserved)
        if clash:
            raise ConfigError(key, f"{clash} are the label/client/cluster columns and never features")
        names = list(feature_columns)
    else:
        names = [n for n in schema.names if n not in reserved]
    if not names:
        raise ConfigError(key, f"{where} has no feature column (columns: {', '.join(schema.names)})")
    types = {n: schema.field(n).type for n in names}
    if len(names) == 1 and (_is_list(types[names[0]]) or _is_image(types[names[0]])):
        return FeaturePlan("list" if _is_list(types[names[0]]) else "image", tuple(names))
    bad = [n for n in names if not _is_number(types[n])]
    samples = [n for n in bad if _is_list(types[n]) or _is_image(types[n])]
    if bad and len(samples) == 1 and len(bad) == 1 and feature_columns is None:
        # blaming the image for not being a number would point at the one column that is right
        others = ", ".join(repr(n) for n in names if n != samples[0])
        raise ConfigError(key, f"{where}: column {samples[0]!r} holds one sample per row ({types[samples[0]]}), "
                               f"and the other columns ({others}) would be features beside it; set "
                               f"data.params.feature_columns: [{samples[0]}] (the label, client and cluster "
                               "columns are never features)")
    if bad:
        # text first: a column of names is never a feature, and is the likelier mistake
        first = next((n for n in bad if n not in samples), bad[0])
        raise ConfigError(key, f"{where}: column {first!r} holds {types[first]}, not numbers, and is not the "
                               "label, client or cluster column; features are number columns, or one column of "
                               "number lists or encoded images (set data.params.feature_columns to choose them)")
    return FeaturePlan("columns", tuple(names), (len(names),))


def candidate_columns(schema: pa.Schema, reserved: set[str]) -> list[str]:
    """Columns that might hold client ids under another name: text or integers."""
    def fits(tp: pa.DataType) -> bool:
        if pa.types.is_dictionary(tp):
            tp = tp.value_type
        return pa.types.is_string(tp) or pa.types.is_large_string(tp) or pa.types.is_integer(tp)
    return [n for n in schema.names if n not in reserved and fits(schema.field(n).type)]


def missing_client_column(columns: dict[str, pa.Array], num_rows: int, column: str, where: str,
                          limit: int = 3) -> ConfigError | None:
    """The error for a client column that is not there, when other columns look like client ids:
    values that repeat (at most half as many distinct values as rows), the most distinct first, so
    that writers come before a few classes or 256 pixel values; None when none does."""
    found = []
    for name, values in columns.items():
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        distinct = pc.count_distinct(values).as_py()
        if 2 <= distinct <= num_rows // 2:
            found.append((distinct, name))
    if not found:
        return None
    found.sort(key=lambda f: -f[0])
    listed = ", ".join(f"{name!r} ({k:,} distinct values over {num_rows:,} rows)" for k, name in found[:limit])
    return ConfigError("data.params.client_column", f"no column {column!r} in {where}; candidates: {listed} — set "
                                                    f"data.params.client_column: {found[0][1]}")


def _decode_image(data: bytes, row: int, column: str, where: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            arr = np.asarray(img.convert("L") if img.mode in ("1", "P", "I;16", "I", "F") else img)
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise ConfigError(PATH_KEY, f"{where}: {row_at(where, row)}, column {column!r} is not a readable PNG/JPEG "
                                    f"image ({str(err).splitlines()[0]})") from None
    if arr.ndim == 2:
        return arr[None]
    return np.ascontiguousarray(arr.transpose(2, 0, 1))  # H, W, C -> C, H, W


def _image_bytes(column: pa.Array) -> list:
    if pa.types.is_struct(column.type):
        data = column.field("bytes").to_pylist()
        paths = column.field("path").to_pylist() if column.type.get_field_index("path") >= 0 else [None] * len(data)
        out = []
        for b, p in zip(data, paths):
            if b is None and p is not None:
                with open(p, "rb") as fh:
                    b = fh.read()
            out.append(b)
        return out
    return column.to_pylist()


def _ragged(lengths: np.ndarray, expected: int, first_row: int, column: str, where: str) -> ConfigError:
    row = int(np.flatnonzero(lengths != expected)[0])
    return ConfigError(PATH_KEY, f"{where}: {row_at(where, first_row + row)}, column {column!r} has "
                                 f"{int(lengths[row])} values, the rows before it {expected}; every sample needs "
                                 "the same shape (ragged rows)")


def features_of(batch: pa.RecordBatch | pa.Table, plan: FeaturePlan, first_row: int, where: str,
                expected: tuple[int, ...] | None = None) -> np.ndarray:
    """The batch's samples as one array of shape (rows, *sample) in stored form.

    ``first_row`` is the batch's position in the file (for messages); ``expected`` the sample
    shape of earlier batches (rows that differ are ragged)."""
    n = batch.num_rows
    if plan.kind == "columns":
        cols = []
        for name in plan.columns:
            col = batch.column(name)
            col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
            if col.null_count:
                row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
                raise ConfigError(PATH_KEY, f"{where}: {row_at(where, first_row + row)}, column {name!r} is empty; "
                                            "fill or drop missing features first")
            cols.append(col.to_numpy(zero_copy_only=False))
        out = np.empty((n, len(cols)), dtype=np.float32)
        for j, c in enumerate(cols):
            out[:, j] = c
        return out
    name = plan.columns[0]
    col = batch.column(name)
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if col.null_count:
        row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise ConfigError(PATH_KEY, f"{where}: {row_at(where, first_row + row)}, column {name!r} is empty")
    if plan.kind == "image":
        images = [_decode_image(b, first_row + i, name, where) for i, b in enumerate(_image_bytes(col))]
        shape = expected or (images[0].shape if images else ())
        for i, img in enumerate(images):
            if img.shape != tuple(shape):
                raise ConfigError(PATH_KEY, f"{where}: {row_at(where, first_row + i)}, column {name!r} is a "
                                            f"{'x'.join(map(str, img.shape))} image, the rows before it "
                                            f"{'x'.join(map(str, shape))}; every image needs the same size")
        return np.stack(images) if images else np.zeros((0, *shape), dtype=np.uint8)
    # a list column: equal lengths, then one reshape of the flat values (no per-row Python)
    if pa.types.is_fixed_size_list(col.type):
        width = col.type.list_size
    else:
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        width = int(expected[0]) if expected else (int(lengths[0]) if n else 0)
        if n and (lengths != width).any():
            raise _ragged(lengths, width, first_row, name, where)
    values = col.flatten()
    if values.null_count:
        flat = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        raise ConfigError(PATH_KEY, f"{where}: {row_at(where, first_row + flat // max(width, 1))}, column "
                                    f"{name}[{flat % max(width, 1)}] is empty")
    if not _is_number(values.type):
        raise ConfigError("data.params.feature_columns", f"{where}: column {name!r} holds lists of "
                                                         f"{values.type}, not numbers")
    if expected and width != int(np.prod(expected)):
        raise _ragged(np.full(max(n, 1), width), int(np.prod(expected)), first_row, name, where)
    return values.to_numpy(zero_copy_only=False).reshape(n, width)


def check_finite(x: np.ndarray, first_row: int, plan: FeaturePlan, where: str) -> None:
    """Refuse nan/inf features, naming the first such row and column."""
    if x.dtype.kind != "f":
        return
    flat = x.reshape(len(x), -1)
    bad = ~np.isfinite(flat)
    if bad.any():
        row, col = (int(v) for v in np.argwhere(bad)[0])
        raise ConfigError(PATH_KEY, f"{where}: {row_at(where, first_row + row)}, column {plan.column_name(col)!r} "
                                    f"is {_value(flat[row, col])}; features must be finite (clean or impute them "
                                    "first)")


def _value(v) -> str:
    """A bad number as a user would write it: a NaN is not an empty cell, and says so."""
    if isinstance(v, (float, np.floating)) and np.isnan(v):
        return "NaN (not a number)"
    return repr(float(v)) if isinstance(v, (float, np.floating)) else repr(v)


# ---- labels, client ids, clusters -------------------------------------------------------------

def labels_of(values: pa.Array | pa.ChunkedArray, task: str, column: str, where: str) -> tuple[np.ndarray, str]:
    """(labels as int64 classes or float32 targets, the task): integers are classes, floats
    targets, unless ``task`` says which."""
    key = "data.params.label_column"
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if values.null_count:
        row = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        raise ConfigError(key, f"{where}: {row_at(where, row)} has no label in column {column!r}")
    tp = values.type
    if pa.types.is_dictionary(tp):
        values = values.dictionary_decode()
        tp = values.type
    if not _is_number(tp):
        raise ConfigError(key, f"{where}: label column {column!r} holds {tp}; classification needs integer "
                               "class ids 0..C-1 (map the names to ids first), regression needs numbers")
    y = values.to_numpy(zero_copy_only=False)
    if task == "auto":
        task = "regression" if pa.types.is_floating(tp) else "classification"
    if task == "regression":
        # a NaN label cell makes an integer column float, so it lands here rather than below
        bad = np.flatnonzero(~np.isfinite(y))
        if bad.size:
            row = int(bad[0])
            raise ConfigError(key, f"{where}: {row_at(where, row)} has label {_value(y[row])} in column {column!r}; "
                                   "labels must be finite numbers (fill or drop the row)")
        return y.astype(np.float32), task
    if y.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(y) | (y != np.round(y)))
        if bad.size:
            row = int(bad[0])
            raise ConfigError(key, f"{where}: {row_at(where, row)} has label {_value(y[row])} in column {column!r}; "
                                   "classification labels must be integers 0..C-1 (or set data.params.task: "
                                   "regression)")
    y = y.astype(np.int64)
    if y.size and y.min() < 0:
        row = int(np.argmin(y))
        raise ConfigError(key, f"{where}: {row_at(where, row)} has label {y[row]} in column {column!r}; "
                               "classification labels must be integers 0..C-1")
    return y, task


def group_ids(values: pa.Array | pa.ChunkedArray, column: str, where: str, key: str) -> tuple[list, np.ndarray]:
    """(the distinct ids, sorted: numerically for numbers, else as text; each row's position in them)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if values.null_count:
        row = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        raise ConfigError(key, f"{where}: {row_at(where, row)} has no value in column {column!r}")
    if not (_is_number(values.type) or pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        values = values.cast(pa.string())
    distinct = pc.unique(values)
    if _is_number(values.type):
        distinct = distinct.take(pc.array_sort_indices(distinct))
    else:  # text ids: numerically when every id is an integer ('2' before '10'), as a folder's names

        distinct = pa.array(sorted_ids(distinct.to_pylist()), type=values.type)
    index = pc.index_in(values, value_set=distinct).to_numpy(zero_copy_only=False).astype(np.int64)
    return distinct.to_pylist(), index


def rows_by_group(index: np.ndarray, groups: int) -> list[np.ndarray]:
    """Row numbers of every group, each in file order."""
    order = np.argsort(index, kind="stable")
    return np.split(order, np.cumsum(np.bincount(index, minlength=groups))[:-1])


def sorted_ids(ids: list[str]) -> list[str]:
    """Ids in pfl's client order: numerically when every id is an integer, else as text."""
    if ids and all(i.lstrip("-").isdigit() for i in ids):
        return sorted(ids, key=int)
    return sorted(ids)



__all__ = ["FeaturePlan", "Where", "candidate_columns", "check_finite", "features_of", "group_ids", "labels_of",
           "missing_client_column", "plan_features", "require_column", "row_at", "rows_by_group", "sorted_ids"]
