"""FPFC's λ tuning: warm-started λ path vs separate runs, to convergence, on Ray Tune, logged to MLflow.

    python pipelines/tune_fpfc.py                       # embedded default: local Ray, ./mlflow.db, S1
    python pipelines/tune_fpfc.py --seeds 3             # both strategies on 3 seeds: ± over seeds
    python pipelines/tune_fpfc.py --smoke               # ~3 minutes
    python pipelines/tune_fpfc.py --preset paper        # the paper's scale and N(0,1) start
    python pipelines/tune_fpfc.py --strategy separate   # only the separate strategy
    python pipelines/tune_fpfc.py --direction ascending  # another path order (docs/methods/fpfc.md §4)

The warm-up sweep searches the other hyperparameters of search_spaces/fpfc.yaml (Optuna); each
trial walks the λ path (pfl/tune/lambda_path.py). With ``--seeds N`` the chosen setting's path is
run on N − 1 more seeds. The separate strategy trains every λ the warm-up visited from scratch,
with the chosen setting, on every seed. Every stage and every run ends on the same convergence
rule (FPFC's ADMM residuals and validation). The comparison (pfl/tune/path_compare.py) counts both
sides per setting and seed; the run closes with the recommended λ: the best validated model of
everything it trained, whichever strategy produced it. The pipeline run (MLflow parent) holds the
sweeps as children (trials below them), the tables (strategies.md / .csv / .parquet,
per_lambda.csv), the best warm-up trial's λ-path plot and per-λ metrics, and the recommended
model's metrics and tags.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path


from pfl.schema import ConfigError, from_dict, to_dict
from pfl.tune.path_settings import DIRECTIONS


def apply_preset(space, name: str | None):
    """A copy of ``space`` with the preset's config/pipeline values and trial count applied."""
    space = copy.deepcopy(space)
    if not name:
        return space
    if name not in space.presets:
        raise ConfigError("--preset", f"unknown preset {name!r}; allowed: {', '.join(sorted(space.presets))}")
    preset = space.presets[name]
    unknown = set(preset) - {"scenario", "config", "fixed", "search", "pipeline", "num_samples"}
    if unknown:
        raise ConfigError(f"presets.{name}", f"unknown keys {sorted(unknown)}; "
                                             "allowed: scenario, config, fixed, search, pipeline, num_samples")
    if "scenario" in preset:  # another federation: its scenario replaces the file's
        space.scenario = preset["scenario"]
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
    parser.add_argument("--smoke", action="store_true", help="the 'smoke' preset (about 3 minutes)")
    parser.add_argument("--preset", help="a preset of the space file, e.g. paper")
    parser.add_argument("--strategy", default="both", choices=("warmup", "separate", "both"))
    parser.add_argument("--direction", nargs="+", choices=DIRECTIONS, metavar="DIRECTION",
                        help=f"the path order ({', '.join(DIRECTIONS)}); several: the first is searched and "
                             "recommended as the warm-up, the others walk at its chosen setting on every seed")
    parser.add_argument("--seeds", type=int, default=1, metavar="N",
                        help="seeds per strategy at the chosen (ρ, lr): the table's ± is over them (default 1: "
                             "no spread)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="dotted config overrides for every trial")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run of the same name")
    parser.add_argument("--name", help="name of the pipeline run (default: tune_fpfc[-preset])")
    parser.add_argument("--storage", default="ray_results")
    parser.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else local)")
    parser.add_argument("--resources", help="per-trial resources, e.g. cpu=1,gpu=0.25")
    args = parser.parse_args(argv)
    try:
        if args.seeds < 1:
            raise ConfigError("--seeds", f"at least 1, got {args.seeds}")
        return run(args, argv)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2


def with_search(space, fixed: dict, search: dict):
    """A copy of ``space`` with ``fixed`` added and a grid ``search`` (key -> values) instead of its own."""
    out = copy.deepcopy(space)
    out.fixed = {**out.fixed, **fixed}
    out.search = {k: {"type": "grid", "values": list(v)} for k, v in search.items()}
    out.validate("")
    out.searcher, out.num_samples = "grid", 1
    return out


