"""FPFC's robustness experiment (paper §6.4.1, Fig. 7, App. E.2): benign accuracy under Byzantine attacks.

    python pipelines/robustness.py                                  # quick preset, the whole grid
    python pipelines/robustness.py --preset paper                   # the paper's scale
    python pipelines/robustness.py --scenarios s1 --methods fpfc fedavg --attacks gaussian --fractions 0 0.2 0.4

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

Output: the table (printed; CSV and Markdown on the MLflow parent run), one plot per attack (benign
accuracy vs malicious fraction, a panel per scenario, a line per method) under ``plots/`` of the
parent, and the largest drop of each method from its clean accuracy (at fractions ≤ 0.4 and over
all). The drop is like for like: the clean run's accuracy on the same benign devices (column
``clean_same_devices`` of the CSV) minus the attacked run's, since which devices are left out
changes the mean by itself.
Every grid point is a child run (per-round metrics of the benign devices, ``attack/benign_clients``,
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
    """The scenario's dotted config (S1 from reproduce_fpfc.py, label swap from scenarios.yaml)."""
    if scenario == "s1":
        from reproduce_fpfc import S1

        return dict(S1)
    from pfl.tune.space import load_scenario

    return load_scenario(scenario)


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
                  experiment: str | None, extra: dict | None = None) -> tuple[dict, dict]:
    """(the scenario's resolved raw config for every entry, the preset) — validated."""
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


def accuracy_of(rows: list[dict], scenario: str, entry: str, attack: str, fraction: float) -> float:
    """Benign accuracy of a grid point (fraction 0: the entry's clean run)."""
    for r in rows:
        if (r["scenario"], r["method"]) == (scenario, entry) and (
                (fraction == 0 and r["fraction"] == 0) or (r["attack"], r["fraction"]) == (attack, fraction)):
            return r["benign_acc"]
    return float("nan")


def format_tables(rows: list[dict], scenarios: list[str], methods: list[str], attacks: list[str],
                  fractions: list[float], header: dict[str, str]) -> str:
    out = []
    attacked = [f for f in fractions if f > 0]
    for scenario in scenarios:
        out.append(f"\n== {scenario} ({header.get(scenario, '')}): benign test accuracy (%) ==")
        columns = ["method", "clean", *(f"{a} {f:g}" for a in attacks for f in attacked)]
        out += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for entry in methods:
            cells = [accuracy_of(rows, scenario, entry, "none", 0.0)]
            cells += [accuracy_of(rows, scenario, entry, a, f) for a in attacks for f in attacked]
            out.append(f"| {entry} | " + " | ".join("–" if c != c else f"{100 * c:.2f}" for c in cells) + " |")
    return "\n".join(out)


def drops(rows: list[dict], scenarios: list[str], methods: list[str]) -> list[str]:
    """Per scenario and method: the largest drop of benign accuracy from the clean run's accuracy on
    the same devices (like for like: the malicious devices are left out of both), at fractions ≤ 0.4
    and over all fractions."""
    lines = []
    for scenario in scenarios:
        for entry in methods:
            mine = [r for r in rows if (r["scenario"], r["method"]) == (scenario, entry) and r["fraction"] > 0
                    and r["clean_same_devices"] == r["clean_same_devices"] and r["benign_acc"] == r["benign_acc"]]
            clean = accuracy_of(rows, scenario, entry, "none", 0.0)
            worst = {}
            for limit in (0.4, 1.0):
                cands = [(r["clean_same_devices"] - r["benign_acc"], r["attack"], r["fraction"])
                         for r in mine if r["fraction"] <= limit]
                if cands:
                    worst[limit] = max(cands)
            if worst:
                text = "; ".join(f"{'≤ 0.4' if k == 0.4 else 'all'}: {100 * d:+.1f} pt ({a} {f:g})"
                                 for k, (d, a, f) in worst.items())
                lines.append(f"{scenario:<17} {entry:<14} clean {100 * clean:6.2f} %  largest drop {text}")
    return lines


