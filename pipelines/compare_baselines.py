"""Compare the baselines on one scenario: personalized accuracy, global accuracy, total traffic.

    python pipelines/compare_baselines.py [--quick] [--scenario fmnist_dir01] [--set key=value ...]
                                          [--methods fedavg ditto ...] [--method-set ditto:method.lam=0.5]
                                          [--no-track] [--out DIR]

Default scenario: Fashion-MNIST, Dirichlet(0.1) over labels, 100 clients, 10 per round
(``fmnist_dir01`` in search_spaces/scenarios.yaml). ``--quick`` is a small version (20 clients,
3,000 samples, an MLP, 5 rounds). Every method runs on the same data (loaded once) and seed, with
FedSLR's tuned baseline settings (Ditto λ = 0.1, APFL α = 0.5, FedDyn α = 0.1).

Prints a table (final personalized accuracy = mean over clients of each client's model on its own
test split; global accuracy = the global model on every client's test split, where the method has
one; cumulative bytes on the wire, up + down) and logs to MLflow: a parent run with the table as
CSV/Markdown artifacts and one child run per method (per-round metrics, config, plots).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pfl.schema import ConfigError  # noqa: E402
from pfl.tracking import run_hint  # noqa: E402

#: every method of the table, global ones first
GLOBAL_METHODS = ["fedavg", "fedprox", "scaffold", "feddyn", "fedadam", "fedadagrad", "fedyogi"]
PERSONAL_METHODS = ["local", "fedavg_ft", "perfedavg", "pfedme", "ditto", "apfl", "fedrep", "lgfedavg"]
METHODS = GLOBAL_METHODS + PERSONAL_METHODS

#: FedSLR's tuned baseline settings (docs/methods/fedslr.md §6)
METHOD_SETTINGS: dict[str, dict[str, object]] = {
    "ditto": {"method.lam": 0.1},
    "apfl": {"method.alpha": 0.5},
    "feddyn": {"method.alpha": 0.1},
}

QUICK = {
    "data.num_clients": 20, "data.max_samples": 3000, "model.name": "mlp",
    "federation.rounds": 5, "federation.clients_per_round": 5, "federation.local_epochs": 1,
    "federation.eval_every": 5,
}

#: FedSLR paper Table 1, CIFAR-10 non-IID column (ResNet-18-GN, 1000 rounds), for the ranking check
PAPER_C10_NONIID = {
    "scaffold": 82.91, "feddyn": 90.14, "fedavg": 82.89, "perfedavg": 91.55, "lgfedavg": 81.35,
    "fedrep": 93.41, "ditto": 94.39, "apfl": 87.11, "local": 82.17,
}


def parse_method_sets(items: list[str]) -> dict[str, dict[str, object]]:
    from pfl.config import parse_value

    out: dict[str, dict[str, object]] = {}
    for item in items:
        method, sep, rest = item.partition(":")
        if not sep or "=" not in rest:
            raise ConfigError("--method-set", f"expected METHOD:key=value, got {item!r}")
        key, value = rest.split("=", 1)
        out.setdefault(method, {})[key] = parse_value(value)
    return out


def build_configs(methods: list[str], scenario: str, quick: bool, overrides: list[str],
                  method_sets: dict[str, dict[str, object]], track: bool) -> dict:
    """One validated config per method (all errors before any training)."""
    from pfl.config import apply_overrides
    from pfl.resolver import resolve
    from pfl.tune.space import load_scenario

    raw = apply_overrides({}, load_scenario(scenario))
    if quick:
        raw = apply_overrides(raw, QUICK)
    raw = apply_overrides(raw, overrides)
    # per-client models of 100 clients would make every child run log hundreds of MB
    raw = apply_overrides(raw, {"tracking.enabled": track, "tracking.log_model": False})
    configs = {}
    for method in methods:
        settings = {"method.name": method, **METHOD_SETTINGS.get(method, {}), **method_sets.get(method, {})}
        configs[method] = resolve(apply_overrides(raw, settings))
    return configs


def format_table(rows: list[dict]) -> str:
    from pfl.runner import format_bytes

    head = ("| method | kind | personalized acc | global acc | total bytes | total | time (s) | "
            "paper C10 non-IID |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        pacc = f"{100 * r['test_acc']:.2f}" if r["test_acc"] == r["test_acc"] else "–"
        gacc = f"{100 * r['global_acc']:.2f}" if r["global_acc"] == r["global_acc"] else "–"
        paper = PAPER_C10_NONIID.get(r["method"])
        lines.append(f"| {r['method']} | {r['kind']} | {pacc} | {gacc} | {int(r['total_bytes']):,} | "
                     f"{format_bytes(r['total_bytes'])} | {r['time_s']:.0f} | "
                     f"{'' if paper is None else f'{paper:.2f}'} |")
    lines += ["", "personalized acc: mean over clients of each client's model on its own test split; global acc: "
              "the global model on every client's test split (– where the method has none); bytes: training "
              "traffic, both directions. The last column is the FedSLR paper's Table 1 on CIFAR-10 non-IID "
              "(ResNet-18-GN, 1,000 rounds), a different data set and scale: compare the ranking of the methods, "
              "not the numbers."]
    return "\n".join(lines)


def run(methods: list[str], scenario: str = "fmnist_dir01", quick: bool = False,
        overrides: list[str] | None = None, method_sets: dict | None = None, track: bool = True,
        out: str | Path | None = None, progress=print) -> dict:
    import pandas as pd

    from pfl.data import load_federated
    from pfl.runner import TableRun
    from pfl.schema import flatten

    configs = build_configs(methods, scenario, quick, list(overrides or []), method_sets or {}, track)
    first = next(iter(configs.values()))
    data = load_federated(first.data, first.seed)
    shared = {k: v for k, v in flatten(first.to_dict()).items() if not k.startswith("method.")}
    parent = TableRun("compare_baselines" + ("-quick" if quick else ""), track=track,
                      tags={"pfl.scenario": scenario},
                      params={**shared, "methods": ",".join(methods), "scenario": scenario, "quick": quick})
    rows = []
    for method, cfg in configs.items():
        start = time.perf_counter()
        if progress:
            progress(f"== {method} ==")
        summary = parent.run(method, cfg, progress=progress, data=data)
        best = max((h["test/acc_mean"] for h in summary.history if "test/acc_mean" in h), default=float("nan"))
        f = summary.final
        rows.append({
            "method": method,
            "kind": "global" if method in GLOBAL_METHODS else ("local" if method == "local" else "personalized"),
            "test_acc": f.get("test/acc_mean", float("nan")), "best_test_acc": best,
            "global_acc": f.get("global/test_acc", float("nan")),
            "total_bytes": f.get("comm/total_bytes", 0.0), "up_bytes": f.get("comm/up_bytes", 0.0),
            "down_bytes": f.get("comm/down_bytes", 0.0), "time_s": time.perf_counter() - start,
            "status": summary.status, "run_id": summary.run_id or "",
        })
        parent.log_metrics({f"{method}/test_acc": rows[-1]["test_acc"], f"{method}/global_acc": rows[-1]["global_acc"],
                            f"{method}/total_bytes": rows[-1]["total_bytes"]})
    table = pd.DataFrame(rows)
    text = format_table(rows)
    parent.finish(rows, "baselines_table", text, outdir=out)
    return {"table": table, "markdown": text, "parent_run_id": parent.run_id}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small, fast version")
    parser.add_argument("--scenario", default="fmnist_dir01", help="named scenario (search_spaces/scenarios.yaml)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="dotted config overrides for every method")
    parser.add_argument("--methods", nargs="+", default=METHODS, help=f"methods (default: {' '.join(METHODS)})")
    parser.add_argument("--method-set", nargs="+", action="extend", default=[], metavar="METHOD:KEY=VALUE",
                        help="an override for one method, e.g. ditto:method.lam=0.5")
    parser.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    parser.add_argument("--out", help="also write the table (CSV, Markdown) into this directory")
    parser.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    args = parser.parse_args(argv)
    try:
        result = run(args.methods, args.scenario, args.quick, args.set, parse_method_sets(args.method_set),
                     track=not args.no_track, out=args.out, progress=None if args.quiet else print)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print("\n" + result["markdown"])
    if result["parent_run_id"]:
        print("\n" + run_hint(result["parent_run_id"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
