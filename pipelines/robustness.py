"""FPFC's robustness experiment (paper §6.4.1, Fig. 7, App. E.2): benign accuracy under Byzantine attacks.

    python pipelines/robustness.py                                  # quick preset, the whole grid
    python pipelines/robustness.py --preset paper                   # the paper's scale
    python pipelines/robustness.py --scenarios s1 --methods fpfc fedavg --attacks gaussian --fractions 0 0.2 0.4
    python pipelines/robustness.py --seeds 0 1 2 3 4                # more seeds (default 0 1 2)

Grid: methods × attacks × malicious fractions × scenarios. Methods (``--methods``): ``fpfc``,
``fpfc_l1``, ``fedavg``, ``fedavg_median`` (coordinate-wise median), ``fedavg_krum`` (Krum with
f = round(|S|·fraction), as the attacks' source [37] sets it), ``local``, ``ifca`` (K = 4), ``cfl``,
``ditto``. Attacks (``--attacks``, pfl/federation/attacks.py, docs/methods/fpfc.md §8): ``same_value``
(c·1, c ~ N(0, 100²)), ``sign_flip`` (−|s|·w, s ~ N(0, 10²)), ``gaussian`` (N(0, 100²) entries).
Fractions (``--fractions``): 0, 0.2, 0.4, 0.6, 0.8 of the devices are malicious (drawn once from the
seed; the same devices for every method and attack); fraction 0 is the clean run, run once per method
and shared by the attacks. The number reported is the mean test accuracy of the **benign** devices
(``test/acc_mean`` of an attacked run), averaged over the evaluations of the last quarter of the rounds
(20 evaluations per run): a poisoned global model is a new random model every round (FedAvg under a
Gaussian attack on S1 scores anywhere between 1 % and 32 % from one evaluation to the next), so one
final evaluation would be a single draw. ``final_acc`` in the CSV is the last evaluation alone.

Scenarios (``--scenarios``):

* ``s1`` — FPFC's synthetic S1 (``pipelines/reproduce_fpfc.py``: 100 devices in 4 clusters, 30 per
  round, 10 full-batch steps, lr 0.1, softmax regression). ``quick``: 100 rounds, FPFC λ = 0.6 from
  the model zoo's initialisation (4 clusters within ~100 rounds; λ = 0.8 from this start learns
  slower, see reproduce_fpfc.py); ``paper``: 2000 rounds, λ = 0.8 from the official N(0, 1) start.
* ``fmnist_labelswap`` — FMNIST, 20 devices in 4 label-swap clusters, 10 per round (the scenario of
  search_spaces/scenarios.yaml); FPFC λ = 0.4 on the last layer, body averaged, silhouette read-out
  (as reproduce_fpfc.py). ``quick``: 6,000 images, 2 local epochs, 20 rounds at a constant lr 0.1
  (reproduce_fpfc.py's quick scale cut down so that 117 runs fit in about an hour on 2 CPUs; the
  scenario's lr 0.009·0.9^⌊k/5⌋ is made for 200 rounds of 10 epochs and leaves FPFC at 36 % here, lr 0.1
  gives FPFC 65 %, FedAvg 56 %, Local 62 % in 20 rounds);
  ``paper``: 200 rounds, 10 local epochs on all 60,000 images.
  CFL uses the FPFC repository's MNIST thresholds ε1/ε2 = 0.05/0.1 here, 0.5/1.0 on S1 (docs/methods/fpfc.md §9).
  The attack rewrites only the last layer of every upload here (``attack.scope: head``): the paper
  attacks "the personalization layers" (§6.4.1); FPFC clusters only that layer and averages the
  convolutional body with a plain mean, so with ``--scope model`` the attackers poison the body and
  FPFC falls with FedAvg (measured: clean 63 % → 26 % at 20 % same-value attackers, 20 rounds, 5
  local epochs). Even with ``scope: head`` a Gaussian attacker poisons that mean indirectly: its ζ
  echoes its own upload (ζ_b ≈ w_b, the flat region cuts it off from everyone), its honest training
  towards it gives a garbage body, which it uploads. ``fpfc_median`` (not in the default grid) is
  FPFC with the body combined by the coordinate-wise median.

Seeds (``--seeds``, default 0 1 2): the whole grid runs once per seed (a seed draws the data, the
malicious devices and the training randomness; within a seed every method sees the same). Each cell
of the table is the mean ± std over the seeds (pfl/seeds.py); ★ marks the best method of a column and
≈ the methods whose mean is within the spread of the best (|difference| < the larger std), which the
grid therefore does not separate from it. The drops below the table are per seed, then mean ± std.

Output: the table (printed; CSV and Markdown on the MLflow parent run), one plot per attack (benign
accuracy vs malicious fraction, a panel per scenario, a line per method) under ``plots/`` of the
parent, and the largest drop of each method from its clean accuracy (at fractions ≤ 0.4 and over
all). The drop is like for like: the clean run's accuracy on the same benign devices (column
``clean_same_devices`` of the CSV) minus the attacked run's, since which devices are left out
changes the mean by itself.
Every grid point and seed is a child run (per-round metrics of the benign devices, ``attack/benign_clients``,
``attack_malicious.csv``). A run whose model the attack drove to inf/NaN is not a failure: it is
evaluated as it is and marked ``attack/diverged``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pfl.federation.loop import Callback  # noqa: E402
from pfl.schema import ConfigError  # noqa: E402
from pfl.seeds import add_seeds_argument  # noqa: E402
from pfl.tracking import run_hint  # noqa: E402

ATTACKS = ("same_value", "sign_flip", "gaussian")
#: evaluations per run, and the share of the last rounds whose evaluations the reported accuracy averages
EVALS = 20
TAIL = 0.25
FRACTIONS = (0.0, 0.2, 0.4, 0.6, 0.8)
PRESETS = ("quick", "paper")

#: table entry -> (registered method, hyperparameters; per scenario where they differ)
ENTRIES: dict[str, tuple[str, dict]] = {
    "fpfc": ("fpfc", {}),
    "fpfc_l1": ("fpfc_l1", {}),
    # FPFC with its shared body combined by the coordinate-wise median (fmnist_labelswap only: S1 shares nothing)
    "fpfc_median": ("fpfc", {"aggregator": "median"}),
    "fedavg": ("fedavg", {}),
    "fedavg_median": ("fedavg", {"aggregator": "median"}),
    "fedavg_krum": ("fedavg", {"aggregator": "krum"}),
    "local": ("local", {}),
    "ifca": ("ifca", {"k": 4}),
    "cfl": ("cfl", {"s1": {"eps1": 0.5, "eps2": 1.0}, "fmnist_labelswap": {"eps1": 0.05, "eps2": 0.1}}),
    "ditto": ("ditto", {}),
    # the other Table 3 baselines (used by pipelines/newcomers.py)
    "lg": ("lgfedavg", {}),
    "perfedavg": ("perfedavg", {}),
    "pacfl": ("pacfl", {"s1": {"beta": 4.0}, "fmnist_labelswap": {"beta": 2.0}}),
}
ROBUSTNESS_ENTRIES = ["fpfc", "fpfc_l1", "fedavg", "fedavg_median", "fedavg_krum", "local", "ifca", "cfl", "ditto"]

#: per scenario: FPFC / FPFC-L1 settings and the presets (rounds, FPFC λ and initialisation, config)
SCENARIOS = {
    "s1": {
        "fpfc": {"nu": 0.1, "nu_select": "fixed"}, "fpfc_l1": {"lam": 0.2, "nu": 4.0}, "attack_scope": "model",
        "presets": {
            "quick": {"rounds": 100, "lam": 0.6, "init_std": 0.0, "config": {}},
            "paper": {"rounds": 2000, "lam": 0.8, "init_std": 1.0, "config": {}},
        },
    },
    "fmnist_labelswap": {
        "fpfc": {"nu_select": "silhouette", "shared_layers": "body"},
        "fpfc_l1": {"lam": 0.4, "shared_layers": "body", "nu_select": "silhouette"}, "attack_scope": "head",
        "presets": {
            "quick": {"rounds": 20, "lam": 0.4, "init_std": 0.0,
                      "config": {"data.max_samples": 6000, "federation.local_epochs": 2, "federation.lr": 0.1,
                                 "federation.lr_decay": 1.0}},
            "paper": {"rounds": 200, "lam": 0.4, "init_std": 0.0, "config": {}},
        },
    },
}


class TailAccuracy(Callback):
    """Every client's test accuracy at each evaluation in the last ``TAIL`` of the rounds."""

    def __init__(self, rounds: int):
        self.first_step = rounds - max(1, round(TAIL * rounds))  # the last evaluation at least
        self.tables: list[dict[int, float]] = []

    def on_round(self, loop, metrics: dict) -> None:
        if metrics["step"] > self.first_step and "test/acc_mean" in metrics:
            self.tables.append({r["client"]: r["test_acc"] for r in loop.sim.last_client_table})

    def mean_over(self, clients) -> float:
        """Mean over the tail's evaluations of the mean accuracy of ``clients``."""
        import numpy as np

        per_eval = [np.mean([t[c] for c in clients if c in t]) for t in self.tables if any(c in t for c in clients)]
        return float(np.mean(per_eval)) if per_eval else float("nan")


