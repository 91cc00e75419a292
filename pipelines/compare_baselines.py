"""Compare the baselines on one scenario: personalized accuracy, global accuracy, total traffic.

    python pipelines/compare_baselines.py [--quick] [--scenario fmnist_dir01] [--set key=value ...]
                                          [--methods fedavg ditto ...] [--method-set ditto:method.lam=0.5]
                                          [--seeds 0 1 2] [--last 3] [--no-track] [--out DIR]

Default scenario: Fashion-MNIST, Dirichlet(0.1) over labels, 100 clients, 10 per round
(``fmnist_dir01`` in search_spaces/scenarios.yaml). ``--quick`` is a small version (20 clients,
3,000 samples, an MLP, 5 rounds). Every method runs on the same data (loaded once) and seed, with
FedSLR's tuned baseline settings (Ditto λ = 0.1, APFL α = 0.5, FedDyn α = 0.1).

Every method runs once per seed (``--seeds``, default 0 1 2; a seed draws the partition, the
initialisation and the sampling, shared by all methods) and the table (pfl/seeds.py) gives, per
method, the personalized accuracy (mean over clients of each client's model on its own test split)
averaged over the last ``--last`` evaluations of a run, as mean ± std over the seeds, its paired
difference to the best method and the mark ≈ where the two are within their spread; the global
accuracy (the global model on every client's test split, where the method has one) and the
cumulative bytes on the wire (up + down). Logged to MLflow: a parent run with the table (CSV,
Markdown, every run as ``baselines_table_runs.csv``) and one child run per method and seed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pfl.schema import ConfigError  # noqa: E402
from pfl.seeds import add_seeds_argument  # noqa: E402
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
    "federation.eval_every": 1,
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
                  method_sets: dict[str, dict[str, object]], track: bool, seed: int | None = None) -> dict:
    """One validated config per method (all errors before any training); ``seed`` replaces the
    scenario's."""
    from pfl.config import apply_overrides
    from pfl.resolver import resolve
    from pfl.tune.space import load_scenario

    raw = apply_overrides({}, load_scenario(scenario))
    if quick:
        raw = apply_overrides(raw, QUICK)
    raw = apply_overrides(raw, overrides)
    # per-client models of 100 clients would make every child run log hundreds of MB
    raw = apply_overrides(raw, {"tracking.enabled": track, "tracking.log_model": False})
    if seed is not None:
        raw = apply_overrides(raw, {"seed": seed})
    configs = {}
    for method in methods:
        settings = {"method.name": method, **METHOD_SETTINGS.get(method, {}), **method_sets.get(method, {})}
        configs[method] = resolve(apply_overrides(raw, settings))
    return configs


def kind(method: str) -> str:
    return "global" if method in GLOBAL_METHODS else ("local" if method == "local" else "personalized")


def measure(summary) -> dict:
    f = summary.final
    return {"global_acc": f.get("global/test_acc", float("nan")), "ari": f.get("cluster/ari", float("nan")),
            "total_bytes": f.get("comm/total_bytes", 0.0),
            "up_bytes": f.get("comm/up_bytes", 0.0), "down_bytes": f.get("comm/down_bytes", 0.0)}


def run(methods: list[str], scenario: str = "fmnist_dir01", quick: bool = False,
        overrides: list[str] | None = None, method_sets: dict | None = None, track: bool = True,
        out: str | Path | None = None, progress=print, seeds=(0, 1, 2), last: int = 3) -> dict:
    import pandas as pd

    from pfl.runner import format_bytes
    from pfl.schema import flatten
    from pfl.seeds import Row, check_seeds, compare

    seeds = check_seeds(seeds)
    args = (scenario, quick, list(overrides or []), method_sets or {}, track)
    per_seed = {s: build_configs(methods, *args, seed=s) for s in seeds}  # every config error first
    first = per_seed[seeds[0]][methods[0]]
    shared = {k: v for k, v in flatten(first.to_dict()).items() if not k.startswith("method.") and k != "seed"}
    rows = [Row(m, lambda s, m=m: per_seed[s][m], measure=measure) for m in methods]
    paper = lambda r: "" if r["row"] not in PAPER_C10_NONIID else f"{PAPER_C10_NONIID[r['row']]:.2f}"  # noqa: E731
    result = compare(
        "baselines_table", rows, seeds, track=track, last=last, reference="best", outdir=out, progress=progress,
        params={**shared, "methods": ",".join(methods), "scenario": scenario, "quick": quick, "last": last},
        columns=[("global_acc", "global acc %", 100.0, 2), ("ari", "cluster ARI", 1.0, 3)],
        text_columns=[("kind", lambda r: kind(r["row"])),
                      ("total bytes", lambda r: format_bytes(r.get("total_bytes_mean", 0.0))),
                      ("paper C10 non-IID", paper)],
        notes=["Reference: the best row. global acc: the global model on every client's test split (– where the "
               "method has none); cluster ARI: clustered methods' assignment against the true clusters; "
               "bytes: training traffic, both directions, per run. The last column is the "
               "FedSLR paper's Table 1 on CIFAR-10 non-IID (ResNet-18-GN, 1,000 rounds), a different data set "
               "and scale: compare the ranking of the methods, not the numbers."])
    table = pd.DataFrame([{"method": r["row"], "kind": kind(r["row"]),
                           **{k: v for k, v in r.items() if k not in ("row", "group", "values")}}
                          for r in result["summary"]])
    return {"table": table, "records": result["records"], "markdown": result["markdown"],
            "parent_run_id": result["parent_run_id"]}


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
    parser.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    parser.add_argument("--last", type=int, default=3, help="evaluations averaged per run (default 3)")
    add_seeds_argument(parser)
    args = parser.parse_args(argv)
    try:
        result = run(args.methods, args.scenario, args.quick, args.set, parse_method_sets(args.method_set),
                     track=not args.no_track, out=args.out, progress=None if args.quiet else print,
                     seeds=args.seeds, last=args.last)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print("\n" + result["markdown"])
    if result["parent_run_id"]:
        print("\n" + run_hint(result["parent_run_id"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
