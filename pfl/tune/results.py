"""What a sweep records: its result, the trial table and curves on the parent run, why trials
failed, and the status of the trials' MLflow runs (Tune may stop a trial before it closes its run)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from ..tracking import Tracker, client
from ..tracking_store import TrackingStoreError
from .ray_session import ANSI
from .space import SearchSpace, grid_size
from .trainable import existing_run

log = logging.getLogger(__name__)


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
    reason: str = ""                    # why an INTERRUPTED sweep stopped, when not a signal


def saved_trials(exp_path: Path) -> list:
    """The experiment's trials as Tune saved them when the run ended (before its clean-up marks
    every stopped trial TERMINATED, so an interrupted trial still reads PENDING or RUNNING here)."""
    from ray.tune import ExperimentAnalysis

    quiet = logging.getLogger("ray.tune.analysis.experiment_analysis")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # a trial interrupted before its first result has no result file
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


def ranked(table: pd.DataFrame, metric: str, mode: str = "max", searched: list[str] | tuple = ()) -> pd.DataFrame:
    """The trial table best first (finished trials by ``metric``, then the others), with the trial,
    the metric and the searched hyperparameters as its first columns."""
    if metric not in table:
        return table
    done = table["status"] == "OK" if "status" in table else pd.Series(True, index=table.index)
    order = table.assign(_unfinished=~done).sort_values(["_unfinished", metric], ascending=[True, mode == "min"],
                                                        na_position="last", kind="stable")
    first = [c for c in ["trial", metric, *searched, "status"] if c in table]
    return order[first + [c for c in table.columns if c not in first]].reset_index(drop=True)


def display_value(value: Any) -> Any:
    """A number as a person reads it: whole numbers without decimals, large ones rounded to the unit,
    the rest to 4 significant digits (the Parquet table keeps full precision)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return value
    if float(value).is_integer() or abs(value) >= 1000:
        return int(round(value))
    return float(f"{value:.4g}")


def log_table(parent: Tracker, table: pd.DataFrame, out: Path, metric: str, title: str, mode: str = "max",
              searched: list[str] | tuple = ()) -> None:
    """The trial table, best first, as Parquet (full precision), CSV and HTML (rounded, previewable
    in MLflow), and every trial's curve in one plot: legend in the table's order, the best marked."""
    from ..plots import plot_curves  # matplotlib only when a sweep logs its table

    table = ranked(table, metric, mode, searched)
    table.to_parquet(out / "trials.parquet")
    shown = table.map(display_value)
    shown.to_csv(out / "trials.csv", index=False)
    (out / "trials.html").write_text(shown.drop(columns=["mlflow_run_id"], errors="ignore").to_html(index=False))
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
        done = table[table["status"] == "OK"] if "status" in table else table
        best = str(done.iloc[0]["trial"]) if len(done) and str(done.iloc[0]["trial"]) in curves else None
        parent.log_artifact(plot_curves(curves, out / f"trials_{safe}.png", ylabel=metric, title=title, best=best),
                            "plots")


def expected_trials(space: SearchSpace, samples: int) -> int:
    return samples * grid_size(space) if space.searcher != "grid" else grid_size(space)


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
    try:
        return existing_run(trial_id, parent_run_id)
    except Exception:
        return None


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
    except TrackingStoreError:  # the trial's failed: line says so; --resume closes the run
        pass
    except Exception as err:  # tracking must never take the sweep down
        log.warning("could not close MLflow run %s: %s", run_id, err)


def kill_unfinished_children(parent_run_id: str | None) -> None:
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


__all__ = ["MlflowStatusCallback", "SweepResult", "display_value", "failure_reason", "kill_unfinished_children",
           "log_table", "ranked", "results_table", "saved_trials", "expected_trials"]
