"""Driver of a sweep: Ray + Tune + Optuna + ASHA, an MLflow parent run, a results table.

``run_sweep`` validates the space, the data, the method's server memory (:mod:`pfl.server_memory`)
and the MLflow store (before Ray starts), creates the MLflow parent run, runs the trials (each a
child run named by what it tries), and logs on the
parent the trial table (CSV, HTML, Parquet), a plot of every trial's curve and, for a complete
sweep, the best config and its metrics. A sweep's Ray experiment lives in ``<storage>/<name>``;
``resume=True`` restores it with ``Tuner.restore`` so finished trials are kept and unfinished ones
continue from their checkpoints, and the parent's summary then describes the whole sweep.

How a sweep ends (``SweepResult.status``): ``FINISHED`` (every trial ran; some may have failed),
``FAILED`` (every trial failed; each reason is in ``failures``) or ``INTERRUPTED`` (SIGINT or
SIGTERM: Tune stops the trials and saves its state; the parent and the unfinished trials' runs are
marked KILLED and no best is logged; ``exit_code`` is 130 or 143). A tracking store that stops
answering is also ``INTERRUPTED`` (``reason`` says so, ``exit_code`` 1): the trials it cut off
fail with that reason, and ``resume=True`` once it is back runs them again in their MLflow runs.

Around the driver: :mod:`.ray_session` (connecting to Ray), :mod:`.progress` (trial labels and
console lines), :mod:`.results` (the result, the trial table, the trials' MLflow runs).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from ..data import load_federated
from ..federation.workers import trial_bundles
from ..models import check_model_on
from ..resolver import resolve
from ..schema import ConfigError, flatten
from ..server_memory import check_server_memory, config_model_size
from ..tracking import Tracker, check_store, export_environment, tracking_uri
from ..tracking_store import TrackingStoreError, store_lost
from .progress import ProgressLines, trial_label
from .ray_session import init_ray
from .runtime_env import worker_runtime_env
from .results import (MlflowStatusCallback, SweepResult, expected_trials, kill_unfinished_children, log_table,
                      results_table, saved_trials)
from .space import SearchSpace, base_config, check_space, describe_search
from .entry import federated_trainable

log = logging.getLogger(__name__)

STATE_FILE = "pfl_sweep.json"


def parse_resources(text: str | None) -> dict[str, float]:
    """'cpu=1,gpu=0.25' -> {'cpu': 1.0, 'gpu': 0.25}."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ("cpu", "gpu"):
            raise ConfigError("--resources", f"unknown resource {key!r}; allowed: cpu, gpu")
        try:
            out[key] = float(value)
        except ValueError:
            raise ConfigError("--resources", f"{part!r} is not key=number") from None
        if out[key] < 0 or (key == "cpu" and out[key] == 0):
            raise ConfigError("--resources", f"{key} must be positive")
    return out


def searcher_for(space: SearchSpace):
    if space.searcher == "optuna" and any(d.type != "grid" for d in space.distributions.values()):
        import optuna
        from optuna.samplers import TPESampler
        from ray.tune.search.optuna import OptunaSearch

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # not one line per study and trial
        return OptunaSearch(sampler=TPESampler(seed=space.seed))
    return None  # random / grid: Tune's basic variant generator


def scheduler_for(space: SearchSpace, max_t: int):
    if space.scheduler is None:
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(time_attr="round",
                         max_t=max(max_t, space.scheduler.grace_period), grace_period=space.scheduler.grace_period,
                         reduction_factor=space.scheduler.reduction_factor)


# ---- the sweep ---------------------------------------------------------------------------------

