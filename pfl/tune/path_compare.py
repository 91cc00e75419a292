"""The comparison of FPFC's two λ-tuning strategies, counted like for like (docs/methods/fpfc.md §4).

Both sides are counted per setting of the other hyperparameters (ρ, lr) and per seed: the warm-up
side is one λ path (its stages, playoff and final continuation), the separate side every λ of the
grid trained from scratch; each trains until the same convergence rule. Rounds and compute are
those of every trial of that side (compute: the trials' CPU seconds, rounds and evaluations, which
on shared CPUs depend far less on the load of the moment than wall time does). The
search over (ρ, lr) that chose the setting is charged to neither side. With several seeds each
figure is the mean ± the sample standard deviation over seeds, and a difference smaller than the
spread is reported as within it; with one seed there is no spread, and the tables say so.

:func:`recommend` names the pipeline's answer: the best validated model of everything it trained,
whichever strategy produced it.

Inputs are plain records, so the counting is testable without Ray or MLflow:

* a path: ``seed``, ``selected_lambda``, ``val``, ``test``, ``clusters``, ``ari``, ``rounds``
  (all its rounds), ``compute_s``, ``stages`` (each ``lambda``, ``rounds``, ``converged``, ``end``,
  ``val``, ``clusters``, ``compute_s``), ``playoff_rounds``, ``final_rounds``, ``converged``,
  ``decline_reached``, ``path_end``, ``run_id``;
* a separate run: ``seed``, ``lambda``, ``val``, ``test``, ``clusters``, ``ari``, ``rounds``,
  ``converged``, ``end``, ``compute_s``, ``run_id``.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from .path_settings import parsimonious


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (NaN for fewer than two values)."""
    values = [float(v) for v in values if v == v]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def separate_per_seed(runs: list[dict], sign: float = 1.0, noise: float = 0.0) -> list[dict]:
    """Each seed's separate strategy: every λ's run counted, the best validation λ selected (``sign``
    −1: the lowest validation score, e.g. RMSE) — or with ``noise`` > 0 the run with the fewest
    clusters within that many standard errors of it (:func:`.path_settings.parsimonious`, the rule
    the warm-up's playoff applies)."""
    by_seed: dict[int, list[dict]] = defaultdict(list)
    for run in runs:
        by_seed[int(run["seed"])].append(run)
    out = []
    for seed, group in sorted(by_seed.items()):
        best = group[parsimonious([(sign * r["val"], r.get("val_se", math.nan), r.get("clusters", math.nan))
                                   for r in group], noise)]
        out.append({"seed": seed, "selected_lambda": best["lambda"], "val": best["val"], "test": best["test"],
                    "clusters": best.get("clusters", math.nan), "ari": best.get("ari", math.nan),
                    "rounds": sum(r["rounds"] for r in group), "compute_s": sum(r["compute_s"] for r in group),
                    "models": len(group), "converged": sum(int(r["converged"]) for r in group),
                    "converged_of": len(group)})
    return out


def strategy_row(name: str, per_seed: list[dict]) -> dict:
    """One table row: means over seeds, and each figure's spread over them (NaN with one seed)."""
    row = {"strategy": name, "seeds": len(per_seed), "selected_lambda": [r["selected_lambda"] for r in per_seed],
           "spread_over": f"{len(per_seed)} seeds" if len(per_seed) > 1 else "one seed"}
    for key in ("val", "test", "clusters", "ari", "rounds", "compute_s"):
        row[key], row[key + "_sd"] = spread([r[key] for r in per_seed])
    row["models"] = sum(r.get("models", 1) for r in per_seed)
    row["converged"] = int(sum(r.get("converged", 0) for r in per_seed))
    row["converged_of"] = int(sum(r.get("converged_of", 1) for r in per_seed))
    return row


