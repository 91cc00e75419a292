"""PNG plots of runs (matplotlib, headless): one run's history, and many runs' curves side by side.

Rounds are whole numbers on the axes, and each line has its own colour, line style and marker, so
lines stay distinguishable in print and for colour-blind readers.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

CURVES = (("test/acc_mean", "personalized test acc"), ("val/acc_mean", "personalized val acc"),
          ("global/test_acc", "global model test acc"), ("test/rmse_mean", "personalized test RMSE"),
          ("global/test_rmse", "global model test RMSE"))


def line_styles() -> Iterator[dict]:
    """Colour × line style × marker combinations, none repeated before 10 × 4 × 6 lines."""
    colors = plt.get_cmap("tab10").colors
    for style, marker in zip(itertools.cycle(("-", "--", "-.", ":")), itertools.cycle("os^Dvx")):
        for color in colors:
            yield {"color": color, "linestyle": style, "marker": marker}


def _series(history: Sequence[dict], key: str, x_key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in history:
        if key in row and x_key in row:
            xs.append(row[x_key])
            ys.append(row[key])
    return xs, ys


def _finish(fig, ax, path: str | Path, title: str, legend: bool) -> Path:
    if title:
        ax.set_title(title)
    if legend:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, metadata={"Title": title} if title else None)  # the title readable without looking
    plt.close(fig)
    return path


def plot_history(history: Sequence[dict], path: str | Path, x_key: str = "step",
                 xlabel: str = "round", title: str = "") -> Path:
    """Accuracy (or RMSE) curves against the rounds done (``step``) or ``comm/total_bytes``."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    scale = 1.0
    if x_key == "comm/total_bytes":
        top = max((row.get(x_key, 0.0) for row in history), default=0.0)
        scale, unit = (2**20, "MiB") if top < 2**30 else (2**30, "GiB")
        xlabel = f"cumulative communication ({unit})"
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    plotted, rmse = False, False
    for (key, label), style in zip(CURVES, line_styles()):
        xs, ys = _series(history, key, x_key)
        if xs:
            ax.plot([x / scale for x in xs], ys, label=label, markersize=4,
                    **dict(style, marker=style["marker"] if len(xs) < 40 else None))
            plotted, rmse = True, rmse or "rmse" in key
    ax.set_xlabel(xlabel)
    ax.set_ylabel("RMSE / accuracy" if rmse else "accuracy")
    return _finish(fig, ax, path, title, plotted)


def plot_curves(curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], path: str | Path,
                ylabel: str, xlabel: str = "round", title: str = "", best: str | None = None) -> Path:
    """One line per labelled (steps, values) series, e.g. every trial of a sweep, in the mapping's
    order (the legend's); ``best`` names the series drawn thicker and marked as the best."""
    fig, ax = plt.subplots(figsize=(7.2, 4.4), dpi=100)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for (label, (xs, ys)), style in zip(curves.items(), line_styles()):
        if label == best:
            style = dict(style, linewidth=2.6, zorder=3)
            label = f"{label} (best)"
        ax.plot(xs, ys, label=label, markersize=4, **dict(style, marker=style["marker"] if len(xs) < 40 else None))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _finish(fig, ax, path, title, bool(curves))


def plot_partition(view, path: str | Path, title: str = "") -> Path:
    """The partition at a glance (:class:`pfl.data.glance.PartitionView`): a heat map of clients ×
    classes (training samples; a regression source: × target bins, each row its client's target
    histogram) beside each client's split sizes as stacked bars."""
    m = view.num_clients
    height = min(12.0, 2.4 + 0.12 * m)
    fig, (heat, bars) = plt.subplots(1, 2, figsize=(10.0, height), dpi=100, sharey=True,
                                     gridspec_kw={"width_ratios": [3, 1.3]})
    image = heat.imshow(view.counts, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(image, ax=heat, fraction=0.04, pad=0.02, label="training samples")
    heat.set_xlabel("class" if view.task == "classification" else "training target (bin)")
    heat.set_ylabel("client")
    heat.set_xticks(range(len(view.columns)))
    heat.set_xticklabels(view.columns, rotation=90 if view.task != "classification" or len(view.columns) > 20
                         else 0, fontsize="small" if len(view.columns) <= 20 else "xx-small")
    heat.yaxis.set_major_locator(MaxNLocator(integer=True))
    heat.set_title(view.what)
    left = view.sizes[:, 0] * 0
    for j, (split, style) in enumerate(zip(("train", "val", "test"), line_styles())):
        if m <= 200:
            bars.barh(range(m), view.sizes[:, j], left=left, color=style["color"], label=split, height=0.8)
        else:  # a large population: filled bands, not one bar artist per client
            bars.fill_betweenx(range(m), left, left + view.sizes[:, j], step="mid", color=style["color"], label=split)
        left = left + view.sizes[:, j]
    bars.set_xlabel("samples")
    bars.set_title("client sizes")
    fig.suptitle(title or f"{view.source}: {view.kind} partition, {m} clients")
    return _finish(fig, bars, path, "", True)
