"""Any registered method's federated run as a Ray Tune function trainable.

The trial's Tune config holds only the searched dotted values; the constants every trial shares
come through ``tune.with_parameters`` as ``setup``: the base experiment config (``base``, a raw
dict), the MLflow parent run (``parent_run_id``, ``experiment``), the tracking environment
(``env``), the trial's CPU count (``cpus``) and the checkpoint period (``checkpoint_every``).
A trial is the round loop (:mod:`pfl.federation.loop`) with the divergence check, the MLflow logger
and the Tune reporter (:mod:`pfl.callbacks.tune`): every round is logged to MLflow, evaluation
rounds are reported to Tune (``round`` is the scheduler's time attribute), and a checkpoint holding
the simulator and the MLflow run id goes with a report every ``checkpoint_every`` rounds, so a
restored trial continues the same rounds and the same MLflow run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..callbacks import MLflowLogger, StopOnDivergence
from ..callbacks.tune import STATE_FILE, TuneReporter
from ..config import apply_overrides
from ..resolver import resolve
from ..federation.loop import Callback, LoopResult, RoundLoop
from ..federation.drivers import simulator_for
from ..federation.simulator import DivergedError
from ..tracking import Tracker


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


def trial_run_opener(setup: dict[str, Any], cfg) -> Callable[[str | None], Tracker]:
    """Opens a trial's MLflow child run: the checkpoint's, the one the trial started before its
    first checkpoint, or a new one."""
    def open_run(restored_run_id: str | None) -> Tracker:
        if not cfg.tracking.enabled:
            return Tracker.disabled()
        name, trial_id = _context()
        if not restored_run_id and trial_id:
            restored_run_id = existing_run(trial_id, setup.get("parent_run_id"))
        if restored_run_id:
            return Tracker.resume(restored_run_id)
        return Tracker.start(setup.get("experiment"), run_name=name, parent_run_id=setup.get("parent_run_id"),
                             tags={"ray.trial_id": trial_id}, sweep=True)

    return open_run


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


def run_trial(cfg, setup: dict[str, Any], steering: Sequence[Callback] = (), until: float | None = None,
              data=None) -> RoundLoop:
    """One Tune trial of ``cfg``: the loop with ``steering`` callbacks (a pipeline's schedule,
    before the loggers), MLflow and Tune reporting, restored from Tune's checkpoint if there is one.
    ``data``: the federated data when the caller has it loaded. A diverged run raises
    :class:`DivergedError` after its MLflow run is marked FAILED."""
    from ray import tune

    os.environ.update(setup.get("env", {}))
    torch.set_num_threads(cfg.federation.threads)
    sim = simulator_for(cfg)(cfg, data=data)
    logger = MLflowLogger(trial_run_opener(setup, cfg))
    reporter = TuneReporter(int(setup.get("checkpoint_every", 5)), run_id=lambda: logger.run_id,
                            final=bool(setup.get("final_checkpoint", True)))
    loop = RoundLoop(sim, [StopOnDivergence(), *steering, logger, reporter])
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            loop.load(Path(d) / STATE_FILE)
    result: LoopResult = loop.run(until)
    if result.status == "FAILED":
        raise DivergedError(result.reason)
    return loop


def federated_trainable(config: dict[str, Any], setup: dict[str, Any]) -> None:
    run_trial(trial_config(config, setup), setup)
