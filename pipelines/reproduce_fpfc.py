"""Reproduce the FPFC paper's synthetic scenario S1 (Table 1 style): FPFC, FPFC-L1 and baselines.

    python pipelines/reproduce_fpfc.py                      # quick preset (a few minutes)
    python pipelines/reproduce_fpfc.py --preset paper       # 2000 rounds, as the paper
    python pipelines/reproduce_fpfc.py --methods fpfc async_fpfc fedavg --rounds 300
    python pipelines/reproduce_fpfc.py --methods fpfc --lam 0.6 --preset paper   # the README λ
    python pipelines/reproduce_fpfc.py --scenario fmnist_labelswap [--preset paper]

S1 (docs/methods/fpfc.md §5.1, §6): ``fpfc_synthetic`` with the paper's generator seed 0, 100 devices in 4
clusters, 80/20 train/test split, 30 devices per round, 10 full-batch gradient steps with lr 0.1,
softmax regression (p = 610). Methods (``--methods``; unknown or unregistered ones are skipped
with a note):

* ``fpfc``       smoothed-SCAD FPFC, λ = 0.8 (docs/methods/fpfc.md §11; README 0.6), ν = 0.1;
* ``fpfc_l1``    group-lasso fusion, README λ = 0.2, ν = 4; the table adds the ν between the
                 largest within- and smallest between-cluster ‖θ_ij‖ (any such ν recovers the
                 true clusters, when one exists);
* ``async_fpfc`` FPFC with ``federation.driver=async`` (pfl/federation/async_clock.py): a
                 logged round holds 30 arrivals, so rounds compare sync and async at equal
                 numbers of device updates; ``sim clock`` is the simulated time they took;
* ``ifca`` (K = 4), ``cfl`` (ε1/ε2 = 0.5/1.0, docs/methods/fpfc.md §9), ``pacfl`` (β = 4) when registered;
* ``fedavg``, ``local``.

Presets: ``quick`` = 200 rounds with the model zoo's initialisation (FPFC λ = 0.8 fuses the four
clusters within ~25 rounds from it); ``paper`` = 2000 rounds with the official N(0, 1)
initialisation of the FPFC models (``method.init_std=1``; from it λ = 0.8 fuses by round ~400).
FedAvg, Local and the other baselines always start from the zoo initialisation (they have no such
option). Smaller devices (``data.params.size_scale`` < 1) were checked and do NOT keep the
clustering on S1 (0.1: ~66 components, 0.3: ~32 after 300 rounds), so both presets use the full
data. The best λ depends on the initialisation: from the zoo initialisation λ = 0.6 reached
88.2 % / 4 clusters and λ = 0.8 82.3 % after 2000 rounds; from the official one λ = 0.8 gives
88.8 % / 4 / ARI 1.00 and λ = 0.6 85.1 % / 37 components (as the check in docs/methods/fpfc.md §11 found).

``--scenario fmnist_labelswap`` is the paper's FMNIST setting (docs/methods/fpfc.md §5.2, §6): 20 devices in 4
label-swap clusters (Dirichlet(1.0) label mixes within a cluster), 10 devices per round, 10 local
epochs of batch 100, lr 0.009·0.9^⌊k/5⌋, FPFC λ = 0.4 (README) with the body shared FedAvg-style and
the last layer clustered; table entries ``fpfc``, ``fedavg``, ``local`` by default (``ifca`` etc. on
request). ``paper`` = all 70,000 pooled Fashion-MNIST images (train and test sets, split per client
70/10/20) and 200 rounds (≈ 22 s a round for FPFC on two
CPU cores); ``quick`` = 10,000 images, 5 local epochs, 40 rounds (a few minutes). The read-out is
ours (the official code has none for FMNIST, docs/methods/fpfc.md §2.7 Q6): no pair fuses exactly there (every
‖θ_ij‖ sits in SCAD's soft-threshold region, within-cluster ≈ 0.2 on average at the paper's scale),
so ν = 0.1 gives 20 singletons, and the window of ν that gives the 4 clusters is 0.01–0.09 wide and
moves with the seed and the round (ν = 0.25 gave ARI ≥ 0.93 for seed 0 at rounds 50–150 and seed 1
at rounds 30–60, but 0.68 for seed 1 at rounds 70–80). Hence ``method.nu_select: silhouette``: at every
evaluation the threshold whose components have the best silhouette on ‖θ_ij‖ (``fpfc/nu``).
Measured at the paper's scale (seeds 0, 1, 2; rounds 10–150): 4 clusters, ARI 1.00 at every
evaluation from round 40 on (seed 1: 5 clusters, ARI 0.93 at rounds 10 and 30), with ν between 0.22
and 0.28; at the quick scale 4 clusters, ARI 1.00 (ν = 0.607).
The table's ``‖θ_ij‖`` line shows the largest within- and smallest between-cluster distance.

Everything is logged to MLflow: a parent run ``reproduce_fpfc`` with the table (CSV and text) as
artifacts and the headline numbers as metrics; each method is a child run (pfl.runner).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pfl.schema import ConfigError  # noqa: E402
from pfl.tracking import run_hint  # noqa: E402

S1 = {
    "data.source": "fpfc_synthetic", "data.num_clients": 100, "data.val_fraction": 0.0,
    "data.test_fraction": 0.2, "data.params.gen_seed": 0, "data.params.num_clusters": 4,
    "federation.clients_per_round": 30, "federation.batch_size": 0, "federation.local_steps": 10,
    "federation.lr": 0.1, "model.name": "softmax_regression", "seed": 1,
}

#: FPFC's MNIST/FMNIST setting (docs/methods/fpfc.md §2.5, §5.2, §6): the scenario file's ``fmnist_labelswap``
#: (20 devices in 4 label-swap clusters, 10 per round, 10 local epochs, lr 0.009·0.9^⌊k/5⌋)
#: with FPFC clustering only the last layer
LABELSWAP_FPFC = {"method.shared_layers": "body"}

#: per scenario: the FPFC λ and read-out defaults, the default table entries and the presets (rounds,
#: evaluation interval, FPFC initialisation, further config)
SCENARIOS = {
    "s1": {
        "lam": 0.8, "nu_select": "fixed", "methods": ["fpfc", "fpfc_l1", "ifca", "cfl", "pacfl", "fedavg", "local"],
        "presets": {
            "quick": {"rounds": 200, "eval_every": 20, "init": "default", "config": {}},
            "paper": {"rounds": 2000, "eval_every": 50, "init": "official", "config": {}},
        },
    },
    "fmnist_labelswap": {
        "lam": 0.4, "nu_select": "silhouette", "methods": ["fpfc", "fedavg", "local"],
        "presets": {
            "quick": {"rounds": 40, "eval_every": 10, "init": "default",
                      "config": {"data.max_samples": 10000, "federation.local_epochs": 5}},
            "paper": {"rounds": 200, "eval_every": 10, "init": "default", "config": {}},
        },
    },
}
PRESETS = ("quick", "paper")

#: method entries: registered name and S1 hyperparameters (applied only where the field exists)
METHODS = {
    "fpfc": ("fpfc", {}),
    "fpfc_l1": ("fpfc_l1", {}),
    "async_fpfc": ("fpfc", {}),
    "ifca": ("ifca", {"k": 4}),
    "cfl": ("cfl", {"eps1": 0.5, "eps2": 1.0}),
    "pacfl": ("pacfl", {"beta": 4.0}),
    "fedavg": ("fedavg", {}),
    "local": ("local", {}),
}

#: the official stored λ = 0.6 curve (docs/methods/fpfc.md §10/§11): test accuracy at rounds 500/1000/2000
OFFICIAL_LAMBDA_06 = {500: 0.786, 1000: 0.843, 2000: 0.8633}


def method_overrides(entry: str, args, init: str) -> dict | None:
    """Config overrides of one table entry, or None when its method is not registered."""
    from pfl.methods import get_method

    name, defaults = METHODS[entry]
    try:
        cls = get_method(name)
    except ConfigError:
        return None
    fields = {f.name for f in dataclasses.fields(cls.Hparams)} if dataclasses.is_dataclass(cls.Hparams) else set()
    out = {"method.name": name}
    out.update({f"method.{k}": v for k, v in defaults.items() if k in fields})
    if name == "fpfc":
        out["method.lam"] = args.lam
        out["method.nu"] = args.nu
        out["method.nu_select"] = args.nu_select
    if name in ("fpfc", "fpfc_l1") and args.scenario == "fmnist_labelswap":
        out.update(LABELSWAP_FPFC)
    if name == "fpfc_l1":
        out["method.lam"] = args.lam_l1
        out["method.nu"] = args.nu_l1
    if name in ("fpfc", "fpfc_l1") and init == "official":
        out["method.init_std"] = 1.0
    return out


def fmt_bytes(n: float) -> str:
    from pfl.runner import format_bytes

    return format_bytes(n)


def curve_points(history: list[dict], key: str = "test/acc_mean") -> list[tuple[int, float]]:
    return [(int(m["round"]) + 1, m[key]) for m in history if key in m]


def l1_between(sim) -> dict:
    """FPFC-L1: the read-out at a ν between the within- and between-cluster ‖θ‖ (docs/methods/fpfc.md §11)."""
    from pfl.clusters import cluster_metrics

    method = sim.method
    gap = method.theta_gap()
    if "fpfc/theta_max_within" not in gap or "fpfc/theta_min_between" not in gap:
        return {}
    lo, hi = gap["fpfc/theta_max_within"], gap["fpfc/theta_min_between"]
    nu = (lo + hi) / 2
    labels = method.clusters(nu)
    out = {"nu": nu, "separable": lo < hi, "max_within": lo, "min_between": hi}
    out.update(cluster_metrics(labels, method.ctx.meta.true_clusters))
    out.update(sim.evaluate_models(method.readout_params(labels), "fpfc/readout"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="s1",
                        help="s1: the synthetic Table 1 (default); fmnist_labelswap: FMNIST, 4 label-swap clusters")
    parser.add_argument("--preset", choices=PRESETS, default="quick")
    parser.add_argument("--methods", nargs="+", metavar="NAME",
                        help="table entries (default: s1 " + " ".join(SCENARIOS["s1"]["methods"])
                        + "; fmnist_labelswap " + " ".join(SCENARIOS["fmnist_labelswap"]["methods"])
                        + "); all: " + " ".join(METHODS))
    parser.add_argument("--rounds", type=int, help="communication rounds (default: the preset's)")
    parser.add_argument("--size-scale", type=float, help="S1 only: data.params.size_scale (default 1)")
    parser.add_argument("--init", choices=("official", "default"),
                        help="FPFC models' initialisation: official N(0,1) or the model zoo's (default: preset's)")
    parser.add_argument("--eval-every", type=int, help="evaluate every this many rounds")
    parser.add_argument("--lam", type=float,
                        help="FPFC λ (default: S1 0.8, docs/methods/fpfc.md §11, README 0.6; fmnist_labelswap 0.4, README)")
    parser.add_argument("--nu", type=float, default=0.1, help="FPFC read-out ν (README 0.1)")
    parser.add_argument("--nu-select", choices=("fixed", "silhouette"),
                        help="FPFC read-out threshold: ν, or the best-silhouette cut of ‖θ_ij‖ with ν as the "
                        "fallback (default: S1 fixed; fmnist_labelswap silhouette)")
    parser.add_argument("--lam-l1", type=float, default=0.2, help="FPFC-L1 λ (README 0.2)")
    parser.add_argument("--nu-l1", type=float, default=4.0, help="FPFC-L1 read-out ν (README 4)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="dotted config overrides for every method (e.g. federation.device=cuda)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: the tensors are small, and several threads on a busy "
                        "machine slow each step down badly; 0 = torch's default)")
    parser.add_argument("--experiment", default=None, help="MLflow experiment (default: mlflow.yaml's)")
    parser.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    parser.add_argument("--quiet", action="store_true", help="no per-evaluation progress lines")
    args = parser.parse_args(argv)

    import torch

    from pfl.config import apply_overrides
    from pfl.resolver import load, resolve
    from pfl.data import load_federated
    from pfl.runner import TableRun

    if args.threads:
        torch.set_num_threads(args.threads)
    scenario = SCENARIOS[args.scenario]
    preset = dict(scenario["presets"][args.preset])
    for key in ("rounds", "init", "eval_every"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    args.lam = scenario["lam"] if args.lam is None else args.lam
    args.nu_select = args.nu_select or scenario["nu_select"]
    args.methods = args.methods or scenario["methods"]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        print(f"unknown table entries {unknown}; allowed: {', '.join(METHODS)}", file=sys.stderr)
        return 2
    if args.scenario == "s1":
        base = dict(S1, **{"data.params.size_scale": 1.0 if args.size_scale is None else args.size_scale})
    elif args.size_scale is not None:
        print("--size-scale applies to the synthetic S1 only; for fmnist_labelswap use "
              "--set data.max_samples=N", file=sys.stderr)
        return 2
    else:
        from pfl.tune.space import load_scenario

        base = load_scenario("fmnist_labelswap")
    base.update(preset["config"])
    base.update({"federation.rounds": preset["rounds"], "federation.eval_every": preset["eval_every"]})
    base["tracking.enabled"] = not args.no_track
    if args.experiment:
        base["tracking.experiment"] = args.experiment

    try:
        common = load(None, apply_overrides(apply_overrides({}, base), args.set))
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    data = load_federated(common.data, common.seed)
    print(f"{args.scenario}: {data.num_clients} devices, {sum(c.n_train for c in data.clients)} training samples, "
          f"{preset['rounds']} rounds, preset {args.preset} (FPFC init {preset['init']}, λ {args.lam}, "
          f"read-out {args.nu_select}, ν {args.nu})",
          flush=True)

    parent = TableRun("reproduce_fpfc", experiment=args.experiment, track=not args.no_track,
                      params={"scenario": args.scenario, "preset": args.preset, "methods": " ".join(args.methods),
                              **{f"preset.{k}": v for k, v in preset.items() if k != "config"},
                              **{f"preset.{k}": v for k, v in preset["config"].items()},
                              "fpfc.lam": args.lam, "fpfc.nu": args.nu, "fpfc.nu_select": args.nu_select,
                              "fpfc_l1.lam": args.lam_l1, "fpfc_l1.nu": args.nu_l1})
    rows, notes = [], []
    for entry in args.methods:
        overrides = method_overrides(entry, args, preset["init"])
        if overrides is None:
            notes.append(f"{entry}: method not registered, skipped")
            print(f"-- {entry}: not registered in pfl.methods, skipped", flush=True)
            continue
        raw = apply_overrides(apply_overrides(common.to_dict(), overrides), args.set)
        raw = apply_overrides(raw, {"tracking.run_name": entry})
        if entry == "async_fpfc":
            raw = apply_overrides(raw, {"federation.driver": "async"})
        try:
            cfg = resolve(raw)
        except ConfigError as err:
            notes.append(f"{entry}: config error {err}")
            print(f"-- {entry}: config error: {err}", flush=True)
            continue
        print(f"-- {entry} ({cfg.method.name})", flush=True)
        start = time.perf_counter()
        summary = parent.run(entry, cfg, progress=None if args.quiet else print, data=data)
        wall = time.perf_counter() - start
        final = summary.final
        row = {
            "method": entry, "test_acc": final.get("test/acc_mean", float("nan")),
            "readout_acc": final.get("fpfc/readout_acc", float("nan")),
            "clusters": final.get("cluster/num", float("nan")), "ari": final.get("cluster/ari", float("nan")),
            "comm_bytes": final.get("comm/total_bytes", 0.0), "sim_clock": final.get("time/sim_clock", float("nan")),
            "wall_s": wall, "status": summary.status, "run_id": summary.run_id or "",
        }
        rows.append(row)
        sim = summary.extra["simulator"]
        if entry.startswith("fpfc") or entry == "async_fpfc":
            points = curve_points(summary.history)
            print("   curve: " + ", ".join(f"{r}:{a:.4f}" for r, a in points), flush=True)
            gap = sim.method.theta_gap() if summary.status == "FINISHED" else {}
            if len(gap) == 2:
                nu = summary.final.get("fpfc/nu", float("nan"))
                print(f"   ‖θ_ij‖: max within a true cluster {gap['fpfc/theta_max_within']:.3f}, min between "
                      f"{gap['fpfc/theta_min_between']:.3f} (read-out at ν = {nu:.3f}: "
                      f"{row['clusters']:.0f} clusters, ARI {row['ari']:.3f})", flush=True)
            if args.scenario == "s1" and abs(args.lam - 0.6) < 1e-9 and entry == "fpfc":
                ours = dict(points)
                cmp = [f"r{r}: ours {ours[r]:.4f} vs official {v:.4f}" for r, v in OFFICIAL_LAMBDA_06.items() if r in ours]
                if cmp:
                    print("   λ=0.6 vs the official stored curve: " + "; ".join(cmp), flush=True)
        if entry == "fpfc_l1" and summary.status == "FINISHED":
            extra = l1_between(sim)
            if extra:
                tag = "" if extra["separable"] else " (no ν separates the true clusters)"
                print(f"   FPFC-L1 ‖θ‖: max within {extra['max_within']:.3f}, min between "
                      f"{extra['min_between']:.3f}; at ν={extra['nu']:.3f}{tag}: "
                      f"{extra['cluster/num']:.0f} clusters, ARI {extra.get('cluster/ari', float('nan')):.3f}, "
                      f"read-out acc {extra.get('fpfc/readout_acc', float('nan')):.4f}", flush=True)
                rows.append({"method": f"fpfc_l1 (ν={extra['nu']:.2f})", "test_acc": row["test_acc"],
                             "readout_acc": extra.get("fpfc/readout_acc", float("nan")),
                             "clusters": extra["cluster/num"], "ari": extra.get("cluster/ari", float("nan")),
                             "comm_bytes": row["comm_bytes"], "sim_clock": row["sim_clock"], "wall_s": 0.0,
                             "status": "derived", "run_id": row["run_id"]})

    table = format_table(rows)
    print(f"\n== {args.scenario} (Table 1 style) ==")
    print(table)
    for note in notes:
        print("note:", note)
    for row in rows:
        if row["status"] == "FINISHED":
            key = row["method"]
            parent.log_metrics({f"{key}/test_acc": row["test_acc"], f"{key}/clusters": row["clusters"],
                                f"{key}/ari": row["ari"], f"{key}/readout_acc": row["readout_acc"],
                                f"{key}/comm_bytes": row["comm_bytes"]})
    parent.finish(rows, "table", text="\n".join([table, *notes]))
    if parent.run_id:
        print(run_hint(parent.run_id))
    return 0


def format_table(rows: list[dict]) -> str:
    """The table as a Markdown pipe table (printed, and rendered by MLflow as ``table.md``)."""
    from pfl.markdown import pipe_table

    def num(v, spec, suffix=""):
        return "–" if v != v else format(v, spec) + suffix

    return pipe_table(["method", "test acc", "read-out", "#clusters", "ARI", "comm", "sim clock", "wall s"],
                      [[r["method"], num(r["test_acc"] * 100, ".2f", " %"), num(r["readout_acc"] * 100, ".2f", " %"),
                        num(r["clusters"], ".0f"), num(r["ari"], ".3f"), fmt_bytes(r["comm_bytes"]),
                        num(r["sim_clock"], ".4g"), f"{r['wall_s']:.1f}"] for r in rows])


if __name__ == "__main__":
    sys.exit(main())
