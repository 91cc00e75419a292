"""Comparisons over seeds: every row of a table is run once per seed and reported as mean ± std.

A single run is one draw of the data partition, the initialisation and the client sampling, and
one evaluation round is a further draw on a small test split: differences of a few points between
two methods are often within that noise. Every comparison (the tables of :mod:`pfl.tables`, whose
cells run as Ray Tune trials, and ``robustness.py``, ``newcomers.py``, ``compression_table.py``)
therefore summarises its runs here:

* a run's record holds the metric's last value (``final``), its mean over the last ``last``
  evaluations (``last_mean``: one evaluation round is noisy, :func:`last_mean`), the number of test
  samples behind it (``test_n``: the evaluated clients' test splits) and the table's own columns;
* :func:`aggregate` turns those records into one row per
  (group, row): mean ± std over the seeds (sample std, ddof = 1) of every numeric column, the paired
  difference to a reference row of its group (same seeds: same data and start) and the mark ``≈``
  when the two rows differ by less than their spread, |mean − mean_ref| < max(std, std_ref);
* :func:`markdown` prints that table with the rule in a footer.

Defaults: seeds 0, 1, 2 (``--seeds`` on every pipeline, :func:`add_seeds_argument`), the mean over
the last 3 evaluations.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np

from .schema import ConfigError

if TYPE_CHECKING:
    from .runner import RunSummary

DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_LAST = 3
MARK = "≈"


def add_seeds_argument(parser, default: Sequence[int] = DEFAULT_SEEDS) -> None:
    """``--seeds S [S ...]`` (default 0 1 2) on a pipeline's argument parser."""
    parser.add_argument("--seeds", nargs="+", type=int, default=list(default), metavar="SEED",
                        help=f"run every row once per seed and report mean ± std (default: "
                             f"{' '.join(map(str, default))}; at least 3 for a claim)")


def check_seeds(seeds: Iterable[int]) -> list[int]:
    """The seeds as a list; a ConfigError on ``--seeds`` when empty or repeated."""
    out = [int(s) for s in seeds]
    if not out:
        raise ConfigError("--seeds", "give at least one seed (3 or more for a comparison)")
    if len(set(out)) != len(out):
        raise ConfigError("--seeds", f"seeds must differ, got {out}")
    return out


def evaluations(history: Sequence[dict], metric: str) -> list[float]:
    return [float(h[metric]) for h in history if metric in h]


def last_mean(history: Sequence[dict], metric: str, last: int = DEFAULT_LAST) -> float:
    """Mean of ``metric`` over the last ``last`` evaluation rows of a run's history (nan if none)."""
    values = evaluations(history, metric)[-last:]
    return float(np.mean(values)) if values else float("nan")


def test_samples(summary: "RunSummary", newcomers: bool = False) -> int:
    """Test samples behind a run's last evaluation: Σ n_test over its evaluated clients (only the
    newcomers, or only the trained clients)."""
    sim = summary.extra.get("simulator")
    table = getattr(sim, "last_client_table", None) or []
    return int(sum(r.get("n_test", 0) for r in table if bool(r.get("newcomer", 0)) == newcomers))


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)


def _mean_std(values: list[float]) -> tuple[float, float]:
    vals = [v for v in values if v == v]
    if not vals:
        return float("nan"), float("nan")
    return float(np.mean(vals)), (float(np.std(vals, ddof=1)) if len(vals) > 1 else float("nan"))


def aggregate(records: Sequence[dict], key: str = "last_mean", reference: str | Callable[[str], str] | None = None,
              skip: Sequence[str] = ("seed", "seconds")) -> list[dict]:
    """One summary row per (group, row), in first-seen order (see the module docstring). ``seeds``
    counts the finished runs with a value; runs whose ``status`` is not FINISHED are counted in
    ``failed`` and left out of every mean.

    ``reference``: None (no comparison), ``"best"`` (the row of the group with the highest mean
    ``key``), a row label, or a function group → row label (or ``"best"``).
    """
    order: list[tuple[str, str]] = []
    by: dict[tuple[str, str], list[dict]] = {}
    for rec in records:
        k = (rec.get("group", ""), rec["row"])
        if k not in by:
            order.append(k)
            by[k] = []
        by[k].append(rec)
    out = []
    for k in order:
        recs = by[k]
        # a run that failed (diverged, interrupted) is counted apart and never averaged in
        failed = sum(1 for r in recs if r.get("status", "FINISHED") != "FINISHED")
        finite = sum(1 for r in recs if r.get("status", "FINISHED") == "FINISHED"
                     and _numeric(r.get(key)) and r.get(key) == r.get(key))
        row: dict[str, Any] = {"group": k[0], "row": k[1], "seeds": finite, "failed": failed}
        recs = [r for r in recs if r.get("status", "FINISHED") == "FINISHED"] or recs
        cols = [c for c in dict.fromkeys(c for r in recs for c in r)
                if c not in skip and c not in ("group", "row") and all(_numeric(r.get(c)) for r in recs)]
        for c in cols:
            row[f"{c}_mean"], row[f"{c}_std"] = _mean_std([float(r[c]) for r in recs])
        row["values"] = {r["seed"]: float(r.get(key, float("nan"))) for r in recs}
        out.append(row)
    if reference is not None:
        _compare(out, key, reference)
    return out


