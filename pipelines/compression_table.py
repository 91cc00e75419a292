"""Communication compression table: accuracy and bytes of compressed FL and the seminar's methods.

    python pipelines/compression_table.py [--quick] [--only TEXT ...] [--target ACC] [--set key=value ...]
                                          [--seeds 0 1 2] [--no-track] [--out DIR] [--quiet]

Entries (docs/methods/seminar.md, docs/methods/compression.md; ``--only`` keeps the labels containing any TEXT):

* ``fedavg`` and ``scaffold`` on Fashion-MNIST Dir(0.5) (scenario ``fmnist_dir05``: 20 clients sharing
  20,000 samples, 10 per round, an MLP, 50 rounds) and ``fpfc`` on FPFC's synthetic S1 (``fpfc_s1``,
  300 rounds), each × {none, fp16, qsgd s=1, qsgd s=7, terngrad, rand-k 10 %, top-k 1 % + EF, scaled
  sign + EF} as ``compression.uplink``, × {fp16, qsgd s=1, qsgd s=7, terngrad, rand-k 10 %, top-k 10 %,
  scaled sign} as ``compression.downlink`` (labels ``down_*``; the replica scheme of
  docs/methods/compression.md), and a few pairs of both (``up+down_*``);
* on Fashion-MNIST: DIANA + QSGD s=1, MARINA + rand-k 10 % (a gradient method: one gradient step
  per round, so it gets 10× the rounds, full participation), LAG, L2GD, FedPD (full participation),
  FedSplit — every method at its defaults.

Columns: final test accuracy (each method's evaluated model: global for the global methods, personal
for FPFC and L2GD), the accuracy difference in points to the same method's uncompressed entry
(FedAvg's for the seminar entries), cumulative uplink and downlink bytes (measured: the encodings'
bits), the ratio of their total to the uncompressed entry's, the total bytes at the first evaluation
that reached the target accuracy (``--target``; default: 95 % of the uncompressed FedAvg's — FPFC's on
S1 — final accuracy), and whether the run was stable (FINISHED; a diverged run ends FAILED).

Seeds (``--seeds``, default 0 1 2): every entry runs once per seed (pfl/seeds.py); the accuracy, the
difference to the baseline (paired: same seed) and the bytes are mean ± std over the seeds, and ≈
marks an entry whose accuracy is within the spread of its baseline's (|Δ| < the larger std). The
target is computed per seed from that seed's reference run; a run that failed (diverged) is counted
in "stable" and left out of the means.

MLflow: a parent run with the table (CSV, Markdown; every run as ``compression_table_runs.csv``), one
plot per scenario of test accuracy vs cumulative total bytes (the first seed's runs,
``plots/accuracy_vs_uplink_<scenario>.png``) and each entry's headline metrics; one child run per
entry and seed (per-round metrics, config, its own plots). ``--quick`` shrinks
everything (6,000 Fashion-MNIST samples, 10 clients, 10 rounds; S1 with 20 devices and 40 rounds)
to run in a few minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pfl.schema import ConfigError  # noqa: E402
from pfl.seeds import add_seeds_argument  # noqa: E402
from pfl.tracking import run_hint  # noqa: E402

#: compression.* settings of the compressor rows (label → dotted overrides): uplink, downlink, both
COMPRESSORS: dict[str, dict] = {
    "none": {},
    "fp16": {"compression.uplink": {"name": "fp16"}},
    "qsgd_s1": {"compression.uplink": {"name": "qsgd", "s": 1}},
    "qsgd_s7": {"compression.uplink": {"name": "qsgd", "s": 7}},
    "terngrad": {"compression.uplink": {"name": "terngrad"}},
    "randk_10": {"compression.uplink": {"name": "randk", "ratio": 0.1}},
    "topk_1_ef": {"compression.uplink": {"name": "topk", "ratio": 0.01}, "compression.error_feedback": True},
    "sign_ef": {"compression.uplink": {"name": "sign", "scaled": True}, "compression.error_feedback": True},
}
DOWNLINK: dict[str, dict] = {f"down_{label}": {"compression.downlink": spec} for label, spec in {
    "fp16": {"name": "fp16"}, "qsgd_s1": {"name": "qsgd", "s": 1}, "qsgd_s7": {"name": "qsgd", "s": 7},
    "terngrad": {"name": "terngrad"}, "randk_10": {"name": "randk", "ratio": 0.1},
    "topk_10": {"name": "topk", "ratio": 0.1}, "sign": {"name": "sign", "scaled": True}}.items()}
#: both directions: an uplink label + a downlink label
BOTH = [("topk_1_ef", "down_sign"), ("topk_1_ef", "down_qsgd_s7"), ("topk_1_ef", "down_topk_10"),
        ("sign_ef", "down_sign"), ("qsgd_s1", "down_qsgd_s7")]
COMPRESSORS.update(DOWNLINK)
COMPRESSORS.update({f"{up}+{down}": {**COMPRESSORS[up], **DOWNLINK[down]} for up, down in BOTH})

#: scenario → (scenario name, overrides, quick overrides)
SCENARIOS: dict[str, tuple[str, dict, dict]] = {
    "fmnist": ("fmnist_dir05", {}, {
        "data.max_samples": 6000, "data.num_clients": 10, "federation.clients_per_round": 5,
        "federation.rounds": 10, "federation.eval_every": 2, "model.params": {"hidden": [100]}}),
    "s1": ("fpfc_s1", {"federation.rounds": 300, "federation.eval_every": 25}, {
        "data.num_clients": 20, "federation.clients_per_round": 6, "federation.rounds": 40,
        "federation.eval_every": 10}),
}

#: the seminar's methods (on the Fashion-MNIST scenario); "rounds_x" multiplies the scenario's rounds
SEMINAR: dict[str, dict] = {
    "diana/qsgd_s1": {"method.name": "diana", "compression.uplink": {"name": "qsgd", "s": 1}},
    "marina/randk_10": {"method.name": "marina", "compression.uplink": {"name": "randk", "ratio": 0.1},
                        "federation.clients_per_round": 0, "federation.lr": 0.5, "rounds_x": 10},
    "lag/none": {"method.name": "lag"},
    "lag/qsgd_s7": {"method.name": "lag", "compression.uplink": {"name": "qsgd", "s": 7}},
    "l2gd/none": {"method.name": "l2gd"},
    "fedpd/none": {"method.name": "fedpd", "federation.clients_per_round": 0},
    "fedpd/topk_1_ef": {"method.name": "fedpd", "federation.clients_per_round": 0,
                        "compression.uplink": {"name": "topk", "ratio": 0.01}, "compression.error_feedback": True},
    "fedsplit/none": {"method.name": "fedsplit"},
}

#: (method, scenario) pairs crossed with every compressor
CROSSED = [("fedavg", "fmnist"), ("scaffold", "fmnist"), ("fpfc", "s1")]
#: the entry whose final accuracy sets each scenario's default target
REFERENCE = {"fmnist": "fedavg/none", "s1": "fpfc/none"}


def entries() -> list[tuple[str, str, str, dict]]:
    """(label, scenario, compressor label, overrides) of every entry, reference entries first."""
    out = []
    for method, scenario in CROSSED:
        for comp, settings in COMPRESSORS.items():
            out.append((f"{method}/{comp}", scenario, comp, {"method.name": method, **settings}))
    for label, settings in SEMINAR.items():
        out.append((label, "fmnist", label.split("/")[1], dict(settings)))
    return out


def matches(label: str, text: str) -> bool:
    """``text`` is in ``label``; a trailing ``$`` anchors it at the label's end (``fpfc/qsgd_s1$``: not
    ``fpfc/qsgd_s1+down_qsgd_s7``)."""
    return label.endswith(text[:-1]) if text.endswith("$") else text in label


def select(all_entries, only: list[str] | None):
    if not only:
        return all_entries
    return [e for e in all_entries if any(matches(e[0], text) for text in only)]


def build_configs(chosen, quick: bool, overrides: list[str], track: bool, seed: int | None = None) -> dict:
    """One validated config per entry (every error before any training); ``seed`` replaces the scenario's."""
    from pfl.config import apply_overrides
    from pfl.resolver import resolve
    from pfl.tune.space import load_scenario

    configs = {}
    for label, scenario, _, settings in chosen:
        name, base, small = SCENARIOS[scenario]
        raw = apply_overrides(apply_overrides({}, load_scenario(name)), base)
        if quick:
            raw = apply_overrides(raw, small)
        settings = dict(settings)
        times = settings.pop("rounds_x", 1)
        raw = apply_overrides(raw, settings)
        raw = apply_overrides(raw, overrides)
        if times != 1:
            fed = raw["federation"]
            fed["rounds"] = int(fed["rounds"]) * times
            fed["eval_every"] = int(fed.get("eval_every", 1)) * times
        raw = apply_overrides(raw, {"tracking.enabled": track, "tracking.log_model": False})
        if seed is not None:
            raw = apply_overrides(raw, {"seed": seed})
        try:
            configs[label] = resolve(raw)
        except ConfigError as err:
            raise ConfigError(err.field, f"{err} (entry {label})") from None
    return configs


