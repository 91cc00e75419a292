"""Command line: ``pfl run``, ``pfl table``, ``pfl methods``, ``pfl compressors``, ``pfl datasets`` (also
``python -m pfl``)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from .federation.checkpoint import CheckpointError
from .federation.store import DamagedFileError, StoreError
from .schema import ConfigError, describe


def _cmd_run(args: argparse.Namespace) -> int:
    from . import config as config_mod
    from . import resolver
    from .runner import format_bytes, run_experiment
    from .server_memory import check_server_memory
    from .tracking import check_store, run_hint

    if args.resume and args.resume_if_exists:
        raise ConfigError("--resume", "give --resume (the checkpoint must exist) or --resume-if-exists, not both")
    if (args.resume or args.resume_if_exists) and not args.checkpoint:
        flag = "--resume" if args.resume else "--resume-if-exists"
        raise ConfigError(flag, "needs --checkpoint FILE (the checkpoint to continue from)")
    overrides = list(args.set or [])
    if args.no_track:
        overrides.append("tracking.enabled=false")
    scenario = None
    if args.scenario:
        from .tune.space import load_scenario

        scenario = load_scenario(args.scenario)
    cfg = resolver.load(args.config, overrides, scenario, plugins=args.plugin)  # validates everything before any work
    if args.print_config:
        print(cfg.to_yaml())
        return 0
    for note in config_mod.config_notes(cfg):
        print(f"note: {note}")
    check_server_memory(cfg)  # a method's population-bound server state that cannot fit: before any data
    if cfg.tracking.enabled:
        check_store()
    resume = "if-exists" if args.resume_if_exists else args.resume
    summary = run_experiment(cfg, checkpoint=args.checkpoint, resume=resume)
    final = summary.final
    print("\n== summary ==")
    print(f"method {cfg.method.name} on {cfg.data.source}: {summary.status}"
          + (f" ({summary.reason})" if summary.reason else ""))
    for key in ("test/acc_mean", "test/acc_std", "test/acc_p10", "val/acc_mean", "global/test_acc",
                "test/rmse_mean", "cluster/num", "cluster/ari", "attack/benign_clients", "newcomer/acc_mean",
                "newcomer/acc_std", "newcomer/ari", "newcomer/in_true_cluster"):
        if key in final:
            print(f"  {key:<24} {final[key]:.4f}")
    print(f"  communication            up {format_bytes(final.get('comm/up_bytes', 0))}, "
          f"down {format_bytes(final.get('comm/down_bytes', 0))}, "
          f"total {int(final.get('comm/total_bytes', 0))} bytes")
    # the rounds' training (time/elapsed_s, evaluations not included) and loading the data
    rounds, data = final.get("time/elapsed_s", 0.0), final.get("time/data_load_s", 0.0)
    how = getattr(summary.extra.get("simulator"), "data_note", "")
    print(f"  time                     {rounds + data:.1f} s (data {data:.1f} s{': ' + how if how else ''}; "
          f"training {rounds:.1f} s)")
    if summary.run_id:
        print("  " + run_hint(summary.run_id, what="MLflow run"))
    return 0 if summary.status == "FINISHED" else 3


def _print_fields(cls: type, indent: str = "    ") -> None:
    rows = describe(cls)
    if not rows:
        print(f"{indent}(no hyperparameters)")
    for name, tp, default, doc in rows:
        print(f"{indent}{name:<22} {tp:<14} default {default!r:<12} {doc}")


def _load_cli_plugins(args: argparse.Namespace) -> None:
    if getattr(args, "plugin", None):
        from .plugins import load_plugins

        load_plugins(args.plugin, "--plugin")


def _cmd_methods(args: argparse.Namespace) -> int:
    from .methods import list_methods

    _load_cli_plugins(args)
    if args.models:
        from .models import list_models

        for spec in list_models():
            print(f"{spec.name}: {spec.description}")
            _print_fields(spec.params)
        return 0
    for cls in list_methods():
        print(f"{cls.name}: {cls.description} [clients: {cls.cohort}]")
        if cls.server_memory_note:  # declared (Method.server_bytes): checked before a run starts
            print(f"    server state that grows with the clients: {cls.server_memory_note}")
        _print_fields(cls.Hparams)
    return 0


def _cmd_datasets(args: argparse.Namespace) -> int:
    from .config import PARTITION_KINDS
    from .data import list_sources

    if args.show is not None:
        return _show_partition(args)
    if args.set or args.scenario:
        raise ConfigError("--set" if args.set else "--scenario", "only with --show (the partition a config makes)")
    _load_cli_plugins(args)
    for spec in list_sources():
        print(f"{spec.name}: {spec.description} (default model: {spec.default_model})")
        _print_fields(spec.params)
    print(f"partition kinds (data.partition.kind): {', '.join(PARTITION_KINDS)}")
    return 0


def _show_partition(args: argparse.Namespace) -> int:
    """``pfl datasets --show [CONFIG] [--set ...]``: the partition the config makes, as a table."""
    from . import resolver
    from .data import load_federated
    from .data.glance import format_view, partition_view

    scenario = None
    if args.scenario:
        from .tune.space import load_scenario

        scenario = load_scenario(args.scenario)
    cfg = resolver.load(args.show or None, list(args.set or []), scenario, plugins=args.plugin)
    data = load_federated(cfg.data, cfg.seed, on_demand=True)  # labels only: no client's features are built
    print(format_view(partition_view(data), max_clients=args.max_clients))
    return 0


def _cmd_compressors(args: argparse.Namespace) -> int:
    from .compression.compressors import describe_compressors

    print("compression.uplink / compression.downlink: {name: <one of these>, <its parameters>} (name: none = off)")
    for name, description, params in describe_compressors():
        print(f"{name}: {description}")
        _print_fields(params)
    print("also: compression.error_feedback (uplink memory per client), compression.min_numel (smaller tensors dense)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pfl", description="personalized federated learning experiments")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run", help="run one federated experiment", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run one federated experiment: the built-in defaults, then --scenario, then CONFIG.yaml, "
                    "then --set overrides; everything is validated before any data is loaded.",
        epilog="""settings most runs touch (see `pfl methods`, `pfl datasets`, `pfl run --print-config`):
  method.name=NAME            fedavg (default), fedprox, ditto, fpfc, ... and its method.* hyperparameters
  data.source=NAME            digits (default, bundled), fmnist, fpfc_synthetic, ...
  data.num_clients=N|all      clients (default 20); your own data (files, hf) has all of its clients
                              by default, and N draws N of them with the seed
  federation.rounds=N         communication rounds (default 50); federation.eval_every=N
  federation.lr=X             client learning rate (default 0.1); federation.local_epochs=N (default 5)
  federation.threads=N        torch CPU threads of the run (default 1). Federated clients train small
                              models on small batches, which gain little from more threads, and a run
                              with several threads slows down many-fold when other jobs share the
                              cores (pipelines/bench_threads.py measures it). 0 = torch's default (one
                              thread per core), worth trying for large models on an idle machine.
  federation.device=cpu|cuda|auto
  tracking.enabled=false      (or --no-track) no MLflow run""")
    run.add_argument("config", nargs="?", help="YAML config file (default: built-in defaults)")
    run.add_argument("--set", nargs="+", metavar="KEY=VALUE", action="extend",
                     help="dotted overrides, e.g. method.name=fedprox method.mu=0.1 federation.rounds=20")
    run.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    run.add_argument("--scenario", help="start from a named scenario of search_spaces/scenarios.yaml "
                                        "(e.g. fpfc_s1, fmnist_labelswap)")
    run.add_argument("--checkpoint", help="checkpoint file (saved every federation.checkpoint_every rounds and at the end)")
    run.add_argument("--resume", action="store_true",
                     help="continue from --checkpoint (refused when it does not exist or cannot be used)")
    run.add_argument("--resume-if-exists", action="store_true",
                     help="continue from --checkpoint when it exists, else start a new run (for jobs that are restarted)")
    run.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    plugin_help = "a .py file or module whose @register classes (methods, models, data sources) join pfl's (repeatable)"
    run.add_argument("--plugin", action="append", metavar="FILE", help=plugin_help)
    run.set_defaults(func=_cmd_run)
    methods = sub.add_parser("methods", help="list methods and their hyperparameters")
    methods.add_argument("--models", action="store_true", help="list models and their parameters instead")
    methods.add_argument("--plugin", action="append", metavar="FILE", help=plugin_help)
    methods.set_defaults(func=_cmd_methods)
    compressors = sub.add_parser("compressors", help="list message compressors and their parameters")
    compressors.set_defaults(func=_cmd_compressors)
    datasets = sub.add_parser("datasets",
                              help="list data sources and their parameters; --show: a config's partition")
    datasets.add_argument("--plugin", action="append", metavar="FILE", help=plugin_help)
    datasets.add_argument("--show", nargs="?", const="", metavar="CONFIG",
                          help="print the partition CONFIG (default: the built-in defaults) makes with --set and "
                               "--scenario: each client's train/val/test sizes and training samples per class (a "
                               "regression source: per target bin), the table behind a run's plots/partition.png")
    datasets.add_argument("--set", nargs="+", metavar="KEY=VALUE", action="extend",
                          help="dotted overrides with --show, e.g. data.source=fmnist data.partition.alpha=0.1")
    datasets.add_argument("--scenario",
                          help="with --show: start from a named scenario of search_spaces/scenarios.yaml")
    datasets.add_argument("--max-clients", type=int, default=100, metavar="N",
                          help="with --show: print the first N clients (0 = every one; default 100)")
    datasets.set_defaults(func=_cmd_datasets)
    from .tables.cli import add_arguments, run as run_table

    table = sub.add_parser("table", help="run a comparison table (tables/*.yaml): every row × seed a Ray Tune trial",
                           description="Run a comparison table: every row × seed is a Ray Tune trial on every core "
                                       "here or every node of a cluster; the summary over seeds goes to MLflow.")
    add_arguments(table)
    table.set_defaults(func=lambda args: run_table(args, sys.argv[2:]))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except CheckpointError as err:   # missing, damaged, another version's or another run's
        print(f"checkpoint error: {err.message}", file=sys.stderr)
        return 2
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except DamagedFileError as err:  # a client-state file found damaged while the run read it
        print(f"error: {err}", file=sys.stderr)
        return 2
    except StoreError as err:  # client states or a checkpoint could not be written: the path and why
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
