"""A table's cells as records (what each run measured), the summary over seeds, and its MLflow parent."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from ..seeds import aggregate, last_mean, markdown, metric_tag
from .spec import Cell, TableSpec

NAN = float("nan")


def read(history: list[dict], final: dict, metric: str, how: str, last: int) -> float:
    """``metric`` of one run read as ``how`` (spec.READS)."""
    if how == "final":
        return float(final.get(metric, NAN))
    if how == "last_mean":
        return last_mean(history, metric, last)
    values = [float(h[metric]) for h in history if metric in h]
    if not values:
        return NAN
    return {"best": max, "mean": lambda v: sum(v) / len(v), "sum": sum,
            "per_round": lambda v: sum(v) / max(len(history), 1)}[how](values)


def hook(spec: TableSpec, field: str) -> Callable | None:
    """The table's ``measure`` or ``headline``: ``FILE.py:function`` (beside the table file) or
    ``module:function``."""
    text = getattr(spec, field)
    if not text:
        return None
    from ..plugins import import_file, import_module
    from ..schema import ConfigError

    where, _, fn = text.rpartition(":")
    if not where or not fn:
        raise ConfigError(field, f"expected FILE.py:function or module:function, got {text!r} (in {spec.path})")
    if where.endswith(".py"):
        path = Path(where) if Path(where).is_absolute() else Path(spec.path).parent / where
        module = import_file(str(path), field)
    else:
        module = import_module(where, field)
    if not callable(getattr(module, fn, None)):
        raise ConfigError(field, f"{where} has no function {fn!r} (in {spec.path})")
    return getattr(module, fn)


def records_of(spec: TableSpec, cells: list[Cell], trials: list) -> tuple[list[dict], dict[str, str]]:
    """One record per cell that ended (FINISHED or FAILED), in the cells' order; failures by label."""
    import json

    from ..runner import RunSummary
    from ..tune.results import failure_reason

    measure = hook(spec, "measure")
    by_cell = {int((t.config or {}).get("cell", -1)): t for t in trials}
    records, failures = [], {}
    for cell in cells:
        trial = by_cell.get(cell.index)
        status = str(getattr(trial, "status", ""))
        result = (trial.last_result or {}) if trial is not None else {}
        rec: dict[str, Any] = {"group": cell.row.group, "row": cell.row.name, "seed": cell.seed,
                               "seconds": float(result.get("time_total_s", NAN)),
                               "run_id": result.get("mlflow_run_id", "")}
        if status == "ERROR":
            error = Path(getattr(trial, "error_file", "") or "")
            failures[cell.label] = failure_reason(rec["run_id"], error.read_text() if error.is_file() else "")
            records.append({**rec, "status": "FAILED", "final": NAN, "last_mean": NAN, "test_n": NAN})
            continue
        if status != "TERMINATED" or "table/record" not in result:
            continue    # cut off: a resume continues it
        run = json.loads(result["table/record"])
        history = run["history"]
        final: dict[str, float] = {}
        for row in history:
            final.update(row)
        final.update(run["summary"])
        final["time/data_load_s"] = run["data_load_s"]
        rec.update(status="FINISHED", final=float(final.get(spec.metric, NAN)),
                   last_mean=last_mean(history, spec.metric, spec.last), test_n=float(run["test_n"]),
                   node=run.get("node", ""))
        if spec.read == "best":
            rec["best"] = read(history, final, spec.metric, "best", spec.last)
        for col in spec.columns:
            if col.metric:
                rec[col.name] = read(history, final, col.metric, col.read, spec.last)
        if measure is not None:
            rec.update(measure(RunSummary(final, history, rec["run_id"] or None)))
        records.append(rec)
    return records, failures


def reference_of(spec: TableSpec):
    ref = spec.reference
    return (lambda group: ref.get(group)) if isinstance(ref, dict) else ref


