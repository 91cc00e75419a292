"""FPFC's newcomer experiment (paper §6.4.2, Table 3): how well devices that join after training do.

    python pipelines/newcomers.py                        # quick preset, S1 and FMNIST label swap
    python pipelines/newcomers.py --preset paper
    python pipelines/newcomers.py --scenarios s1 --methods fpfc local
    python pipelines/newcomers.py --seeds 0 1 2 3 4      # more seeds (default 0 1 2)

20 % of the devices (``newcomers.fraction``, drawn once from the seed) take no part in training and
join after the last round by their method's rule (pfl/federation/newcomers.py, docs/methods/fpfc.md §8):

* ``local``      trains alone (``newcomers.rounds`` local updates);
* ``fedavg``     is evaluated with the final global model;
* ``lg``         (LG-FedAvg) fine-tunes the server's model for ``newcomers.finetune_rounds`` (1) local
                 updates; the body was FedAvg-trained in a warm-up of half the rounds
                 (``warmup_rounds``) so that the server's model is a trained one (docs/methods/fpfc.md §9: the FPFC
                 repository's "LG" is FedAvg-like);
* ``perfedavg``  fine-tunes the final global model for ``newcomers.finetune_rounds`` (1) local updates;
* ``ifca``       picks the cluster model with the lowest training loss (K = 4);
* ``cfl``        descends CFL's split tree (its update at each cached pre-split model);
* ``pacfl``      uploads its data basis; the server puts it in the nearest cluster;
* ``fpfc_l1``, ``fpfc``  train alone first, then newcomer-only ADMM rounds against the trained
                 devices until the upload settles (``newcomers.tol``) or ``newcomers.rounds``.

Every (scenario, method) runs once per seed (``--seeds``, default 0 1 2; a seed draws the data, the
newcomers and the training randomness, shared by the methods). Reported per method, as mean ± std
over the seeds (pfl/seeds.py): the newcomers' mean test accuracy (★ the best method of the scenario,
≈ within its spread) and the std of the newcomers' accuracies within a run (Table 3's two numbers,
printed beside the paper's); the test samples behind the newcomers' mean; for the clustered methods
the ARI of the cluster assignment of all devices (trained and newcomers) against the true clusters
and the share of newcomers placed in the cluster of most of their true cluster's trained devices;
the trained devices' accuracy; the join steps and join traffic.

Scenarios and presets are robustness.py's (S1 quick: 200 rounds here, FPFC λ = 0.6 from the zoo
initialisation, 200 join rounds; FMNIST label swap quick: 40 rounds, 10,000 images, 5 local epochs,
20 join rounds). Logged to MLflow: a parent run with the table (CSV, Markdown) and the headline
numbers; one child run per (scenario, method, seed) with ``newcomer/*`` metrics and ``newcomers.csv``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pfl.schema import ConfigError  # noqa: E402
from pfl.seeds import add_seeds_argument  # noqa: E402
from pfl.tracking import run_hint  # noqa: E402

#: Table 3's rows in the paper's order
METHODS = ["local", "fedavg", "lg", "perfedavg", "ifca", "cfl", "pacfl", "fpfc_l1", "fpfc"]

#: the paper's Table 3 (mean local test accuracy of the newcomers in %, std), docs/methods/fpfc.md §8
PAPER = {
    "local": {"s1": (79.00, 0.08), "mnist": (90.81, 0.06), "fmnist_labelswap": (75.29, 0.06)},
    "fedavg": {"s1": (38.73, 0.29), "mnist": (73.67, 0.04), "fmnist_labelswap": (66.26, 0.06)},
    "lg": {"s1": (66.22, 0.11), "mnist": (95.71, 0.03), "fmnist_labelswap": (80.25, 0.07)},
    "perfedavg": {"s1": (43.26, 0.26), "mnist": (96.62, 0.01), "fmnist_labelswap": (77.94, 0.06)},
    "ifca": {"s1": (33.57, 0.28), "mnist": (96.65, 0.01), "fmnist_labelswap": (73.93, 0.10)},
    "cfl": {"s1": (69.43, 0.33), "mnist": (95.46, 0.02), "fmnist_labelswap": (70.66, 0.07)},
    "pacfl": {"s1": (71.88, 0.30), "mnist": (74.45, 0.05), "fmnist_labelswap": (66.42, 0.06)},
    "fpfc_l1": {"s1": (67.72, 0.10), "mnist": (92.73, 0.05), "fmnist_labelswap": (75.54, 0.08)},
    "fpfc": {"s1": (79.31, 0.08), "mnist": (93.51, 0.06), "fmnist_labelswap": (75.73, 0.07)},
}

#: per scenario and preset: training rounds, join rounds and further config (the rest: robustness.py's)
PRESETS = {
    "s1": {"quick": {"rounds": 200, "join_rounds": 200, "config": {}},
           "paper": {"rounds": 2000, "join_rounds": 500, "config": {}}},
    "fmnist_labelswap": {"quick": {"rounds": 40, "join_rounds": 20,
                                   "config": {"data.max_samples": 10000, "federation.local_epochs": 5}},
                         "paper": {"rounds": 200, "join_rounds": 50, "config": {}}},
}


def format_table(summary: list[dict]) -> str:
    from pfl.seeds import MARK, fmt

    head = ("| scenario | method | seeds | newcomer acc % | std over newcomers | paper % (std) | Δ pt | test samples | "
            "ARI (all) | in true cluster | trained acc % | join steps | join bytes |")
    lines = [head, "|" + "---|" * 13]
    for r in summary:
        scenario, method = r["group"], r["row"]
        paper = PAPER.get(method, {}).get(scenario)
        paper_text = "–" if paper is None else f"{paper[0]:.2f} ({paper[1]:.2f})"
        acc = r["acc_mean"]
        delta = "–" if paper is None or acc != acc else f"{100 * acc - paper[0]:+.2f}"
        mark = {"ref": " ★", MARK: f" {MARK}"}.get(r.get("mark", ""), "")
        lines.append(f"| {scenario} | {method} | {r['seeds']} | {fmt(acc, r['acc_std'], 100)}{mark} | "
                     f"{fmt(r['std_mean'], r['std_std'], 1.0)} | {paper_text} | {delta} | {r['test_n_mean']:,.0f} | "
                     f"{fmt(r['ari_mean'], r['ari_std'], 1.0, 3)} | {fmt(r['in_true_mean'], r['in_true_std'])} | "
                     f"{fmt(r['trained_acc_mean'], r['trained_acc_std'], 100)} | {r['join_steps_mean']:.0f} | "
                     f"{int(r['join_bytes_mean']):,} |")
    lines += ["", f"Mean ± std over the seeds. ★ the best method of the scenario; {MARK} within its spread "
              "(|difference of means| < the larger std): not separated from it. test samples: the newcomers' "
              "test splits behind one run's mean."]
    return "\n".join(lines)


def run(scenarios: list[str], methods: list[str], preset_name: str = "quick", rounds: int | None = None,
        join_rounds: int | None = None, fraction: float = 0.2, overrides: list[str] | None = None,
        track: bool = True, experiment: str | None = None, out: str | Path | None = None, progress=print,
        seeds=(0, 1, 2)) -> dict:
    from pfl.config import apply_overrides
    from pfl.resolver import resolve
    from pfl.data import load_federated
    from pfl.runner import TableRun
    from pfl.seeds import aggregate, check_seeds, test_samples
    from robustness import common_config, entry_overrides

    overrides = list(overrides or [])
    seeds = check_seeds(seeds)
    plans = {}
    for seed in seeds:
        for scenario in scenarios:
            sizes = dict(PRESETS[scenario][preset_name])
            sizes["rounds"] = rounds if rounds is not None else sizes["rounds"]
            sizes["join_rounds"] = join_rounds if join_rounds is not None else sizes["join_rounds"]
            raw, preset = common_config(scenario, preset_name, sizes["rounds"], overrides, track, experiment,
                                        extra={"newcomers.fraction": fraction, "newcomers.rounds": sizes["join_rounds"],
                                               **sizes["config"]}, seed=seed)
            configs = []
            for entry in methods:
                settings = {**entry_overrides(entry, scenario, preset),
                            "tracking.run_name": f"{scenario}/{entry}/seed{seed}"}
                if entry == "lg":
                    settings["method.warmup_rounds"] = sizes["rounds"] // 2
                configs.append((entry, resolve(apply_overrides(apply_overrides(raw, settings), overrides))))
            plans[(seed, scenario)] = (sizes, preset, configs)
    first = {s: plans[(seeds[0], s)][0] for s in scenarios}
    parent = TableRun(f"newcomers-{preset_name}", experiment=experiment, track=track,
                      params={"preset": preset_name, "scenarios": " ".join(scenarios), "methods": " ".join(methods),
                              "newcomers.fraction": fraction, "seeds": " ".join(map(str, seeds)),
                              **{f"{s}.rounds": first[s]["rounds"] for s in scenarios},
                              **{f"{s}.join_rounds": first[s]["join_rounds"] for s in scenarios}})
    rows = []
    for seed in seeds:
        for scenario in scenarios:
            sizes, preset, configs = plans[(seed, scenario)]
            data = load_federated(configs[0][1].data, configs[0][1].seed)
            if progress:
                progress(f"{scenario}, seed {seed}: {data.num_clients} devices ({round(fraction * data.num_clients)} "
                         f"newcomers), {sizes['rounds']} rounds, up to {sizes['join_rounds']} join rounds")
            for entry, cfg in configs:
                start = time.perf_counter()
                summary = parent.run(cfg.tracking.run_name, cfg, data=data)
                f = summary.final
                row = {"scenario": scenario, "method": entry, "seed": seed,
                       "acc": f.get("newcomer/acc_mean", float("nan")),
                       "std": f.get("newcomer/acc_std", float("nan")), "ari": f.get("newcomer/ari", float("nan")),
                       "in_true": f.get("newcomer/in_true_cluster", float("nan")),
                       "clusters": f.get("newcomer/clusters", float("nan")),
                       "trained_acc": f.get("test/acc_mean", float("nan")),
                       "test_n": float(test_samples(summary, newcomers=True)),
                       "join_steps": f.get("newcomer/join_steps", 0.0),
                       "join_bytes": f.get("comm/join_up_bytes", 0.0) + f.get("comm/join_down_bytes", 0.0),
                       "wall_s": time.perf_counter() - start, "status": summary.status, "run_id": summary.run_id or ""}
                paper = PAPER.get(entry, {}).get(scenario)
                row["paper_acc"], row["paper_std"] = (paper[0] / 100, paper[1]) if paper else (float("nan"),) * 2
                rows.append(row)
                if progress:
                    progress(f"   {entry:<10} newcomers {100 * row['acc']:6.2f} % (std {row['std']:.2f})"
                             + (f", ARI {row['ari']:.3f}" if row["ari"] == row["ari"] else "")
                             + f"; trained {100 * row['trained_acc']:.2f} %  [{row['wall_s']:.0f} s]")
    records = [{**{k: v for k, v in r.items() if k not in ("scenario", "method", "paper_acc", "paper_std")},
                "group": r["scenario"], "row": r["method"]} for r in rows]
    summary = aggregate(records, key="acc", reference="best", skip=("seed", "wall_s"))
    for r in summary:
        parent.log_metrics({k: v for k, v in {f"{r['group']}/{r['row']}/newcomer_acc_mean": r["acc_mean"],
                                               f"{r['group']}/{r['row']}/newcomer_ari_mean": r["ari_mean"]}.items()
                            if v == v})
    text = format_table(summary)
    from pfl.methods import get_method
    from robustness import ENTRIES

    rules = [f"- {m}: {get_method(ENTRIES[m][0]).newcomer_rule}" for m in methods]
    text = "\n".join([text, "", "Newcomer rules:", *rules])
    table_rows = [{k: v for k, v in r.items() if k != "values"} for r in summary]
    parent.finish(table_rows, "newcomers_table", text=text, outdir=out, runs=rows)
    return {"rows": rows, "summary": summary, "table": text, "parent_run_id": parent.run_id}


def main(argv: list[str] | None = None) -> int:
    from robustness import SCENARIOS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=("quick", "paper"), default="quick")
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=["s1", "fmnist_labelswap"])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS, metavar="NAME",
                        help=f"Table 3 rows (default: {' '.join(METHODS)})")
    parser.add_argument("--rounds", type=int, help="training rounds (default: the preset's)")
    parser.add_argument("--join-rounds", type=int, help="newcomers.rounds (default: the preset's)")
    parser.add_argument("--fraction", type=float, default=0.2, help="share of newcomers (paper: 0.2)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="dotted config overrides for every run")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; 0 = torch's default)")
    parser.add_argument("--experiment", default=None, help="MLflow experiment (default: mlflow.yaml's)")
    parser.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    parser.add_argument("--out", help="also write the table into this directory")
    parser.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    add_seeds_argument(parser)
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = run(args.scenarios, args.methods, args.preset, args.rounds, args.join_rounds, args.fraction,
                     args.set, track=not args.no_track, experiment=args.experiment, out=args.out,
                     progress=None if args.quiet else print, seeds=args.seeds)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print()
    print(result["table"])
    if result["parent_run_id"]:
        print("\n" + run_hint(result["parent_run_id"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
