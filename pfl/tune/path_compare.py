"""The comparison of FPFC's two λ-tuning strategies, counted like for like (docs/methods/fpfc.md §4).

Both sides are counted per setting of the other hyperparameters (ρ, lr) and per seed: the warm-up
side is one λ path (its stages, playoff and final continuation), the separate side every λ of the
grid trained from scratch; each trains until the same convergence rule. Rounds and compute are
those of every trial of that side (compute: the trials' CPU seconds, rounds and evaluations, which
on shared CPUs depend far less on the load of the moment than wall time does). The
search over (ρ, lr) that chose the setting is charged to neither side. With several seeds each
figure is the mean ± the sample standard deviation over seeds; with one seed the warm-up side's
spread over its search trials stands in (other ρ / lr, so an upper bound of noise), and a
difference smaller than the spread is reported as within it.

Inputs are plain records, so the counting is testable without Ray or MLflow:

* a path: ``seed``, ``selected_lambda``, ``val``, ``test``, ``clusters``, ``ari``, ``rounds``
  (all its rounds), ``compute_s``, ``stages`` (each ``lambda``, ``rounds``, ``converged``,
  ``val``, ``clusters``, ``compute_s``), ``playoff_rounds``, ``final_rounds``, ``converged``, ``decline_reached``;
* a separate run: ``seed``, ``lambda``, ``val``, ``test``, ``clusters``, ``ari``, ``rounds``,
  ``converged``, ``compute_s``.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (NaN for fewer than two values)."""
    values = [float(v) for v in values if v == v]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def separate_per_seed(runs: list[dict], sign: float = 1.0) -> list[dict]:
    """Each seed's separate strategy: every λ's run counted, the best validation λ selected (``sign``
    −1: the lowest validation score, e.g. RMSE)."""
    by_seed: dict[int, list[dict]] = defaultdict(list)
    for run in runs:
        by_seed[int(run["seed"])].append(run)
    out = []
    for seed, group in sorted(by_seed.items()):
        best = max(group, key=lambda r: sign * r["val"])
        out.append({"seed": seed, "selected_lambda": best["lambda"], "val": best["val"], "test": best["test"],
                    "clusters": best.get("clusters", math.nan), "ari": best.get("ari", math.nan),
                    "rounds": sum(r["rounds"] for r in group), "compute_s": sum(r["compute_s"] for r in group),
                    "models": len(group), "converged": sum(int(r["converged"]) for r in group),
                    "converged_of": len(group)})
    return out


def strategy_row(name: str, per_seed: list[dict], noise_from: list[dict] | None = None) -> dict:
    """One table row: means over seeds, and each figure's spread (over seeds, or over ``noise_from``
    — the search trials — when there is a single seed)."""
    source = per_seed if len(per_seed) > 1 or not noise_from else noise_from
    row = {"strategy": name, "seeds": len(per_seed), "selected_lambda": [r["selected_lambda"] for r in per_seed],
           "spread_over": (f"{len(per_seed)} seeds" if len(per_seed) > 1 else
                           f"{len(noise_from)} search trials (other ρ, lr)" if noise_from and len(noise_from) > 1
                           else "none (one seed)")}
    for key in ("val", "test", "clusters", "ari", "rounds", "compute_s"):
        mean = spread([r[key] for r in per_seed])[0]
        row[key] = mean
        row[key + "_sd"] = spread([r[key] for r in source])[1] if len(source) > 1 else math.nan
    row["models"] = sum(r.get("models", 1) for r in per_seed)
    row["converged"] = int(sum(r.get("converged", 0) for r in per_seed))
    row["converged_of"] = int(sum(r.get("converged_of", 1) for r in per_seed))
    return row


