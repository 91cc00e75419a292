"""Hyperparameter sweep of any method with Ray Tune + Optuna (optionally ASHA).

    python pipelines/sweep.py --space search_spaces/fedprox.yaml [--set key=value ...] [--smoke]
                              [--resume] [--address ray://... | $RAY_ADDRESS] [--resources cpu=1,gpu=0.25]

Prints progress, then the best config and a table of all trials. The table is written as Parquet
and logged, with the best config and its metrics, on the sweep's MLflow parent run; every trial is
a nested child run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pfl.schema import ConfigError  # noqa: E402
from pfl.tracking import tracking_uri  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--space", required=True, help="search-space YAML file")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="dotted config overrides applied to every trial")
    parser.add_argument("--smoke", action="store_true", help="tiny, fast version (the space's smoke values)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted sweep of the same name")
    parser.add_argument("--name", help="experiment name (default: the space file's stem)")
    parser.add_argument("--storage", default="ray_results", help="where Ray keeps the experiment")
    parser.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a local instance)")
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
    import pandas as pd

    with pd.option_context("display.max_columns", 20, "display.width", 160):
        print("\n== trials ==")
        print(result.table.drop(columns=["mlflow_run_id"], errors="ignore").to_string(index=False))
    print("\n== best ==")
    for key, value in result.best_config.items():
        print(f"  {key} = {value}")
    for key in (space.metric, "test/acc_mean", "global/test_acc"):
        if key in result.best_metrics:
            print(f"  {key}: {result.best_metrics[key]:.4f}")
    print(f"\nwall time {result.wall_s:.0f} s; trials table: {result.experiment_path}/trials.parquet")
    print(f"MLflow parent run {result.parent_run_id}; view: mlflow ui --backend-store-uri {tracking_uri()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