def run_sweep(space: SearchSpace, *, overrides: list[str] | None = None, smoke: bool = False,
              resume: bool = False, address: str | None = None, resources: dict[str, float] | None = None,
              name: str | None = None, storage: str | Path = "ray_results", num_samples: int | None = None,
              trainable: Callable | None = None, progress: Callable[[str], None] | None = print,
              parent_tags: dict[str, str] | None = None, setup_extra: dict[str, Any] | None = None,
              pipeline_run_id: str | None = None, extra_params: dict[str, Any] | None = None,
              extra_metrics: tuple[str, ...] = (), label_prefix: str | None = None, label_suffix: str = "",
              run_name: str | None = None, description: str | None = None,
              steered: tuple[str, ...] = ()) -> SweepResult:
    """Run (or resume) one sweep; see the module docstring.

    ``trainable(config, setup)`` defaults to :func:`federated_trainable`; ``setup_extra`` is merged
    into the constants it receives. ``pipeline_run_id`` nests this sweep's MLflow run under a
    pipeline's run (trials are then grandchildren). ``label_prefix`` starts every trial's name
    (default: the method's name), ``label_suffix`` ends it. ``run_name`` names the sweep's MLflow
    run (default ``name``, which also names its Ray experiment folder); ``description`` says what
    it is for (default: the space's description), followed by what it searches. ``steered``: base
    config keys the trainable sets itself (e.g. the λ path's λ and rounds), left out of the sweep's
    ``base.*`` params so every param is one the trials ran.
    """
    from ray import tune

    raw = base_config(space, overrides, smoke=smoke)
    check_space(space, raw, extra_metrics)  # before Ray starts: the space, the data, the store
    base_cfg = resolve(raw)
    if base_cfg.tracking.enabled:
        check_store()
    data = load_federated(base_cfg.data, base_cfg.seed)  # unreadable data fails here; the partition is cached
    check_model_on(base_cfg, data)  # your model's buffers, output shape and head, on one batch
    # a method's population-bound server state (FPFC's pairs) must fit a trial; its device is not
    # touched here (here=False: a CUDA device's total, no context in the driver)
    check_server_memory(base_cfg, len(data.clients), config_model_size(base_cfg, data.input_shape, data.num_classes),
                        here=False)
    del data
    on_cluster = bool(address or os.environ.get("RAY_ADDRESS"))
    shipped = worker_runtime_env([base_cfg], ship_data=on_cluster)  # plugin files, model files, data sets
    res = {"cpu": space.resources.cpu, "gpu": space.resources.gpu}
    res.update(resources or {})
    samples = num_samples or (space.smoke_samples if smoke else space.num_samples)
    expected = expected_trials(space, samples)
    name = name or (Path(space.path).stem + ("-smoke" if smoke else ""))
    storage = Path(storage).resolve()
    exp_path = storage / name
    state_path = exp_path / STATE_FILE
    prefix = base_cfg.method.name if label_prefix is None else label_prefix
    searched = list(space.distributions)

    def label(config_or_trial) -> str:
        config = getattr(config_or_trial, "config", config_or_trial) or {}
        return trial_label({k: config[k] for k in searched if k in config}, prefix, label_suffix)

    where = init_ray(address, runtime_env=shipped.runtime_env)
    if progress:
        progress(f"Ray: {where}; experiment {exp_path}")
        for note in shipped.notes:
            progress(f"note: {note}")

    def bind(setup: dict[str, Any]):
        fn = tune.with_parameters(trainable or federated_trainable, setup=setup)
        fed = base_cfg.federation
        return tune.with_resources(fn, lambda config: tune.PlacementGroupFactory(trial_bundles(
            replace(fed, workers=int(config.get("federation.workers", fed.workers))), res["cpu"], res["gpu"])))

    resuming = resume and tune.Tuner.can_restore(str(exp_path))
    previous_wall = float(json.loads(state_path.read_text()).get("wall_s", 0.0)) if resuming else 0.0
    callbacks = [MlflowStatusCallback()]
    if progress:
        callbacks.append(ProgressLines(progress, label, space.metric))
    run_config = tune.RunConfig(name=name, storage_path=str(storage), verbose=0, callbacks=callbacks,
                                failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
                                checkpoint_config=tune.CheckpointConfig(num_to_keep=2))
    parent: Tracker
    if resuming:
        state = json.loads(state_path.read_text())
        parent = Tracker.resume(state["parent_run_id"]) if state.get("parent_run_id") else Tracker.disabled()
        # trials that failed because the tracking store was gone run again from their checkpoints
        # (in their MLflow runs); Tune resumes errored trials all or none, so a trial that failed
        # for another reason (a diverged loss) then runs again from its checkpoint and fails alike
        tuner = tune.Tuner.restore(str(exp_path), trainable=bind(state["setup"]), resume_unfinished=True,
                                   resume_errored=bool(state.get("store_lost")), restart_errored=False)
        if progress:
            progress(f"resuming {exp_path} (parent MLflow run {parent.run_id}; {previous_wall:.0f} s so far)")
    else:
        if resume and progress:
            progress(f"nothing to resume at {exp_path}; starting a new sweep")
        parent = _open_parent(space, base_cfg, raw, run_name or name, samples, expected, smoke, pipeline_run_id,
                              parent_tags, extra_params, description, steered)
        setup = {**(setup_extra or {}), "base": raw, "parent_run_id": parent.run_id, "env": export_environment(),
                 "experiment": base_cfg.tracking.experiment, "cpus": res["cpu"],
                 "checkpoint_every": space.checkpoint_every}
        exp_path.mkdir(parents=True, exist_ok=True)
        state_path.write_text(json.dumps({"parent_run_id": parent.run_id, "space": space.path, "setup": setup}))
        tuner = tune.Tuner(
            bind(setup),
            param_space={k: d.to_tune() for k, d in space.distributions.items()},
            tune_config=tune.TuneConfig(
                metric=space.metric, mode=space.mode, num_samples=samples if space.searcher != "grid" else 1,
                search_alg=searcher_for(space), scheduler=scheduler_for(space, base_cfg.federation.rounds),
                max_concurrent_trials=space.max_concurrent or None, trial_name_creator=label),
            run_config=run_config,
        )
    grid, received, wall = fit_tuner(tuner, previous_wall)
    state = json.loads(state_path.read_text())
    state_path.write_text(json.dumps({**state, "wall_s": wall}))
    table = (results_table(saved_trials(exp_path), searched, label, parent.run_id) if grid is not None
             else pd.DataFrame())
    result = _finish(space, table, searched, parent, exp_path, run_name or name, wall, expected,
                     interrupted=grid is None or bool(received), signals=received)
    lost = bool(result.reason) or any("TrackingStoreError" in r for r in result.failures.values())
    state_path.write_text(json.dumps({**json.loads(state_path.read_text()), "store_lost": lost}))
    return result


