"""The λ-tuning pipeline's records, read back from its sweeps' trial tables and MLflow runs.

:mod:`pfl.tune.path_compare` counts plain records; this module makes them from what the sweeps of
``pipelines/tune_fpfc.py`` left: a row of a sweep's trial table (a warm-up path or a separate run)
and, for a path, the per-stage metrics its trial logged (``stage/*``, one step per stage end).
"""

from __future__ import annotations

import math

from .path_report import SEGMENT_END_NAMES, STAGE_METRICS

NAN = math.nan


def best_row(table, metric: str = "val/acc_mean", sign: float = 1.0):
    """The trial with the best ``metric`` among those that finished (``sign`` −1: the lowest)."""
    ok = table[table["status"] == "OK"]
    if not len(ok):
        raise RuntimeError("every trial failed; see the MLflow runs' pfl.failure tags")
    return ok.sort_values(metric, ascending=sign < 0).iloc[0]


def ok_rows(table) -> list:
    return [row for _, row in table.iterrows() if row["status"] == "OK"]


def stage_history(run_id: str, prefix: str = "stage/") -> list[dict]:
    """The per-λ stage records a warm-up trial logged (one step per stage end; ``playoff/``: per
    finalist), under the records' keys (``end`` as its name)."""
    from ..tracking import client

    mc = client()
    stages: dict[int, dict] = {}
    for key, name in {**STAGE_METRICS, "end": "end"}.items():
        for m in mc.get_metric_history(run_id, prefix + name):
            stages.setdefault(m.step, {})[key] = SEGMENT_END_NAMES.get(m.value, "?") if key == "end" else m.value
    return [stages[i] for i in sorted(stages)]


def _common(row, metric: str, first_seed: int) -> dict:
    test = metric.replace("val/", "test/")
    return {"seed": int(row["seed"]) if "seed" in row and row["seed"] == row["seed"] else first_seed,
            "val": float(row[metric]), "val_se": float(row.get(metric.replace("_mean", "_se"), NAN)),
            "test": float(row.get(test, NAN)),
            "clusters": float(row.get("cluster/num", NAN)), "ari": float(row.get("cluster/ari", NAN)),
            "rounds": float(row["fpfc/total_rounds"]), "compute_s": float(row["fpfc/cpu_s"]),
            "converged": float(row["fpfc/converged"]), "run_id": row["mlflow_run_id"]}


def path_record(row, metric: str, first_seed: int, stages: bool) -> dict:
    """A warm-up trial as a path record (with its stages read from MLflow when ``stages``)."""
    record = {**_common(row, metric, first_seed), "selected_lambda": float(row["fpfc/selected_lambda"]),
              "playoff_rounds": float(row.get("fpfc/playoff_total_rounds", 0)),
              "final_rounds": float(row.get("fpfc/final_rounds", 0)),
              "decline_reached": float(row.get("fpfc/decline_reached", NAN)),
              "path_end": float(row.get("fpfc/path_end", NAN)), "frozen": float(row.get("fpfc/frozen", 0.0)),
              "stages": []}
    if stages:
        test = metric.replace("val/", "test/")
        record["stages"] = [{"lambda": st["lambda"], "rounds": st.get("rounds", NAN), "end": st.get("end", "?"),
                             "converged": st.get("converged", 0.0), "val": st.get(metric, NAN),
                             "test": st.get(test, NAN), "clusters": st.get("cluster/num", NAN),
                             "ari": st.get("cluster/ari", NAN), "ari_prev": st.get("ari_prev", NAN),
                             "unchanged": st.get("unchanged", 0.0), "lineage": st.get("lineage", NAN),
                             "compute_s": st.get("cpu_s", NAN)}
                            for st in stage_history(row["mlflow_run_id"])]
    return record


def run_record(row, metric: str, first_seed: int) -> dict:
    """A separate trial as a run record."""
    return {**_common(row, metric, first_seed), "lambda": float(row["method.lam"])}


def stage_lines(path: dict, direction: str) -> list[str]:
    """The path's stage report as Markdown: how each stage ended and how it moved the partition."""
    lines = [f"| stage ({direction}) | λ | rounds | ended | val acc | clusters | ARI (true) | ARI vs previous stage |",
             "|---|---|---|---|---|---|---|---|"]
    for i, st in enumerate(path["stages"]):
        moved = "–" if st["ari_prev"] != st["ari_prev"] else f"{st['ari_prev']:.2f}"
        if st.get("unchanged") == 1:
            moved += " (λ changed nothing)"
        lines.append(f"| {i + 1} | {st['lambda']:g} | {st['rounds']:.0f} | {st['end']} | {st['val']:.4f} | "
                     f"{st['clusters']:.0f} | {st['ari']:.2f} | {moved} |")
    end = {0.0: "a real decline (stages below the best by more than the noise)", 1.0: "the grid and its extension "
           "ran out without a real decline", 2.0: "the lineage's round budget"}.get(path.get("path_end"), "?")
    return lines + ["", f"The path (seed {path['seed']}) ended on {end}; selected λ {path['selected_lambda']:g}."]


def log_recommendation(top, rec: dict) -> None:
    """The recommended model on the pipeline run: tags, its figures over seeds (``recommended/*``) and
    the first seed's model's metrics under its trial's names (one runs-table column for all levels)."""
    from ..tracking import client

    top.set_tags({"pfl.recommended_lambda": " ".join(f"{v:g}" for v in rec["lambdas"]),
                  "pfl.recommended_strategy": rec["strategy"], "pfl.recommended_run_id": rec["run_ids"][0]})
    top.log_metrics({f"recommended/{k}{sd}": float(rec[k + sd]) for k in ("val", "test", "clusters", "ari")
                     for sd in ("", "_sd") if rec[k + sd] == rec[k + sd]})
    chosen = client().get_run(rec["run_ids"][0]).data.metrics
    top.log_metrics({k: float(v) for k, v in chosen.items()
                     if "/" in k and not k.startswith(("stage/", "playoff/")) and v == v})


__all__ = ["best_row", "log_recommendation", "ok_rows", "path_record", "run_record", "stage_history", "stage_lines"]
