"""Ray Tune trainable for FPFC's λ tuning: one trial = a warm-started λ path or one separate λ.

Each trial is an MLflow child run. Its ``step`` is the number of rounds executed so far (monotone
across stages): per round the usual metrics with ``fpfc/lambda``; at the end of every path stage
of a warmup trial ``stage/lambda``, ``stage/val_acc``, ``stage/test_acc``, ``stage/clusters``,
``stage/ari``, ``stage/rounds``; with a playoff, ``playoff/*`` (the same names, step = finalist);
at the end the stage table (CSV), the playoff table and the λ-path plot (PNG).
Both kinds report ``fpfc/selected_lambda``, ``fpfc/total_rounds`` and the final model's metrics
to Tune.
"""

from __future__ import annotations

import csv
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..federation.simulator import DivergedError, simulator_for
from ..runner import log_artifacts
from .lambda_path import PathSettings, separate_run, warmup_path
from .trainable import start_tracker, trial_config
from ..schema import from_dict


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


# a stage record's keys -> the names its MLflow metrics carry after the prefix (stage/, playoff/)
STAGE_METRICS = {"lambda": "lambda", "val/acc_mean": "val_acc", "test/acc_mean": "test_acc",
                 "cluster/num": "clusters", "cluster/ari": "ari", "rounds": "rounds"}


def stage_metrics(stage: dict, prefix: str = "stage/") -> dict[str, float]:
    """A path stage (or playoff match) as MLflow metrics (``stage/*``, ``playoff/*``)."""
    return {prefix + name: float(stage[key]) for key, name in STAGE_METRICS.items() if key in stage}


def write_stages(stages: list[dict], path: Path) -> Path:
    keys = sorted({k for s in stages for k in s}, key=lambda k: (k != "lambda", k))
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(stages)
    return path


def fpfc_path_trainable(config: dict[str, Any], setup: dict[str, Any]) -> None:
    from ray import tune

    os.environ.update(setup.get("env", {}))
    settings = from_dict(PathSettings, setup["path"], "pipeline")
    cfg = trial_config(config, setup)
    if cfg.method.name not in ("fpfc",) and not hasattr(cfg.method.hparams, "lam"):
        raise ValueError(f"λ tuning needs a method with a `lam` hyperparameter, got {cfg.method.name}")
    cfg.federation.eval_every = settings.eval_every
    cfg.federation.rounds = 10**9  # rounds are driven by the path, never by this cap
    torch.set_num_threads(cfg.federation.threads)
    sim = simulator_for(cfg)(cfg)
    tracker = start_tracker(setup, cfg, None)
    executed = [0]

    def on_round(metrics: dict) -> None:
        tracker.log_metrics({k: v for k, v in metrics.items() if k != "round"}, step=executed[0])
        executed[0] += 1

    def on_stage(index: int, stage: dict) -> None:
        tracker.log_metrics(stage_metrics(stage), step=executed[0])
        tune.report({"stage": index, "fpfc/lambda": stage["lambda"], "val/acc_mean": stage["val/acc_mean"],
                     "rounds_so_far": executed[0], "mlflow_run_id": tracker.run_id or ""})

    strategy = setup.get("strategy", "warmup")
    try:
        if strategy == "warmup":
            result = warmup_path(sim, settings, on_stage=on_stage, on_eval=on_round)
            final, stages, total, lam = result.final, result.stages, result.total_rounds, result.best_lambda
            playoff = result.extra.get("playoff", [])
            for index, match in enumerate(playoff):  # step = the finalist's index, best path stage first
                tracker.log_metrics(stage_metrics(match, "playoff/"), step=index)
        else:
            lam, playoff = float(cfg.method.hparams.lam), []
            final = separate_run(sim, lam, settings, on_eval=on_round)
            stages, total = [final], int(final["rounds"])
    except DivergedError as err:
        tracker.set_tags({"pfl.failure": str(err)})
        tracker.end("FAILED")
        raise
    summary = {"fpfc/selected_lambda": lam, "fpfc/total_rounds": float(total),
               "fpfc/path_stages": float(len(stages)) if strategy == "warmup" else 1.0}
    summary.update({k: v for k, v in final.items() if "/" in k})
    tracker.log_metrics(summary, step=executed[0])
    tracker.set_tags({"pfl.strategy": strategy, "pfl.selected_lambda": lam})
    with tempfile.TemporaryDirectory() as tmp:
        if strategy == "warmup":
            tracker.log_artifact(write_stages(stages, Path(tmp) / "lambda_path.csv"))
            if playoff:
                tracker.log_artifact(write_stages(playoff, Path(tmp) / "lambda_playoff.csv"))
            tracker.log_artifact(plot_path(stages, Path(tmp) / "lambda_path.png",
                                           f"FPFC λ path ({settings.direction})", playoff), "plots")
    log_artifacts(sim, tracker)
    tracker.end("FINISHED")
    tune.report(dict(summary, stage=len(stages), mlflow_run_id=tracker.run_id or "",
                     **{"val/acc_mean": final.get("val/acc_mean", 0.0)}))