def _open_parent(space: SearchSpace, base_cfg, raw: dict, name: str, samples: int, expected: int, smoke: bool,
                 pipeline_run_id: str | None, parent_tags: dict[str, str] | None,
                 extra_params: dict[str, Any] | None, description: str | None = None,
                 steered: tuple[str, ...] = ()) -> Tracker:
    """A new sweep's MLflow parent run: what it searches as its description, the space and the base
    config as params (a searched or steered key's base value is not what the trials ran: left out)."""
    about = (description or space.description or "").strip()
    note = (f"{about.rstrip('.')}. " if about else "") + (
        f"Searches {describe_search(space)}: {expected} trial{'s' * (expected != 1)}, metric {space.metric} "
        f"({space.mode}); "
        f"space file {space.path}.")
    parent = (Tracker.start(base_cfg.tracking.experiment, run_name=name, sweep=True,
                            parent_run_id=pipeline_run_id,
                            tags={"pfl.kind": "sweep", "pfl.space": space.path, "mlflow.note.content": note,
                                  **(parent_tags or {})})
              if base_cfg.tracking.enabled else Tracker.disabled())
    hidden = set(space.distributions) | set(steered)
    parent.log_params({"space": space.path, "metric": space.metric, "mode": space.mode,
                       "num_samples": samples, "searcher": space.searcher, "smoke": smoke,
                       **{f"search.{k}": json.dumps(vars(v)) for k, v in space.distributions.items()},
                       **{f"base.{k}": v for k, v in flatten(raw).items() if k not in hidden},
                       **(extra_params or {})})
    return parent


def fit_tuner(tuner, previous_wall: float) -> tuple[Any, list[int], float]:
    """Run the trials; SIGTERM stops them like Ctrl-C (Tune saves its state and ends the trials).
    Returns Tune's result grid (None when a second interrupt cut the saving short), the signals
    received, and the sweep's wall time so far."""
    # Tune's own interrupt advice names its Python API; ours (printed by the pipelines) is a command
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0: no status boxes, no TensorBoard hint
    for logger in ("ray.tune.tune", "ray.tune.execution.tune_controller"):
        logging.getLogger(logger).addFilter(_DropTuneNoise())
    started = time.perf_counter()
    received: list[int] = []
    previous_term = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        received.append(signum)
        signal.raise_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        grid = tuner.fit()
    except KeyboardInterrupt:  # a second Ctrl-C: Tune gave up saving
        received.append(signal.SIGINT)
        grid = None
    finally:
        signal.signal(signal.SIGTERM, previous_term)
    return grid, received, previous_wall + time.perf_counter() - started


