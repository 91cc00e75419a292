"""Any registered method's federated run as a Ray Tune function trainable.

The trial's Tune config holds the base experiment config (``_base``, a raw dict), the searched
dotted values (every key not starting with ``_``), the MLflow parent run (``_parent_run_id``,
``_experiment``), the tracking environment (``_env``) and the trial's CPU count (``_cpus``).
The trainable reports every round's metrics (evaluation metrics carried forward between
evaluation rounds, so schedulers always see the metric), saves a checkpoint every
``_checkpoint_every`` rounds and at the last round, and keeps its MLflow run id in the checkpoint
so that a restored trial continues the same MLflow run.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..config import apply_overrides, resolve
from ..federation.simulator import DivergedError, Simulator
from ..runner import config_params, log_artifacts
from ..tracking import Tracker

RUN_ID_FILE = "mlflow_run_id"
STATE_FILE = "state.pt"


def searched_values(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if not k.startswith("_")}


def trial_config(config: dict[str, Any]):
    """The validated ExperimentConfig of one trial, placed on the trial's device."""
    raw = apply_overrides(config["_base"], searched_values(config))
    cfg = resolve(raw)
    gpus = _gpu_ids()
    if gpus and cfg.federation.device in ("auto", "cpu"):
        cfg.federation.device = "cuda"  # Ray exposes only the trial's GPU as cuda:0
    elif cfg.federation.device == "auto":
        cfg.federation.device = "cpu"
    cfg.federation.threads = max(1, int(config.get("_cpus", 1)))
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


def start_tracker(config: dict[str, Any], cfg, restored_run_id: str | None) -> Tracker:
    if not cfg.tracking.enabled:
        return Tracker.disabled()
    if restored_run_id:
        return Tracker.resume(restored_run_id)
    name, trial_id = _context()
    tracker = Tracker.start(config.get("_experiment"), run_name=name, parent_run_id=config.get("_parent_run_id"),
                            tags={"ray.trial_id": trial_id, "pfl.method": cfg.method.name,
                                  "pfl.source": cfg.data.source}, sweep=True)
    tracker.log_params(config_params(cfg))
    return tracker


def save_checkpoint(sim: Simulator, tracker: Tracker, directory: Path) -> None:
    sim.save(directory / STATE_FILE)
    (directory / RUN_ID_FILE).write_text(tracker.run_id or "")


def federated_trainable(config: dict[str, Any]) -> None:
    from ray import tune

    os.environ.update(config.get("_env", {}))
    cfg = trial_config(config)
    torch.set_num_threads(cfg.federation.threads)
    sim = Simulator(cfg)
    restored_run_id = None
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            sim.load(Path(d) / STATE_FILE)
            restored_run_id = (Path(d) / RUN_ID_FILE).read_text().strip() or None
    tracker = start_tracker(config, cfg, restored_run_id)
    every = int(config.get("_checkpoint_every", 5))
    total = cfg.federation.rounds
    carried: dict[str, float] = {}
    for row in sim.history:  # a restored trial re-reports nothing but keeps its last evaluation
        carried.update({k: v for k, v in row.items() if "/" in k})
    try:
        for metrics in sim.rounds():
            tracker.log_metrics({k: v for k, v in metrics.items() if k != "round"}, step=int(metrics["round"]))
            carried.update(metrics)
            report = dict(carried, round=sim.round, mlflow_run_id=tracker.run_id or "")
            if sim.round % every == 0 or sim.round == total:
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
