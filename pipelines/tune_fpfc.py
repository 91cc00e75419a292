"""FPFC's λ tuning: warm-started λ path vs separate runs, to convergence, on Ray Tune, logged to MLflow.

    python pipelines/tune_fpfc.py                       # embedded default: local Ray, ./mlflow.db, S1
    python pipelines/tune_fpfc.py --seeds 3             # both strategies on 3 seeds: ± over seeds
    python pipelines/tune_fpfc.py --smoke               # ~3 minutes
    python pipelines/tune_fpfc.py --preset paper        # the paper's scale and N(0,1) start
    python pipelines/tune_fpfc.py --strategy separate   # only the separate strategy
    python pipelines/tune_fpfc.py --direction descending # the other path order (docs/methods/fpfc.md §4)

The warm-up sweep searches the other hyperparameters of search_spaces/fpfc.yaml (Optuna); each
trial walks the λ path (pfl/tune/lambda_path.py). With ``--seeds N`` the chosen setting's path is
run on N − 1 more seeds. The separate strategy trains every λ the warm-up visited from scratch,
with the chosen setting, on every seed. Every stage and every run ends on the same convergence
rule. The comparison (pfl/tune/path_compare.py) counts both sides per setting and seed; the
pipeline run (MLflow parent) holds the sweeps as children (trials below them), the tables
(strategies.md / .csv / .parquet, per_lambda.csv) and the best warm-up trial's λ-path plot and
per-λ metrics.
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
    parser.add_argument("--smoke", action="store_true", help="the 'smoke' preset (about 3 minutes)")
    parser.add_argument("--preset", help="a preset of the space file, e.g. paper")
    parser.add_argument("--strategy", default="both", choices=("warmup", "separate", "both"))
    parser.add_argument("--direction", choices=("ascending", "descending"), help="override the path order")
    parser.add_argument("--seeds", type=int, default=1, metavar="N",
                        help="seeds per strategy at the chosen (ρ, lr): the table's ± is over them (default 1: "
                             "the warm-up search trials' spread)")
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
    from pfl.tracking import check_store
    from pfl.tune.lambda_path import PATH_METRICS, PathSettings, require_validation
    from pfl.tune.space import base_config, check_space, load_space
    from pfl.tune.sweep import parse_resources

    preset = "smoke" if args.smoke else args.preset
    space = apply_preset(load_space(args.space), preset)
    pipeline = dict(space.pipeline)
    if args.direction:
        pipeline["direction"] = args.direction
    settings = from_dict(PathSettings, pipeline, "pipeline")
    raw = base_config(space, args.set)
    check_space(space, raw, PATH_METRICS)  # everything validated before Ray starts
    cfg = resolve(raw)
    require_validation(cfg)
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

    def sweep(self, space, suffix: str, strategy: str, run_name: str, description: str):
        from pfl.schema import to_dict
        from pfl.tune.fpfc_trainable import fpfc_path_trainable
        from pfl.tune.sweep import run_sweep

        # trial names start with what tells them apart (MLflow cuts nested names): `λ-path ρ=1.5`,
        # `λ=0.6 separate`
        labels = {"label_prefix": "λ-path"} if strategy == "warmup" else {"label_prefix": "", "label_suffix": strategy}
        steered = ("method.lam", "federation.rounds") if strategy == "warmup" else ("federation.rounds",)
        result = run_sweep(space, name=f"{self.name}-{suffix}", trainable=fpfc_path_trainable,
                           setup_extra={"path": to_dict(self.settings), "strategy": strategy},
                           parent_tags={"pfl.strategy": strategy}, run_name=run_name, description=description,
                           steered=steered, extra_params={f"path.{k}": v for k, v in to_dict(self.settings).items()},
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

    def ok_rows(self, table):
        return [row for _, row in table.iterrows() if row["status"] == "OK"]

    def warmup(self) -> int:
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
        self.search = [self.path_record(row, stages=False) for row in self.ok_rows(result.table)]
        self.best_trial = best_row(result.table, self.metric, self.sign)
        self.paths.append(self.path_record(self.best_trial, stages=True))
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
            self.paths += [self.path_record(row, stages=True) for row in self.ok_rows(result.table)]
        return 0

    def separate(self) -> int:
        from pfl.tune.path_compare import separate_per_seed

        # every λ the warm-up visited (the grid, and any λ it extended the grid by)
        # larger λ first: on S1 their fused models take longest to converge, and started last they would
        # run alone at the end while the other CPU idles (the order changes no result)
        grid = sorted(set(self.settings.lambdas) | {st["lambda"] for p in self.paths for st in p["stages"]},
                      reverse=True)
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
        self.runs = [self.run_record(row) for row in self.ok_rows(result.table)]
        failed = len(result.table) - len(self.runs)
        if failed:
            print(f"separate: {failed} run(s) failed and are not counted (see the sweep's table)")
        per_seed = separate_per_seed(self.runs, self.sign)
        if per_seed:
            self.mark_selected(result, [s["selected_lambda"] for s in per_seed])
        return 0

    # ---- records -------------------------------------------------------------------------------
    def _common(self, row) -> dict:
        test = self.metric.replace("val/", "test/")
        return {"seed": int(row["seed"]) if "seed" in row and row["seed"] == row["seed"] else self.seeds[0],
                "val": float(row[self.metric]), "test": float(row.get(test, float("nan"))),
                "clusters": float(row.get("cluster/num", float("nan"))),
                "ari": float(row.get("cluster/ari", float("nan"))),
                "rounds": float(row["fpfc/total_rounds"]), "compute_s": float(row["fpfc/cpu_s"]),
                "converged": float(row["fpfc/converged"])}

    def path_record(self, row, stages: bool) -> dict:
        record = {**self._common(row), "selected_lambda": float(row["fpfc/selected_lambda"]),
                  "playoff_rounds": float(row.get("fpfc/playoff_total_rounds", 0)),
                  "final_rounds": float(row.get("fpfc/final_rounds", 0)),
                  "decline_reached": float(row.get("fpfc/decline_reached", float("nan"))), "stages": [],
                  "run_id": row["mlflow_run_id"]}
        if stages:
            nan = float("nan")
            test = self.metric.replace("val/", "test/")
            record["stages"] = [{"lambda": st["lambda"], "rounds": st.get("rounds", nan),
                                 "converged": st.get("converged", 0.0), "val": st.get(self.metric, nan),
                                 "test": st.get(test, nan), "clusters": st.get("cluster/num", nan),
                                 "ari": st.get("cluster/ari", nan), "lineage": st.get("lineage", nan),
                                 "compute_s": st.get("cpu_s", nan)}
                                for st in stage_history(row["mlflow_run_id"])]
        return record

    def run_record(self, row) -> dict:
        return {**self._common(row), "lambda": float(row["method.lam"])}


TITLE = "FPFC λ tuning: warm-started path vs separate runs, to convergence (cf. the paper's Fig. 6, Table 2)"
# a strategy row's figures on the pipeline run, under the names the trials give the same quantity
ROW_METRICS = {"clusters": "cluster/num", "ari": "cluster/ari"}
# the runs table's columns in the saved view the pipeline prints: the same names at every level
VIEW_COLUMNS = [("metrics", "val/acc_mean"), ("metrics", "test/acc_mean"), ("tags", "pfl.selected_lambda"),
                ("metrics", "cluster/num"), ("metrics", "fpfc/total_rounds"), ("params", "method.lam"),
                ("params", "method.rho"), ("tags", "pfl.strategy")]


def finish(ctx, wall: float) -> int:
    """The comparison tables (printed, and on the pipeline run with the plots), the selected model's
    metrics under the trials' names, and tags that say what each strategy selected."""
    import textwrap

    import pandas as pd

    from pfl.tracking import run_hint, runs_table_view
    from pfl.tune.path_compare import explanation, markdown, per_lambda, separate_per_seed, strategy_row, verdict
    from pfl.tune.path_report import plot_path, plot_selection, stage_metrics

    rows = []
    separate_seeds = separate_per_seed(ctx.runs, ctx.sign) if ctx.runs else []
    if ctx.paths:
        rows.append(strategy_row("warmup", ctx.paths, noise_from=ctx.search))
    if separate_seeds:
        rows.append(strategy_row("separate", separate_seeds))
    lambdas = per_lambda(ctx.paths, ctx.runs)
    notes = explanation(ctx.settings, rows, ctx.search, ctx.walls)
    closing = [verdict(*rows)] if len(rows) == 2 else []
    tables = markdown(rows, lambdas)
    text = "\n".join([f"== {TITLE} ==", tables, ""] + [textwrap.fill(n, 100, subsequent_indent="  ")
                                                        for n in notes + closing])
    document = "\n".join([f"# {TITLE}", "", *(f"**{c}**\n" for c in closing), tables, "",
                          "## How each figure was counted", "", *(f"- {n}" for n in notes)])
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
            run_id = ctx.best_trial["mlflow_run_id"]
            stages = stage_history(run_id)
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
    selected = selected_trial(ctx)
    if selected is not None:
        # the model the pipeline selected (the warm-up's best path; the separate strategy's best run
        # when only it ran), under its trials' metric names: one runs-table column compares all levels
        top.log_metrics({k: float(selected[k]) for k in selected.index
                         if "/" in k and isinstance(selected[k], (int, float)) and selected[k] == selected[k]})
        lam = selected["fpfc/selected_lambda"] if "fpfc/selected_lambda" in selected else selected["method.lam"]
        top.set_tags({"pfl.selected_lambda": f"{float(lam):g}", "pfl.selected_trial": str(selected["trial"]),
                      "pfl.selected_run_id": str(selected["mlflow_run_id"])})
    if len(rows) == 2 and rows[0]["rounds"] and rows[0]["compute_s"]:
        top.log_metrics({"speedup/rounds": rows[1]["rounds"] / rows[0]["rounds"],
                         "speedup/compute": rows[1]["compute_s"] / rows[0]["compute_s"]})
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