def recommend(paths: dict[str, list[dict]], runs: list[dict], sign: float = 1.0, noise: float = 2.0) -> dict | None:
    """The pipeline's answer among the warm-up's final models (``paths``: per strategy name, e.g. one
    per path order, one model per seed) and every λ trained from scratch (one per seed each): the
    candidate with the best mean validation score over the seeds
    (``sign`` −1: the lowest, e.g. RMSE) — or, among the candidates within ``noise`` standard errors
    of the difference from it, the one with the fewest clusters (then the better score): a
    difference the validation samples cannot resolve does not buy a more fragmented model (the
    one-standard-error rule of model selection, here with the decline rule's 2). A candidate's
    standard error is its seed spread over √seeds, or with one seed the binomial error of its
    validation estimate (``val_se``). A candidate is a strategy and its λ: the warm-up's λ may differ
    between seeds (each seed's is listed), and its model is the path's, not that λ from scratch."""
    candidates = [{"strategy": name, "members": group, "lambdas": [p["selected_lambda"] for p in group]}
                  for name, group in paths.items() if group]
    for lam in sorted({r["lambda"] for r in runs}):
        group = [r for r in runs if r["lambda"] == lam]
        candidates.append({"strategy": "separate", "members": group, "lambdas": [lam] * len(group)})
    if not candidates:
        return None
    for c in candidates:
        members = c["members"]
        for key in ("val", "test", "clusters", "ari"):
            c[key], c[key + "_sd"] = spread([m.get(key, math.nan) for m in members])
        c["score"] = sign * c["val"]
        c["se"] = (c["val_sd"] / math.sqrt(len(members)) if len(members) > 1
                   else float(members[0].get("val_se", math.nan)))
    best = max(candidates, key=lambda c: c["score"])
    chosen = candidates[parsimonious([(c["score"], c["se"], c["clusters"]) for c in candidates], noise)]
    out = {"strategy": chosen["strategy"], "lambdas": chosen["lambdas"], "seeds": len(chosen["members"]),
           "run_ids": [m.get("run_id", "") for m in chosen["members"]], "best_val": best["val"],
           "best_is": f"{best['strategy']} λ " + "/".join(f"{v:g}" for v in best["lambdas"]), "noise": noise,
           "parsimonious": chosen is not best}
    out.update({k: chosen[k] for key in ("val", "test", "clusters", "ari") for k in (key, key + "_sd")})
    return out


def recommendation_line(rec: dict) -> str:
    """The recommendation as one sentence."""
    lams = sorted(set(rec["lambdas"]))
    lam = f"λ {lams[0]:g}" if len(lams) == 1 else "λ " + "/".join(f"{v:g}" for v in rec["lambdas"]) + " (per seed)"
    how = "trained from scratch" if rec["strategy"] == "separate" else f"reached by the {rec['strategy']} path"
    spread_of = (lambda k: f" ± {100 * rec[k + '_sd']:.2f}" if rec[k + "_sd"] == rec[k + "_sd"] else "")
    over = f"mean ± sd over {rec['seeds']} seeds" if rec["seeds"] > 1 else "one seed"
    why = (f"the fewest clusters among the models within {rec['noise']:g} standard errors of the best validated one "
           f"({rec['best_is']}, val acc {100 * rec['best_val']:.2f} %)" if rec["parsimonious"]
           else "the best validated model of everything the pipeline trained")
    return (f"recommended: {lam}, {how} — val acc {100 * rec['val']:.2f}{spread_of('val')} %, test acc "
            f"{100 * rec['test']:.2f}{spread_of('test')} %, {rec['clusters']:.1f} clusters, ARI {rec['ari']:.2f} "
            f"({over}); {why}.")


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
                     "warmup_unchanged": sum(1 for s in stages if s.get("unchanged") == 1),
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


def _rounds(mean: float, n: int, capped: int, unchanged: int = 0) -> str:
    """Rounds to convergence and what ended the segments otherwise (a cap: the stage cap or the
    budget; unchanged: the new λ changed nothing, so the rule's minimum)."""
    if not n:
        return "–"
    notes = ([f"{capped} of {n} at a cap"] if capped else []) + ([f"{unchanged} unchanged"] if unchanged else [])
    return f"{mean:.0f}" + (f" ({'; '.join(notes)})" if notes else " (converged)")


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
            lines.append(f"| {r['lambda']:g} | "
                         f"{_rounds(r['warmup_rounds'], r['warmup_n'], r['warmup_capped'], r['warmup_unchanged'])} | "
                         f"{_rounds(r['separate_rounds'], r['separate_n'], r['separate_capped'])} | "
                         f"{_pm(r['warmup_val'], math.nan, '.4f')} | {_pm(r['separate_val'], math.nan, '.4f')} | "
                         f"{_pm(r['warmup_clusters'], math.nan, '.0f')} | "
                         f"{_pm(r['separate_clusters'], math.nan, '.0f')} | "
                         f"{_pm(r['warmup_compute_s'], math.nan, '.0f')} | "
                         f"{_pm(r['separate_compute_s'], math.nan, '.0f')} |")
    return "\n".join(lines)


def visited_runs(paths: list[dict], runs: list[dict]) -> list[dict]:
    """The separate runs of the λ values these paths visited: the separate side a path is counted
    against (several path orders in one pipeline run visit different λ; the sweep trains them all)."""
    visited = {st["lambda"] for p in paths for st in p["stages"]} | {p["selected_lambda"] for p in paths}
    return [r for r in runs if r["lambda"] in visited]