def run(args, argv: list[str] | None = None) -> int:
    from pfl.resolver import resolve
    from pfl.server_memory import check_server_memory
    from pfl.tracking import check_store
    from pfl.tune.lambda_path import PATH_METRICS, PathSettings, require_validation
    from pfl.tune.space import base_config, check_space, load_space
    from pfl.tune.sweep import parse_resources

    preset = "smoke" if args.smoke else args.preset
    space = apply_preset(load_space(args.space), preset)
    pipeline = dict(space.pipeline)
    if args.direction:
        if len(set(args.direction)) != len(args.direction):
            raise ConfigError("--direction", f"each direction once, got {' '.join(args.direction)}")
        pipeline["direction"] = args.direction[0]
    settings = from_dict(PathSettings, pipeline, "pipeline")
    raw = base_config(space, args.set)
    check_space(space, raw, PATH_METRICS)  # everything validated before Ray starts
    cfg = resolve(raw)
    require_validation(cfg)
    # a trial keeps the live state and the finalists' snapshots: all must fit, before the pipeline's run or Ray
    check_server_memory(cfg, here=False, copies=1 + settings.finalists,
                        copies_note=f"the live state and {settings.finalists} finalists' snapshots")
    if space.metric not in ("val/acc_mean", "val/rmse_mean"):
        raise ConfigError("metric", f"λ tuning selects by val/acc_mean (or val/rmse_mean), got {space.metric!r}")
    name = args.name or "tune_fpfc" + (f"-{preset}" if preset else "")
    args.argv = argv
    seeds = [cfg.seed + i for i in range(args.seeds)]
    ctx = Context(args, space, settings, seeds, name, parse_resources(args.resources))
    if cfg.tracking.enabled:
        check_store()  # an unreachable store fails here, before the pipeline's run or Ray
    started = time.perf_counter()
    ctx.top = pipeline_run(name, args, preset, settings)
    code = ctx.warmup() if args.strategy in ("warmup", "both") else 0
    if code == 0 and args.strategy in ("separate", "both"):
        code = ctx.separate()
    if code:
        return code
    return finish(ctx, time.perf_counter() - started)