def scenario_base(scenario: str) -> dict:
    """The scenario's dotted config (S1 as FPFC's Table 1, label swap; scenarios.yaml)."""
    from pfl.tune.space import load_scenario

    return load_scenario("fpfc_s1_table1" if scenario == "s1" else scenario)


def entry_overrides(entry: str, scenario: str, preset: dict) -> dict:
    """The dotted method settings of one table entry in one scenario."""
    from pfl.methods import get_method

    name, params = ENTRIES[entry]
    per = params.get(scenario, {}) if any(k in SCENARIOS for k in params) else params
    out = {"method.name": name, **{f"method.{k}": v for k, v in per.items()}}
    cls = get_method(name)
    fields = {f.name for f in dataclasses.fields(cls.Hparams)}
    if name == "fpfc":
        out.update({f"method.{k}": v for k, v in SCENARIOS[scenario]["fpfc"].items()})
        out["method.lam"] = preset["lam"]
    if name == "fpfc_l1":
        out.update({f"method.{k}": v for k, v in SCENARIOS[scenario]["fpfc_l1"].items()})
    if name in ("fpfc", "fpfc_l1") and preset["init_std"]:
        out["method.init_std"] = preset["init_std"]
    unknown = [k for k in out if k.startswith("method.") and k != "method.name" and k[7:] not in fields]
    if unknown:
        raise ConfigError(unknown[0], f"not a hyperparameter of {name}")
    return out