def plot_attack(rows: list[dict], attack: str, scenarios: list[str], methods: list[str], fractions: list[float],
                path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(scenarios), figsize=(5.2 * len(scenarios), 4.0), dpi=100, squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        for entry in methods:
            ys = [accuracy_of(rows, scenario, entry, attack, f) for f in fractions]
            if any(y == y for y in ys):
                ax.plot(fractions, [100 * y for y in ys], marker="o", label=entry)
        ax.set_title(f"{scenario}: {attack}")
        ax.set_xlabel("fraction of malicious devices")
        ax.set_ylabel("benign test accuracy (%)")
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
        progress=print, scope: str | None = None) -> dict:
    import tempfile

    from pfl.config import apply_overrides
    from pfl.resolver import resolve
    from pfl.data import load_federated
    from pfl.runner import TableRun

    overrides = list(overrides or [])
    # every config first, so that a bad value stops the pipeline before any training
    plans = {}
    for scenario in scenarios:
        raw, preset = common_config(scenario, preset_name, rounds, overrides, track, experiment)
        configs = []
        for entry, attack, fraction in grid_points(methods, attacks, fractions):
            settings = {**entry_overrides(entry, scenario, preset), "attack.kind": attack,
                        "attack.fraction": fraction, "attack.scope": scope or SCENARIOS[scenario]["attack_scope"],
                        "tracking.run_name": f"{scenario}/{entry}/{attack if fraction else 'clean'}"
                                             + (f"/{fraction:g}" if fraction else "")}
            cfg = resolve(apply_overrides(apply_overrides(raw, settings), overrides))
            configs.append((entry, attack, fraction, cfg))
        plans[scenario] = (preset, configs)
    parent = TableRun(f"robustness-{preset_name}", experiment=experiment, track=track,
                      params={"preset": preset_name, "scenarios": " ".join(scenarios), "methods": " ".join(methods),
                              "attacks": " ".join(attacks), "fractions": " ".join(f"{f:g}" for f in fractions),
                              **{f"{s}.rounds": plans[s][0]["rounds"] for s in scenarios},
                              **{f"{s}.fpfc_lam": plans[s][0]["lam"] for s in scenarios},
                              **{f"{s}.attack_scope": scope or SCENARIOS[s]["attack_scope"] for s in scenarios}})
    from pfl.federation.attacks import malicious_clients

    rows: list[dict] = []
    clean_tail: dict[tuple[str, str], TailAccuracy] = {}  # per-device accuracies of the clean runs
    for scenario in scenarios:
        preset, configs = plans[scenario]
        data = load_federated(configs[0][3].data, configs[0][3].seed)
        if progress:
            progress(f"{scenario}: {data.num_clients} devices, {preset['rounds']} rounds, {len(configs)} runs")
        for entry, attack, fraction, cfg in configs:
            start = time.perf_counter()
            tail = TailAccuracy(cfg.federation.rounds)
            summary = parent.run(cfg.tracking.run_name, cfg, data=data, callbacks=[tail])
            f = summary.final
            if fraction == 0:
                clean_tail[(scenario, entry)] = tail
            benign = sorted(set(range(data.num_clients)) - set(malicious_clients(cfg, data.num_clients)))
            clean = clean_tail.get((scenario, entry))
            row = {"scenario": scenario, "method": entry, "attack": attack, "fraction": fraction,
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
                progress(f"   {cfg.tracking.run_name:<36} benign acc {100 * row['benign_acc']:6.2f} %"
                         f"{'  (diverged)' if row['diverged'] else ''}  [{row['wall_s']:.0f} s]")
            parent.log_metrics({f"{scenario}/{entry}/{attack}/{fraction:g}/benign_acc": row["benign_acc"]})
    header = {s: f"{preset_name}: {plans[s][0]['rounds']} rounds, attack scope "
                 f"{scope or SCENARIOS[s]['attack_scope']}" for s in scenarios}
    text = format_tables(rows, scenarios, methods, attacks, fractions, header)
    summary_lines = drops(rows, scenarios, methods)
    with tempfile.TemporaryDirectory() as tmp:
        for attack in attacks:
            path = plot_attack(rows, attack, scenarios, methods, sorted(set(fractions) | {0.0}),
                               Path(tmp) / f"benign_acc_vs_fraction_{attack}.png")
            parent.parent.log_artifact(path, "plots")
            if out:
                Path(out).mkdir(parents=True, exist_ok=True)
                (Path(out) / path.name).write_bytes(path.read_bytes())
    parent.finish(rows, "robustness_table", text="\n".join([text, "", *summary_lines]), outdir=out)
    return {"rows": rows, "table": text, "drops": summary_lines, "parent_run_id": parent.run_id}


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
                     progress=None if args.quiet else print, scope=args.scope)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print(result["table"])
    print("\nLargest drop from the clean run's accuracy on the same benign devices:")
    print("\n".join(result["drops"]))
    if result["parent_run_id"]:
        print("\n" + run_hint(result["parent_run_id"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
