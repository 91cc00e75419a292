"""Table hooks: the few lines of Python a table's YAML cannot say, registered by name.

A table names them (``measure: fedala``); a user registers their own in a plugin file
(``plugins: [my_hooks.py]`` in the table's ``set``) with ``@table_hook("measure", "mine")``. Kinds:

* ``measure``: a run's summary (``final``, ``history``) → extra columns of its record (driver);
* ``trial``: a :class:`TrialColumns` class, a callback of the cell's round loop in its worker (where
  the simulator lives): it may watch the rounds (its ``key`` and state make it resume with the
  cell) and gives extra columns at the end (numbers, or lists and dicts of numbers);
* ``records``: every record of the table → the records (columns that compare cells, such as a
  drop from the clean run on the same devices);
* ``headline``: the summary rows → numbers printed and logged on the parent run;
* ``report``: (the summary rows, the cells, a folder) → (Markdown printed after the table, figure
  files written into the folder and logged under ``plots/``), for layouts a table's columns cannot
  give (robustness: methods × attacks per scenario, one plot per attack).

The built-in hooks of the shipped tables are in :mod:`pfl.tables.builtin`.
"""

from __future__ import annotations

from typing import Any, Callable

from ..federation.loop import Callback
from ..registry import Registry
from ..schema import ConfigError

KINDS = ("measure", "trial", "records", "headline", "report")


def _load_builtin() -> None:
    import importlib
    import pkgutil

    from . import builtin

    for module in pkgutil.iter_modules(builtin.__path__):
        importlib.import_module(f"{builtin.__name__}.{module.name}")


HOOKS: Registry[tuple[str, Callable]] = Registry("table hook", "hook", sort=True, load=_load_builtin)


class TrialColumns(Callback):
    """A ``trial`` hook: built with the cell's config, run as a callback of its loop."""

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def columns(self, loop) -> dict[str, Any]:
        """The cell's extra columns, once its run finished."""
        return {}


def table_hook(kind: str, name: str | None = None):
    """Register a function as the table hook ``name`` (default: its own name) of ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"hook kind {kind!r}; allowed: {', '.join(KINDS)}")

    def register(fn: Callable) -> Callable:
        HOOKS.register(name or fn.__name__, (kind, fn))
        return fn

    return register


def get_hook(spec, kind: str) -> Callable | None:
    """The function the table names for ``kind`` (None when it names none); a ConfigError naming the
    table's key when the name is unknown or of another kind."""
    name = getattr(spec, kind)
    if not name:
        return None
    try:
        found, fn = HOOKS.get(name, kind)
    except ConfigError as err:
        raise ConfigError(kind, f"{err.message} (in {spec.path})") from None
    if found != kind:
        raise ConfigError(kind, f"{name!r} is a {found} hook, not a {kind} hook (in {spec.path})")
    return fn


__all__ = ["HOOKS", "KINDS", "TrialColumns", "get_hook", "table_hook"]
