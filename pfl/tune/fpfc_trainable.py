"""Ray Tune trainable for FPFC's λ tuning: one trial = a warm-started λ path or one separate λ.

A trial is the ordinary trial loop (:func:`pfl.tune.trainable.run_trial`) steered by
:class:`pfl.tune.lambda_path.LambdaPath`, so it checkpoints and resumes like any other trial (its
path position is part of the checkpoint). Each trial is an MLflow child run whose ``step`` is the
number of rounds executed so far (monotone across stages and playoff branches): per round the usual
metrics with ``fpfc/lambda``; at the end of every path stage ``stage/lambda``, ``stage/val_acc``,
``stage/test_acc``, ``stage/clusters``, ``stage/ari``, ``stage/rounds``; at the end of every playoff
match ``playoff/*`` (the same names); at the end the stage table (CSV), the playoff table and the
λ-path plot (PNG). Both kinds report ``fpfc/selected_lambda``, ``fpfc/total_rounds`` and the final
model's metrics to Tune.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from ..schema import from_dict
from .lambda_path import STAGE_METRICS, LambdaPath, PathSettings, stage_metrics  # noqa: F401
from .trainable import run_trial, trial_config


def plot_path(stages: list[dict], path: Path, title: str = "", playoff: list[dict] | None = None) -> Path:
    from ..plots import plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    order = range(len(stages))
    labels = [f"{s['lambda']:g}" for s in stages]
    ax.plot(order, [s.get("val/acc_mean", float("nan")) for s in stages], marker="o", label="val acc")
    ax.plot(order, [s.get("test/acc_mean", float("nan")) for s in stages], marker="s", label="test acc")
    if playoff:
        where = {s["lambda"]: i for i, s in enumerate(stages)}
        rounds = int(playoff[0].get("rounds", 0))
        ax.scatter([where[m["lambda"]] for m in playoff], [m["val/acc_mean"] for m in playoff], marker="*",
                   s=120, color="C3", zorder=3, label=f"val acc after {rounds} playoff rounds")
    ax.set_xticks(list(order), labels)
    ax.set_xlabel("λ (path order)")
    ax.set_ylabel("accuracy")
    ax2 = ax.twinx()
    ax2.plot(order, [s.get("cluster/num", float("nan")) for s in stages], color="gray", linestyle="--",
             marker="^", label="#clusters")
    ax2.set_ylabel("#clusters")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="best")
    ax.set_title(title or "FPFC λ path")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_stages(stages: list[dict], path: Path) -> Path:
    keys = sorted({k for s in stages for k in s}, key=lambda k: (k != "lambda", k))
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(stages)
    return path


def fpfc_path_trainable(config: dict[str, Any], setup: dict[str, Any]) -> None:
    settings = from_dict(PathSettings, setup["path"], "pipeline")
    cfg = trial_config(config, setup)
    if not hasattr(cfg.method.hparams, "lam"):
        raise ValueError(f"λ tuning needs a method with a `lam` hyperparameter, got {cfg.method.name}")
    # the path decides when to evaluate and when to stop; the lineage's budget is the round budget
    cfg.federation.eval_every = settings.eval_every
    cfg.federation.rounds = settings.budget
    strategy = setup.get("strategy", "warmup")
    path = LambdaPath(settings, strategy)
    loop = run_trial(cfg, setup, steering=[path], until=math.inf)
    logger = next(cb for cb in loop.callbacks if cb.key == "mlflow")
    logger.tracker.set_tags({"pfl.strategy": strategy, "pfl.selected_lambda": loop.summary["fpfc/selected_lambda"]})
