"""FedALA measurement table: FedAvg vs FedALA, ALA plugged into other methods, s and p, ALA cost.

    python pipelines/fedala_table.py [--rounds 10] [--max-samples 6000] [--rows fedavg fedala ...]
                                     [--set key=value ...] [--no-track] [--experiment NAME]

Setting: scenario ``fmnist_dir01_20`` of search_spaces/scenarios.yaml (Fashion-MNIST, Dirichlet(0.1),
20 clients, all participating, the 4-layer CNN, batch 10, lr 0.005, one local epoch); ``--rounds``,
``--max-samples`` and ``--eval-every`` shrink it to fit a time budget. Every row trains from the same
data partition and seed. The personalized accuracy is ``test/acc_mean`` (each client's personalized
model on its own test split, mean over clients): FedAvg/FedProx are evaluated with the global model,
the ALA variants with the ALA-initialised local model, Ditto/FedRep with their personal models.
Reported: last and best evaluated round, the sample-weighted accuracy (the paper's metric), ALA time
per round (client compute of ALA summed over the round's clients, averaged over rounds), start-phase
passes, training seconds per round (including ALA, also where it ran during evaluation) and total
traffic.

One MLflow parent run holds the table (markdown + CSV artifacts, one metric per cell); each row is a
child run with its per-round metrics.
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


def row_config(base: dict, label: str, tracking: bool, experiment: str | None):
    method, overrides = ROWS[label]
    raw = apply_overrides(base, {"method.name": method, **overrides})
    raw = apply_overrides(raw, {"tracking.enabled": tracking, "tracking.run_name": label})
    if experiment:
        raw = apply_overrides(raw, {"tracking.experiment": experiment})
    return resolve(raw)


def summarize(label: str, cfg, history: list[dict]) -> dict:
    evals = [h for h in history if "test/acc_mean" in h]
    last = history[-1]
    rounds = len(history)
    best = max(evals, key=lambda h: h["test/acc_mean"]) if evals else {}
    hp = cfg.method.hparams
    return {
        "row": label,
        "method": cfg.method.name,
        "s": getattr(hp, "s", ""),
        "p": ("all" if getattr(hp, "p", None) == 0 else getattr(hp, "p", "")),
        "acc_last": evals[-1]["test/acc_mean"] if evals else float("nan"),
        "acc_best": best.get("test/acc_mean", float("nan")),
        "best_round": int(best["round"]) + 1 if best else -1,
        "acc_weighted_last": evals[-1].get("test/acc_weighted", float("nan")) if evals else float("nan"),
        "acc_std_last": evals[-1].get("test/acc_std", float("nan")) if evals else float("nan"),
        "global_acc_last": evals[-1].get("global/test_acc", float("nan")) if evals else float("nan"),
        "ala_time_per_round_s": last.get("ala/time_total_s", 0.0) / max(rounds, 1) if "ala/time_total_s" in last else float("nan"),
        "ala_start_passes": last.get("ala/start_passes", float("nan")),
        # time/round_s misses the ALA work done during the previous evaluation (cached, reused)
        "s_per_round": (sum(h["time/round_s"] for h in history)
                        + last.get("ala/time_at_eval_total_s", 0.0)) / max(rounds, 1),
        "comm_total_MiB": last.get("comm/total_bytes", 0.0) / 2**20,
    }


def format_table(rows: list[dict]) -> str:
    cols = ["row", "method", "s", "p", "acc_last", "acc_best", "best_round", "acc_weighted_last",
            "acc_std_last", "global_acc_last", "ala_time_per_round_s", "ala_start_passes", "s_per_round",
            "comm_total_MiB"]
    fmt = lambda v: (f"{v:.4f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


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
    args = parser.parse_args(argv)

    from pfl.data import load_federated
    from pfl.runner import TableRun
    from pfl.tune.space import load_scenario

    tracking = not args.no_tracking
    try:
        base = apply_overrides({}, load_scenario(args.scenario))
        base = apply_overrides(base, {"federation.rounds": args.rounds, "federation.eval_every": args.eval_every,
                                      "data.max_samples": args.max_samples or None})
        base = apply_overrides(base, args.set)
        configs = {label: row_config(base, label, tracking, args.experiment) for label in args.rows}
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2

    first = next(iter(configs.values()))
    data = load_federated(first.data, first.seed)  # one partition for every row
    sizes = [len(c.y_train) for c in data.clients]
    print(f"data: {first.data.source}, {len(data.clients)} clients, Dir({first.data.partition.alpha}), "
          f"train samples per client min {min(sizes)} / median {sorted(sizes)[len(sizes) // 2]} / max {max(sizes)}; "
          f"model {first.model.name}; {first.federation.rounds} rounds, all clients per round")

    # pipeline runs go to mlflow.yaml's sweep experiment unless --experiment names one
    parent = TableRun("fedala_table", experiment=args.experiment, track=tracking,
                      tags={"pfl.source": first.data.source},
                      params={"scenario": args.scenario, "rounds": args.rounds, "max_samples": args.max_samples,
                              "eval_every": args.eval_every, "rows": " ".join(args.rows),
                              "overrides": " ".join(args.set)})
    results = []
    t0 = time.perf_counter()
    for label, cfg in configs.items():
        start = time.perf_counter()
        summary = parent.run(label, cfg, data=data)
        row = summarize(label, cfg, summary.history)
        row["wall_s"] = time.perf_counter() - start
        results.append(row)
        print(f"  {label:<14} acc last {row['acc_last']:.4f} best {row['acc_best']:.4f} "
              f"(ALA {row['ala_time_per_round_s']:.3f} s/round, {row['wall_s']:.0f} s)", flush=True)
        for key in ("acc_last", "acc_best", "acc_weighted_last", "ala_time_per_round_s", "s_per_round"):
            value = row[key]
            if isinstance(value, float) and value == value:
                parent.log_metrics({f"table/{metric_key(label)}/{key}": value})

    table = format_table(results)
    print("\n" + table)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")
    parent.finish(results, "fedala_table", table)
    if tracking:
        print(run_hint(parent.run_id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