def curve(history: list[dict]) -> list[tuple[float, float]]:
    """(cumulative training bytes, uplink and downlink, test accuracy) at every evaluation."""
    return [(h["comm/total_bytes"], h["test/acc_mean"]) for h in history if "test/acc_mean" in h]


def bytes_to_target(points: list[tuple[float, float]], target: float) -> float:
    for up, acc in points:
        if acc >= target:
            return up
    return math.nan


def plot_curves(curves: dict[str, list[tuple[float, float]]], targets: dict[str, float], scenario: str,
                path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 5.2), dpi=100)
    colors = plt.get_cmap("tab20").colors
    for i, (label, points) in enumerate(curves.items()):
        if points:
            xs, ys = zip(*points)
            ax.plot([x / 2**20 for x in xs], ys, marker=".", label=label, color=colors[i % len(colors)],
                    linestyle="-" if "/none" in label else "--" if "_ef" in label else "-.")
    if scenario in targets and targets[scenario] == targets[scenario]:
        ax.axhline(targets[scenario], color="grey", lw=0.8, ls=":", label="target")
    ax.set_xscale("log")
    ax.set_xlabel("cumulative uplink + downlink (MiB, log scale)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"accuracy vs bytes — {SCENARIOS[scenario][0]}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def format_table(rows: list[dict]) -> str:
    """``rows``: one summary per entry (mean/std over the seeds, :func:`summarize`)."""
    from pfl.runner import format_bytes
    from pfl.seeds import fmt

    lines = ["| entry | scenario | seeds | test acc % | Δ acc (pt, paired) | within spread | uplink | downlink | "
             "total ratio | total to target | stable | rounds |", "|" + "---|" * 12]
    for r in rows:
        ratio = r["total_ratio_mean"]
        ratio = "–" if ratio != ratio else f"1/{1 / ratio:.1f}" if ratio else "0"
        target = "not reached" if r["to_target_mean"] != r["to_target_mean"] else format_bytes(r["to_target_mean"])
        runs = r["seeds"] + r["failed"]
        stable = "yes" if not r["failed"] else f"no ({r['failed']} of {runs} failed)"
        lines.append(f"| {r['entry']} | {r['scenario']} | {r['seeds']} | {fmt(r['test_acc_mean'], r['test_acc_std'], 100)} | "
                     f"{fmt(r['acc_delta_mean'], r['acc_delta_std'], 100)} | {r['mark']} | "
                     f"{format_bytes(r['up_bytes_mean'])} | {format_bytes(r['down_bytes_mean'])} | {ratio} | {target} | "
                     f"{stable} | {r['rounds']} |")
    return "\n".join(lines)


def summarize(records: list[dict]) -> list[dict]:
    """Per entry: mean ± std over the seeds (pfl.seeds.aggregate: failed runs counted apart, never
    averaged) and ≈ where its accuracy is within the spread of its baseline's; 'total to target' is the
    mean over the seeds that reached it."""
    from pfl.seeds import MARK, aggregate

    numeric = [{"row": r["entry"], "seed": r["seed"], "status": r["status"], **{k: r[k] for k in
               ("test_acc", "global_acc", "up_bytes", "down_bytes", "time_s", "up_ratio", "total_ratio",
                "acc_delta", "to_target")}} for r in records]
    summary = aggregate(numeric, key="test_acc", skip=("seed", "status"))
    first = {r["entry"]: r for r in records}
    by = {s["row"]: s for s in summary}
    out = []
    for s in summary:
        meta = first[s["row"]]
        base = by.get(meta["baseline"])
        mark = ""
        if base is not None and base is not s and s["seeds"] > 1:
            spread = max(x for x in (s["test_acc_std"], base["test_acc_std"], 0.0) if x == x)
            mark = MARK if abs(s["test_acc_mean"] - base["test_acc_mean"]) < spread else ""
        out.append({"entry": s["row"], "scenario": meta["scenario"], "method": meta["method"],
                    "compressor": meta["compressor"], "error_feedback": meta["error_feedback"],
                    "baseline": meta["baseline"], "rounds": meta["rounds"], "seeds": s["seeds"],
                    "failed": s["failed"], "mark": mark,
                    **{k: v for k, v in s.items() if k.endswith(("_mean", "_std"))}})
    return out


def relative_columns(rows, chosen, finals, ups, totals, curves, target) -> dict[str, float]:
    """Each row of one seed against its method's dense run (FedAvg's for the seminar entries), in
    place; returns the target accuracy of each scenario."""
    targets = {}
    for scenario, ref in REFERENCE.items():
        targets[scenario] = target if target is not None else 0.95 * finals.get(ref, math.nan)
    for row, (label, scenario, _, _) in zip(rows, chosen):
        base = f"{label.split('/')[0]}/none"
        if base not in finals or label in SEMINAR:
            base = REFERENCE[scenario]
        row["baseline"] = base if base in finals else ""
        row["up_ratio"] = ups[label] / ups[base] if base in ups and ups[base] else math.nan
        row["total_ratio"] = totals[label] / totals[base] if base in totals and totals[base] else math.nan
        row["acc_delta"] = finals[label] - finals[base] if base in finals else math.nan
        row["target"] = targets[scenario]
        row["to_target"] = bytes_to_target(curves[scenario][label], targets[scenario])
    return targets


def write_partial(records: list[dict], out: Path, total: int) -> None:
    """``compression_table.partial.md`` / ``.csv`` in ``out``: the runs done so far, said to be partial."""
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(records).to_csv(out / "compression_table.partial.csv", index=False)
    head = f"PARTIAL: {len(records)} of {total} runs done\n\n" if len(records) < total else ""
    (out / "compression_table.partial.md").write_text(head + format_table(summarize(records)) + "\n")


def _data_key(cfg) -> str:
    from pfl.schema import to_dict

    return json.dumps({"seed": cfg.seed, "data": to_dict(cfg.data)}, sort_keys=True, default=str)


def run(only: list[str] | None = None, quick: bool = False, overrides: list[str] | None = None,
        target: float | None = None, track: bool = True, out: str | Path | None = None, progress=print,
        seeds=(0, 1, 2)) -> dict:
    import tempfile

    import pandas as pd

    from pfl.data import load_federated
    from pfl.runner import TableRun
    from pfl.seeds import check_seeds

    chosen = select(entries(), only)
    if not chosen:
        raise ConfigError("--only", f"no entry matches {only}; entries: {', '.join(e[0] for e in entries())}")
    seeds = check_seeds(seeds)
    per_seed = {seed: build_configs(chosen, quick, list(overrides or []), track, seed) for seed in seeds}
    parent = TableRun("compression_table" + ("-quick" if quick else ""), track=track,
                      params={"entries": ",".join(per_seed[seeds[0]]), "quick": quick, "target": target,
                              "overrides": " ".join(overrides or []), "seeds": " ".join(map(str, seeds))})
    records = []
    plotted: dict[str, dict] = {s: {} for s in SCENARIOS}
    targets_by_seed: dict[int, dict[str, float]] = {}
    for seed in seeds:
        configs = per_seed[seed]
        datasets: dict[str, object] = {}
        rows, curves = [], {s: {} for s in SCENARIOS}
        finals: dict[str, float] = {}
        ups: dict[str, float] = {}
        totals: dict[str, float] = {}
        for label, scenario, comp, _ in chosen:
            cfg = configs[label]
            key = _data_key(cfg)
            if key not in datasets:
                datasets[key] = load_federated(cfg.data, cfg.seed)
            if progress:
                progress(f"== {label} ({SCENARIOS[scenario][0]}, seed {seed}) ==")
            start = time.perf_counter()
            summary = parent.run(f"{label} [seed {seed}]", cfg, progress=progress, data=datasets[key])
            f = summary.final
            finals[label] = f.get("test/acc_mean", math.nan)
            ups[label] = f.get("comm/up_bytes", math.nan)
            totals[label] = f.get("comm/total_bytes", math.nan)
            curves[scenario][label] = curve(summary.history)
            rows.append({"entry": label, "seed": seed, "scenario": SCENARIOS[scenario][0], "method": cfg.method.name,
                         "compressor": comp, "error_feedback": cfg.compression.error_feedback,
                         "test_acc": finals[label], "global_acc": f.get("global/test_acc", math.nan),
                         "up_bytes": ups[label], "down_bytes": f.get("comm/down_bytes", math.nan),
                         "rounds": cfg.federation.rounds, "time_s": time.perf_counter() - start,
                         "status": summary.status, "run_id": summary.run_id or ""})
            targets = relative_columns(rows, chosen, finals, ups, totals, curves, target)
            if out:  # the runs so far, so that a run cut off still leaves what it measured (marked partial)
                write_partial(records + rows, Path(out), len(chosen) * len(seeds))
        records += rows
        targets_by_seed[seed] = targets
        if seed == seeds[0]:
            plotted = curves
    table = summarize(records)
    for row in table:
        safe = row["entry"].replace("/", ".").replace("+", "_and_")  # MLflow metric names take no '+'
        parent.log_metrics({f"{safe}.test_acc": row["test_acc_mean"], f"{safe}.up_bytes": row["up_bytes_mean"]})
    text = format_table(table)
    targets = targets_by_seed[seeds[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for scenario, drawn in plotted.items():
            if drawn:
                path = plot_curves(drawn, targets, scenario, Path(tmp) / f"accuracy_vs_uplink_{scenario}.png")
                parent.parent.log_artifact(path, "plots")
                if out:
                    Path(out).mkdir(parents=True, exist_ok=True)
                    (Path(out) / path.name).write_bytes(path.read_bytes())
        parent.finish(table, "compression_table", text, outdir=out, runs=records)
    return {"table": pd.DataFrame(table), "runs": pd.DataFrame(records), "markdown": text,
            "parent_run_id": parent.run_id, "targets": targets, "targets_by_seed": targets_by_seed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small, fast version (a few minutes)")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="run only the entries whose label contains one of these (e.g. fedavg/ diana); "
                             "a trailing $ anchors TEXT at the label's end (fpfc/qsgd_s1$)")
    parser.add_argument("--target", type=float, default=None,
                        help="target test accuracy for the bytes-to-target column (default: 0.95 × the "
                             "uncompressed FedAvg's, FPFC's on S1)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="dotted config overrides for every entry")
    parser.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    parser.add_argument("--out", help="also write the table (CSV, Markdown) and plots into this directory, and "
                                      "after every entry the rows so far (compression_table.partial.*)")
    parser.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    parser.add_argument("--list", action="store_true", help="list the entries and exit")
    add_seeds_argument(parser)
    args = parser.parse_args(argv)
    if args.list:
        for label, scenario, _, settings in entries():
            print(f"{label:<22} {SCENARIOS[scenario][0]:<14} {settings}")
        return 0
    try:
        result = run(args.only, args.quick, args.set, args.target, track=not args.no_track, out=args.out,
                     progress=None if args.quiet else print, seeds=args.seeds)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print("\n" + result["markdown"])
    if result["parent_run_id"]:
        print("\n" + run_hint(result["parent_run_id"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
