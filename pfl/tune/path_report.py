"""What a λ-tuning trial writes about its schedule: the stage and playoff records as metrics, the
stage table (CSV) and the λ-path plot (PNG).

:mod:`pfl.tune.lambda_path` records the stages and imports this module to report them; the trainable
and the pipeline import both. Nothing here imports the path, so the imports go one way.
"""

from __future__ import annotations

import csv
from pathlib import Path

# a stage record's keys -> the names its MLflow metrics carry after the prefix (stage/, playoff/)
STAGE_METRICS = {"lambda": "lambda", "val/acc_mean": "val_acc", "val/rmse_mean": "val_rmse", "val/acc_se": "val_acc_se",
                 "val/rmse_se": "val_rmse_se", "test/acc_mean": "test_acc", "test/rmse_mean": "test_rmse",
                 "cluster/num": "clusters", "cluster/ari": "ari", "ari_prev": "ari_prev", "unchanged": "unchanged",
                 "rounds": "rounds", "converged": "converged", "primal_rel": "primal_rel", "dual_rel": "dual_rel",
                 "lineage": "lineage_rounds", "wall_s": "compute_time_s", "cpu_s": "cpu_time_s"}


def partition_change(before: list[int], after: list[int]) -> float:
    """How much a partition of the same devices moved: the adjusted Rand index between the two (1:
    the same partition, whatever the labels' names)."""
    from sklearn.metrics import adjusted_rand_score

    if len(set(before)) == 1 and len(set(after)) == 1:
        return 1.0   # both one cluster (sklearn agrees; said here so the case is plain)
    return float(adjusted_rand_score(before, after))


#: what a λ-tuning trial reports besides the run's own metrics
PATH_METRICS = ("fpfc/selected_lambda", "fpfc/total_rounds", "fpfc/path_stages", "fpfc/lineage_rounds",
                "fpfc/converged", "fpfc/path_rounds", "fpfc/playoff_total_rounds", "fpfc/final_rounds",
                "fpfc/grid_extended", "fpfc/decline_reached", "fpfc/path_end", "fpfc/frozen", "fpfc/budget_reached",
                "fpfc/trial_wall_s", "fpfc/compute_s", "fpfc/cpu_s", "stage/*", "playoff/*")
#: the run's metrics a stage record keeps
RECORD_KEYS = ("val/acc_mean", "val/rmse_mean", "val/acc_se", "val/rmse_se", "test/acc_mean", "test/rmse_mean",
               "cluster/num", "cluster/ari", "fpfc/readout_acc")


def stage_record(lam: float, metrics: dict, rounds: int, wall: float, **extra) -> dict:
    """A segment's record: its λ, rounds and time, the run's metrics of :data:`RECORD_KEYS` as they
    stood at its end, and ``extra`` (numbers, or text such as what ended it)."""
    out = {"lambda": float(lam), "rounds": float(rounds), "wall_s": wall}
    out.update({k: float(metrics[k]) for k in RECORD_KEYS if k in metrics})
    out.update({k: v if isinstance(v, str) else float(v) for k, v in extra.items()})
    return out


def stage_metrics(stage: dict, prefix: str = "stage/") -> dict[str, float]:
    """A path stage (or playoff match) as metrics (``stage/*``, ``playoff/*``); what ended it as
    ``stage/end`` (0 converged, 1 the stage cap, 2 the budget, 3 a playoff match's length, 4 left glued)."""
    out = {prefix + name: float(stage[key]) for key, name in STAGE_METRICS.items()
           if key in stage and stage[key] == stage[key]}
    if "end" in stage:
        out[prefix + "end"] = float(SEGMENT_ENDS.get(stage["end"], -1))
    return out


#: what ended a segment, as the number ``stage/end`` logs
SEGMENT_ENDS = {"converged": 0, "stage cap": 1, "budget": 2, "playoff": 3, "glued": 4}
#: and back, from the number to the name
SEGMENT_END_NAMES = {float(v): k for k, v in SEGMENT_ENDS.items()}


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


def _mean_by_lambda(records: list[dict], key: str) -> dict[float, float]:
    groups: dict[float, list[float]] = {}
    for r in records:
        value = r.get(key, float("nan"))
        if value == value:
            groups.setdefault(float(r["lambda"]), []).append(float(value))
    return {lam: sum(v) / len(v) for lam, v in sorted(groups.items())}