class Context:
    """The pipeline's sweeps and what they measured, as the records of pfl/tune/path_compare.py."""

    def __init__(self, args, space, settings, seeds, name, resources):
        from pfl.tune.lambda_path import PATH_METRICS

        self.args, self.space, self.settings, self.seeds, self.name = args, space, settings, seeds, name
        self.metric = space.metric
        self.sign = 1.0 if space.mode == "max" else -1.0
        self.top = None
        self.best_config: dict = {}
        self.paths: list[dict] = []       # warm-up paths at the chosen (ρ, lr), one per seed
        self.others: dict[str, list[dict]] = {}   # the other directions' paths at that setting, per seed
        self.search: list[dict] = []      # every trial of the (ρ, lr) search
        self.runs: list[dict] = []        # separate runs, one per λ and seed
        self.best_trial = None
        self.separate_table = None
        self.walls: dict[str, float] = {}
        # the λ path sets each trial's evaluation period and round cap itself: the sweeps' base
        # config says the period the trials ran, and leaves the unused round count out
        self.common = dict(overrides=[*args.set, f"federation.eval_every={settings.eval_every}"],
                           resume=args.resume, address=args.address, resources=resources,
                           storage=args.storage, pipeline_run_id=None, extra_metrics=PATH_METRICS)

    def sweep(self, space, suffix: str, strategy: str, run_name: str, description: str, settings=None):
        from pfl.schema import to_dict
        from pfl.tune.fpfc_trainable import fpfc_path_trainable
        from pfl.tune.sweep import run_sweep

        # trial names start with what tells them apart (MLflow cuts nested names): `λ-path ρ=1.5`,
        # `λ=0.6 separate`
        labels = {"label_prefix": "λ-path"} if strategy == "warmup" else {"label_prefix": "", "label_suffix": strategy}
        steered = ("method.lam", "federation.rounds") if strategy == "warmup" else ("federation.rounds",)
        path = to_dict(settings or self.settings)
        result = run_sweep(space, name=f"{self.name}-{suffix}", trainable=fpfc_path_trainable,
                           setup_extra={"path": path, "strategy": strategy},
                           parent_tags={"pfl.strategy": strategy}, run_name=run_name, description=description,
                           steered=steered, extra_params={f"path.{k}": v for k, v in path.items()},
                           **labels, **{**self.common, "pipeline_run_id": self.top.run_id})
        self.walls[suffix] = result.wall_s
        if result.status != "FINISHED":
            return result, stopped(suffix, result, space, self.top, self.args.argv)
        return result, 0

    def mark_selected(self, result, lams: list[float]) -> None:
        """The λ a sweep selected (per seed), as the tag its trials carry when they select one."""
        from pfl.tracking import client

        if result.parent_run_id:
            client().set_tag(result.parent_run_id, "pfl.selected_lambda", " ".join(f"{v:g}" for v in lams))

    def warmup(self) -> int:
        from pfl.tune.path_records import best_row, ok_rows, path_record

        s = self.settings
        print(f"\n== warmup strategy: λ path {s.ordered()} ({s.direction}), searched over "
              f"{', '.join(self.space.search) or 'nothing'} ==")
        order = " → ".join(f"{v:g}" for v in s.ordered())
        about = (f"Warm-up strategy: each trial walks one λ path ({order}, {s.direction}; every stage until "
                 f"convergence, warm-started from the one before), compares its {s.finalists} best stages at "
                 "equal rounds (playoff) and continues the winner until convergence; the trials differ in the "
                 "searched hyperparameters, and the best path's λ is the strategy's choice")
        result, code = self.sweep(self.space, "warmup", "warmup", "λ-path sweep", about)
        if code:
            return code
        self.best_config = dict(result.best_config)
        self.search = [path_record(row, self.metric, self.seeds[0], stages=False) for row in ok_rows(result.table)]
        self.best_trial = best_row(result.table, self.metric, self.sign)
        self.paths.append(path_record(self.best_trial, self.metric, self.seeds[0], stages=True))
        self.mark_selected(result, [self.paths[0]["selected_lambda"]])
        if len(self.seeds) > 1:
            print(f"\n== warmup strategy: the chosen setting on seeds {self.seeds[1:]} ==")
            space = with_search(self.space, self.best_config, {"seed": self.seeds[1:]})
            about = (f"Warm-up strategy on more seeds: the chosen setting "
                     f"({', '.join(f'{k}={v}' for k, v in self.best_config.items()) or 'the space’s fixed values'})"
                     f", one λ path ({order}) per seed")
            result, code = self.sweep(space, "warmup-seeds", "warmup", "λ-path seeds", about)
            if code:
                return code
            self.paths += [path_record(row, self.metric, self.seeds[0], stages=True) for row in ok_rows(result.table)]
        return self.other_directions()

    def other_directions(self) -> int:
        """The other path orders of ``--direction``, each at the chosen setting on every seed."""
        import dataclasses

        from pfl.tune.path_records import ok_rows, path_record

        for direction in (self.args.direction or [])[1:]:
            settings = dataclasses.replace(self.settings, direction=direction)
            order = " → ".join(f"{v:g}" for v in settings.ordered())
            print(f"\n== warmup strategy, {direction}: λ path {order} at the chosen setting, seeds {self.seeds} ==")
            space = with_search(self.space, self.best_config, {"seed": self.seeds} if len(self.seeds) > 1 else {})
            about = (f"Warm-up strategy, another order: one λ path ({order}, {direction}) per seed at the setting the "
                     f"{self.settings.direction} path's search chose")
            result, code = self.sweep(space, f"warmup-{direction}", "warmup", f"λ-path {direction}", about, settings)
            if code:
                return code
            self.others[direction] = [path_record(row, self.metric, self.seeds[0], stages=True)
                                      for row in ok_rows(result.table)]
        return 0

    def separate(self) -> int:
        from pfl.tune.path_compare import separate_per_seed
        from pfl.tune.path_records import ok_rows, run_record

        # every λ the warm-up visited (the grid, and any λ it extended the grid by)
        # larger λ first: on S1 their fused models take longest to converge, and started last they would
        # run alone at the end while the other CPU idles (the order changes no result)
        paths = self.paths + [p for group in self.others.values() for p in group]
        grid = sorted(set(self.settings.lambdas) | {st["lambda"] for p in paths for st in p["stages"]}, reverse=True)
        search = {"method.lam": grid, **({"seed": self.seeds} if len(self.seeds) > 1 else {})}
        print(f"\n== separate strategy: every λ of {grid} from scratch until convergence "
              f"(at most {self.settings.budget} rounds), seeds {self.seeds} ==")
        space = with_search(self.space, self.best_config, search)
        chosen = ", ".join(f"{k}={v}" for k, v in self.best_config.items())
        about = (f"Separate strategy: a grid over λ (every λ the warm-up visited), each trained from scratch until "
                 f"convergence (at most {self.settings.budget} rounds)"
                 + (f" with the warm-up's chosen {chosen}" if chosen else "")
                 + f"; the λ with the best {self.metric} is the strategy's choice")
        result, code = self.sweep(space, "separate", "separate", "separate λ grid", about)
        if code:
            return code
        self.separate_table = result.table
        self.runs = [run_record(row, self.metric, self.seeds[0]) for row in ok_rows(result.table)]
        failed = len(result.table) - len(self.runs)
        if failed:
            print(f"separate: {failed} run(s) failed and are not counted (see the sweep's table)")
        per_seed = separate_per_seed(self.runs, self.sign, self.settings.noise_se)
        if per_seed:
            self.mark_selected(result, [s["selected_lambda"] for s in per_seed])
        return 0


