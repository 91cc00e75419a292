"""Any registered method's federated run as a Ray Tune function trainable.

The trial's Tune config holds only the searched dotted values; the constants every trial shares
come through ``tune.with_parameters`` as ``setup``: the base experiment config (``base``, a raw
dict), the MLflow parent run (``parent_run_id``, ``experiment``), the tracking environment
(``env``), the trial's CPU count (``cpus``) and the checkpoint period (``checkpoint_every``).
The trainable logs every round's metrics to MLflow and reports the evaluation rounds to Tune
(``round`` is the scheduler's time attribute), saves a checkpoint at the first evaluation round
``_checkpoint_every`` rounds after the last one and at the last round, and keeps its MLflow run id in the checkpoint
so that a restored trial continues the same MLflow run.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..config import apply_overrides, resolve
from ..federation.simulator import DivergedError, Simulator, simulator_for
from ..runner import config_params, log_artifacts
from ..tracking import Tracker

RUN_ID_FILE = "mlflow_run_id"
STATE_FILE = "state.pt"


def trial_config(config: dict[str, Any], setup: dict[str, Any]):
    """The validated ExperimentConfig of one trial, placed on the trial's device."""
    raw = apply_overrides(setup["base"], dict(config))
    cfg = resolve(raw)
    gpus = _gpu_ids()
    if gpus and cfg.federation.device in ("auto", "cpu"):
        cfg.federation.device = "cuda"  # Ray exposes only the trial's GPU as cuda:0
    elif cfg.federation.device == "auto":
        cfg.federation.device = "cpu"
    cfg.federation.threads = max(1, int(setup.get("cpus", 1)))
    return cfg


def _gpu_ids() -> list:
    try:
        import ray

        return list(ray.get_gpu_ids())
    except Exception:
        return []


def _context() -> tuple[str, str]:
    from ray import tune

    ctx = tune.get_context()
    return ctx.get_trial_name() or "trial", ctx.get_trial_id() or ""


def start_tracker(setup: dict[str, Any], cfg, restored_run_id: str | None) -> Tracker:
    if not cfg.tracking.enabled:
        return Tracker.disabled()
    name, trial_id = _context()
    if not restored_run_id and trial_id:
        restored_run_id = existing_run(trial_id, setup.get("parent_run_id"))
    if restored_run_id:
        return Tracker.resume(restored_run_id)
    tracker = Tracker.start(setup.get("experiment"), run_name=name, parent_run_id=setup.get("parent_run_id"),
                            tags={"ray.trial_id": trial_id, "pfl.method": cfg.method.name,
                                  "pfl.source": cfg.data.source}, sweep=True)
    tracker.log_params(config_params(cfg))
    return tracker


def existing_run(trial_id: str, parent_run_id: str | None) -> str | None:
    """The MLflow run a trial started before it was interrupted (before its first checkpoint).

    Restarting such a trial must continue that run, so that the sweep keeps one child run per trial.
    """
    if not parent_run_id:
        return None
    from ..tracking import client

    mc = client()
    parent = mc.get_run(parent_run_id)
    runs = mc.search_runs([parent.info.experiment_id],
                          filter_string=f"tags.`ray.trial_id` = '{trial_id}' and "
                                        f"tags.`mlflow.parentRunId` = '{parent_run_id}'")
    return runs[0].info.run_id if runs else None


def save_checkpoint(sim: Simulator, tracker: Tracker, directory: Path) -> None:
    sim.save(directory / STATE_FILE)
    (directory / RUN_ID_FILE).write_text(tracker.run_id or "")


def federated_trainable(config: dict[str, Any], setup: dict[str, Any]) -> None:
    from ray import tune

    os.environ.update(setup.get("env", {}))
    cfg = trial_config(config, setup)
    torch.set_num_threads(cfg.federation.threads)
    sim = simulator_for(cfg)(cfg)
    restored_run_id = None
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            sim.load(Path(d) / STATE_FILE)
            restored_run_id = (Path(d) / RUN_ID_FILE).read_text().strip() or None
    tracker = start_tracker(setup, cfg, restored_run_id)
    every = int(setup.get("checkpoint_every", 5))
    total = cfg.federation.rounds
    last_saved = sim.round
    try:
        for metrics in sim.rounds():
            tracker.log_metrics({k: v for k, v in metrics.items() if k != "round"}, step=int(metrics["round"]))
            if not sim.is_eval_round(int(metrics["round"])):
                continue  # Tune sees evaluation rounds only, so every report holds the metric
            report = dict(metrics, round=sim.round, mlflow_run_id=tracker.run_id or "")
            if sim.round - last_saved >= every or sim.round == total:
                last_saved = sim.round
                with tempfile.TemporaryDirectory() as tmp:
                    save_checkpoint(sim, tracker, Path(tmp))
                    tune.report(report, checkpoint=tune.Checkpoint.from_directory(tmp))
            else:
                tune.report(report)
    except DivergedError as err:
        tracker.set_tags({"pfl.failure": str(err)})
        tracker.end("FAILED")
        raise
    except BaseException as err:
        tracker.set_tags({"pfl.failure": f"{type(err).__name__}: {err}"})
        raise
    log_artifacts(sim, tracker)
    tracker.end("FINISHED")
