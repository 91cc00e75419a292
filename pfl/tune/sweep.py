"""Driver of a sweep: Ray + Tune + Optuna + ASHA, an MLflow parent run, a results table.

``run_sweep`` validates the space (before Ray starts), creates the MLflow parent run, runs the
trials (each a child run), and logs the trial table (Parquet) and the best config on the parent.
A sweep's Ray experiment lives in ``<storage>/<name>``; ``resume=True`` restores it with
``Tuner.restore`` so finished trials are kept and unfinished ones continue from their checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from ..schema import ConfigError
from ..tracking import Tracker, client, export_environment
from .space import SearchSpace, base_config, check_space, grid_size

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


def init_ray(address: str | None = None, num_cpus: int | None = None) -> str:
    """Connect to ``address``/``$RAY_ADDRESS``, else start a local instance. Returns a description."""
    import ray

    if ray.is_initialized():
        return "already initialised"
    env = export_environment()
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = dict(runtime_env={"env_vars": env}, log_to_driver=False, configure_logging=False)
    if address:
        try:
            ray.init(address=address, **kwargs)
        except Exception as err:
            # Ray >= 2.59 clusters started with `ray start` require token authentication; a driver
            # on the head machine finds the token in ~/.ray/auth_token once token mode is on.
            token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
            if "uthenticat" not in str(err) or os.environ.get("RAY_AUTH_MODE") == "token":
                raise RuntimeError(f"cannot connect to the Ray cluster at {address}: {err}. With token "
                                   "authentication set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or "
                                   "RAY_AUTH_TOKEN_PATH) to the cluster's token (`ray get-auth-token`).") from err
            if not (os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file()):
                raise
            log.info("cluster requires token authentication; retrying with RAY_AUTH_MODE=token")
            os.environ["RAY_AUTH_MODE"] = "token"
            ray.shutdown()
            ray.init(address=address, **kwargs)
        return f"cluster at {address}"
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, **kwargs)
    return f"local Ray instance ({ray.cluster_resources().get('CPU', 0):.0f} CPUs)"


def searcher_for(space: SearchSpace):
    if space.searcher == "optuna" and any(d.type != "grid" for d in space.distributions.values()):
        from optuna.samplers import TPESampler
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(sampler=TPESampler(seed=space.seed))
    return None  # random / grid: Tune's basic variant generator


def scheduler_for(space: SearchSpace, max_t: int):
    if space.scheduler is None:
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(time_attr="round",
                         max_t=max(max_t, space.scheduler.grace_period), grace_period=space.scheduler.grace_period,
                         reduction_factor=space.scheduler.reduction_factor)


class MlflowStatusCallback:
    """Ends the MLflow run of trials that Tune stopped or that errored (the trial may not get to)."""

    def __new__(cls, *args, **kwargs):
        from ray.tune import Callback

        class _Callback(Callback):
            def on_trial_complete(self, iteration, trials, trial, **info):
                _end_run(trial, "FINISHED", None)

            def on_trial_error(self, iteration, trials, trial, **info):
                reason = None
                error_file = getattr(trial, "error_file", None) or ""
                if error_file and Path(error_file).is_file():
                    reason = Path(error_file).read_text()[-2000:]
                _end_run(trial, "FAILED", reason)

        return _Callback()


def _end_run(trial, status: str, reason: str | None) -> None:
    run_id = (trial.last_result or {}).get("mlflow_run_id")
    if not run_id:
        return
    try:
        mc = client()
        run = mc.get_run(run_id)
        if run.info.status == "RUNNING":
            if reason:
                mc.set_tag(run_id, "pfl.failure", reason)
            mc.set_terminated(run_id, status=status)
    except Exception as err:  # tracking must never take the sweep down
        log.warning("could not close MLflow run %s: %s", run_id, err)


@dataclass
class SweepResult:
    table: pd.DataFrame
    best_config: dict[str, Any]
    best_metrics: dict[str, float]
    parent_run_id: str | None
    experiment_path: str
    wall_s: float


def results_table(result_grid, metric: str, searched: list[str]) -> pd.DataFrame:
    rows = []
    for result in result_grid:
        cfg = result.config or {}
        m = result.metrics or {}
        row = {"trial": m.get("trial_id", ""), "status": "ERROR" if result.error else "OK"}
        for key in searched:
            row[key] = cfg.get(key)
        for key, value in m.items():  # every reported metric (names with a '/', plus the round)
            if ("/" in key and not key.startswith("config/") and isinstance(value, (int, float))) \
                    or key == "round":
                row[key] = value
        row["mlflow_run_id"] = m.get("mlflow_run_id", "")
        row["error"] = str(result.error).splitlines()[0][:200] if result.error else ""
        rows.append(row)
    return pd.DataFrame(rows)


def run_sweep(space: SearchSpace, *, overrides: list[str] | None = None, smoke: bool = False,
              resume: bool = False, address: str | None = None, resources: dict[str, float] | None = None,
              name: str | None = None, storage: str | Path = "ray_results", num_samples: int | None = None,
              trainable: Callable | None = None, progress: Callable[[str], None] | None = print,
              parent_tags: dict[str, str] | None = None, setup_extra: dict[str, Any] | None = None,
              pipeline_run_id: str | None = None, extra_params: dict[str, Any] | None = None) -> SweepResult:
    """Run (or resume) one sweep; see the module docstring.

    ``trainable(config, setup)`` defaults to :func:`federated_trainable`; ``setup_extra`` is merged
    into the constants it receives. ``pipeline_run_id`` nests this sweep's MLflow run under a
    pipeline's run (trials are then grandchildren).
    """
    from ray import tune

    from .trainable import federated_trainable

    raw = base_config(space, overrides, smoke=smoke)
    check_space(space, raw)  # before Ray starts
    res = {"cpu": space.resources.cpu, "gpu": space.resources.gpu}
    res.update(resources or {})
    samples = num_samples or (space.smoke_samples if smoke else space.num_samples)
    name = name or (Path(space.path).stem + ("-smoke" if smoke else ""))
    storage = Path(storage).resolve()
    exp_path = storage / name
    state_path = exp_path / STATE_FILE
    started = time.perf_counter()

    where = init_ray(address)
    if progress:
        progress(f"Ray: {where}; experiment {exp_path}")
    def bind(setup: dict[str, Any]):
        fn = tune.with_parameters(trainable or federated_trainable, setup=setup)
        return tune.with_resources(fn, {"cpu": res["cpu"], "gpu": res["gpu"]})

    parent: Tracker
    if resume and tune.Tuner.can_restore(str(exp_path)):
        state = json.loads(state_path.read_text())
        parent = Tracker.resume(state["parent_run_id"]) if state.get("parent_run_id") else Tracker.disabled()
        tuner = tune.Tuner.restore(str(exp_path), trainable=bind(state["setup"]), resume_unfinished=True,
                                   resume_errored=False, restart_errored=False)
        if progress:
            progress(f"resuming {exp_path} (parent MLflow run {parent.run_id})")
    else:
        if resume and progress:
            progress(f"nothing to resume at {exp_path}; starting a new sweep")
        from ..config import resolve

        base_cfg = resolve(raw)
        parent = (Tracker.start(base_cfg.tracking.experiment, run_name=name, sweep=True,
                                parent_run_id=pipeline_run_id,
                                tags={"pfl.kind": "sweep", "pfl.space": space.path, **(parent_tags or {})})
                  if base_cfg.tracking.enabled else Tracker.disabled())
        parent.log_params({"space": space.path, "metric": space.metric, "mode": space.mode,
                           "num_samples": samples, "searcher": space.searcher, "smoke": smoke,
                           **{f"search.{k}": json.dumps(vars(v)) for k, v in space.distributions.items()},
                           **{f"base.{k}": v for k, v in _flat(raw).items()}, **(extra_params or {})})
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
                max_concurrent_trials=space.max_concurrent or None),
            run_config=tune.RunConfig(
                name=name, storage_path=str(storage), verbose=1 if progress else 0,
                callbacks=[MlflowStatusCallback()],
                failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
                checkpoint_config=tune.CheckpointConfig(num_to_keep=2)),
        )
    try:
        grid = tuner.fit()
    except KeyboardInterrupt:
        parent.end("KILLED")
        raise
    searched = list(space.distributions)
    table = results_table(grid, space.metric, searched)
    ok = table[table["status"] == "OK"] if len(table) else table
    best_config: dict[str, Any] = {}
    best_metrics: dict[str, float] = {}
    if len(ok) and space.metric in ok:
        best_row = ok.sort_values(space.metric, ascending=space.mode == "min").iloc[0]
        best_config = {k: _plain(best_row[k]) for k in searched}
        best_metrics = {k: float(best_row[k]) for k in ok.columns
                        if "/" in k and pd.notna(best_row[k]) and isinstance(best_row[k], (int, float))}
    wall = time.perf_counter() - started
    if parent.enabled:
        out = exp_path / "trials.parquet"
        table.to_parquet(out)
        parent.log_artifact(out)
        parent.log_params({f"best.{k}": v for k, v in best_config.items()})
        parent.log_metrics({f"best/{k}": v for k, v in best_metrics.items()})
        parent.log_metrics({"sweep/trials": float(len(table)),
                            "sweep/errored": float((table["status"] == "ERROR").sum()) if len(table) else 0.0,
                            "sweep/wall_s": wall})
        parent.end("FINISHED")
    return SweepResult(table, best_config, best_metrics, parent.run_id, str(exp_path), wall)


def _flat(raw: dict) -> dict:
    from ..schema import flatten

    return flatten(raw)


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


__all__ = ["SweepResult", "init_ray", "parse_resources", "run_sweep", "grid_size"]
