"""MLflow tracking: where the store is, and one run's params, metrics and artifacts.

Settings come from ``mlflow.yaml`` (``$PFL_MLFLOW_CONFIG``, else ``./mlflow.yaml``, else the one
next to the package). The default store is an SQLite file in the working directory (MLflow 3
refuses the plain file store by default); ``MLFLOW_TRACKING_URI`` overrides it. Relative paths are
turned into absolute URIs here, in the driver, because Ray workers run in other directories. What
depends on the kind of store (a server, SQLite, a database: where artifacts go, the quick
reachability check, the hint a pipeline prints) is in :mod:`pfl.tracking_store`.

A :class:`Tracker` wraps one MLflow run through ``MlflowClient`` with an explicit run id, so that
nested runs (a pipeline's parent, its trials as children) and resumed runs (a restored Ray
trial continues the run id kept in its checkpoint) never depend on MLflow's global active run.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

import yaml

from .tracking_store import (SAVED_VIEW_TAG, GuardedClient, experiment_url, local_location, location_warning,
                             preflight, saved_view, store_kind, store_lost, view_hint)
from .tracking_store import worker_environment as _worker_environment

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "tracking_uri": "sqlite:///mlflow.db",
    "artifact_root": None,  # None: the store's own rule (see artifact_root)
    "experiment": "pfl",
    "sweep_experiment": "pfl-sweeps",
    "log": {"per_round_metrics": True, "client_table": True, "plots": True, "model": True},
}

PARAM_MAX_LEN = 6000  # MLflow's limit on a param value


def settings_path() -> Path | None:
    env = os.environ.get("PFL_MLFLOW_CONFIG")
    candidates = [Path(env)] if env else []
    candidates += [Path.cwd() / "mlflow.yaml", Path(__file__).resolve().parents[1] / "mlflow.yaml"]
    for path in candidates:
        if path.is_file():
            return path
    return None


def load_settings() -> dict[str, Any]:
    settings = {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEFAULTS.items()}
    path = settings_path()
    if path is not None:
        loaded = yaml.safe_load(path.read_text()) or {}
        unknown = set(loaded) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}; allowed: {sorted(DEFAULTS)}")
        for key, value in loaded.items():
            if isinstance(value, dict):
                settings[key].update(value)
            else:
                settings[key] = value
    return settings


def _absolute_sqlite(uri: str) -> str:
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str((Path.cwd() / uri[len(prefix):]).resolve())
    return uri


def tracking_uri(settings: Mapping[str, Any] | None = None) -> str:
    """The absolute tracking URI (environment first, then mlflow.yaml)."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return _absolute_sqlite(env)
    settings = settings or load_settings()
    uri = str(settings["tracking_uri"])
    if "://" not in uri:  # a bare path means an SQLite file
        uri = "sqlite:///" + uri
    return _absolute_sqlite(uri)


def artifact_root(settings: Mapping[str, Any] | None = None) -> str | None:
    """Where new experiments keep their artifacts, or None: the tracking server decides.

    An explicit root (``$PFL_ARTIFACT_ROOT``, else mlflow.yaml's ``artifact_root``) is used for every
    kind of store. Otherwise a server stores them itself (proxied artifacts: no node writes to its
    own disk) and a database store gets ``mlartifacts`` beside an SQLite file given by the
    environment, else in the working directory."""
    settings = settings or load_settings()
    root = os.environ.get("PFL_ARTIFACT_ROOT") or settings.get("artifact_root")
    uri = tracking_uri(settings)
    if not root:
        if store_kind(uri) == "server":
            return None
        root = "mlartifacts"
    root = str(root)
    if "://" in root or root.startswith("mlflow-artifacts:"):
        return root
    # keep artifacts beside the database when the store is an sqlite file given by the environment
    if os.environ.get("MLFLOW_TRACKING_URI") and uri.startswith("sqlite:///"):
        base = Path(uri[len("sqlite:///"):]).parent
    else:
        base = Path.cwd()
    return (base / root).resolve().as_uri()


def export_environment() -> dict[str, str]:
    """Environment a worker process needs to reach the same store (absolute paths)."""
    settings = load_settings()
    env = {"MLFLOW_TRACKING_URI": tracking_uri(settings)}
    root = artifact_root(settings)
    if root is not None:
        env["PFL_ARTIFACT_ROOT"] = root
    path = settings_path()
    if path is not None:
        env["PFL_MLFLOW_CONFIG"] = str(path.resolve())
    return env


_READY_STORES: set[str] = set()


