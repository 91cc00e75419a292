"""``pfl table FILE.yaml`` (also ``python3 pipelines/table.py FILE.yaml``): run a comparison table.

Exit status: 0 when every cell ran (failed cells are listed and never averaged), 1 when every cell
failed, 2 for an invalid table, config, tracking store or Ray address (nothing started), 130 / 143
when interrupted by SIGINT / SIGTERM (the command to resume is printed).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser, table: bool = True) -> None:
    from ..seeds import DEFAULT_SEEDS

    if table:
        parser.add_argument("table", help="table file (tables/*.yaml)")
    parser.add_argument("--preset", help="the table's values of a preset (e.g. paper)")
    parser.add_argument("--quick", action="store_true", help="--preset quick: the table's small, fast version")
    parser.add_argument("--scenario", help="another named scenario (search_spaces/scenarios.yaml) for every row")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="dotted config overrides for every row")
    parser.add_argument("--row-set", "--method-set", nargs="+", action="extend", default=[], metavar="ROW:KEY=VALUE",
                        help="an override for one row, e.g. ditto:method.lam=0.5")
    parser.add_argument("--rows", nargs="+", metavar="ROW", help="run only these rows (names)")
    parser.add_argument("--methods", nargs="+", metavar="METHOD",
                        help="run only the rows of these methods (ungrouped ones first); a method the table lacks is a "
                             "row of its own")
    parser.add_argument("--last", type=int, help="evaluations averaged per run (default: the table's)")
    parser.add_argument("--only", nargs="+", metavar="TEXT", help="run only rows whose GROUP/ROW matches TEXT (a regular expression)")
    parser.add_argument("--seeds", nargs="+", type=int, metavar="SEED",
                        help=f"seeds (default: the table's, usually {' '.join(map(str, DEFAULT_SEEDS))})")
    parser.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    parser.add_argument("--resources", help="per-cell resources, e.g. cpu=1,gpu=0.25")
    parser.add_argument("--max-concurrent", type=int, metavar="N",
                        help="cells at once (default: the table's; 1 for timing columns measured alone)")
    parser.add_argument("--address", help="Ray cluster HOST:PORT (default: $RAY_ADDRESS, else a local instance)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted table of the same name")
    parser.add_argument("--name", help="the table's run name (default: the table's)")
    parser.add_argument("--storage", default="ray_results", help="where Ray keeps the table's cells")
    parser.add_argument("--out", help="also write the table (CSV, Markdown, Parquet, plots) into this directory")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from ..schema import ConfigError
    from ..seeds import check_seeds
    from ..tracking import run_hint
    from ..tune.sweep import parse_resources
    from .engine import run_table
    from .spec import cells, expand, load_table, method_rows, parse_row_sets, select_rows

    try:
        spec = load_table(args.table)
        spec.scenario = args.scenario or spec.scenario
        spec.last = args.last or spec.last
        spec.max_concurrent = spec.max_concurrent if args.max_concurrent is None else args.max_concurrent
        seeds = check_seeds(args.seeds if args.seeds else spec.seeds)
        rows = select_rows(expand(spec), args.rows, args.only)
        if args.methods:
            rows = method_rows(expand(spec), args.methods)
        preset = "quick" if args.quick else args.preset
        table_cells = cells(spec, preset=preset, overrides=args.set, seeds=seeds, track=not args.no_track,
                            row_sets=parse_row_sets(args.row_set), rows=rows)
        name = args.name or spec.name + (f"-{preset}" if preset else "")
        result = run_table(spec, table_cells, address=args.address, resources=parse_resources(args.resources),
                           resume=args.resume, storage=args.storage, name=name, outdir=args.out,
                           progress=None if args.quiet else print)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print("\n" + result.markdown)
    if result.headline:
        print("\n== headline ==")
        for key, value in result.headline.items():
            print(f"  {key} = {value:.4f}" if abs(value) < 1e4 else f"  {key} = {value:,.0f}")
    for label, reason in result.failures.items():
        print(f"failed: {label}: {reason}")
    done = sum(r["status"] == "FINISHED" for r in result.records)
    print(f"\n{result.status.lower()}: {done} of {result.cells} cells finished"
          f"{f', {len(result.failures)} failed' if result.failures else ''}; wall time {result.wall_s:.0f} s")
    if result.status == "INTERRUPTED":
        again = list(sys.argv[1:] if argv is None else argv)
        print("resume with: " + " ".join(shlex.quote(a) for a in [sys.executable, sys.argv[0] or "pfl", *again,
                                                                    *([] if "--resume" in again else ["--resume"])]))
    if result.parent_run_id:
        print(run_hint(result.parent_run_id))
    return result.exit_code


def main(argv: list[str] | None = None, table: str | Path | None = None, legacy: dict[str, str] | None = None) -> int:
    """The command line; a pipeline wrapper names its ``table`` and maps its ``legacy`` flags (e.g.
    ``--rounds``) to the config keys they set."""
    parser = argparse.ArgumentParser(description=__doc__ if table is None else f"The table {table} (pfl table).",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, table=table is None)
    for flag, keys in (legacy or {}).items():
        parser.add_argument(flag, dest=f"legacy_{flag}", metavar="VALUE", help=f"sets {keys} for every row")
    args = parser.parse_args(argv)
    if table is not None:
        args.table = str(table)
    given = {flag: getattr(args, f"legacy_{flag}") for flag in legacy or {}}
    args.set = [f"{key}={value}" for flag, value in given.items() if value is not None
                for key in legacy[flag].split()] + args.set
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
