"""PNG plots of a run's history (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CURVES = (("test/acc_mean", "personalized test acc"), ("val/acc_mean", "personalized val acc"),
          ("global/test_acc", "global model test acc"), ("test/rmse_mean", "personalized test RMSE"),
          ("global/test_rmse", "global model test RMSE"))


def _series(history: Sequence[dict], key: str, x_key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in history:
        if key in row and x_key in row:
            xs.append(row[x_key])
            ys.append(row[key])
    return xs, ys


def plot_history(history: Sequence[dict], path: str | Path, x_key: str = "round",
                 xlabel: str = "round", title: str = "") -> Path:
    """Accuracy (or RMSE) curves against ``x_key`` ('round' or 'comm/total_bytes')."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    scale, unit = 1.0, ""
    if x_key == "comm/total_bytes":
        top = max((row.get(x_key, 0.0) for row in history), default=0.0)
        scale, unit = (2**20, "MiB") if top < 2**30 else (2**30, "GiB")
        xlabel = f"cumulative communication ({unit})"
    plotted = False
    for key, label in CURVES:
        xs, ys = _series(history, key, x_key)
        if xs:
            x_plot = [x + 1 for x in xs] if x_key == "round" else [x / scale for x in xs]
            ax.plot(x_plot, ys, marker="." if len(xs) < 40 else None, label=label)
            plotted = True
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy" if not any("rmse" in k for k, _ in CURVES if _series(history, k, x_key)[0]) else "value")
    if title:
        ax.set_title(title)
    if plotted:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