def _finish(space: SearchSpace, table: pd.DataFrame, searched: list[str], parent: Tracker, exp_path: Path,
            name: str, wall: float, expected: int, interrupted: bool, signals: list[int]) -> SweepResult:
    """The sweep's outcome from its trial table; logged on (and ending) the parent run."""
    finished = int((table["status"] == "OK").sum()) if len(table) else 0
    failed_rows = table[table["status"] == "FAILED"] if len(table) else table
    failures = {str(r["trial"]): str(r["error"]) for _, r in failed_rows.iterrows()}
    lost = parent.enabled and (any("TrackingStoreError" in r for r in failures.values())
                               or store_lost(tracking_uri()))
    complete = not interrupted and not lost and finished + len(failures) >= expected
    best_config: dict[str, Any] = {}
    best_metrics: dict[str, float] = {}
    if complete:
        ok = table[table["status"] == "OK"]
        status = "FINISHED" if len(ok) else "FAILED"
        if len(ok) and space.metric in ok:
            best_row = ok.sort_values(space.metric, ascending=space.mode == "min").iloc[0]
            best_config = {k: _plain(best_row[k]) for k in searched}
            best_metrics = {k: float(best_row[k]) for k in ok.columns
                            if "/" in k and pd.notna(best_row[k]) and isinstance(best_row[k], (int, float))}
    else:
        status = "INTERRUPTED"
    exit_code = {"FINISHED": 0, "FAILED": 1}.get(status, 143 if signal.SIGTERM in signals else 130)
    reason = ""
    if lost and not signals:
        reason, exit_code = f"the MLflow tracking store stopped answering ({tracking_uri()})", 1
    try:
        if parent.enabled and not lost:
            _close_parent(parent, table, exp_path, space, name, expected, finished, failures, wall,
                          best_config, best_metrics, status)
    except TrackingStoreError as err:  # gone while the summary was written: resume writes it again
        reason, exit_code, status = f"{err}", 1, "INTERRUPTED"
    return SweepResult(table, best_config, best_metrics, parent.run_id, str(exp_path), wall, status=status,
                       exit_code=exit_code, failures=failures, expected_trials=expected, reason=reason)


def _close_parent(parent: Tracker, table: pd.DataFrame, out: Path, space: SearchSpace, name: str, expected: int,
                  finished: int, failures: dict[str, str], wall: float, best_config: dict[str, Any],
                  best_metrics: dict[str, float], status: str) -> None:
    """The sweep's summary on its MLflow parent run, and the run's end."""
    if len(table):
        log_table(parent, table, out, space.metric, f"{name}: {space.metric} of every trial", space.mode,
                  list(space.distributions))
    parent.log_metrics({"sweep/trials": float(len(table)), "sweep/expected_trials": float(expected),
                        "sweep/finished": float(finished), "sweep/failed": float(len(failures)),
                        "sweep/wall_s": wall})
    if best_config:
        # params cannot change, and a sweep is complete only once: tags hold the same best
        parent.log_params({f"best.{k}": v for k, v in best_config.items()})
        parent.set_tags({f"best.{k}": v for k, v in best_config.items()})
        # the best trial's metrics under the trials' own names: one column of the runs table
        # compares the sweep with its trials (and a pipeline's run with its sweeps)
        parent.log_metrics(best_metrics)
        ok = table[table["status"] == "OK"]
        best = ok.sort_values(space.metric, ascending=space.mode == "min").iloc[0]
        parent.set_tags({"pfl.best_trial": str(best["trial"]), "pfl.best_run_id": str(best["mlflow_run_id"])})
    parent.set_tags({"pfl.status": status.lower()})
    if status == "INTERRUPTED":
        kill_unfinished_children(parent.run_id)
    parent.end({"FINISHED": "FINISHED", "FAILED": "FAILED"}.get(status, "KILLED"))


class _DropTuneNoise(logging.Filter):
    """Tune's own interrupt advice (a Python call; ours is a command) and a failed trial's raw
    traceback (coloured, with process ids; our progress line gives the reason in one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("has been interrupted" in text or text.startswith(("Trial task failed for trial",
                                                                      "Trials did not complete")))


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


__all__ = ["STATE_FILE", "SweepResult", "fit_tuner", "parse_resources", "run_sweep", "scheduler_for", "searcher_for"]
