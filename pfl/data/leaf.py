"""LEAF's JSON (``{"users": [...], "user_data": {user: {"x": [...], "y": [...]}}}``) as a :class:`Table`:
one file, a folder of them, or LEAF's ``train/`` and ``test/`` folders, whose split is kept
(``Table.test``).

Real LEAF dumps hold writers with no samples (``"x": []``) and writers present in only one of
``train/`` and ``test/``; they are read, not refused: a writer with no sample anywhere is listed
in ``Table.empty_clients``, and each writer's files in ``Table.client_files``, so that the files
source can leave them out with a count, or refuse them by name (``data.params.drop_incomplete_clients``).
Messages name a sample by its file, writer and place in the writer's list (:class:`~.tables.Where`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..schema import ConfigError
from .readers import Table
from .tables import PATH_KEY, FeaturePlan, Where, sorted_ids


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
    """LEAF's users and samples; with train/ and test/ folders, ``test`` marks LEAF's test rows."""
    # per user: its pieces (file name, split, x, y) in file order, and every file that lists it
    users: dict[str, dict[str, list]] = {}
    files = _leaf_files(path)
    shape, first = None, None
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
                entry = users.setdefault(str(user), {"pieces": [], "files": []})
                entry["files"].append(name)
                if not data["y"]:  # a writer without samples in this file: known, but nothing to read
                    continue
                x = _leaf_x(data["x"], f, user)  # converted per file: never the whole data set as Python floats
                if shape is None:
                    shape, first = x.shape[1:], (name, user)
                elif x.shape[1:] != shape:
                    raise ConfigError(PATH_KEY, f"{f}: user {user!r} has samples of shape {list(x.shape[1:])}, "
                                                f"user {first[1]!r} in {first[0]} {list(shape)} (ragged rows)")
                entry["pieces"].append((name, split, x, data["y"]))
            del blob
    if not users:
        raise ConfigError(PATH_KEY, f"{path} holds no LEAF users (looked for *.json, train/*.json, test/*.json)")
    if shape is None:
        raise ConfigError(PATH_KEY, f"{path}: none of its {len(users):,} LEAF users has a sample")
    every = sorted_ids(list(users))
    names = [u for u in every if users[u]["pieces"]]
    pieces = [(u, piece) for u in names for piece in users[u]["pieces"]]
    x = np.concatenate([p[2] for _, p in pieces])
    sizes = [len(p[3]) for _, p in pieces]
    try:
        labels = pa.array([v for _, p in pieces for v in p[3]])
    except (pa.ArrowException, TypeError) as err:
        raise ConfigError("data.params.label_column", f"{path}: LEAF y values are not numbers ({err})") from None
    test = np.repeat([p[1] == "test" for _, p in pieces], sizes).astype(bool) if "test" in files else None
    counts = [sum(len(p[3]) for p in users[u]["pieces"]) for u in names]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    where = Where.of(str(path), parts=(starts, [f"{p[0]} user {u!r} sample" for u, p in pieces]))
    return Table(where, len(x), labels, pa.array(np.repeat(np.arange(len(names)), counts)), None,
                 FeaturePlan("list", ("x",), tuple(shape)), tuple(shape), x=x, test=test, client_names=names,
                 empty_clients=[u for u in every if not users[u]["pieces"]],
                 client_files={u: users[u]["files"] for u in every})


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
