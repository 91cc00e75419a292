"""FedALA measurement table: FedAvg vs FedALA, ALA plugged into other methods, s and p, ALA cost.

    python pipelines/fedala_table.py [--rounds 10] [--max-samples 6000] [--rows fedavg fedala ...]
                                     [--seeds 0 1 2] [--last 3] [--set key=value ...] [--no-track]
                                     [--experiment NAME]

Setting: scenario ``fmnist_dir01_20`` of search_spaces/scenarios.yaml (Fashion-MNIST, Dirichlet(0.1),
20 clients, all participating, the 4-layer CNN, batch 10, lr 0.005, one local epoch); ``--rounds``,
``--max-samples`` and ``--eval-every`` shrink it to fit a time budget. Every row trains from the same
data partition for a given seed; every row runs once per seed (``--seeds``, default 0 1 2) and the
table (pfl/seeds.py) reports mean ± std over the seeds. The personalized accuracy is
``test/acc_mean`` (each client's personalized model on its own test split, mean over clients),
averaged over the last ``--last`` evaluations of a run: FedAvg/FedProx are evaluated with the
global model, the ALA variants with the ALA-initialised local model, Ditto/FedRep with their
personal models. Beside it, each row's paired difference to FedAvg (≈: within the spread), the
best evaluated round, the sample-weighted accuracy (the paper's metric), ALA time per round (client
compute of ALA summed over the round's clients, averaged over rounds), start-phase passes, training
seconds per round (including ALA, also where it ran during evaluation) and total traffic.

One MLflow parent run holds the table (Markdown + CSV artifacts, every run as
``fedala_table_runs.csv``); each row and seed is a child run with its per-round metrics.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pfl.config import apply_overrides  # noqa: E402
from pfl.resolver import resolve  # noqa: E402
from pfl.schema import ConfigError  # noqa: E402
from pfl.seeds import add_seeds_argument  # noqa: E402
from pfl.tracking import run_hint  # noqa: E402

#: label -> (method name, method overrides)
ROWS: dict[str, tuple[str, dict]] = {
    "fedavg": ("fedavg", {}),
    "fedala": ("fedala", {"method.s": 80, "method.p": 1}),
    "fedprox": ("fedprox", {"method.mu": 0.01}),
    "fedprox+ala": ("fedprox+ala", {"method.mu": 0.01, "method.s": 80, "method.p": 1}),
    "fedala_s5": ("fedala", {"method.s": 5, "method.p": 1}),
    "fedala_p_all": ("fedala", {"method.s": 80, "method.p": 0}),
    "fedavg+ala": ("fedavg+ala", {"method.s": 80, "method.p": 1}),
    "ditto": ("ditto", {}),
    "ditto+ala": ("ditto+ala", {"method.s": 80, "method.p": 1}),
    "fedrep": ("fedrep", {}),
    "fedrep+ala": ("fedrep+ala", {"method.s": 80, "method.p": 1}),
    "local": ("local", {}),
}
DEFAULT_ROWS = ["fedavg", "fedala", "fedprox", "fedprox+ala", "fedala_s5", "fedala_p_all"]


def metric_key(label: str) -> str:
    """An MLflow-safe metric name part ('+' and '=' are not allowed in metric names)."""
    return re.sub(r"[^0-9A-Za-z_\-./ ]", "_", label.replace("+", "_plus_"))


def row_config(base: dict, label: str, tracking: bool, experiment: str | None, seed: int | None = None):
    method, overrides = ROWS[label]
    raw = apply_overrides(base, {"method.name": method, **overrides})
    if seed is not None:
        raw = apply_overrides(raw, {"seed": seed})
    raw = apply_overrides(raw, {"tracking.enabled": tracking, "tracking.run_name": label})
    if experiment:
        raw = apply_overrides(raw, {"tracking.experiment": experiment})
    return resolve(raw)


def measure(summary) -> dict:
    """The per-run columns beside the accuracy: best round, weighted accuracy, ALA cost, time, traffic."""
    history = summary.history
    evals = [h for h in history if "test/acc_mean" in h]
    last = history[-1]
    rounds = len(history)
    best = max(evals, key=lambda h: h["test/acc_mean"]) if evals else {}
    nan = float("nan")
    return {
        "acc_best": best.get("test/acc_mean", nan),
        "best_round": float(int(best["round"]) + 1) if best else nan,
        "acc_weighted_last": evals[-1].get("test/acc_weighted", nan) if evals else nan,
        "global_acc_last": evals[-1].get("global/test_acc", nan) if evals else nan,
        "ala_time_per_round_s": last.get("ala/time_total_s", 0.0) / max(rounds, 1) if "ala/time_total_s" in last else nan,
        "ala_start_passes": last.get("ala/start_passes", nan),
        # time/round_s misses the ALA work done during the previous evaluation (cached, reused)
        "s_per_round": (sum(h["time/round_s"] for h in history)
                        + last.get("ala/time_at_eval_total_s", 0.0)) / max(rounds, 1),
        "comm_total_MiB": last.get("comm/total_bytes", 0.0) / 2**20,
    }


COLUMNS = [("acc_best", "best acc %", 100.0, 2), ("best_round", "best round", 1.0, 1),
           ("acc_weighted_last", "weighted acc % (last)", 100.0, 2), ("global_acc_last", "global acc % (last)", 100.0, 2),
           ("ala_time_per_round_s", "ALA s/round", 1.0, 3), ("ala_start_passes", "start passes", 1.0, 0),
           ("s_per_round", "s/round", 1.0, 2), ("comm_total_MiB", "traffic MiB", 1.0, 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="communication rounds per row")
    parser.add_argument("--max-samples", type=int, default=3000,
                        help="pooled Fashion-MNIST samples (0 = all 70,000)")
    parser.add_argument("--eval-every", type=int, default=1, help="rounds between evaluations")
    parser.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, choices=list(ROWS), metavar="ROW",
                        help=f"rows to run (default: {' '.join(DEFAULT_ROWS)}; also: "
                             f"{' '.join(r for r in ROWS if r not in DEFAULT_ROWS)})")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="dotted config overrides applied to every row")
    parser.add_argument("--scenario", default="fmnist_dir01_20", help="named scenario (scenarios.yaml)")
    parser.add_argument("--experiment", help="MLflow experiment (default: mlflow.yaml's sweep_experiment)")
    parser.add_argument("--no-track", "--no-tracking", dest="no_tracking", action="store_true",
                        help="do not log to MLflow")
    parser.add_argument("--last", type=int, default=3, help="evaluations averaged per run (default 3)")
    add_seeds_argument(parser)
    args = parser.parse_args(argv)

    from pfl.data import load_federated
    from pfl.runner import TableRun
    from pfl.seeds import Row, aggregate, check_seeds, markdown, run_rows
    from pfl.tune.space import load_scenario

    tracking = not args.no_tracking
    try:
        seeds = check_seeds(args.seeds)
        base = apply_overrides({}, load_scenario(args.scenario))
        base = apply_overrides(base, {"federation.rounds": args.rounds, "federation.eval_every": args.eval_every,
                                      "data.max_samples": args.max_samples or None})
        base = apply_overrides(base, args.set)
        configs = {(label, s): row_config(base, label, tracking, args.experiment, s)
                   for s in seeds for label in args.rows}
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2

    first = next(iter(configs.values()))
    data = load_federated(first.data, first.seed)  # the first seed's partition, for the summary line
    sizes = [len(c.y_train) for c in data.clients]
    print(f"data: {first.data.source}, {len(data.clients)} clients, Dir({first.data.partition.alpha}), "
          f"train samples per client (seed {seeds[0]}) min {min(sizes)} / median {sorted(sizes)[len(sizes) // 2]} / "
          f"max {max(sizes)}; model {first.model.name}; {first.federation.rounds} rounds, all clients per round; "
          f"seeds {' '.join(map(str, seeds))}")
    del data

    # pipeline runs go to mlflow.yaml's sweep experiment unless --experiment names one
    parent = TableRun("fedala_table", experiment=args.experiment, track=tracking,
                      tags={"pfl.source": first.data.source},
                      params={"scenario": args.scenario, "rounds": args.rounds, "max_samples": args.max_samples,
                              "eval_every": args.eval_every, "rows": " ".join(args.rows), "last": args.last,
                              "seeds": " ".join(map(str, seeds)), "overrides": " ".join(args.set)})
    t0 = time.perf_counter()
    rows = [Row(label, lambda s, label=label: configs[(label, s)], measure=measure) for label in args.rows]
    records = run_rows(parent, rows, seeds, last=args.last)
    reference = "fedavg" if "fedavg" in args.rows else args.rows[0]
    summary = aggregate(records, reference=reference)
    table = markdown(summary, columns=COLUMNS, last=args.last,
                     notes=[f"Reference: {reference}. Scenario {args.scenario}, {args.rounds} rounds, "
                            f"max_samples {args.max_samples}."])
    for r in summary:
        parent.log_metrics({f"table/{metric_key(r['row'])}/acc_mean": r["last_mean_mean"]})
    print("\n" + table)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")
    parent.finish([{k: v for k, v in r.items() if k != "values"} for r in summary], "fedala_table", table,
                  runs=records)
    if tracking:
        print(run_hint(parent.run_id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