def selected_trial(ctx):
    """The table row of the trial whose model the pipeline selected: the warm-up's best path, or with
    only the separate strategy the first seed's best λ."""
    if ctx.best_trial is not None:
        return ctx.best_trial
    table = ctx.separate_table
    if table is None or not len(table):
        return None
    ok = table[table["status"] == "OK"]
    if "seed" in ok:
        ok = ok[ok["seed"] == ctx.seeds[0]]
    return best_row(ok, ctx.metric, ctx.sign) if len(ok) else None


def overview(ctx, rows: list[dict], closing: list[str]) -> str:
    """The pipeline run's description (its Overview page, Markdown): what it compares, the result,
    where the rest is."""
    from pfl.tune.path_compare import markdown

    parts = ["FPFC's λ tuning: a warm-started λ path against every λ trained from scratch (the paper's Table 2). "
             "The sweeps are child runs, their trials grandchildren. `val/acc_mean`, `test/acc_mean`, `cluster/*` "
             "here are the selected model's (tag `pfl.selected_trial`), as on its trial and sweep.", ""]
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


def best_row(table, metric: str = "val/acc_mean", sign: float = 1.0):
    ok = table[table["status"] == "OK"]
    if not len(ok):
        raise RuntimeError("every trial failed; see the MLflow runs' pfl.failure tags")
    return ok.sort_values(metric, ascending=sign < 0).iloc[0]


def stage_history(run_id: str, prefix: str = "stage/") -> list[dict]:
    """The per-λ stage metrics a warmup trial logged (one step per stage end; ``playoff/``: per finalist)."""
    from pfl.tracking import client
    from pfl.tune.path_report import STAGE_METRICS

    mc = client()
    stages: dict[int, dict] = {}
    for key, name in STAGE_METRICS.items():
        for m in mc.get_metric_history(run_id, prefix + name):
            stages.setdefault(m.step, {})[key] = m.value
    return [stages[i] for i in sorted(stages)]


if __name__ == "__main__":
    sys.exit(main())
