"""A table's cells as records (what each run measured), the summary over seeds, and its MLflow parent."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..seeds import aggregate, last_mean, markdown, metric_tag
from .hooks import get_hook
from .spec import Cell, TableSpec, dotted

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


def records_of(spec: TableSpec, cells: list[Cell], trials: list) -> tuple[list[dict], dict[str, str], dict]:
    """One record per cell that ended (FINISHED or FAILED), in the cells' order; failures by label;
    the histories of the first seed's cells (for curve plots)."""
    import json

    from ..runner import RunSummary
    from ..tune.results import failure_reason

    measure, combine = get_hook(spec, "measure"), get_hook(spec, "records")
    by_cell = {int((t.config or {}).get("cell", -1)): t for t in trials}
    records, failures, histories = [], {}, {}
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
        if cell.seed == cells[0].seed:
            histories[cell.index] = history
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
        rec.update(run.get("trial", {}))
        if measure is not None:
            rec.update(measure(RunSummary(final, history, rec["run_id"] or None)))
        records.append(rec)
    return (combine(records) if combine is not None else records), failures, histories


def reference_of(spec: TableSpec):
    ref = spec.reference
    return (lambda group: ref.get(group)) if isinstance(ref, dict) else ref


def summarize(spec: TableSpec, cells: list[Cell], records: list[dict]) -> tuple[list[dict], str]:
    from ..runner import format_bytes

    summary = aggregate(records, key=spec.key, reference=reference_of(spec), skip=("seed", "seconds"))
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
            return str(col.values.get(f"{r['group']}/{r['row']}" if r["group"] else r["row"], ""))
        return cell_text

    columns = [(c.name, c.title or c.name, c.scale, c.digits) for c in spec.columns if c.show]
    text_md = markdown(summary, spec.key, columns, key_title=spec.title, scale=spec.scale, last=spec.last,
                       metric=spec.metric, text_columns=[(c.title, text(c)) for c in spec.text_columns],
                       notes=list(spec.notes))
    return summary, text_md


def close_parent(parent, spec: TableSpec, cells: list[Cell], name: str, summary: list[dict], records: list[dict],
                 text: str, status: str, wall: float, outdir: str | Path | None, headline: dict | None = None,
                 histories: dict | None = None) -> str:
    """The table on its parent run (CSV, Markdown, Parquet, every cell, the plots, per-row metrics);
    returns the text with what the table's ``report`` hook adds."""
    import tempfile

    import pandas as pd

    from ..runner import write_table
    from .plots import plot

    flat = [{k: v for k, v in r.items() if k != "values"} for r in summary]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(outdir) if outdir else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        report = get_hook(spec, "report")
        if report is not None and status == "FINISHED":
            more, files = report(summary, cells, out)
            text = f"{text}\n\n{more}" if more else text
            for path in files:
                parent.log_artifact(path, "plots")
        write_table(parent, flat, name, text if status != "INTERRUPTED" else f"(partial: {status})\n\n{text}", out,
                    runs=records)
        if records:
            pd.DataFrame(records).to_parquet(out / f"{name}_runs.parquet")
            parent.log_artifact(out / f"{name}_runs.parquet")
        for i in range(len(spec.plots) if status == "FINISHED" else 0):
            for path in plot(spec, cells, summary, histories or {}, i, out):
                parent.log_artifact(path, "plots")
    for r in summary:
        tag = metric_tag(f"{r['group']}/{r['row']}" if r["group"] else r["row"])
        values = {f"{tag}/{spec.key}_{s}": r.get(f"{spec.key}_{s}", NAN) for s in ("mean", "std")}
        parent.log_metrics({k: v for k, v in values.items() if v == v})
    parent.log_metrics({"table/cells": float(len(cells)), "table/finished": float(
        sum(r["status"] == "FINISHED" for r in records)), "table/failed": float(
        sum(r["status"] == "FAILED" for r in records)), "table/wall_s": wall})
    parent.log_metrics({k: v for k, v in (headline or {}).items() if v == v})
    parent.set_tags({"pfl.status": status.lower()})
    parent.end({"FINISHED": "FINISHED", "FAILED": "FAILED"}.get(status, "KILLED"))
    return text


__all__ = ["close_parent", "read", "records_of", "summarize"]
