"""What a run needs on a Ray worker, as a Ray ``runtime_env``: local files reach the workers
through Ray, not through a shared disk.

A run reads local files named in its config: plugin files and local plugin packages
(``plugins``), a model file (``model.name: path/to/file.py:Class``) and a data set
(``data.params.path`` of ``data.source: files``; ``data_files`` / ``data_dir`` of ``hf``).
:func:`worker_runtime_env` turns the configs of a sweep into one ``runtime_env`` dict for
``ray.init``:

* every such file or folder is staged (hard-linked where possible, else copied) into a package
  folder ``pfl_ship_<kind>_<hash>`` (one for code, one for data, so that editing a plugin does not
  upload the data again) and listed in ``py_modules``: Ray zips it, stores it in the cluster
  (content-addressed) and unpacks it on every node, where it is importable;
* local packages named as ``plugins: [mypkg.methods]`` go into ``py_modules`` as they are
  (installed packages are expected on the cluster and are not shipped);
* ``env_vars`` carries ``PFL_SHIPPED`` (original absolute path → place inside a staged package)
  and ``PFL_ORIGIN_CWD`` (the driver's directory, against which relative config paths resolve on
  a worker, whose own directory is its trial's). :func:`shipped_path` is what readers call: on a
  worker it returns the unpacked copy, elsewhere the path itself.

Ray 2.60's limits, checked here before Ray starts: a package is at most 512 MiB zipped
(``RAY_max_grpc_message_size``); a data set above :data:`SHIP_LIMIT` is not shipped and the
workers read it at its path (a shared disk), which is said in a log line and in the returned
notes. ``py_modules`` takes a folder or a single ``.py`` file; ``excludes`` (gitignore syntax)
drops byte code; ``.gitignore`` files inside a staged folder apply as usual.

Ray warns, when it zips a package (``ray._private.runtime_env.packaging``), about every file of
10 MiB or more ("Consider adding this file to the 'excludes' list") and about a package of 256 MiB
or more zipped ("approaching the maximum upload size"). pfl stages only what its runs read, so
about its own packages that advice is wrong: those two warnings are dropped for files under pfl's
staging folders (:class:`QuietAboutShipped`; Ray's warnings about anything else stay), and a data
set of 10 MiB or more that is shipped is said in one note instead.

Also used by the team setup (a Ray cluster + MLflow server): pass ``extra_modules`` for code the
nodes lack.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..paths import ORIGIN_ENV, SHIPPED_ENV, absolute_path, is_file_entry, shipped_path
from ..schema import ConfigError

log = logging.getLogger(__name__)

#: Ray refuses packages of 512 MiB (zipped); data above this stays where it is
SHIP_LIMIT = 400 * 2**20
EXCLUDES = ["__pycache__", "*.pyc"]
#: Ray 2.60 warns about each file of this size in a package it zips (packaging.FILE_SIZE_WARNING)
RAY_FILE_WARNING = 10 * 2**20
#: the warnings Ray gives about a package's size, which are wrong about what pfl ships on purpose
RAY_SIZE_ADVICE = ("Consider adding this file to the 'excludes' list", "approaching the maximum upload size")
#: the loggers Ray gives them on: the driver's (ray.init), the packaging default, Ray Client's
RAY_LOGGERS = ("ray._private.worker", "ray._private.runtime_env.packaging", "ray.util.client.worker")


# ---- what a config reads ----------------------------------------------------------------------

@dataclass
class WorkerNeeds:
    """Local files and packages a run reads, by config key."""
    code: dict[str, str] = field(default_factory=dict)      # path -> config key (plugin / model files)
    data: dict[str, str] = field(default_factory=dict)      # path -> config key (data sets)
    modules: dict[str, str] = field(default_factory=dict)   # local package folder or .py -> config key

    def add(self, other: "WorkerNeeds") -> None:
        self.code.update(other.code)
        self.data.update(other.data)
        self.modules.update(other.modules)


def _installed(origin: str) -> bool:
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}
    return any(origin.startswith(r + os.sep) for r in roots) or "site-packages" in origin \
        or "dist-packages" in origin


def _module_location(name: str) -> str | None:
    """The folder (or .py file) of ``name``'s top-level package, unless it is installed."""
    top = name.split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        where = list(spec.submodule_search_locations)[0]
    else:
        where = spec.origin or ""
    if not where or _installed(where) or top == "pfl":
        return None
    return where


def needs_of(cfg) -> WorkerNeeds:
    """The local files and packages one resolved :class:`~pfl.config.ExperimentConfig` reads."""

    needs = WorkerNeeds()
    for i, entry in enumerate(getattr(cfg, "plugins", []) or []):
        if is_file_entry(entry):
            needs.code[absolute_path(entry)] = f"plugins[{i}]"
        else:
            where = _module_location(entry)
            if where:
                needs.modules[where] = f"plugins[{i}]"
    name = cfg.model.name
    if ":" in name:
        target = name.rsplit(":", 1)[0]
        if target.endswith(".py") or os.sep in target:
            needs.code[absolute_path(target)] = "model.name"
        else:
            where = _module_location(target)
            if where:
                needs.modules[where] = "model.name"
    params = cfg.data.params or {}
    for key in ("path", "data_dir"):
        value = params.get(key)
        if value and "://" not in str(value) and os.path.exists(absolute_path(value)):
            needs.data[absolute_path(value)] = f"data.params.{key}"
    files = params.get("data_files")
    for j, value in enumerate(files if isinstance(files, list) else [files] if files else []):
        if "://" not in str(value) and os.path.exists(absolute_path(value)):
            needs.data[absolute_path(value)] = f"data.params.data_files[{j}]"
    return needs


