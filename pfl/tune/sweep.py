"""Driver of a sweep: Ray + Tune + Optuna + ASHA, an MLflow parent run, a results table.

``run_sweep`` validates the space, the data and the MLflow store (before Ray starts), creates the
MLflow parent run, runs the trials (each a child run named by what it tries), and logs on the
parent the trial table (CSV, HTML, Parquet), a plot of every trial's curve and, for a complete
sweep, the best config and its metrics. A sweep's Ray experiment lives in ``<storage>/<name>``;
``resume=True`` restores it with ``Tuner.restore`` so finished trials are kept and unfinished ones
continue from their checkpoints, and the parent's summary then describes the whole sweep.

How a sweep ends (``SweepResult.status``): ``FINISHED`` (every trial ran; some may have failed),
``FAILED`` (every trial failed; each reason is in ``failures``) or ``INTERRUPTED`` (SIGINT or
SIGTERM: Tune stops the trials and saves its state; the parent and the unfinished trials' runs are
marked KILLED and no best is logged; ``exit_code`` is 130 or 143).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from ..schema import ConfigError
from ..tracking import Tracker, check_store, client, export_environment
from .space import SearchSpace, base_config, check_space, grid_size

log = logging.getLogger(__name__)

STATE_FILE = "pfl_sweep.json"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


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


# ---- Ray ---------------------------------------------------------------------------------------

def _messages(err: BaseException) -> str:
    """The messages of an exception and of everything it was raised from."""
    parts, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        parts.append(str(err))
        err = err.__cause__ or err.__context__
    return " | ".join(parts)


def check_address(address: str, timeout: float = 5.0) -> None:
    """Refuse ``ray://`` and fail fast when nothing listens at HOST:PORT."""
    if address.startswith("ray://"):
        raise ConfigError("--address", f"{address}: Ray Client (ray://) addresses are not supported: a sweep's "
                                       "Tune driver must run on the cluster (its trials report to it for hours "
                                       "and checkpoints live in its storage). Run the pipeline on the head node "
                                       "with RAY_ADDRESS=HOST:6379 (or --address HOST:6379), or submit it with "
                                       "`ray job submit -- python pipelines/...`.")
    if address in ("auto", "local"):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("--address", f"{address!r} is not HOST:PORT (e.g. 127.0.0.1:6379)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as err:
        raise ConfigError("--address", f"no Ray cluster answers at {address} ({err}); start one with "
                                       "`ray start --head --port=PORT` or fix --address / RAY_ADDRESS") from None


def _stay_on_loopback() -> None:
    """Keep this process's Ray node address at 127.0.0.1 (what RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    does for `ray start`): Ray otherwise advertises the machine's network address."""
    try:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError) as err:  # another Ray version: it binds as it likes
        log.debug("could not keep Ray on the loopback interface: %s", err)


