"""FPFC's λ tuning: warm-started λ path vs separate runs, on Ray Tune, logged to MLflow.

    python pipelines/tune_fpfc.py                       # embedded default: local Ray, ./mlflow.db, S1
    python pipelines/tune_fpfc.py --smoke               # ~2 minutes
    python pipelines/tune_fpfc.py --preset paper        # the paper's scale
    python pipelines/tune_fpfc.py --strategy separate   # only the separate strategy
    python pipelines/tune_fpfc.py --direction descending # the other path order (docs/methods/fpfc.md §4)

Trials run in parallel over the other hyperparameters of search_spaces/fpfc.yaml (Optuna); each
warmup trial walks the λ path (pfl/tune/lambda_path.py). The separate strategy trains every λ of
the grid from scratch with the best warmup trial's other hyperparameters. The pipeline run (MLflow
parent) holds both strategies' sweeps as children (trials below them), the comparison table
(Parquet + CSV: selected λ, test accuracy, #clusters, ARI, total rounds, wall time) and the best
warmup trial's λ-path plot and per-λ metrics.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pfl.schema import ConfigError, from_dict, to_dict  # noqa: E402


def apply_preset(space, name: str | None):
    """A copy of ``space`` with the preset's config/pipeline values and trial count applied."""
    space = copy.deepcopy(space)
    if not name:
        return space
    if name not in space.presets:
        raise ConfigError("--preset", f"unknown preset {name!r}; allowed: {', '.join(sorted(space.presets))}")
    preset = space.presets[name]
    unknown = set(preset) - {"config", "fixed", "search", "pipeline", "num_samples"}
    if unknown:
        raise ConfigError(f"presets.{name}", f"unknown keys {sorted(unknown)}; "
                                             "allowed: config, fixed, search, pipeline, num_samples")
    space.base = {**space.base, **preset.get("config", {})}
    space.fixed = {**space.fixed, **preset.get("fixed", {})}
    if "search" in preset:  # a preset's search replaces the file's (an empty one: a single setting)
        space.search = dict(preset["search"] or {})
        space.validate(f"presets.{name}")
    space.pipeline = {**space.pipeline, **preset.get("pipeline", {})}
    space.num_samples = int(preset.get("num_samples", space.num_samples))
    return space


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--space", default=str(Path(__file__).resolve().parents[1] / "search_spaces" / "fpfc.yaml"))
    parser.add_argument("--smoke", action="store_true", help="the 'smoke' preset (about 2 minutes)")
    parser.add_argument("--preset", help="a preset of the space file, e.g. paper")
    parser.add_argument("--strategy", default="both", choices=("warmup", "separate", "both"))
    parser.add_argument("--direction", choices=("ascending", "descending"), help="override the path order")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="dotted config overrides for every trial")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run of the same name")
    parser.add_argument("--name", help="name of the pipeline run (default: tune_fpfc[-preset])")
    parser.add_argument("--storage", default="ray_results")
    parser.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else local)")
    parser.add_argument("--resources", help="per-trial resources, e.g. cpu=1,gpu=0.25")
    args = parser.parse_args(argv)
    try:
        return run(args, argv)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2


