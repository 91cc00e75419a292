"""FedSLR's λ table (the paper's Table 3 on a CPU budget): as λ grows the GKR's rank, parameter
count and downlink bytes fall; compare mixed (GKR + P_i) vs GKR vs FedAvg accuracies.

    python pipelines/fedslr_lambda.py [--lams 0 1e-4 1e-3 1e-2] [--rounds 40] [--max-samples 20000]
                                      [--scenario fmnist_dir01] [--set key=value ...] [--no-fedavg]

Every run is a nested MLflow child run of one parent run; the table is printed and logged on the
parent as ``fedslr_lambda.csv``. Bytes are measured by the simulator from the delivered messages.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pfl.config import apply_overrides  # noqa: E402
from pfl.resolver import load  # noqa: E402
from pfl.runner import TableRun  # noqa: E402
from pfl.schema import ConfigError  # noqa: E402
from pfl.tracking import run_hint  # noqa: E402
from pfl.tune.space import load_scenario  # noqa: E402

COLUMNS = ("method", "lam", "rank_mean", "rank_kept", "gkr_params", "mixed_params", "sparsity",
           "down_MiB_total", "down_KiB_last_round_per_client", "global_acc", "personal_acc", "wall_s")


def row_of(method: str, lam: float | None, final: dict, clients_per_round: int, wall: float) -> dict:
    return {
        "method": method, "lam": "" if lam is None else lam,
        "rank_mean": final.get("model/rank_mean", float("nan")),
        "rank_kept": final.get("model/rank_kept_ratio", float("nan")),
        "gkr_params": final.get("model/params", float("nan")),
        "mixed_params": final.get("model/mixed_params", float("nan")),
        "sparsity": final.get("model/sparsity", float("nan")),
        "down_MiB_total": final["comm/down_bytes"] / 2**20,
        "down_KiB_last_round_per_client": final["comm/round_down_bytes"] / max(1, clients_per_round) / 2**10,
        "global_acc": final.get("global/test_acc", float("nan")),
        "personal_acc": final.get("test/acc_mean", float("nan")),
        "wall_s": wall,
    }


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lams", type=float, nargs="+", default=[0.0, 1e-4, 1e-3, 1e-2])
    parser.add_argument("--scenario", default="fmnist_dir01")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--max-samples", type=int, default=20000)
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="dotted config overrides for every run (e.g. method.eta=10)")
    parser.add_argument("--no-fedavg", action="store_true", help="skip the FedAvg reference run")
    parser.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    args = parser.parse_args(argv)

    try:
        raw = apply_overrides({}, load_scenario(args.scenario))
        raw = apply_overrides(raw, {"federation.rounds": args.rounds, "data.max_samples": args.max_samples,
                                    "federation.eval_every": args.rounds})
        raw = apply_overrides(raw, args.set)
        configs = [("fedslr", lam, load(None, apply_overrides(raw, {"method.name": "fedslr", "method.lam": lam})))
                   for lam in args.lams]
        if not args.no_fedavg:
            fedavg_raw = {k: v for k, v in raw.items() if k != "method"}
            configs.append(("fedavg", None, load(None, apply_overrides(fedavg_raw, {"method.name": "fedavg"}))))
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2

    parent = TableRun("fedslr_lambda", track=not args.no_track,
                      params={"scenario": args.scenario, "rounds": args.rounds, "max_samples": args.max_samples,
                              "lams": " ".join(map(str, args.lams)), "overrides": " ".join(args.set)})
    rows = []
    for method, lam, cfg in configs:
        name = f"{method}" + ("" if lam is None else f" lam={lam:g}")
        start = time.perf_counter()
        summary = parent.run(name, cfg)
        wall = time.perf_counter() - start
        row = row_of(method, lam, summary.final, cfg.federation.clients_per_round, wall)
        rows.append(row)
        print(f"{name}: " + ", ".join(f"{k} {fmt(row[k])}" for k in COLUMNS[2:]), flush=True)
        if lam is not None:
            parent.log_metrics({f"lam/{k}": row[k] for k in COLUMNS[2:]}, step=len(rows) - 1)

    print("\n" + " | ".join(COLUMNS))
    for row in rows:
        print(" | ".join(fmt(row[k]) for k in COLUMNS))
    parent.finish(rows, "fedslr_lambda")
    if parent.run_id:
        print("\n" + run_hint(parent.run_id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