def _reload_auth_settings() -> None:
    """Make this process see a changed RAY_AUTH_MODE: Ray caches its config and token at first use."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError) as err:  # another Ray version: the environment may suffice
        log.debug("could not reload Ray's auth settings: %s", err)


def init_ray(address: str | None = None, num_cpus: int | None = None,
             runtime_env: dict[str, Any] | None = None) -> str:
    """Connect to ``address``/``$RAY_ADDRESS``, else start a local instance on 127.0.0.1.
    ``runtime_env`` (pfl.tune.runtime_env) adds what the workers need. Returns a description."""
    import ray

    if ray.is_initialized():
        return "already initialised"
    env = export_environment()
    address = address or os.environ.get("RAY_ADDRESS")
    job_env = dict(runtime_env or {})
    job_env["env_vars"] = {**env, **job_env.get("env_vars", {})}
    kwargs: dict[str, Any] = dict(runtime_env=job_env, log_to_driver=False, configure_logging=False)
    if address:
        check_address(address)
        if address.rpartition(":")[0] in ("127.0.0.1", "localhost", "::1"):
            _stay_on_loopback()  # else Ray swaps 127.0.0.1 for the machine's address and misses the head
        token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
        if "RAY_AUTH_MODE" not in os.environ and (os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file()):
            # a token is at hand: present it (a cluster without authentication ignores it), rather
            # than wait ~20 s for a token-protected head to refuse the connection
            os.environ["RAY_AUTH_MODE"] = "token"
            _reload_auth_settings()
        try:
            ray.init(address=address, **kwargs)
        except Exception as err:
            # a cluster started with token authentication refuses a driver without the token; on the
            # head machine the token is in ~/.ray/auth_token (or $RAY_AUTH_TOKEN[_PATH])
            text = _messages(err)
            has_token = bool(os.environ.get("RAY_AUTH_TOKEN")) or token_file.is_file()
            if "uthenticat" not in text and "token" not in text.lower() \
                    or os.environ.get("RAY_AUTH_MODE") == "token" or not has_token:
                raise ConfigError("--address", f"cannot connect to the Ray cluster at {address}: "
                                               f"{ANSI.sub('', text)[:500]}. With token authentication set "
                                               "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) "
                                               "to the cluster's token (`ray get-auth-token`).") from None
            log.info("cluster requires token authentication; retrying with RAY_AUTH_MODE=token")
            os.environ["RAY_AUTH_MODE"] = "token"
            ray.shutdown()
            _reload_auth_settings()
            ray.init(address=address, **kwargs)
        return f"cluster at {address}"
    _stay_on_loopback()  # a single-machine instance listens on the loopback interface only
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if "RAY_AUTH_MODE" not in os.environ and (os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file()):
        # Ray would do the same with the token it finds, and print a notice saying so
        os.environ["RAY_AUTH_MODE"] = "token"
        _reload_auth_settings()
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, **kwargs)
    return f"local Ray instance on 127.0.0.1 ({ray.cluster_resources().get('CPU', 0):.0f} CPUs)"


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


# ---- trial labels and progress ----------------------------------------------------------------

def _short(value: Any) -> str:
    if isinstance(value, str):  # YAML reads 1.0e12 (no exponent sign) as a string; the config as a number
        try:
            value = float(value)
        except ValueError:
            return value
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def trial_label(searched: dict[str, Any], prefix: str = "") -> str:
    """``fedprox mu=0.043 lr=0.05``: the last part of each searched key (more where two would
    collide) with its value."""
    keys = list(searched)
    tails = {k: k.rsplit(".", 1)[-1] for k in keys}
    for k in keys:
        if sum(t == tails[k] for t in tails.values()) > 1:
            tails[k] = k
    parts = [f"{tails[k]}={_short(searched[k])}" for k in keys]
    return " ".join(p for p in [prefix, *parts] if p)


def failure_reason(trial_run: str | None, error: Any) -> str:
    """A failed trial's reason in one line: the MLflow run's ``pfl.failure`` tag, else the last
    exception line of Ray's error without colour codes, process ids and module paths."""
    if trial_run:
        try:
            tag = client().get_run(trial_run).data.tags.get("pfl.failure")
            if tag:
                return tag
        except Exception:  # the run may not exist (a trial that failed before its first round)
            pass
    text = ANSI.sub("", str(error or "")).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    found = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*:", ln)]
    line = found[-1] if found else (lines[-1] if lines else "unknown error")
    line = re.sub(r"\(pid=\d+[^)]*\)", "", line).strip()
    line = re.sub(r"^(?:[A-Za-z_]\w*\.)+(\w+:)", r"\1", line)          # pfl.x.y.SomeError: -> SomeError:
    line = re.sub(r"^DivergedError: ", "", line)                          # its message says it all
    return line[:300]


def _trial_run(trial_id: str, parent_run_id: str | None) -> str | None:
    """The MLflow run of a trial that failed before it reported (its id is not in Tune's results)."""
    if not parent_run_id:
        return None
    from .trainable import existing_run

    try:
        return existing_run(trial_id, parent_run_id)
    except Exception:
        return None