def _compare(rows: list[dict], key: str, reference: str | Callable[[str], str]) -> None:
    groups = list(dict.fromkeys(r["group"] for r in rows))
    for g in groups:
        members = [r for r in rows if r["group"] == g]
        label = reference(g) if callable(reference) else reference
        if label == "best":
            ref = max(members, key=lambda r: -math.inf if r[f"{key}_mean"] != r[f"{key}_mean"] else r[f"{key}_mean"])
        else:
            ref = next((r for r in members if r["row"] == label), None)
            if ref is None:
                continue
        for r in members:
            r["reference"] = ref["row"]
            if r is ref:
                r["delta_mean"] = r["delta_std"] = float("nan")
                r["mark"] = "ref"
                continue
            common = [s for s in r["values"] if s in ref["values"]]
            diffs = [r["values"][s] - ref["values"][s] for s in common]
            r["delta_mean"], r["delta_std"] = _mean_std(diffs)
            spread = max(x for x in (r[f"{key}_std"], ref[f"{key}_std"], 0.0) if x == x)
            gap = abs(r[f"{key}_mean"] - ref[f"{key}_mean"])
            r["mark"] = MARK if len(common) > 1 and gap < spread else ""


def fmt(mean: float, std: float, scale: float = 1.0, digits: int = 2) -> str:
    """'m ± s' (scaled); '–' for nan; the std is left out when there is only one seed."""
    if mean != mean:
        return "–"
    if std != std:
        return f"{mean * scale:.{digits}f}"
    return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}"


def markdown(rows: Sequence[dict], key: str = "last_mean", columns: Sequence[tuple[str, str, float, int]] = (),
             *, key_title: str = "acc %", scale: float = 100.0, last: int = DEFAULT_LAST,
             metric: str = "test/acc_mean", text_columns: Sequence[tuple[str, Callable[[dict], str]]] = (),
             notes: Sequence[str] = ()) -> str:
    """The summary as a Markdown table: group, row, seeds, the key column, Δ to the reference with
    the mark, the test samples per seed, then ``columns`` = (column, title, scale, digits) as
    mean ± std and ``text_columns`` = (title, row → text); ``notes`` are appended to the footer."""
    has_ref = any("reference" in r for r in rows)
    grouped = any(r["group"] for r in rows)
    head = (["group"] if grouped else []) + ["row", "seeds", f"{key_title} (mean ± std)"]
    if has_ref:
        head += ["Δ vs ref (paired)", "within spread"]
    head += ["test samples / seed"] + [c[1] for c in columns] + [t for t, _ in text_columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        seeds = str(r["seeds"]) + (f" ({r['failed']} failed)" if r.get("failed") else "")
        cells = ([r["group"]] if grouped else []) + [r["row"], seeds, fmt(r.get(f"{key}_mean", float("nan")),
                                                           r.get(f"{key}_std", float("nan")), scale)]
        if has_ref:
            cells += ["ref" if r.get("mark") == "ref" else fmt(r.get("delta_mean", float("nan")),
                                                               r.get("delta_std", float("nan")), scale),
                      r.get("mark", "") if r.get("mark") != "ref" else ""]
        test_n = r.get("test_n_mean", float("nan"))
        cells.append("–" if test_n != test_n else f"{test_n:,.0f}")
        for col, _, sc, digits in columns:
            cells.append(fmt(r.get(f"{col}_mean", float("nan")), r.get(f"{col}_std", float("nan")), sc, digits))
        cells += [fn(r) for _, fn in text_columns]
        lines.append("| " + " | ".join(cells) + " |")
    what = (f"{metric} averaged over the last {last} evaluations of each run" if key == "last_mean"
            else f"{metric} at the last evaluation" if key == "final"
            else f"the best {metric} of a run's evaluations" if key == "best" else key)
    footer = [f"{key_title}: {what}; mean ± sample std over the seeds."]
    if has_ref:
        footer.append(f"Δ vs ref: the paired difference to the group's reference row over the same seeds; "
                      f"{MARK}: the two rows differ by less than their spread (|Δ mean| < the larger std), "
                      f"so the table does not separate them.")
    footer.append("test samples / seed: the test-split samples behind one run's mean accuracy (every "
                  "evaluated client's split).")
    return "\n".join(lines + [""] + footer + list(notes))


def metric_tag(label: str) -> str:
    """An MLflow-safe metric name part (letters, digits, '_', '-', '.', '/', ' ')."""
    import re

    return re.sub(r"[^0-9A-Za-z_\-./ ]", "_", label.replace("+", "_plus_").replace("λ", "lam"))


__all__ = ["DEFAULT_LAST", "DEFAULT_SEEDS", "MARK", "add_seeds_argument", "aggregate", "check_seeds", "evaluations",
           "fmt", "last_mean", "markdown", "metric_tag", "test_samples"]