def plot_selection(paths: list[dict], runs: list[dict], separate_selected: list[float], path: Path,
                   score: str = "accuracy", playoff: list[dict] | None = None, title: str = "") -> Path:
    """The λ choice of both strategies on one λ axis: validation and test score against λ (warm-up:
    each path stage at its end, annotated with the rounds its lineage had trained by then; separate:
    each λ trained from scratch), the selected λ of each marked, the playoff's matches (equal
    rounds) as stars; below, #clusters and ARI against λ. Several seeds: means per λ.

    ``paths``: warm-up path records (``selected_lambda``, ``stages`` of ``lambda``, ``val``,
    ``test``, ``clusters``, ``ari``, ``lineage``); ``runs``: separate runs (``lambda``, ``val``,
    ``test``, ``clusters``, ``ari``), as in :mod:`pfl.tune.path_compare`."""
    from ..plots import plt

    stages = [s for p in paths for s in p["stages"]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.6, 7.2), dpi=100, sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    warm_c, sep_c = "C0", "C1"
    series = [(stages, warm_c, "warm-up path stage", "o"), (runs, sep_c, "separate (from scratch)", "s")]
    for records, color, who, marker in series:
        if not records:
            continue
        for key, style, what in (("val", "-", "val"), ("test", ":", "test")):
            points = _mean_by_lambda(records, key)
            top.plot(list(points), list(points.values()), color=color, linestyle=style, marker=marker,
                     markerfacecolor=color if key == "val" else "white", label=f"{who}: {what} {score}")
    if stages:  # a later λ of the path had also trained longer: the rounds it had had at its end
        val = _mean_by_lambda(stages, "val")
        for lam, rounds in _mean_by_lambda(stages, "lineage").items():
            top.annotate(f"{rounds:.0f} r", (lam, val[lam]), textcoords="offset points", xytext=(0, 8),
                         ha="center", fontsize=8, color=warm_c)
    if playoff:
        rounds = max(float(m.get("lineage", 0)) for m in playoff)
        top.scatter([m["lambda"] for m in playoff], [m.get("val", float("nan")) for m in playoff], marker="*",
                    s=160, color="C3", zorder=4, label=f"playoff: val {score} at {rounds:.0f} rounds each")
    chosen = [(sorted({float(p["selected_lambda"]) for p in paths}), warm_c, "warm-up"),
              (sorted({float(v) for v in separate_selected}), sep_c, "separate")]
    for lams, color, who in chosen:
        for i, lam in enumerate(lams):
            for ax in (top, bottom):
                ax.axvline(lam, color=color, linestyle="--", alpha=0.7, linewidth=1.2,
                           label=f"{who} selects λ = {', '.join(f'{v:g}' for v in lams)}" if ax is top and not i
                           else None)
    top.set_ylabel(score)
    top.legend(fontsize=7, loc="best")
    top.grid(alpha=0.3)
    top.set_title(title or "λ selection: both strategies")
    ari_ax = bottom.twinx()
    for records, color, who, marker in series:
        if not records:
            continue
        clusters = _mean_by_lambda(records, "clusters")
        ari = _mean_by_lambda(records, "ari")
        bottom.plot(list(clusters), list(clusters.values()), color=color, marker=marker, label=f"{who}: #clusters")
        ari_ax.plot(list(ari), list(ari.values()), color=color, marker=marker, linestyle=":", markerfacecolor="white",
                    label=f"{who}: ARI")
    bottom.set_xlabel("λ")
    bottom.set_ylabel("#clusters")
    ari_ax.set_ylabel("ARI")
    handles = [h + g for h, g in zip(bottom.get_legend_handles_labels(), ari_ax.get_legend_handles_labels())]
    if handles[0]:
        bottom.legend(*handles, fontsize=7, loc="best")
    bottom.grid(alpha=0.3)
    lams = sorted({float(r["lambda"]) for r in stages + runs})
    bottom.set_xticks(lams, [f"{v:g}" for v in lams])
    fig.tight_layout()
    fig.savefig(path, metadata={"Title": title or "λ selection: both strategies"})
    plt.close(fig)
    return path