def run(args, argv: list[str] | None = None) -> int:
    import pandas as pd

    from pfl.tracking import tracking_uri
    from pfl.tune.fpfc_trainable import fpfc_path_trainable, plot_path, stage_metrics
    from pfl.resolver import resolve
    from pfl.tune.lambda_path import PATH_METRICS, PathSettings, require_validation
    from pfl.tune.space import base_config, check_space, load_space
    from pfl.tune.sweep import parse_resources, run_sweep

    preset = "smoke" if args.smoke else args.preset
    space = apply_preset(load_space(args.space), preset)
    pipeline = dict(space.pipeline)
    if args.direction:
        pipeline["direction"] = args.direction
    settings = from_dict(PathSettings, pipeline, "pipeline")
    raw = base_config(space, args.set)
    check_space(space, raw, PATH_METRICS)  # everything validated before Ray starts
    require_validation(resolve(raw))
    name = args.name or "tune_fpfc" + (f"-{preset}" if preset else "")
    resources = parse_resources(args.resources)

    started = time.perf_counter()
    top = pipeline_run(name, args, preset, settings)
    rows = []
    warm = None
    common = dict(overrides=args.set, resume=args.resume, address=args.address, resources=resources,
                  storage=args.storage, trainable=fpfc_path_trainable, pipeline_run_id=top.run_id,
                  extra_metrics=PATH_METRICS)
    if args.strategy in ("warmup", "both"):
        print(f"\n== warmup strategy: λ path {settings.ordered()} ({settings.direction}) ==")
        warm = run_sweep(space, name=f"{name}-warmup", setup_extra={"path": to_dict(settings), "strategy": "warmup"},
                         parent_tags={"pfl.strategy": "warmup"}, label_prefix="warmup path", **common)
        if warm.status != "FINISHED":
            return stopped("warmup", warm, space, top, argv)
        # rounds one hyperparameter setting costs: one path (mean over the Optuna trials)
        rows.append(strategy_row("warmup", warm, total_of=lambda t: t["fpfc/total_rounds"].mean()))
    if args.strategy in ("separate", "both"):
        separate_space = copy.deepcopy(space)
        fixed = dict(separate_space.fixed)
        if warm is not None and warm.best_config:
            fixed.update(warm.best_config)  # the best other hyperparameters of the warmup sweep
        separate_space.fixed = fixed
        separate_space.search = {"method.lam": {"type": "grid", "values": list(settings.lambdas)}}
        separate_space.validate("")
        separate_space.searcher, separate_space.num_samples = "grid", 1
        print(f"\n== separate strategy: every λ of {sorted(settings.lambdas)} from scratch, "
              f"{settings.budget} rounds each ==")
        sep = run_sweep(separate_space, name=f"{name}-separate",
                        setup_extra={"path": to_dict(settings), "strategy": "separate"},
                        parent_tags={"pfl.strategy": "separate"}, label_prefix="separate", **common)
        if sep.status != "FINISHED":
            return stopped("separate", sep, separate_space, top, argv)
        # rounds one hyperparameter setting costs: every λ of the grid from scratch
        rows.append(strategy_row("separate", sep, total_of=lambda t: t["fpfc/total_rounds"].sum()))
    table = pd.DataFrame(rows)
    wall = time.perf_counter() - started
    text = report(rows, settings)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        table.to_parquet(out / "strategies.parquet")
        table.to_csv(out / "strategies.csv", index=False)
        (out / "strategies.md").write_text(text + "\n")
        for fname in ("strategies.parquet", "strategies.csv", "strategies.md"):
            top.log_artifact(out / fname)
        if warm is not None and len(warm.table):
            best_trial = best_row(warm.table)
            stages = stage_history(best_trial["mlflow_run_id"])
            step = 0
            for stage in stages:  # step = rounds of the path so far, as in the trial's run
                step += int(stage.get("rounds", 0))
                top.log_metrics(stage_metrics(stage), step=step)
            playoff = stage_history(best_trial["mlflow_run_id"], "playoff/")
            if stages:
                top.log_artifact(plot_path(stages, out / "lambda_path.png",
                                           f"best warmup trial ({settings.direction}); each λ at the end of its stage",
                                           playoff), "plots")
    for row in rows:
        top.log_metrics({f"{row['strategy']}/{k}": float(v) for k, v in row.items()
                         if k not in ("strategy",) and isinstance(v, (int, float))})
        top.set_tags({f"selected_lambda.{row['strategy']}": f"{row['selected_lambda']:g}"})
    if len(rows) == 2 and rows[0]["total_rounds"]:
        top.log_metrics({"speedup/rounds": rows[1]["total_rounds"] / rows[0]["total_rounds"],
                         "speedup/wall": rows[1]["wall_s"] / max(rows[0]["wall_s"], 1e-9)})
    top.log_metrics({"pipeline/wall_s": wall})
    top.set_tags({"pfl.status": "finished"})
    top.end("FINISHED")

    print("\n" + text)
    print(f"\npipeline wall time {wall:.0f} s; MLflow pipeline run {top.run_id}; "
          f"view: mlflow ui --backend-store-uri {tracking_uri()}")
    return 0


def pipeline_run(name: str, args, preset: str | None, settings):
    """The pipeline's MLflow parent run: a new one, or with --resume the one this name started."""
    import json

    from pfl.tracking import Tracker

    state = Path(args.storage).resolve() / f"{name}.pipeline.json"
    if args.resume and state.is_file():
        run_id = json.loads(state.read_text()).get("run_id")
        if run_id:
            return Tracker.resume(run_id)
    top = Tracker.start(None, run_name=name, sweep=True,
                        tags={"pfl.kind": "pipeline", "pfl.pipeline": "tune_fpfc",
                              "mlflow.note.content": "FPFC's λ tuning: a warm-started λ path against every λ "
                                                     "trained from scratch (the paper's Table 2). The two "
                                                     "sweeps are child runs, their trials grandchildren."})
    top.log_params({"space": args.space, "preset": preset or "default", "strategy": args.strategy,
                    **{f"path.{k}": v for k, v in to_dict(settings).items()}})
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"run_id": top.run_id}))
    return top


