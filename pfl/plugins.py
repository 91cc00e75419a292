"""Plugins: a researcher's own methods (and models, data sources, compressors) from a file or a module.

``plugins: [my_method.py, mypkg.methods]`` in a config (``pfl run --plugin FILE``, ``pfl methods
--plugin FILE``) imports each entry before anything else is resolved. What the entry registers
with pfl's decorators and functions (``@pfl.methods.register``, ``pfl.models.register``,
``pfl.data.register_source``) then works like a built-in: ``pfl methods`` lists it, search spaces
may name it, and the cohort, compression, checkpoint and resume machinery treat it as their own.

* An entry ending in ``.py`` or containing a path separator is a file, relative to the directory
  the run was started from; the resolved config keeps its absolute path. Anything else is a module
  name imported from ``sys.path``.
* A file is imported once per process under a name derived from its content
  (``pfl_user_<stem>_<hash>``), so loading the same config twice registers nothing twice (an
  edited file is a new module, and registering its names again is an error).
* Every failure is a ConfigError on ``plugins[i]``: a missing file, an import that fails (its
  first line), and a name registered twice (a plugin may not replace a built-in). A plugin that
  fails leaves the registries as they were before it.
* On a Ray cluster the files travel to the workers with the sweep (:mod:`pfl.tune.runtime_env`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType

from .paths import absolute_path, is_file_entry, shipped_path
from .registry import Registry
from .schema import ConfigError


def _first_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    return text.splitlines()[0] if text else type(err).__name__


def _user_frame(err: BaseException, path: str) -> str:
    """' (line N)' of the deepest traceback frame inside ``path``, if any."""
    lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == path]
    return f" (line {lines[-1]})" if lines else ""


def module_name_for(path: str | Path, content: bytes) -> str:
    """The module name of a plugin file: its stem and a hash of its content, so the same file
    (also a Ray worker's copy of it) is one module, and an edited one another."""
    stem = "".join(c if c.isalnum() else "_" for c in Path(path).stem)
    return f"pfl_user_{stem}_{hashlib.sha1(content).hexdigest()[:12]}"


def _registries() -> list[Registry]:
    """The registries a plugin may add to (restored when it fails half-way), each filled with its
    built-ins first, so that a plugin cannot take their names."""
    for registry in Registry.instances:
        registry.names()
    return list(Registry.instances)


def _guarded(run, key: str, where: str):
    before = [r.snapshot() for r in _registries()]
    try:
        return run()
    except ConfigError:
        _restore(before)
        raise
    except ValueError as err:
        _restore(before)
        if "regist" in str(err):
            raise ConfigError(key, f"{where}: {err}; a plugin must register new names (a built-in or another "
                                   "plugin has this one)") from None
        raise ConfigError(key, f"{where} does not import: {_first_line(err)}{_user_frame(err, where)}") from None
    except (Exception, SystemExit) as err:  # a plugin's own error of any kind: one line, the file
        _restore(before)
        raise ConfigError(key, f"{where} does not import: {_first_line(err)}{_user_frame(err, where)}") from None


def _restore(before: list[dict]) -> None:
    for registry, saved in zip(_registries(), before):
        registry.restore(saved)


def import_file(path: str, key: str) -> ModuleType:
    """Import the Python file ``path`` (absolute) once; errors are ConfigErrors on ``key``."""
    local = shipped_path(path)
    if not local.is_file():
        raise ConfigError(key, f"no such file: {path}")
    name = module_name_for(local, local.read_bytes())
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, local)
    if spec is None or spec.loader is None:
        raise ConfigError(key, f"{path} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module

    def run():
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module

    return _guarded(run, key, str(local))


def import_module(name: str, key: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]

    def run():
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name and name.startswith(err.name):
                raise ConfigError(key, f"no module named {name!r} (a plugin is a .py file or an importable "
                                       "module)") from None
            raise

    return _guarded(run, key, name)


def load_plugins(entries: list[str] | None, key: str = "plugins") -> list[str]:
    """Import every entry; returns the entries as a config keeps them (files made absolute)."""
    if entries is None:
        return []
    if isinstance(entries, str) or not isinstance(entries, (list, tuple)):
        raise ConfigError(key, f"expected a list of .py files or module names, got {entries!r}")
    out = []
    for i, entry in enumerate(entries):
        where = f"{key}[{i}]"
        if not isinstance(entry, str) or not entry.strip():
            raise ConfigError(where, f"expected a .py file or a module name, got {entry!r}")
        if is_file_entry(entry):
            path = absolute_path(entry)
            import_file(path, where)
            out.append(path)
        else:
            import_module(entry, where)
            out.append(entry)
    return out


__all__ = ["import_file", "import_module", "is_file_entry", "load_plugins", "module_name_for"]
