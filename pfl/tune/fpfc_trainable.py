"""Ray Tune trainable for FPFC's λ tuning: one trial = a warm-started λ path or one separate λ.

A trial is the ordinary trial loop (:func:`pfl.tune.trainable.run_trial`) steered by
:class:`pfl.tune.lambda_path.LambdaPath`, so it checkpoints and resumes like any other trial (its
path position is part of the checkpoint). Each trial is an MLflow child run whose ``step`` is the
number of rounds executed so far (monotone across stages and playoff branches): per round the usual
metrics; at the end of every path stage ``stage/lambda``, ``stage/val_acc``, ``stage/test_acc``,
``stage/clusters``, ``stage/ari``, ``stage/rounds``, ``stage/converged``, ``stage/lineage_rounds``
(:mod:`pfl.tune.path_report`); at the end of every playoff match ``playoff/*`` (the same names); at
the end the stage table (CSV), the playoff table and the λ-path plot (PNG). Both kinds report the
``fpfc/*`` schedule metrics (selected λ, rounds, convergence, the trial's CPU and wall time) and the
selected model's metrics to Tune.
"""

from __future__ import annotations

import math
from typing import Any

from ..schema import from_dict
from .lambda_path import LambdaPath, PathSettings
from .trainable import run_trial, trial_config


def fpfc_path_trainable(config: dict[str, Any], setup: dict[str, Any]) -> None:
    settings = from_dict(PathSettings, setup["path"], "pipeline")
    cfg = trial_config(config, setup)
    if not hasattr(cfg.method.hparams, "lam"):
        raise ValueError(f"λ tuning needs a method with a `lam` hyperparameter, got {cfg.method.name}")
    # the path decides when to evaluate and when to stop; no lineage trains past the budget
    cfg.federation.eval_every = settings.eval_every
    cfg.federation.rounds = settings.budget
    strategy = setup.get("strategy", "warmup")
    path = LambdaPath(settings, strategy)
    loop = run_trial(cfg, setup, steering=[path], until=math.inf)
    logger = next(cb for cb in loop.callbacks if cb.key == "mlflow")
    logger.tracker.set_tags({"pfl.strategy": strategy})
    if strategy == "warmup":  # a path selects its λ; a separate run only trains the one it was given
        logger.tracker.set_tags({"pfl.selected_lambda": f"{loop.summary['fpfc/selected_lambda']:g}"})