def per_lambda(paths: list[dict], runs: list[dict]) -> list[dict]:
    """Rounds (and compute) each λ took to converge: a warm-started path stage vs from scratch
    (the paper's Fig. 6 bars), mean over seeds; ``*_capped``: how many ended at a cap instead."""
    lambdas = sorted({s["lambda"] for p in paths for s in p["stages"]} | {r["lambda"] for r in runs})
    rows = []
    for lam in lambdas:
        stages = [s for p in paths for s in p["stages"] if s["lambda"] == lam]
        scratch = [r for r in runs if r["lambda"] == lam]
        rows.append({"lambda": lam,
                     "warmup_rounds": spread([s["rounds"] for s in stages])[0], "warmup_n": len(stages),
                     "warmup_capped": sum(1 for s in stages if not s["converged"]),
                     "warmup_val": spread([s["val"] for s in stages])[0],
                     "warmup_compute_s": spread([s.get("compute_s", math.nan) for s in stages])[0],
                     "warmup_clusters": spread([s.get("clusters", math.nan) for s in stages])[0],
                     "separate_rounds": spread([r["rounds"] for r in scratch])[0], "separate_n": len(scratch),
                     "separate_capped": sum(1 for r in scratch if not r["converged"]),
                     "separate_val": spread([r["val"] for r in scratch])[0],
                     "separate_compute_s": spread([r["compute_s"] for r in scratch])[0],
                     "separate_clusters": spread([r.get("clusters", math.nan) for r in scratch])[0]})
    return rows


def _pm(mean: float, sd: float, fmt: str) -> str:
    if mean != mean:
        return "–"
    return format(mean, fmt) + ("" if sd != sd else " ± " + format(sd, fmt))


def _rounds(mean: float, n: int, capped: int) -> str:
    if not n:
        return "–"
    return f"{mean:.0f}" + (f" ({capped} of {n} at the cap)" if capped else "")