TITLE = "FPFC λ tuning: warm-started path vs separate runs, to convergence (cf. the paper's Fig. 6, Table 2)"
# a strategy row's figures on the pipeline run, under the names the trials give the same quantity
ROW_METRICS = {"clusters": "cluster/num", "ari": "cluster/ari"}
# the runs table's columns in the saved view the pipeline prints: the same names at every level
VIEW_COLUMNS = [("metrics", "val/acc_mean"), ("metrics", "test/acc_mean"), ("tags", "pfl.selected_lambda"),
                ("metrics", "cluster/num"), ("metrics", "fpfc/total_rounds"), ("params", "method.lam"),
                ("params", "method.rho"), ("tags", "pfl.strategy")]


def finish(ctx, wall: float) -> int:
    """The comparison tables, the stage report and the recommendation (printed, and on the pipeline
    run with the plots), the recommended model's metrics under the trials' names, and tags that say
    what each strategy selected and what the pipeline recommends."""
    import textwrap

    import pandas as pd

    from pfl.tracking import run_hint, runs_table_view
    from pfl.tune.path_compare import (explanation, markdown, per_lambda, recommend, recommendation_line,
                                       separate_per_seed, strategy_row, verdict, visited_runs)
    from pfl.tune.path_records import log_recommendation, stage_history, stage_lines
    from pfl.tune.path_report import plot_path, plot_selection, stage_metrics

    groups = {"warmup": ctx.paths, **{f"warmup-{d}": group for d, group in ctx.others.items()}}
    separate_seeds = separate_per_seed(ctx.runs, ctx.sign, ctx.settings.noise_se) if ctx.runs else []
    rows = [strategy_row(name, group) for name, group in groups.items() if group]
    sep = strategy_row("separate", separate_seeds) if separate_seeds else None
    lambdas = per_lambda(ctx.paths, ctx.runs)
    rec = recommend(groups, ctx.runs, ctx.sign, ctx.settings.noise_se)
    # each path order against the separate runs of the λ it visited, as if it had run alone
    own = {name: separate_per_seed(visited_runs(group, ctx.runs), ctx.sign, ctx.settings.noise_se)
           for name, group in groups.items() if group}
    own = {name: strategy_row("separate", per_seed) for name, per_seed in own.items() if per_seed}
    notes = explanation(ctx.settings, rows[:1] + ([own.get("warmup", sep)] if sep else []), ctx.search, ctx.walls)
    if ctx.others:
        notes.insert(1, "warmup-<order>: the same path in another order (" + ", ".join(ctx.others) + ") at the setting "
                     f"the {ctx.settings.direction} path's search chose, on every seed; rows named warmup are "
                     f"{ctx.settings.direction}; each order is compared with the separate runs of the λ it visited, "
                     "the separate row holds every λ trained from scratch.")
    closing = [verdict(row, own[row["strategy"]], "" if own[row["strategy"]]["models"] == sep["models"] else
                       f" (the {own[row['strategy']]['models'] // len(ctx.seeds)} λ it visited)")
               for row in rows if sep and row["strategy"] in own] + ([recommendation_line(rec)] if rec else [])
    warnings = [f"warning ({name}, seed {p['seed']}): the path's partition froze while λ grew (stage report: ARI "
                "1.00 between consecutive stages); a larger λ cannot re-fuse pairs already farther apart than aλ"
                for name, group in groups.items() for p in group if p.get("frozen") == 1]
    rows += [sep] if sep else []
    report = stage_lines(ctx.paths[0], ctx.settings.direction) if ctx.paths and ctx.paths[0]["stages"] else []
    tables = markdown(rows, lambdas) + ("\n\n" + "\n".join(report) if report else "")
    wrap = [textwrap.fill(n, 100, subsequent_indent="  ") for n in notes + warnings + closing]
    text = "\n".join([f"== {TITLE} ==", tables, ""] + wrap)
    document = "\n".join([f"# {TITLE}", "", *(f"**{c}**\n" for c in closing), *(f"*{w}*\n" for w in warnings),
                          tables, "", "## How each figure was counted", "", *(f"- {n}" for n in notes)])
    top = ctx.top
    playoff = stage_history(ctx.best_trial["mlflow_run_id"], "playoff/") if ctx.best_trial is not None else []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        table = pd.DataFrame([{**r, "selected_lambda": " ".join(f"{v:g}" for v in r["selected_lambda"])}
                              for r in rows])
        table.to_parquet(out / "strategies.parquet")
        table.to_csv(out / "strategies.csv", index=False)
        pd.DataFrame(lambdas).to_csv(out / "per_lambda.csv", index=False)
        (out / "strategies.md").write_text(document + "\n")
        for fname in ("strategies.parquet", "strategies.csv", "per_lambda.csv", "strategies.md"):
            top.log_artifact(out / fname)
        if ctx.best_trial is not None:
            stages = stage_history(ctx.best_trial["mlflow_run_id"])
            step = 0
            for stage in stages:  # step = rounds of the path so far, as in the trial's run
                step += int(stage.get("rounds", 0))
                top.log_metrics(stage_metrics(stage), step=step)
            if stages:
                top.log_artifact(plot_path(stages, out / "lambda_path.png",
                                           f"best warmup trial ({ctx.settings.direction}); each λ at the end of "
                                           "its stage", playoff), "plots")
        if ctx.paths or ctx.runs:
            score = "RMSE" if ctx.metric.endswith("rmse_mean") else "accuracy"
            matches = [{"lambda": m["lambda"], "val": m.get(ctx.metric, float("nan")), "lineage": m.get("lineage", 0)}
                       for m in playoff]
            top.log_artifact(plot_selection(ctx.paths, ctx.runs, [s["selected_lambda"] for s in separate_seeds],
                                            out / "lambda_selection.png", score, matches,
                                            f"λ selection ({ctx.name}): warm-up path vs separate runs"), "plots")
    for row in rows:
        name = row["strategy"]
        metrics = {}
        for key, value in row.items():
            if key == "strategy" or not isinstance(value, (int, float)) or value != value:
                continue
            base, sd = (key[:-3], "_sd") if key.endswith("_sd") else (key, "")
            base = {"val": ctx.metric, "test": ctx.metric.replace("val/", "test/"), **ROW_METRICS}.get(base, base)
            metrics[f"{name}/{base}{sd}"] = float(value)
        top.log_metrics(metrics)
        top.set_tags({f"selected_lambda.{name}": " ".join(f"{v:g}" for v in row["selected_lambda"])})
    if ctx.paths:
        top.set_tags({"pfl.selected_lambda": f"{ctx.paths[0]['selected_lambda']:g}",
                      "pfl.selected_trial": str(ctx.best_trial["trial"]),
                      "pfl.selected_run_id": str(ctx.best_trial["mlflow_run_id"])})
    if rec:
        log_recommendation(top, rec)
    if "warmup" in own and rows[0]["rounds"] and rows[0]["compute_s"]:
        top.log_metrics({"speedup/rounds": own["warmup"]["rounds"] / rows[0]["rounds"],
                         "speedup/compute": own["warmup"]["compute_s"] / rows[0]["compute_s"]})
    top.log_metrics({"search/paths": float(len(ctx.search)), "search/rounds": sum(r["rounds"] for r in ctx.search),
                     "pipeline/wall_s": wall})
    top.set_tags({"pfl.status": "finished", "mlflow.note.content": overview(ctx, rows, closing)})
    top.end("FINISHED")
    print("\n" + text)
    print(f"\npipeline wall time {wall:.0f} s; " + run_hint(top.run_id, what="MLflow pipeline run"))
    view = runs_table_view(top.run_id, "tune_fpfc", VIEW_COLUMNS,
                           "tune_fpfc: the selected λ and its accuracy at every level")
    if view:
        print(view)
    return 0