# ---- staging ------------------------------------------------------------------------------------

def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


_STAGING: list[tempfile.TemporaryDirectory] = []


def _stage(kind: str, paths: Iterable[str], root: Path) -> tuple[str, dict[str, str]]:
    """A package folder under ``root`` holding ``paths``; (its folder, origin -> package/entry)."""
    paths = sorted(set(paths))
    digest = hashlib.sha256("\0".join(paths).encode()).hexdigest()[:12]
    package = f"pfl_ship_{kind}_{digest}"
    folder = root / package
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("# files shipped to Ray workers by pfl (pfl/tune/runtime_env.py)\n")
    mapping = {}
    for i, origin in enumerate(paths):
        entry = f"e{i}_{Path(origin).name}"
        if Path(origin).is_dir():
            shutil.copytree(origin, folder / entry, copy_function=_link_or_copy,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            _link_or_copy(origin, str(folder / entry))
        mapping[origin] = f"{package}/{entry}"
    return str(folder), mapping


class QuietAboutShipped(logging.Filter):
    """Drops Ray's size advice (:data:`RAY_SIZE_ADVICE`) about files in pfl's staging folders."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (any(a in text for a in RAY_SIZE_ADVICE) and any(t.name in text for t in _STAGING))


def _quiet_ray_about_shipped() -> None:
    for name in RAY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietAboutShipped) for f in logger.filters):
            logger.addFilter(QuietAboutShipped())


@dataclass
class ShippedEnv:
    runtime_env: dict[str, Any]
    notes: list[str]   # what was not shipped and why; a data set of 10 MiB or more that is shipped


def worker_runtime_env(cfgs: Iterable, *, ship_data: bool = True, extra_modules: Iterable[str] = (),
                       env_vars: dict[str, str] | None = None, limit: int = SHIP_LIMIT) -> ShippedEnv:
    """The ``runtime_env`` that gives Ray workers what the runs ``cfgs`` read (see the module
    docstring). ``ship_data=False`` (a local Ray instance shares this machine's disk) ships code
    only. Staged folders live until this process exits."""

    needs = WorkerNeeds()
    for cfg in cfgs:
        needs.add(needs_of(cfg))
    notes: list[str] = []
    vars_ = {ORIGIN_ENV: os.getcwd(), **(env_vars or {})}
    modules: list[str] = list(extra_modules) + sorted(needs.modules)
    data = {}
    if needs.data:
        total = sum(_size(Path(p)) for p in needs.data)
        if not ship_data:
            log.info("data sets are read at their paths (a local Ray instance shares this disk)")
        elif total > limit:
            keys = ", ".join(sorted(set(needs.data.values())))
            notes.append(f"{keys} ({total / 2**20:.0f} MiB) is more than Ray ships through runtime_env "
                         f"({limit / 2**20:.0f} MiB here, 512 MiB zipped at most): every node must read it "
                         "at the same path (a shared disk)")
            log.warning("%s", notes[-1])
        else:
            data = needs.data
            if total >= RAY_FILE_WARNING:
                keys = ", ".join(sorted(set(data.values())))
                notes.append(f"{keys} ({total / 2**20:.0f} MiB) goes to every Ray node with the sweep, on purpose: "
                             "zipped and uploaded once per content, unpacked on each node")
                log.info("%s", notes[-1])
    mapping: dict[str, str] = {}
    if needs.code or data:
        tmp = tempfile.TemporaryDirectory(prefix="pfl-ship-")
        _STAGING.append(tmp)
        for kind, paths in (("code", needs.code), ("data", data)):
            if not paths:
                continue
            missing = [f"{key}: {p}" for p, key in paths.items() if not os.path.exists(p)]
            if missing:
                key, _, p = missing[0].partition(": ")
                raise ConfigError(key, f"no such file: {p}")
            folder, entries = _stage(kind, paths, Path(tmp.name))
            modules.append(folder)
            mapping.update(entries)
        _quiet_ray_about_shipped()
        vars_[SHIPPED_ENV] = json.dumps(mapping, sort_keys=True)
    env: dict[str, Any] = {"env_vars": vars_}
    if modules:
        env["py_modules"] = modules
        env["excludes"] = list(EXCLUDES)
    return ShippedEnv(env, notes)


@atexit.register
def _cleanup() -> None:
    for tmp in _STAGING:
        tmp.cleanup()


__all__ = ["ORIGIN_ENV", "QuietAboutShipped", "SHIPPED_ENV", "SHIP_LIMIT", "ShippedEnv", "WorkerNeeds",
           "absolute_path", "needs_of", "shipped_path", "worker_runtime_env"]