def worker_environment() -> dict[str, str]:
    """What Ray puts in every worker's environment: :func:`export_environment` and the driver's
    MLflow client settings (credentials, HTTP retries), which nodes started elsewhere lack."""
    return _worker_environment(export_environment())


def client():
    """An MlflowClient of the configured store whose calls raise TrackingStoreError (a ConfigError
    naming MLFLOW_TRACKING_URI) when the store is unreachable. A server or database is checked once
    per process with one quick request, so a trial started while it is down fails at once."""
    from mlflow.tracking import MlflowClient

    # creating a new SQLite store logs schema migrations at INFO: nothing a person acts on
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # MLflow prints two GenAI-view links per run a process ends on a server; pfl prints its own
    # line per pipeline (the model-training view)
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    uri = tracking_uri()
    if uri not in _READY_STORES:
        if uri.startswith("sqlite:///"):
            _initialise_sqlite(uri)
        else:
            preflight(uri)
            _READY_STORES.add(uri)
    return GuardedClient(MlflowClient(tracking_uri=uri), uri)


def _initialise_sqlite(uri: str, attempts: int = 5) -> None:
    """Create or migrate the SQLite store once, under a file lock: two processes creating the same
    new database at once (a sweep's driver and its trials, or a UI opened at that moment) otherwise
    race in MLflow's schema creation and one of them dies with "table already exists"."""
    import fcntl

    from mlflow.tracking import MlflowClient

    import hashlib

    key = hashlib.sha1(uri.encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"pfl-mlflow-{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for attempt in range(attempts):
            try:
                MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
                break
            except Exception:  # a process outside pfl held the schema half-made: let it finish
                if attempt == attempts - 1:
                    raise
                time.sleep(1.0 + attempt)
    _READY_STORES.add(uri)


def run_hint(run_id: str, what: str = "MLflow parent run") -> str:
    """The line a pipeline prints at its end: where its MLflow run is and how to look (the server's
    page of the run, or the `mlflow ui` command and the page it serves)."""
    uri = tracking_uri()
    experiment = None
    if not store_lost(uri):
        try:
            experiment = client().get_run(run_id).info.experiment_id
        except Exception:  # the hint still names the run; MLflow's run route finds its experiment
            pass
    return view_hint(run_id, experiment, uri, what)


def runs_table_view(run_id: str, key: str, columns: list[tuple[str, str]], name: str = "") -> str:
    """Save a view of the run's experiment that shows ``columns`` ((kind, key) pairs, e.g.
    ``("metrics", "val/acc_mean")``) in the runs table (listed as ``name`` under *Views*), and
    return the line to print: its address in the model-training view. Empty when the store cannot
    be asked."""
    uri = tracking_uri()
    try:
        mc = client()
        experiment = mc.get_run(run_id).info.experiment_id
        mc.set_experiment_tag(experiment, SAVED_VIEW_TAG + key, saved_view(name or key, columns))
    except Exception as err:  # a view is a convenience: the run's own line still says where it is
        log.warning("could not save the runs-table view %s: %s", key, err)
        return ""
    return f"runs table ({', '.join(k for _, k in columns)}): {experiment_url(experiment, uri, key)}"


DESCRIPTIONS = {
    "experiment": "Single federated runs (`pfl run`, the comparison pipelines' rows): one run per experiment "
                  "with every resolved config value as a param, per-round metrics (step = round), plots, "
                  "client table and final model as artifacts.",
    "sweep_experiment": "Ray Tune sweeps and pipelines (`pipelines/sweep.py`, `tune_fpfc.py`, the tables): "
                        "one parent run per sweep or pipeline with the trial table (CSV, HTML, Parquet) and "
                        "a comparison plot; every trial is a nested child run named by what it tries.",
}


def experiment_id(name: str | None = None, sweep: bool = False) -> str:
    """Id of the named experiment (mlflow.yaml's default), created with an absolute artifact root
    and a description (shown on the experiment's page)."""
    settings = load_settings()
    kind = "sweep_experiment" if sweep else "experiment"
    name = name or settings[kind]
    mc = client()
    exp = mc.get_experiment_by_name(name)
    if exp is not None:
        _warn_location(exp)
        return exp.experiment_id
    root = artifact_root(settings)
    location = None if root is None else root.rstrip("/") + "/" + name  # None: the server's store
    description = DESCRIPTIONS[kind] if name == settings[kind] else f"pfl runs ({DESCRIPTIONS[kind]})"
    try:
        return mc.create_experiment(name, artifact_location=location,
                                    tags={"mlflow.note.content": description, "pfl.kind": kind})
    except Exception:  # created concurrently by another process
        exp = mc.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


_WARNED: set[str] = set()


def _warn_location(exp) -> None:
    """Once per process and experiment: a server's experiment whose artifacts bypass the server."""
    uri = tracking_uri()
    if artifact_root() is not None or exp.experiment_id in _WARNED:
        return  # an explicit artifact root is the user's choice
    text = location_warning(exp.name, exp.experiment_id, exp.artifact_location, uri)
    if text:
        _WARNED.add(exp.experiment_id)
        log.warning(text)


def check_store(timeout: float = 5.0) -> str:
    """Fail fast (ConfigError naming MLFLOW_TRACKING_URI and the place) when the tracking store or
    the artifact root cannot be written; returns the tracking URI."""
    from .schema import ConfigError

    uri = tracking_uri()
    source = "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "mlflow.yaml tracking_uri"
    where = f"{source}={uri}"
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        if not db.parent.is_dir():
            raise ConfigError("MLFLOW_TRACKING_URI", f"{where}: the folder {db.parent} does not exist")
        if not os.access(db.parent, os.W_OK) or (db.exists() and not os.access(db, os.W_OK)):
            raise ConfigError("MLFLOW_TRACKING_URI", f"{where}: {db if db.exists() else db.parent} is not writable")
    else:  # a server or a database: one quick request (no Ray started, no minute of retries)
        preflight(uri, timeout)
        _READY_STORES.add(uri)
    root = artifact_root()
    if store_kind(uri) == "server" and local_location(root):
        log.warning(f"the artifact root {root} ($PFL_ARTIFACT_ROOT or mlflow.yaml artifact_root) puts new "
                    "experiments' artifacts on the disk of each machine that writes them, not on the MLflow server; "
                    "unset it to let the server store them")
    if root is not None and root.startswith("file://"):
        from urllib.parse import unquote, urlparse

        folder = Path(unquote(urlparse(root).path))
        existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if existing is None or not os.access(existing, os.W_OK):
            raise ConfigError("PFL_ARTIFACT_ROOT", f"the MLflow artifact root {folder} cannot be created "
                                                   f"({existing} is not writable)")
    return uri


class Tracker:
    """One MLflow run, addressed by id. ``Tracker.disabled()`` logs nothing (benchmarks)."""

    def __init__(self, run_id: str | None, enabled: bool = True):
        self.run_id = run_id
        self.enabled = enabled and run_id is not None
        self._client = client() if self.enabled else None
        self._logged_params: set[str] = set()
        self.resumed = False  # a run reopened after an interruption (it may hold earlier steps)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def start(cls, experiment: str | None = None, run_name: str | None = None,
              parent_run_id: str | None = None, tags: Mapping[str, str] | None = None,
              sweep: bool = False) -> "Tracker":
        exp_id = experiment_id(experiment, sweep=sweep)
        all_tags = dict(tags or {})
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = client().create_run(exp_id, run_name=run_name, tags=all_tags)
        return cls(run.info.run_id)

    @classmethod
    def resume(cls, run_id: str) -> "Tracker":
        tracker = cls(run_id)
        tracker.resumed = True
        tracker._client.update_run(run_id, status="RUNNING")
        tracker._logged_params = set(tracker._client.get_run(run_id).data.params)
        return tracker

    @classmethod
    def disabled(cls) -> "Tracker":
        return cls(None, enabled=False)

    # ---- logging ------------------------------------------------------------------------------
    def log_params(self, params: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Param

        items = [Param(k, str(v)[:PARAM_MAX_LEN]) for k, v in params.items() if k not in self._logged_params]
        for start in range(0, len(items), 100):
            self._client.log_batch(self.run_id, params=items[start:start + 100])
        self._logged_params.update(p.key for p in items)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and math.isfinite(float(v))]
        for start in range(0, len(items), 500):
            self._client.log_batch(self.run_id, metrics=items[start:start + 500])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        for key, value in tags.items():
            self._client.set_tag(self.run_id, key, str(value))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.enabled:
            self._client.log_artifact(self.run_id, str(path), artifact_path)

    def last_step(self, key: str) -> int:
        """The largest step logged for metric ``key`` (0 when none)."""
        if not self.enabled:
            return 0
        return max((m.step for m in self._client.get_metric_history(self.run_id, key)), default=0)

    def log_text(self, text: str, name: str) -> None:
        if not self.enabled:
            return
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(text)
            self.log_artifact(path)

    def end(self, status: str = "FINISHED") -> None:
        if self.enabled:
            self._client.set_terminated(self.run_id, status=status)