def verdict(warm: dict, sep: dict, against: str = "") -> str:
    """The closing line: λ, accuracy difference against the seed spread (both sides' spreads
    combined), rounds and compute ratios; ``against`` says which λ the separate side holds when it
    is not every λ trained from scratch."""
    diff = 100 * (warm["test"] - sep["test"])
    sds = [s for s in (warm["test_sd"], sep["test_sd"]) if s == s]
    if sds:
        noise = 100 * math.sqrt(sum(s * s for s in sds))
        within = f"{'within' if abs(diff) <= noise else 'beyond'} the seed spread of ± {noise:.2f} pt"
    else:
        within = "one seed: no spread, so no claim either way"
    rounds = sep["rounds"] / warm["rounds"] if warm["rounds"] else math.nan
    compute = sep["compute_s"] / warm["compute_s"] if warm["compute_s"] else math.nan
    lam = lambda r: "/".join(f"{v:g}" for v in r["selected_lambda"])  # noqa: E731
    return (f"{warm['strategy']} vs separate{against}: λ {lam(warm)} vs {lam(sep)}, test acc {diff:+.2f} pt ({within}), "
            f"{rounds:.1f}× fewer rounds and {compute:.1f}× less compute, per (ρ, lr) setting and seed, the "
            f"(ρ, lr) search charged to neither.")


def explanation(s, rows: list[dict], search: list[dict], walls: dict[str, float]) -> list[str]:
    """How each strategy ran and how each figure was counted (printed under the tables and kept in
    strategies.md); ``s``: the path settings, ``search``: the (ρ, lr) search trials' records."""
    residuals = (f"FPFC's ADMM residuals (primal, dual) at most {s.residual_tol:g} of their scales on average over "
                 "the rounds since the previous evaluation, and " if s.residual_tol > 0 else "")
    rule = (f"until convergence ({residuals}the best validation score of its last {s.window} evaluations, one every "
            f"{s.eval_every} rounds, at most {s.tolerance:g} above its best before them)")
    lines = []
    for r in rows:
        if r["strategy"] == "warmup":
            how = "a step" if s.extension == "step" else "a factor"
            extend = (f", extended past its end by {how} at a time while no stage fell more than {s.noise_se:g} "
                      f"standard errors of the difference below the best (at most {s.extend} λ)" if s.extend else "")
            playoff = (f"the {s.finalists} best stages continued from their own states to equal lineage rounds (the "
                       f"latest one's + {s.playoff_rounds}) and compared there; the best of them (or one with fewer "
                       "clusters within the noise) " if s.finalists > 1 else "the best stage ")
            order = " → ".join(f"{v:g}" for v in s.ordered())
            lines.append(f"warmup ({s.direction}): per seed one path through λ = {order}{extend}, "
                         f"each stage {rule} or {s.stage_cap} rounds; the path stops after {s.patience} stages in a "
                         f"row below the best; {playoff}continued until convergence; the path and the playoff stop at "
                         f"{s.budget} lineage rounds, the selected model at {s.budget} rounds at its λ (its stage "
                         "and playoff rounds included), as a separate run does.")
        else:
            lines.append(f"separate: every λ the warm-up visited trained from scratch {rule}, at most {s.budget} "
                         "rounds; the λ with the best final validation score selected, or one with fewer clusters "
                         f"within {s.noise_se:g} standard errors of the difference.")
    searched = sum(r["rounds"] for r in search)
    lines.append("columns: val / test acc = mean over clients of each client's own model on its validation / test "
                 "split, for the selected model (evaluated once more at the end, with the final read-out); clusters "
                 "and ARI = that model's read-out against the true clusters.")
    lines.append(
        "counting: rounds = every round one side computed for one (ρ, lr) setting and seed (warm-up: its path, "
        "playoff and final continuation; separate: every λ's run); compute s = the CPU seconds of those trials "
        "(rounds and evaluations; on shared CPUs a round's wall time moves with the load, so the sweeps' wall times "
        + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()) + " are not like for like); the (ρ, lr) search "
        f"({len(search)} warm-up trial(s), {searched:.0f} rounds, the best of them the first seed's path) is charged "
        "to neither side; ± = sample standard deviation over seeds (none with one seed). converged = models "
        "(warm-up: final models; separate: every λ's run) that ended on the rule rather than at the budget.")
    lines.append("per λ: rounds each λ trained, as a warm-started path stage and from scratch (the paper's Fig. 6 "
                 "bars), mean over seeds, with what ended the segments that did not converge.")
    if len(rows) == 2 and rows[0]["rounds"] and rows[0]["compute_s"]:
        lines.append(f"speedup (metrics speedup/rounds = {rows[1]['rounds'] / rows[0]['rounds']:.2f}, speedup/compute "
                     f"= {rows[1]['compute_s'] / rows[0]['compute_s']:.2f}): the separate side's rounds (CPU seconds) "
                     "over the warm-up side's, like for like: both for the chosen (ρ, lr) setting and per seed, every "
                     "λ run of the grid against every path, playoff and continuation round; the search's paths "
                     "(metrics search/paths, search/rounds) are in neither.")
    return lines