def common_config(scenario: str, preset_name: str, rounds: int | None, overrides: list[str], track: bool,
                  experiment: str | None, extra: dict | None = None, seed: int | None = None) -> tuple[dict, dict]:
    """(the scenario's resolved raw config for every entry, the preset) — validated; ``seed``
    replaces the scenario's."""
    from pfl.config import apply_overrides
    from pfl.resolver import load

    preset = dict(SCENARIOS[scenario]["presets"][preset_name])
    if rounds is not None:
        preset["rounds"] = rounds
    base = scenario_base(scenario)
    base.update(preset["config"])
    base.update({"federation.rounds": preset["rounds"], "federation.eval_every": max(1, preset["rounds"] // EVALS),
                 "tracking.enabled": track, "tracking.log_model": False, **(extra or {})})
    if experiment:
        base["tracking.experiment"] = experiment
    if seed is not None:
        base["seed"] = seed
    cfg = load(None, apply_overrides(apply_overrides({}, base), overrides))
    return cfg.to_dict(), preset


def grid_points(methods: list[str], attacks: list[str], fractions: list[float]) -> list[tuple[str, str, float]]:
    """(entry, attack, fraction) to run; fraction 0 once per entry (attack 'none', shared)."""
    points = []
    for entry in methods:
        if 0.0 in fractions:
            points.append((entry, "none", 0.0))
        points += [(entry, attack, f) for attack in attacks for f in fractions if f > 0]
    return points


def cell_group(scenario: str, attack: str, fraction: float) -> str:
    return f"{scenario}|{'none' if fraction == 0 else attack}|{fraction:g}"


def summarize(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """(grid cell, entry) → mean ± std over the seeds of the benign accuracy and of the drop from the
    clean run on the same devices, with ★/≈ against the best entry of the cell (pfl/seeds.py)."""
    from pfl.seeds import aggregate

    records = [{"group": cell_group(r["scenario"], r["attack"], r["fraction"]), "row": r["method"], "seed": r["seed"],
                "benign_acc": r["benign_acc"], "drop": r["clean_same_devices"] - r["benign_acc"]} for r in rows]
    return {(a["group"], a["row"]): a for a in aggregate(records, key="benign_acc", reference="best")}


def accuracy_of(summary: dict, scenario: str, entry: str, attack: str, fraction: float) -> float:
    """Mean benign accuracy over the seeds of a grid point (fraction 0: the entry's clean run)."""
    cell = summary.get((cell_group(scenario, attack, fraction), entry))
    return float("nan") if cell is None else cell["benign_acc_mean"]


def format_tables(summary: dict, scenarios: list[str], methods: list[str], attacks: list[str],
                  fractions: list[float], header: dict[str, str], seeds: list[int]) -> str:
    from pfl.seeds import MARK, fmt

    out = []
    attacked = [f for f in fractions if f > 0]
    cols = ([("none", 0.0)] if 0.0 in fractions else []) + [(a, f) for a in attacks for f in attacked]
    for scenario in scenarios:
        out.append(f"\n== {scenario} ({header.get(scenario, '')}): benign test accuracy (%), mean ± std over "
                   f"seeds {' '.join(map(str, seeds))} ==")
        columns = ["method", *("clean" if f == 0 else f"{a} {f:g}" for a, f in cols)]
        out += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for entry in methods:
            cells = []
            for a, f in cols:
                c = summary.get((cell_group(scenario, a, f), entry))
                if c is None:
                    cells.append("–")
                    continue
                mark = {"ref": " ★", MARK: f" {MARK}"}.get(c.get("mark", ""), "")
                cells.append(fmt(c["benign_acc_mean"], c["benign_acc_std"], 100.0) + mark)
            out.append(f"| {entry} | " + " | ".join(cells) + " |")
    out.append(f"\n★ the best method of a column; {MARK} within the spread of the best (|difference of means| < "
               "the larger std over the seeds): the grid does not separate the two.")
    return "\n".join(out)


def drops(summary: dict, scenarios: list[str], methods: list[str]) -> list[str]:
    """Per scenario and method: the largest mean drop (over the seeds) of benign accuracy from the
    clean run's accuracy on the same devices (like for like: the malicious devices are left out of
    both), at fractions ≤ 0.4 and over all fractions."""
    from pfl.seeds import fmt

    lines = []
    for scenario in scenarios:
        for entry in methods:
            cells = [(g.split("|"), c) for (g, e), c in summary.items() if e == entry and g.startswith(scenario + "|")]
            attacked = [(float(g[2]), g[1], c) for g, c in cells if float(g[2]) > 0 and c["drop_mean"] == c["drop_mean"]]
            clean = accuracy_of(summary, scenario, entry, "none", 0.0)
            worst = {}
            for limit in (0.4, 1.0):
                cands = [(c["drop_mean"], a, f, c["drop_std"]) for f, a, c in attacked if f <= limit]
                if cands:
                    worst[limit] = max(cands, key=lambda t: t[0])
            if worst:
                text = "; ".join(f"{'≤ 0.4' if k == 0.4 else 'all'}: {fmt(d, sd, 100.0, 1)} pt ({a} {f:g})"
                                 for k, (d, a, f, sd) in worst.items())
                lines.append(f"{scenario:<17} {entry:<14} clean {100 * clean:6.2f} %  largest drop {text}")
    return lines


def plot_attack(summary: dict, attack: str, scenarios: list[str], methods: list[str], fractions: list[float],
                path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(scenarios), figsize=(5.2 * len(scenarios), 4.0), dpi=100, squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        for entry in methods:
            ys = [accuracy_of(summary, scenario, entry, attack, f) for f in fractions]
            if any(y == y for y in ys):
                ax.plot(fractions, [100 * y for y in ys], marker="o", label=entry)
        ax.set_title(f"{scenario}: {attack}")
        ax.set_xlabel("fraction of malicious devices")
        ax.set_ylabel("benign test accuracy (%), mean over seeds")
        ax.grid(alpha=0.3)
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def run(scenarios: list[str], methods: list[str], attacks: list[str], fractions: list[float],
        preset_name: str = "quick", rounds: int | None = None, overrides: list[str] | None = None,
        track: bool = True, experiment: str | None = None, out: str | Path | None = None,
        progress=print, scope: str | None = None, seeds=(0, 1, 2)) -> dict:
    import tempfile

    from pfl.config import apply_overrides
    from pfl.resolver import resolve
    from pfl.data import load_federated
    from pfl.runner import TableRun
    from pfl.seeds import check_seeds

    overrides = list(overrides or [])
    seeds = check_seeds(seeds)
    # every config first, so that a bad value stops the pipeline before any training
    plans = {}
    for seed in seeds:
        for scenario in scenarios:
            raw, preset = common_config(scenario, preset_name, rounds, overrides, track, experiment, seed=seed)
            configs = []
            for entry, attack, fraction in grid_points(methods, attacks, fractions):
                settings = {**entry_overrides(entry, scenario, preset), "attack.kind": attack,
                            "attack.fraction": fraction, "attack.scope": scope or SCENARIOS[scenario]["attack_scope"],
                            "tracking.run_name": f"{scenario}/{entry}/{attack if fraction else 'clean'}"
                                                 + (f"/{fraction:g}" if fraction else "") + f"/seed{seed}"}
                cfg = resolve(apply_overrides(apply_overrides(raw, settings), overrides))
                configs.append((entry, attack, fraction, cfg))
            plans[(seed, scenario)] = (preset, configs)
    presets = {s: plans[(seeds[0], s)][0] for s in scenarios}
    parent = TableRun(f"robustness-{preset_name}", experiment=experiment, track=track,
                      params={"preset": preset_name, "scenarios": " ".join(scenarios), "methods": " ".join(methods),
                              "attacks": " ".join(attacks), "fractions": " ".join(f"{f:g}" for f in fractions),
                              "seeds": " ".join(map(str, seeds)),
                              **{f"{s}.rounds": presets[s]["rounds"] for s in scenarios},
                              **{f"{s}.fpfc_lam": presets[s]["lam"] for s in scenarios},
                              **{f"{s}.attack_scope": scope or SCENARIOS[s]["attack_scope"] for s in scenarios}})
    from pfl.federation.attacks import malicious_clients

    rows: list[dict] = []
    for seed in seeds:
        clean_tail: dict[tuple[str, str], TailAccuracy] = {}  # per-device accuracies of this seed's clean runs
        for scenario in scenarios:
            preset, configs = plans[(seed, scenario)]
            data = load_federated(configs[0][3].data, configs[0][3].seed)
            if progress:
                progress(f"{scenario}, seed {seed}: {data.num_clients} devices, {preset['rounds']} rounds, "
                         f"{len(configs)} runs")
            for entry, attack, fraction, cfg in configs:
                start = time.perf_counter()
                tail = TailAccuracy(cfg.federation.rounds)
                summary = parent.run(cfg.tracking.run_name, cfg, data=data, callbacks=[tail])
                f = summary.final
                if fraction == 0:
                    clean_tail[(scenario, entry)] = tail
                benign = sorted(set(range(data.num_clients)) - set(malicious_clients(cfg, data.num_clients)))
                clean = clean_tail.get((scenario, entry))
                row = {"scenario": scenario, "method": entry, "attack": attack, "fraction": fraction, "seed": seed,
                       "benign_acc": tail.mean_over(benign), "final_acc": f.get("test/acc_mean", float("nan")),
                       # the clean run's accuracy on the same (benign) devices: the like-for-like reference
                       "clean_same_devices": clean.mean_over(benign) if clean else float("nan"),
                       "benign_clients": f.get("attack/benign_clients", float(data.num_clients)),
                       "global_acc": f.get("global/test_acc", float("nan")),
                       "clusters": f.get("cluster/num", float("nan")), "ari": f.get("cluster/ari", float("nan")),
                       "diverged": any(h.get("attack/diverged") for h in summary.history),
                       "wall_s": time.perf_counter() - start, "status": summary.status, "run_id": summary.run_id or ""}
                rows.append(row)
                if progress:
                    progress(f"   {cfg.tracking.run_name:<42} benign acc {100 * row['benign_acc']:6.2f} %"
                             f"{'  (diverged)' if row['diverged'] else ''}  [{row['wall_s']:.0f} s]")
    cells = summarize(rows)
    for (group, entry), c in cells.items():
        scenario, attack, fraction = group.split("|")
        parent.log_metrics({f"{scenario}/{entry}/{attack}/{fraction}/benign_acc_mean": c["benign_acc_mean"]})
    header = {s: f"{preset_name}: {presets[s]['rounds']} rounds, attack scope "
                 f"{scope or SCENARIOS[s]['attack_scope']}" for s in scenarios}
    text = format_tables(cells, scenarios, methods, attacks, fractions, header, seeds)
    summary_lines = drops(cells, scenarios, methods)
    with tempfile.TemporaryDirectory() as tmp:
        for attack in attacks:
            path = plot_attack(cells, attack, scenarios, methods, sorted(set(fractions) | {0.0}),
                               Path(tmp) / f"benign_acc_vs_fraction_{attack}.png")
            parent.parent.log_artifact(path, "plots")
            if out:
                Path(out).mkdir(parents=True, exist_ok=True)
                (Path(out) / path.name).write_bytes(path.read_bytes())
    table_rows = [{"cell": g, "method": e, **{k: v for k, v in c.items() if k not in ("values", "group", "row")}}
                  for (g, e), c in cells.items()]
    parent.finish(table_rows, "robustness_table", text="\n".join([text, "", *summary_lines]), outdir=out, runs=rows)
    return {"rows": rows, "cells": cells, "table": text, "drops": summary_lines, "parent_run_id": parent.run_id}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="quick")
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=["s1", "fmnist_labelswap"])
    parser.add_argument("--methods", nargs="+", choices=list(ENTRIES), default=ROBUSTNESS_ENTRIES, metavar="NAME",
                        help=f"table entries (default: {' '.join(ROBUSTNESS_ENTRIES)})")
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    parser.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS),
                        help="malicious fractions (0 = the clean run)")
    parser.add_argument("--rounds", type=int, help="communication rounds (default: the preset's)")
    parser.add_argument("--scope", choices=("model", "head"),
                        help="attack.scope: rewrite the whole upload or only the head (default: s1 model, "
                        "fmnist_labelswap head, the paper's 'personalization layers')")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="dotted config overrides for every run (e.g. federation.device=cuda)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; 0 = torch's default)")
    parser.add_argument("--experiment", default=None, help="MLflow experiment (default: mlflow.yaml's)")
    parser.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    parser.add_argument("--out", help="also write the table and plots into this directory")
    parser.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    add_seeds_argument(parser)
    args = parser.parse_args(argv)
    bad = [f for f in args.fractions if not 0 <= f < 1]
    if bad:
        print(f"--fractions must be in [0, 1), got {bad}", file=sys.stderr)
        return 2
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = run(args.scenarios, args.methods, args.attacks, sorted(set(args.fractions)), args.preset,
                     args.rounds, args.set, track=not args.no_track, experiment=args.experiment, out=args.out,
                     progress=None if args.quiet else print, scope=args.scope, seeds=args.seeds)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print(result["table"])
    print("\nLargest drop from the clean run's accuracy on the same benign devices (mean ± std over the seeds):")
    print("\n".join(result["drops"]))
    if result["parent_run_id"]:
        print("\n" + run_hint(result["parent_run_id"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
