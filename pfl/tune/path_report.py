"""What a λ-tuning trial writes about its schedule: the stage and playoff records as metrics, the
stage table (CSV) and the λ-path plot (PNG).

:mod:`pfl.tune.lambda_path` records the stages and imports this module to report them; the trainable
and the pipeline import both. Nothing here imports the path, so the imports go one way.
"""

from __future__ import annotations

import csv
from pathlib import Path

# a stage record's keys -> the names its MLflow metrics carry after the prefix (stage/, playoff/)
STAGE_METRICS = {"lambda": "lambda", "val/acc_mean": "val_acc", "val/rmse_mean": "val_rmse",
                 "test/acc_mean": "test_acc", "test/rmse_mean": "test_rmse", "cluster/num": "clusters",
                 "cluster/ari": "ari", "rounds": "rounds", "converged": "converged", "lineage": "lineage_rounds",
                 "wall_s": "compute_time_s", "cpu_s": "cpu_time_s"}


def stage_metrics(stage: dict, prefix: str = "stage/") -> dict[str, float]:
    """A path stage (or playoff match) as metrics (``stage/*``, ``playoff/*``)."""
    return {prefix + name: float(stage[key]) for key, name in STAGE_METRICS.items() if key in stage}


def write_stages(stages: list[dict], path: Path) -> Path:
    keys = sorted({k for s in stages for k in s}, key=lambda k: (k != "lambda", k))
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(stages)
    return path


def _score_key(stages: list[dict]) -> tuple[str, str]:
    """The validation metric the records carry (classification: accuracy; regression: RMSE)."""
    if any("val/rmse_mean" in s for s in stages) and not any("val/acc_mean" in s for s in stages):
        return "val/rmse_mean", "test/rmse_mean"
    return "val/acc_mean", "test/acc_mean"


def plot_path(stages: list[dict], path: Path, title: str = "", playoff: list[dict] | None = None) -> Path:
    """Each stage's validation and test score at its end (path order) with #clusters; the playoff's
    matches as stars (their validation score after the matches, at equal lineage rounds)."""
    from ..plots import plt

    val_key, test_key = _score_key(stages)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    order = range(len(stages))
    labels = [f"{s['lambda']:g}" for s in stages]
    ax.plot(order, [s.get(val_key, float("nan")) for s in stages], marker="o", label=val_key)
    ax.plot(order, [s.get(test_key, float("nan")) for s in stages], marker="s", label=test_key)
    if playoff:
        where = {s["lambda"]: i for i, s in enumerate(stages)}
        total = int(max(m.get("lineage", 0) for m in playoff))
        ax.scatter([where[m["lambda"]] for m in playoff], [m.get(val_key, float("nan")) for m in playoff],
                   marker="*", s=120, color="C3", zorder=3, label=f"{val_key} after the playoff ({total} rounds each)")
    ax.set_xticks(list(order), labels)
    ax.set_xlabel("λ (path order)")
    ax.set_ylabel("RMSE" if val_key.endswith("rmse_mean") else "accuracy")
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
