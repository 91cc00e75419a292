"""Paths a config names (data files, model and plugin files), as every process of a run sees them.

A relative path is made absolute against the directory the run was started from — on a Ray worker
the driver's (``PFL_ORIGIN_CWD``) — and a file the driver shipped to the workers
(:mod:`pfl.tune.runtime_env`) is read from the copy Ray unpacked on this node (``PFL_SHIPPED``).
This module imports nothing of pfl, so readers, model loading and plugins can all use it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

SHIPPED_ENV = "PFL_SHIPPED"
ORIGIN_ENV = "PFL_ORIGIN_CWD"


def is_file_entry(entry: str) -> bool:
    """A plugin (or model) entry naming a file rather than a module."""
    return entry.endswith(".py") or "/" in entry or os.sep in entry


def absolute_path(path: str | os.PathLike) -> str:
    """``path`` made absolute against the directory the run was started from (on a Ray worker:
    the driver's, from ``PFL_ORIGIN_CWD``)."""
    text = os.path.expanduser(str(path))
    if os.path.isabs(text):
        return os.path.normpath(text)
    return os.path.normpath(os.path.join(os.environ.get(ORIGIN_ENV) or os.getcwd(), text))


_MAP: dict[str, str] | None = None


def _shipped() -> dict[str, str]:
    global _MAP
    text = os.environ.get(SHIPPED_ENV, "")
    if _MAP is None or _MAP.get("\0source") != text:
        _MAP = {"\0source": text, **(json.loads(text) if text else {})}
    return _MAP


def shipped_path(path: str | os.PathLike) -> Path:
    """Where this process reads ``path``: the copy Ray unpacked on this node when the driver
    shipped it (:func:`worker_runtime_env`), else the path itself (made absolute)."""
    key = absolute_path(path)
    mapping = _shipped()
    for origin, target in mapping.items():
        if origin.startswith("\0") or not (key == origin or key.startswith(origin.rstrip(os.sep) + os.sep)):
            continue
        package, _, inner = target.partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue  # not on this node's path: not a worker of the shipping job
        base = Path(list(spec.submodule_search_locations)[0]) / inner
        return base / os.path.relpath(key, origin) if key != origin else base
    return Path(key)


__all__ = ["ORIGIN_ENV", "SHIPPED_ENV", "absolute_path", "is_file_entry", "shipped_path"]