def report(rows: list[dict], settings) -> str:
    """The comparison table with what each column means and how each strategy chose its λ."""
    import pandas as pd

    shown = pd.DataFrame([{
        "strategy": r["strategy"], "selected λ": f"{r['selected_lambda']:g}", "val acc": f"{r['val_acc']:.4f}",
        "test acc": f"{r['test_acc']:.4f}", "clusters": "-" if r["clusters"] != r["clusters"] else int(r["clusters"]),
        "ARI": f"{r['ari']:.2f}", "rounds": r["total_rounds"], "trials": r["trials"], "wall s": f"{r['wall_s']:.0f}",
    } for r in rows])
    lines = ["== λ tuning: warm-started path vs separate runs (cf. the paper's Table 2) ==",
             shown.to_string(index=False), ""]
    playoff = (f", then a playoff: the {settings.finalists} best stages continued {settings.playoff_rounds} "
               "rounds each" if settings.finalists > 1 else "")
    for r in rows:
        if r["strategy"] == "warmup":
            lines.append(f"warmup: one path through λ = {' → '.join(f'{v:g}' for v in settings.ordered())} "
                         f"from a single start; each λ trained until its validation accuracy settled{playoff}; "
                         f"λ = {r['selected_lambda']:g} had the best validation accuracy and was continued to "
                         f"{settings.budget} rounds (counting the path rounds it inherited).")
        else:
            lines.append(f"separate: every λ of the grid trained from scratch for {settings.budget} rounds; "
                         f"λ = {r['selected_lambda']:g} had the best final validation accuracy.")
    lines += ["columns: val / test acc = mean over clients of each client's own model on its validation / test "
              "split, for the selected λ's final model; clusters and ARI = that model's read-out "
              "(components of ‖θ_ij‖ < ν) against the true clusters; rounds = rounds computed (warmup: per path, "
              "mean over its trials; separate: summed over the λ grid); wall s = the strategy's sweep time.",
              "the λ-path plot shows each λ at the end of its stage, before the chosen one was continued, so "
              "its cluster counts can differ from the final ones above."]
    if len(rows) == 2 and rows[0]["total_rounds"]:
        w, sep = rows
        lines.append(f"warmup vs separate: λ {w['selected_lambda']:g} vs {sep['selected_lambda']:g}, test acc "
                     f"{100 * (w['test_acc'] - sep['test_acc']):+.2f} pt, {sep['total_rounds'] / w['total_rounds']:.1f}× "
                     f"fewer rounds, {sep['wall_s'] / max(w['wall_s'], 1e-9):.1f}× less wall time.")
    import textwrap

    return "\n".join(lines[:3] + [textwrap.fill(ln, 100, subsequent_indent="  ") for ln in lines[3:]])


def stopped(strategy: str, result, space, top, argv) -> int:
    """An interrupted or wholly failed strategy ends the pipeline: its outcome, how to resume."""
    from sweep import print_outcome  # the sweep pipeline's report (pipelines/sweep.py)

    print(f"\n== {strategy} strategy did not finish ==")
    code = print_outcome(result, space, argv)
    top.set_tags({"pfl.status": result.status.lower()})
    top.end("KILLED" if result.status == "INTERRUPTED" else "FAILED")
    return code


def best_row(table):
    ok = table[table["status"] == "OK"]
    if not len(ok):
        raise RuntimeError("every trial failed; see the MLflow runs' pfl.failure tags")
    return ok.sort_values("val/acc_mean", ascending=False).iloc[0]


def strategy_row(strategy: str, result, total_of) -> dict:
    table = result.table
    best = best_row(table)
    return {
        "strategy": strategy,
        "selected_lambda": float(best["fpfc/selected_lambda"]),
        "val_acc": float(best["val/acc_mean"]),
        "test_acc": float(best.get("test/acc_mean", float("nan"))),
        "clusters": float(best.get("cluster/num", float("nan"))),
        "ari": float(best.get("cluster/ari", float("nan"))),
        "trials": int(len(table)),
        "total_rounds": int(round(float(total_of(table)))),
        "wall_s": round(result.wall_s, 1),
    }


def stage_history(run_id: str, prefix: str = "stage/") -> list[dict]:
    """The per-λ stage metrics a warmup trial logged (one step per stage end; ``playoff/``: per finalist)."""
    from pfl.tracking import client
    from pfl.tune.fpfc_trainable import STAGE_METRICS

    mc = client()
    stages: dict[int, dict] = {}
    for key, name in STAGE_METRICS.items():
        for m in mc.get_metric_history(run_id, prefix + name):
            stages.setdefault(m.step, {})[key] = m.value
    return [stages[i] for i in sorted(stages)]


if __name__ == "__main__":
    sys.exit(main())