def summarize(spec: TableSpec, cells: list[Cell], records: list[dict]) -> tuple[list[dict], str]:
    from ..runner import format_bytes

    summary = aggregate(records, key=spec.read, reference=reference_of(spec), skip=("seed", "seconds"))
    rows = {(c.row.group, c.row.name): c for c in cells}

    def text(col) -> Callable[[dict], str]:
        def cell_text(r: dict) -> str:
            cell = rows[(r["group"], r["row"])]
            if col.kind == "tag":
                return str(cell.row.tags.get(col.key, ""))
            if col.kind == "config":
                return str(dotted(cell.raw, col.key))
            if col.kind == "bytes":
                value = r.get(f"{col.key}_mean", NAN)
                return "–" if value != value else format_bytes(value)
            return str(col.values.get(r["row"], ""))
        return cell_text

    columns = [(c.name, c.title or c.name, c.scale, c.digits) for c in spec.columns if c.show]
    text_md = markdown(summary, spec.read, columns, key_title=spec.title, scale=spec.scale, last=spec.last,
                       metric=spec.metric, text_columns=[(c.title, text(c)) for c in spec.text_columns],
                       notes=list(spec.notes))
    return summary, text_md


def dotted(raw: dict, key: str) -> Any:
    value: Any = raw
    for part in key.split("."):
        value = value.get(part, "") if isinstance(value, dict) else ""
    return value


def plot(spec: TableSpec, cells: list[Cell], summary: list[dict], index: int, out: Path) -> Path:
    """One of the table's plots: a column (or the metric) against a column or a row parameter,
    mean ± std over the seeds, one line per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = spec.plots[index]
    raw = {(c.row.group, c.row.name): c.raw for c in cells}
    y_key = spec.read if p.y == "value" else p.y
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for group in dict.fromkeys(r["group"] for r in summary):
        pts = []
        for r in (r for r in summary if r["group"] == group):
            x = (dotted(raw[(group, r["row"])], p.x[7:]) if p.x.startswith("config:") else r.get(f"{p.x}_mean"))
            y, err = r.get(f"{y_key}_mean", NAN), r.get(f"{y_key}_std", NAN)
            if isinstance(x, (int, float)) and not math.isnan(float(x)) and y == y:
                pts.append((float(x), y, 0.0 if err != err else err, r["row"]))
        pts.sort()
        if pts:
            xs, ys, es, names = zip(*pts)
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=group or None)
            for x, y, name in zip(xs, ys, names):
                ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(p.x.removeprefix("config:"))
    ax.set_ylabel(spec.metric if p.y == "value" else p.y)
    if p.logx:
        ax.set_xscale("log")
    ax.set_title(p.title or f"{spec.name}: {ax.get_ylabel()} against {ax.get_xlabel()}", fontsize=10)
    ax.grid(alpha=0.3)
    if any(r["group"] for r in summary):
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{spec.name}_plot{index + 1}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def close_parent(parent, spec: TableSpec, cells: list[Cell], name: str, summary: list[dict], records: list[dict],
                 text: str, status: str, wall: float, outdir: str | Path | None, headline: dict | None = None) -> None:
    """The table on its parent run (CSV, Markdown, Parquet, every cell, the plots, per-row metrics)."""
    import tempfile

    import pandas as pd

    from ..runner import write_table

    flat = [{k: v for k, v in r.items() if k != "values"} for r in summary]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(outdir) if outdir else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        write_table(parent, flat, name, text if status != "INTERRUPTED" else f"(partial: {status})\n\n{text}", out,
                    runs=records)
        if records:
            pd.DataFrame(records).to_parquet(out / f"{name}_runs.parquet")
            parent.log_artifact(out / f"{name}_runs.parquet")
        for i in range(len(spec.plots) if status == "FINISHED" else 0):
            parent.log_artifact(plot(spec, cells, summary, i, out), "plots")
    for r in summary:
        tag = metric_tag(f"{r['group']}/{r['row']}" if r["group"] else r["row"])
        values = {f"{tag}/{spec.read}_{s}": r.get(f"{spec.read}_{s}", NAN) for s in ("mean", "std")}
        parent.log_metrics({k: v for k, v in values.items() if v == v})
    parent.log_metrics({"table/cells": float(len(cells)), "table/finished": float(
        sum(r["status"] == "FINISHED" for r in records)), "table/failed": float(
        sum(r["status"] == "FAILED" for r in records)), "table/wall_s": wall})
    parent.log_metrics({k: v for k, v in (headline or {}).items() if v == v})
    parent.set_tags({"pfl.status": status.lower()})
    parent.end({"FINISHED": "FINISHED", "FAILED": "FAILED"}.get(status, "KILLED"))


__all__ = ["close_parent", "hook", "plot", "read", "records_of", "summarize"]