class ProgressLines:
    """A Tune callback that prints one short line per trial event instead of Tune's status table:
    a trial's start, its evaluations (at most one line per ``every`` seconds per trial, and always
    at a λ-path stage or playoff end), and its end."""

    def __new__(cls, write: Callable[[str], None], label: Callable[[Any], str], metric: str, every: float = 20.0):
        from ray.tune import Callback

        class _Progress(Callback):
            def __init__(self):
                self.setup()

            def setup(self, **info):  # also on resume (Tune restores this object from its state)
                self.last: dict[str, float] = {}
                self.started = time.perf_counter()

            def _line(self, trial, text: str) -> None:
                stamp = time.perf_counter() - self.started
                write(f"[{stamp:6.0f} s] {label(trial)}: {text}")

            def on_trial_start(self, iteration, trials, trial, **info):
                self._line(trial, "started")

            def on_trial_result(self, iteration, trials, trial, result, **info):
                event = "stage/lambda" in result or "playoff/lambda" in result
                now = time.perf_counter()
                if not event and now - self.last.get(trial.trial_id, -1e9) < every:
                    return
                self.last[trial.trial_id] = now
                parts = [f"round {int(result.get('round', 0))}"]
                for key, name in ((metric, metric), ("test/acc_mean", "test acc"), ("cluster/num", "clusters")):
                    if key in result and (key != "test/acc_mean" or metric != key):
                        value = result[key]
                        parts.append(f"{name} {int(value)}" if key == "cluster/num" else f"{name} {value:.4f}")
                for kind in ("stage", "playoff"):
                    if f"{kind}/lambda" in result:
                        parts.append(f"{kind} λ={result[f'{kind}/lambda']:g} ended (val {result.get(f'{kind}/val_acc', float('nan')):.4f})")
                self._line(trial, " | ".join(parts))

            def on_trial_complete(self, iteration, trials, trial, **info):
                value = (trial.last_result or {}).get(metric)
                self._line(trial, "finished" + (f" ({metric} {value:.4f})" if isinstance(value, float) else ""))

            def on_trial_error(self, iteration, trials, trial, **info):
                error_file = Path(getattr(trial, "error_file", "") or "")
                text = error_file.read_text() if error_file.is_file() else ""
                self._line(trial, f"failed: {failure_reason(None, text)}")

        return _Progress()


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
                    reason = failure_reason(None, Path(error_file).read_text())
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
            if reason and "pfl.failure" not in run.data.tags:
                mc.set_tag(run_id, "pfl.failure", reason)
            mc.set_terminated(run_id, status=status)
    except Exception as err:  # tracking must never take the sweep down
        log.warning("could not close MLflow run %s: %s", run_id, err)


# ---- results -----------------------------------------------------------------------------------

@dataclass
class SweepResult:
    table: pd.DataFrame
    best_config: dict[str, Any]
    best_metrics: dict[str, float]
    parent_run_id: str | None
    experiment_path: str
    wall_s: float
    status: str = "FINISHED"            # FINISHED, FAILED or INTERRUPTED
    exit_code: int = 0
    failures: dict[str, str] = field(default_factory=dict)   # trial label -> reason
    expected_trials: int = 0


def saved_trials(exp_path: Path) -> list:
    """The experiment's trials as Tune saved them when the run ended (before its clean-up marks
    every stopped trial TERMINATED, so an interrupted trial still reads PENDING or RUNNING here)."""
    import logging as _logging

    from ray.tune import ExperimentAnalysis

    quiet = _logging.getLogger("ray.tune.analysis.experiment_analysis")
    level = quiet.level
    quiet.setLevel(_logging.ERROR)  # a trial interrupted before its first result has no result file
    try:
        return list(ExperimentAnalysis(str(exp_path)).trials)
    finally:
        quiet.setLevel(level)


def results_table(trials: list, searched: list[str], label: Callable[[dict], str],
                  parent_run_id: str | None = None) -> pd.DataFrame:
    rows = []
    for trial in trials:
        cfg = trial.config or {}
        m = trial.last_result or {}
        status = str(trial.status)
        row = {"trial": label(cfg), "status": {"TERMINATED": "OK", "ERROR": "FAILED"}.get(status, "UNFINISHED")}
        for key in searched:
            row[key] = cfg.get(key)
        for key, value in m.items():  # every reported metric (names with a '/', plus the round)
            if ("/" in key and not key.startswith("config/") and isinstance(value, (int, float))) \
                    or key == "round":
                row[key] = value
        row["mlflow_run_id"] = m.get("mlflow_run_id") or _trial_run(trial.trial_id, parent_run_id) or ""
        error = ""
        if status == "ERROR":
            error_file = Path(getattr(trial, "error_file", "") or "")
            error = error_file.read_text() if error_file.is_file() else str(trial.get_error() or "")
        row["error"] = failure_reason(row["mlflow_run_id"], error) if status == "ERROR" else ""
        rows.append(row)
    table = pd.DataFrame(rows)
    for col in table.columns:  # one type per column (Parquet), numbers where the values are numbers
        if table[col].dtype == object and col not in ("trial", "status", "mlflow_run_id", "error"):
            try:
                table[col] = pd.to_numeric(table[col])
            except (ValueError, TypeError):
                table[col] = table[col].astype(str)
    return table


