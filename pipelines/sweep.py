"""Hyperparameter sweep of any method with Ray Tune + Optuna (optionally ASHA).

    python pipelines/sweep.py --space search_spaces/fedprox.yaml [--set key=value ...] [--smoke]
                              [--resume] [--address HOST:PORT | $RAY_ADDRESS] [--resources cpu=1,gpu=0.25]

Prints one line per trial event (start, evaluations, end), then the trials (the key columns; the
full table is the parent run's artifact) and the best config. The table (CSV, HTML, Parquet), a
plot of every trial's curve and the best config are logged on the sweep's MLflow parent run; every
trial is a nested child run named by what it tries.

Exit status: 0 when every trial ran (failures are listed), 1 when every trial failed or the MLflow
tracking store stopped answering (the command to resume is printed), 2 for an invalid space or
config, an unreachable tracking store or Ray address (nothing started), 130 / 143 when interrupted
by SIGINT / SIGTERM (the command to resume is printed).
"""

from __future__ import annotations

import argparse
import shlex
import sys


from pfl.schema import ConfigError
from pfl.tracking import run_hint


def resume_command(argv: list[str] | None) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--resume" not in args:
        args.append("--resume")
    return " ".join(shlex.quote(a) for a in [sys.executable, sys.argv[0] or "pipelines/sweep.py", *args])


def short_table(table, searched: list[str], metric: str):
    """The columns a person compares (the full table is the artifact)."""
    keys = ["trial", "status", *searched, metric, "test/acc_mean", "global/test_acc", "round", "error"]
    return table[[k for k in dict.fromkeys(keys) if k in table.columns]]


def print_outcome(result, space, argv: list[str] | None) -> int:
    import pandas as pd

    searched = list(space.distributions)
    if len(result.table):
        with pd.option_context("display.max_columns", 12, "display.width", 150, "display.max_colwidth", 60,
                               "display.float_format", "{:.4g}".format):
            print("\n== trials ==")
            print(short_table(result.table, searched, space.metric).to_string(index=False))
    for trial, reason in result.failures.items():
        print(f"failed: {trial}: {reason}")
    if result.status == "INTERRUPTED":
        done = int((result.table["status"] == "OK").sum()) if len(result.table) else 0
        why = f"stopped: {result.reason}; " if result.reason else "interrupted "
        print(f"\n{why}after {result.wall_s:.0f} s: {done} of {result.expected_trials} trials finished; "
              "no best is reported for an incomplete sweep.\nresume with: " + resume_command(argv)
              + (" (once the store answers again)" if result.reason else ""))
    elif result.status == "FAILED":
        print(f"\nevery trial failed ({len(result.failures)}); see the reasons above")
    else:
        print("\n== best ==")
        for key, value in result.best_config.items():
            print(f"  {key} = {value}")
        for key in dict.fromkeys((space.metric, "test/acc_mean", "global/test_acc")):
            if key in result.best_metrics:
                print(f"  {key}: {result.best_metrics[key]:.4f}")
    print(f"\nwall time {result.wall_s:.0f} s; trials table: {result.experiment_path}/trials.csv")
    if result.parent_run_id:
        print(run_hint(result.parent_run_id))
    return result.exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--space", required=True, help="search-space YAML file")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="dotted config overrides applied to every trial")
    parser.add_argument("--smoke", action="store_true", help="tiny, fast version (the space's smoke values)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted sweep of the same name")
    parser.add_argument("--name", help="experiment name (default: the space file's stem)")
    parser.add_argument("--storage", default="ray_results", help="where Ray keeps the experiment")
    parser.add_argument("--address", help="Ray cluster HOST:PORT (default: $RAY_ADDRESS, else a local instance)")
    parser.add_argument("--resources", help="per-trial resources, e.g. cpu=1,gpu=0.25")
    parser.add_argument("--num-samples", type=int, help="override the space's number of trials")
    args = parser.parse_args(argv)

    from pfl.tune.space import load_space
    from pfl.tune.sweep import parse_resources, run_sweep

    try:
        space = load_space(args.space)
        result = run_sweep(space, overrides=args.set, smoke=args.smoke, resume=args.resume,
                           address=args.address, resources=parse_resources(args.resources),
                           name=args.name, storage=args.storage, num_samples=args.num_samples)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    return print_outcome(result, space, argv)


if __name__ == "__main__":
    sys.exit(main())
