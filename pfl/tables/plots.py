"""A table's plots: a column against a row parameter or another column (mean ± std over seeds), or
the per-round curves of two run metrics for the first seed's runs; one line per group or row, one
figure per facet."""

from __future__ import annotations

import math
from pathlib import Path

from .spec import Cell, TableSpec, dotted


def _facet(p, cell: Cell) -> str:
    if not p.facet:
        return ""
    return cell.row.group if p.facet == "group" else str(dotted(cell.raw, p.facet.removeprefix("config:")))


def _lines(spec: TableSpec, p, cells: list[Cell], summary: list[dict], histories: dict) -> dict:
    """facet → series → [(x, y, err, label)]."""
    out: dict[str, dict[str, list]] = {}
    first = {(c.row.group, c.row.name): c for c in cells if c.seed == cells[0].seed}
    if p.kind == "curve":
        for cell in first.values():
            history = histories.get(cell.index) or []
            pts = [(float(h[p.x]), float(h[p.y]), 0.0, "") for h in history if p.x in h and p.y in h]
            series = cell.row.name if p.series == "row" else cell.row.group
            out.setdefault(_facet(p, cell), {}).setdefault(series or cell.row.name, []).extend(pts)
        return out
    y_key = spec.key if p.y == "value" else p.y
    for r in summary:
        cell = first.get((r["group"], r["row"]))
        if cell is None:
            continue
        x = dotted(cell.raw, p.x[7:]) if p.x.startswith("config:") else r.get(f"{p.x}_mean")
        y, err = r.get(f"{y_key}_mean", float("nan")), r.get(f"{y_key}_std", float("nan"))
        if isinstance(x, (int, float)) and not math.isnan(float(x)) and y == y:
            series = r["row"] if p.series == "row" else r["group"]
            out.setdefault(_facet(p, cell), {}).setdefault(series, []).append(
                (float(x), y, 0.0 if err != err else err, r["row"] if p.series == "group" else ""))
    return out


def plot(spec: TableSpec, cells: list[Cell], summary: list[dict], histories: dict, index: int,
         out: Path) -> list[Path]:
    """The figures of plot ``index`` of the table, as PNG files in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = spec.plots[index]
    paths = []
    for n, (facet, lines) in enumerate(_lines(spec, p, cells, summary, histories).items()):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for series, pts in lines.items():
            if p.kind == "summary":
                pts.sort()
            xs, ys, es, names = zip(*pts) if pts else ((), (), (), ())
            if p.kind == "curve":
                ax.plot(xs, ys, marker=".", label=series or None)
                continue
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=series or None)
            for x, y, name in zip(xs, ys, names):
                if name:
                    ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(p.x.removeprefix("config:"))
        ax.set_ylabel(spec.metric if p.y == "value" else p.y)
        if p.logx:
            ax.set_xscale("log")
        title = p.title or f"{spec.name}: {ax.get_ylabel()} against {ax.get_xlabel()}"
        ax.set_title(f"{title}{f' ({facet})' if facet else ''}", fontsize=10)
        ax.grid(alpha=0.3)
        if any(lines):
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{spec.name}_plot{index + 1}{f'_{n + 1}' if facet else ''}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


__all__ = ["plot"]