def overview(ctx, rows: list[dict], closing: list[str]) -> str:
    """The pipeline run's description (its Overview page, Markdown): what it compares, the result,
    where the rest is."""
    from pfl.tune.path_compare import markdown

    parts = ["FPFC's λ tuning: a warm-started λ path against every λ trained from scratch (the paper's Table 2). "
             "The sweeps are child runs, their trials grandchildren. `val/acc_mean`, `test/acc_mean`, `cluster/*` "
             "here are the recommended model's (tag `pfl.recommended_run_id`: the best validated model of "
             "everything the pipeline trained), as on its trial; `recommended/*` are its figures over the seeds.",
             ""]
    parts += [*(f"**{c}**\n" for c in closing), markdown(rows, []), "",
              "Per λ and how each figure was counted: `strategies.md`; the λ choice of both strategies: "
              "`plots/lambda_selection.png`."]
    return "\n".join(parts)[:5000]


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
                    "seeds": args.seeds,
                    **{f"path.{k}": v for k, v in to_dict(settings).items()}})
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"run_id": top.run_id}))
    return top


def stopped(strategy: str, result, space, top, argv) -> int:
    """An interrupted or wholly failed strategy ends the pipeline: its outcome, how to resume."""
    from sweep import print_outcome  # the sweep pipeline's report (pipelines/sweep.py)

    print(f"\n== {strategy} strategy did not finish ==")
    code = print_outcome(result, space, argv)
    if result.reason:  # the tracking store is gone: --resume closes the pipeline's run
        return code
    top.set_tags({"pfl.status": result.status.lower()})
    top.end("KILLED" if result.status == "INTERRUPTED" else "FAILED")
    return code


if __name__ == "__main__":
    sys.exit(main())