def _log_table(parent: Tracker, table: pd.DataFrame, out: Path, metric: str, title: str) -> None:
    """The trial table as Parquet, CSV and HTML (previewable in MLflow), and every trial's curve."""
    from ..plots import plot_curves

    table.to_parquet(out / "trials.parquet")
    table.to_csv(out / "trials.csv", index=False)
    (out / "trials.html").write_text(table.drop(columns=["mlflow_run_id"], errors="ignore")
                                     .to_html(index=False, float_format=lambda v: f"{v:.4g}"))
    for name in ("trials.parquet", "trials.csv", "trials.html"):
        parent.log_artifact(out / name)
    curves = {}
    mc = client() if parent.enabled else None
    for _, row in table.iterrows():
        if mc is None or not row.get("mlflow_run_id"):
            continue
        try:
            history = sorted(mc.get_metric_history(row["mlflow_run_id"], metric), key=lambda m: m.step)
        except Exception:
            continue
        if history:
            curves[str(row["trial"])] = ([m.step for m in history], [m.value for m in history])
    if curves:
        safe = metric.replace("/", "_")
        parent.log_artifact(plot_curves(curves, out / f"trials_{safe}.png", ylabel=metric, title=title), "plots")


def _expected_trials(space: SearchSpace, samples: int) -> int:
    return samples * grid_size(space) if space.searcher != "grid" else grid_size(space)


# ---- the sweep ---------------------------------------------------------------------------------

