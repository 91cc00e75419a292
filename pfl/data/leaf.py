"""LEAF's JSON (``{"users": [...], "user_data": {user: {"x": [...], "y": [...]}}}``) as a :class:`Table`:
one file, a folder of them, or LEAF's ``train/`` and ``test/`` folders, whose split is kept
(``Table.test``).

Real LEAF dumps hold writers with no samples (``"x": []``) and writers present in only one of
``train/`` and ``test/``; they are read, not refused: a writer with no sample anywhere is listed
in ``Table.empty_clients``, and each writer's files in ``Table.client_files``, so that the files
source can leave them out with a count, or refuse them by name (``data.params.drop_incomplete_clients``).
Messages name a sample by its file, writer and place in the writer's list (:class:`~.tables.Where`).

A folder is parsed once, a file at a time, into Parquet in pfl's cache (:mod:`.converted`), every
check made then (a bad file fails on its first load and is never cached); later loads read that
file. Rows are in file order: ``train/`` then ``test/``, each file's users in its own order.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..schema import ConfigError
from .converted import Sink, converted
from .readers import Table
from .tables import PATH_KEY, FeaturePlan, Where, check_finite, sorted_ids


def _leaf_files(path: Path) -> dict[str, list[Path]]:
    if path.is_file():
        return {"train": [path]}
    split = {s: sorted((path / s).glob("*.json")) for s in ("train", "test") if (path / s).is_dir()}
    return split if split else {"train": sorted(path.glob("*.json"))}


def _blob(f: Path) -> dict:
    try:
        blob = json.loads(f.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(PATH_KEY, f"{f} is not readable LEAF JSON ({str(err).splitlines()[0]})") from None
    if not isinstance(blob, dict) or "users" not in blob or "user_data" not in blob:
        found = ", ".join(map(str, blob)) if isinstance(blob, dict) else type(blob).__name__
        raise ConfigError(PATH_KEY, f"{f} is not LEAF JSON: it needs 'users' and 'user_data' (found: {found})")
    return blob


def read_leaf(path: Path, params) -> Table:
    """LEAF's users and samples, parsed once into the cache (:mod:`.converted`) and read from there;
    with train/ and test/ folders, ``test`` marks LEAF's test rows."""
    files = _leaf_files(path)
    sources = [f for paths in files.values() for f in paths]
    return converted("leaf", path, sources, path if path.is_dir() else None, {},
                     lambda sink: _convert(path, files, sink))


def _convert(path: Path, files: dict[str, list[Path]], sink: Sink) -> dict:
    """Every file's users into ``sink``, a file at a time, in file order (a user's samples in the
    order of its files); returns the table's metadata: its pieces (where each file's user starts,
    for messages), the users without samples and each user's files."""
    user_files: dict[str, list[str]] = {}  # every user, and every file that lists it
    with_samples: set[str] = set()
    starts, pieces, kinds = [], [], set()
    shape, first, rows = None, None, 0
    fixed = "test" in files
    for split, paths in files.items():
        for f in paths:
            name = str(f.relative_to(path)) if path.is_dir() else f.name
            blob = _blob(f)
            for user in blob["users"]:
                data = blob["user_data"].get(user)
                if data is None or "x" not in data or "y" not in data:
                    raise ConfigError(PATH_KEY, f"{f}: user {user!r} has no x/y in user_data")
                if len(data["x"]) != len(data["y"]):
                    raise ConfigError(PATH_KEY, f"{f}: user {user!r} has {len(data['x'])} x and {len(data['y'])} y")
                user_files.setdefault(str(user), []).append(name)
                if not data["y"]:  # a writer without samples in this file: known, but nothing to read
                    continue
                x = _leaf_x(data["x"], f, user)  # converted per file: never the whole data set as Python floats
                if shape is None:
                    shape, first = x.shape[1:], (name, user)
                elif x.shape[1:] != shape:
                    raise ConfigError(PATH_KEY, f"{f}: user {user!r} has samples of shape {list(x.shape[1:])}, "
                                                f"user {first[1]!r} in {first[0]} {list(shape)} (ragged rows)")
                piece = f"{name} user {user!r} sample"
                check_finite(x.reshape(len(x), -1), 0, FeaturePlan("list", ("x",), tuple(shape)),
                             Where.of(str(path), parts=(np.zeros(1, dtype=np.int64), [piece])))
                y = _leaf_y(data["y"], path, piece)
                kinds.add(y.type)
                columns = {"label": y.cast(pa.float64()), "client": pa.array([str(user)] * len(x))}
                if fixed:
                    columns["test"] = pa.array(np.full(len(x), split == "test"))
                sink.add(columns, x)
                with_samples.add(str(user))
                starts.append(rows)
                pieces.append(piece)
                rows += len(x)
            del blob
    if not user_files:
        raise ConfigError(PATH_KEY, f"{path} holds no LEAF users (looked for *.json, train/*.json, test/*.json)")
    if shape is None:
        raise ConfigError(PATH_KEY, f"{path}: none of its {len(user_files):,} LEAF users has a sample")
    every = sorted_ids(list(user_files))
    label_type = "double" if any(pa.types.is_floating(k) for k in kinds) else \
        "bool" if kinds and all(pa.types.is_boolean(k) for k in kinds) else "int64"
    return {"shape": list(shape), "plan": ["list", ["x"]], "label_type": label_type, "parts": [starts, pieces],
            "empty_clients": [u for u in every if u not in with_samples],
            "client_files": {u: user_files[u] for u in every}}


def _leaf_y(values: list, path: Path, piece: str) -> pa.Array:
    try:
        y = pa.array(values)
    except (pa.ArrowException, TypeError) as err:
        raise ConfigError("data.params.label_column", f"{path}: LEAF y values are not numbers ({err})") from None
    if not (pa.types.is_integer(y.type) or pa.types.is_floating(y.type) or pa.types.is_boolean(y.type)
            or pa.types.is_null(y.type)):
        raise ConfigError("data.params.label_column", f"{path}: LEAF y values of {piece}s hold {y.type}, not "
                                                      "numbers; classification needs integer class ids 0..C-1 "
                                                      "(map the names to ids first)")
    return y


def _leaf_x(values: list, f: Path, user: str) -> np.ndarray:
    if isinstance(values[0], str):
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


__all__ = ["read_leaf"]