def markdown(rows: list[dict], lambdas: list[dict]) -> str:
    """The two tables as Markdown pipe tables."""
    lines = ["| strategy | selected λ (per seed) | val acc | test acc | clusters | ARI | rounds | compute s | "
             "models trained | converged | ± over |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {', '.join(f'{v:g}' for v in r['selected_lambda'])} | "
                     f"{_pm(r['val'], r['val_sd'], '.4f')} | {_pm(r['test'], r['test_sd'], '.4f')} | "
                     f"{_pm(r['clusters'], r['clusters_sd'], '.1f')} | {_pm(r['ari'], r['ari_sd'], '.2f')} | "
                     f"{_pm(r['rounds'], r['rounds_sd'], '.0f')} | {_pm(r['compute_s'], r['compute_s_sd'], '.0f')} | "
                     f"{r['models']} | {r['converged']} of {r['converged_of']} | {r['spread_over']} |")
    if lambdas:
        lines += ["", "| λ | warm-up stage rounds | from scratch rounds | warm-up stage val acc | "
                      "from scratch val acc | warm-up stage clusters | from scratch clusters | "
                      "warm-up stage compute s | from scratch compute s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in lambdas:
            lines.append(f"| {r['lambda']:g} | {_rounds(r['warmup_rounds'], r['warmup_n'], r['warmup_capped'])} | "
                         f"{_rounds(r['separate_rounds'], r['separate_n'], r['separate_capped'])} | "
                         f"{_pm(r['warmup_val'], math.nan, '.4f')} | {_pm(r['separate_val'], math.nan, '.4f')} | "
                         f"{_pm(r['warmup_clusters'], math.nan, '.0f')} | "
                         f"{_pm(r['separate_clusters'], math.nan, '.0f')} | "
                         f"{_pm(r['warmup_compute_s'], math.nan, '.0f')} | "
                         f"{_pm(r['separate_compute_s'], math.nan, '.0f')} |")
    return "\n".join(lines)


def verdict(warm: dict, sep: dict) -> str:
    """The closing line: λ, accuracy difference against its spread (both sides' spreads combined;
    a side without one is named), rounds and compute ratios."""
    diff = 100 * (warm["test"] - sep["test"])
    sds = [s for s in (warm["test_sd"], sep["test_sd"]) if s == s]
    if sds:
        noise = 100 * math.sqrt(sum(s * s for s in sds))
        within = f"{'within' if abs(diff) <= noise else 'beyond'} the spread of ± {noise:.2f} pt"
        missing = [r["strategy"] for r in (warm, sep) if r["test_sd"] != r["test_sd"]]
        if missing:
            within += f"; the {missing[0]} side's spread not measured"
    else:
        within = "no spread measured: one seed, one trial"
    rounds = sep["rounds"] / warm["rounds"] if warm["rounds"] else math.nan
    compute = sep["compute_s"] / warm["compute_s"] if warm["compute_s"] else math.nan
    lam = lambda r: "/".join(f"{v:g}" for v in r["selected_lambda"])  # noqa: E731
    return (f"warmup vs separate: λ {lam(warm)} vs {lam(sep)}, test acc {diff:+.2f} pt ({within}), "
            f"{rounds:.1f}× fewer rounds and {compute:.1f}× less compute to convergence, per (ρ, lr) setting "
            f"and seed, the (ρ, lr) search charged to neither.")


def explanation(s, rows: list[dict], search: list[dict], walls: dict[str, float]) -> list[str]:
    """How each strategy ran and how each figure was counted (printed under the tables and kept in
    strategies.md); ``s``: the path settings, ``search``: the (ρ, lr) search trials' records."""
    rule = (f"until convergence (the best validation score of its last {s.window} evaluations, one every "
            f"{s.eval_every} rounds, at most {s.tolerance:g} above its best before them)")
    lines = []
    for r in rows:
        if r["strategy"] == "warmup":
            extend = f", extended past its end while validation still rose (at most {s.extend} λ)" if s.extend else ""
            playoff = (f"the {s.finalists} best stages continued from their own states to equal lineage rounds (the "
                       f"latest one's + {s.playoff_rounds}) and compared there; the best of them " if s.finalists > 1
                       else "the best stage ")
            order = " → ".join(f"{v:g}" for v in s.ordered())
            lines.append(f"warmup: per seed one path through λ = {order}{extend}, "
                         f"each stage {rule} or {s.stage_cap} rounds; {playoff}continued until convergence; no "
                         f"lineage past {s.budget} rounds.")
        else:
            lines.append(f"separate: every λ the warm-up visited trained from scratch {rule}, at most {s.budget} "
                         "rounds; the λ with the best final validation score selected.")
    searched = sum(r["rounds"] for r in search)
    lines.append("columns: val / test acc = mean over clients of each client's own model on its validation / test "
                 "split, for the selected model (evaluated once more at the end, with the final read-out); clusters "
                 "and ARI = that model's read-out (components of ‖θ_ij‖ < ν) against the true clusters.")
    lines.append(
        "counting: rounds = every round one side computed for one (ρ, lr) setting and seed (warm-up: its path, "
        "playoff and final continuation; separate: every λ's run); compute s = the CPU seconds of those trials "
        "(rounds and evaluations; on shared CPUs a round's wall time moves with the load, so the sweeps' wall times "
        + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()) + " are not like for like); the (ρ, lr) search "
        f"({len(search)} warm-up trial(s), {searched:.0f} rounds, the best of them the first seed's path) is charged "
        "to neither side; ± = sample standard deviation over seeds, or with one seed the spread of the warm-up "
        "search trials (other ρ, lr: more than seed noise). converged = models (warm-up: final models; separate: "
        "every λ's run) that ended on the rule rather than at the budget.")
    lines.append("per λ: rounds each λ trained until convergence, as a warm-started path stage and from scratch "
                 "(the paper's Fig. 6 bars), mean over seeds.")
    if len(rows) == 2 and rows[0]["rounds"] and rows[0]["compute_s"]:
        lines.append(f"speedup (metrics speedup/rounds = {rows[1]['rounds'] / rows[0]['rounds']:.2f}, speedup/compute "
                     f"= {rows[1]['compute_s'] / rows[0]['compute_s']:.2f}): the separate side's rounds (CPU seconds) "
                     "over the warm-up side's, like for like: both for the chosen (ρ, lr) setting and per seed, every "
                     "λ run of the grid against every path, playoff and continuation round; the search's paths "
                     "(metrics search/paths, search/rounds) are in neither.")
    return lines