def run_sweep(space: SearchSpace, *, overrides: list[str] | None = None, smoke: bool = False,
              resume: bool = False, address: str | None = None, resources: dict[str, float] | None = None,
              name: str | None = None, storage: str | Path = "ray_results", num_samples: int | None = None,
              trainable: Callable | None = None, progress: Callable[[str], None] | None = print,
              parent_tags: dict[str, str] | None = None, setup_extra: dict[str, Any] | None = None,
              pipeline_run_id: str | None = None, extra_params: dict[str, Any] | None = None,
              extra_metrics: tuple[str, ...] = (), label_prefix: str | None = None) -> SweepResult:
    """Run (or resume) one sweep; see the module docstring.

    ``trainable(config, setup)`` defaults to :func:`federated_trainable`; ``setup_extra`` is merged
    into the constants it receives. ``pipeline_run_id`` nests this sweep's MLflow run under a
    pipeline's run (trials are then grandchildren). ``label_prefix`` starts every trial's name
    (default: the method's name).
    """
    from ray import tune

    from ..config import resolve
    from ..data import load_federated
    from ..models.custom import check_model_on
    from .runtime_env import worker_runtime_env
    from .trainable import federated_trainable

    raw = base_config(space, overrides, smoke=smoke)
    check_space(space, raw, extra_metrics)  # before Ray starts: the space, the data, the store
    base_cfg = resolve(raw)
    if base_cfg.tracking.enabled:
        check_store()
    data = load_federated(base_cfg.data, base_cfg.seed)  # unreadable data fails here; the partition is cached
    check_model_on(base_cfg, data)  # your model's buffers, output shape and head, on one batch
    del data
    on_cluster = bool(address or os.environ.get("RAY_ADDRESS"))
    shipped = worker_runtime_env([base_cfg], ship_data=on_cluster)  # plugin files, model files, data sets
    res = {"cpu": space.resources.cpu, "gpu": space.resources.gpu}
    res.update(resources or {})
    samples = num_samples or (space.smoke_samples if smoke else space.num_samples)
    expected = _expected_trials(space, samples)
    name = name or (Path(space.path).stem + ("-smoke" if smoke else ""))
    storage = Path(storage).resolve()
    exp_path = storage / name
    state_path = exp_path / STATE_FILE
    prefix = base_cfg.method.name if label_prefix is None else label_prefix
    searched = list(space.distributions)

    def label(config_or_trial) -> str:
        config = getattr(config_or_trial, "config", config_or_trial) or {}
        return trial_label({k: config[k] for k in searched if k in config}, prefix)

    where = init_ray(address, runtime_env=shipped.runtime_env)
    if progress:
        progress(f"Ray: {where}; experiment {exp_path}")
        for note in shipped.notes:
            progress(f"note: {note}")

    def bind(setup: dict[str, Any]):
        fn = tune.with_parameters(trainable or federated_trainable, setup=setup)
        return tune.with_resources(fn, {"cpu": res["cpu"], "gpu": res["gpu"]})

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
        tuner = tune.Tuner.restore(str(exp_path), trainable=bind(state["setup"]), resume_unfinished=True,
                                   resume_errored=False, restart_errored=False)
        if progress:
            progress(f"resuming {exp_path} (parent MLflow run {parent.run_id}; {previous_wall:.0f} s so far)")
    else:
        if resume and progress:
            progress(f"nothing to resume at {exp_path}; starting a new sweep")
        parent = (Tracker.start(base_cfg.tracking.experiment, run_name=name, sweep=True,
                                parent_run_id=pipeline_run_id,
                                tags={"pfl.kind": "sweep", "pfl.space": space.path,
                                      "mlflow.note.content": f"Sweep of {space.path}: {space.description or ''} "
                                                             f"{expected} trials, metric {space.metric} ({space.mode}).",
                                      **(parent_tags or {})})
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
                max_concurrent_trials=space.max_concurrent or None, trial_name_creator=label),
            run_config=run_config,
        )
    # Tune's own interrupt advice names its Python API; ours (printed by the pipelines) is a command
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0: no status boxes, no TensorBoard hint
    for name in ("ray.tune.tune", "ray.tune.execution.tune_controller"):
        logging.getLogger(name).addFilter(_DropTuneNoise())
    started = time.perf_counter()
    received: list[int] = []
    previous_term = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):  # stop like Ctrl-C: Tune saves its state and ends the trials
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
    wall = previous_wall + time.perf_counter() - started
    state = json.loads(state_path.read_text())
    state_path.write_text(json.dumps({**state, "wall_s": wall}))
    table = (results_table(saved_trials(exp_path), searched, label, parent.run_id) if grid is not None
             else pd.DataFrame())
    finished = int((table["status"] == "OK").sum()) if len(table) else 0
    failed_rows = table[table["status"] == "FAILED"] if len(table) else table
    failures = {str(r["trial"]): str(r["error"]) for _, r in failed_rows.iterrows()}
    complete = grid is not None and not received and finished + len(failures) >= expected
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
    exit_code = {"FINISHED": 0, "FAILED": 1}.get(status, 143 if signal.SIGTERM in received else 130)
    if parent.enabled:
        out = exp_path
        if len(table):
            _log_table(parent, table, out, space.metric, f"{name}: {space.metric} of every trial")
        parent.log_metrics({"sweep/trials": float(len(table)), "sweep/expected_trials": float(expected),
                            "sweep/finished": float(finished), "sweep/failed": float(len(failures)),
                            "sweep/wall_s": wall})
        if best_config:
            # params cannot change, and a sweep is complete only once: tags hold the same best
            parent.log_params({f"best.{k}": v for k, v in best_config.items()})
            parent.set_tags({f"best.{k}": v for k, v in best_config.items()})
            parent.log_metrics({f"best/{k}": v for k, v in best_metrics.items()})
        parent.set_tags({"pfl.status": status.lower()})
        if status == "INTERRUPTED":
            _kill_unfinished_children(parent.run_id)
        parent.end({"FINISHED": "FINISHED", "FAILED": "FAILED"}.get(status, "KILLED"))
    return SweepResult(table, best_config, best_metrics, parent.run_id, str(exp_path), wall, status=status,
                       exit_code=exit_code, failures=failures, expected_trials=expected)


class _DropTuneNoise(logging.Filter):
    """Tune's own interrupt advice (a Python call; ours is a command) and a failed trial's raw
    traceback (coloured, with process ids; our progress line gives the reason in one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("has been interrupted" in text or text.startswith(("Trial task failed for trial",
                                                                      "Trials did not complete")))


def _kill_unfinished_children(parent_run_id: str | None) -> None:
    """Trials cut off by an interrupt: their MLflow runs end as KILLED (a resume reopens them)."""
    if not parent_run_id:
        return
    mc = client()
    parent = mc.get_run(parent_run_id)
    for run in mc.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}' and "
                                            "attributes.status = 'RUNNING'"):
        mc.set_tag(run.info.run_id, "pfl.failure", "interrupted (the sweep was stopped; --resume continues it)")
        mc.set_terminated(run.info.run_id, status="KILLED")


def _flat(raw: dict) -> dict:
    from ..schema import flatten

    return flatten(raw)


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


__all__ = ["SweepResult", "failure_reason", "init_ray", "parse_resources", "run_sweep", "trial_label"]
