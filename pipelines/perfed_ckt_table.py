"""PerFed-CKT measurement table: accuracy against Local with the same model, clustering vs none,
communication vs FedAvg — every row over seeds.

    python pipelines/perfed_ckt_table.py [--seeds 0 1 2] [--rounds 30] [--max-samples 2000] [--lam 0.1 ...]
                                         [--model cnn_fpfc] [--mixed] [--cluster-kind label_shift]
                                         [--set key=value ...] [--only TEXT ...] [--no-track]

Two scenarios on Fashion-MNIST, 20 clients, every client with the same model (``--model``, the
method's default ``architectures: [model.name]``), so PerFed-CKT, Local and FedAvg differ only in
what they communicate:

* ``dir01``: Dirichlet(0.1) labels, ``--max-samples`` pooled images (2000: ~70 training samples per
  client, the data-scarce clients the paper's transfer is for). PerFed-CKT (k = 2) against Local
  (the reference row) and FedAvg, whose measured bytes are the communication baseline.
* the clustered scenario (default ``label_shift``: 2 clusters whose labels are shifted by the
  cluster id, iid within a cluster): PerFed-CKT with k = #true clusters vs k = 1 (no clustering) vs
  Local.

``--mixed`` adds the paper's heterogeneous setting as its own group: three architectures
(cnn_fpfc < mlp < cnn_fedavg, assigned by data size × a random score) for PerFed-CKT and for Local
on the same mix (PerFed-CKT at λ = 0, which is Local exactly).

The public set is the images no client holds (``data.max_samples`` leaves them unused), so its
overlap with client data is 0 (column ``public overlap``, metric ``ckt/public_overlap``). Every
row runs once per seed (the seed draws the partition, initialisation and sampling, shared by the
rows); the table (pfl/seeds.py) gives the personalized accuracy averaged over the last ``--last``
evaluations as mean ± std over the seeds, the paired difference to the group's Local row and ≈
where the two are within their spread. One MLflow parent run holds the table and the headline; each
row and seed is a child run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pfl.resolver import load, with_overrides  # noqa: E402
from pfl.runner import TableRun, format_bytes  # noqa: E402
from pfl.schema import ConfigError  # noqa: E402
from pfl.seeds import Row, add_seeds_argument, aggregate, check_seeds, markdown, run_rows  # noqa: E402
from pfl.tracking import run_hint  # noqa: E402

MIXED = ["cnn_fpfc", "mlp", "cnn_fedavg"]
LOCAL = "Local"


def scenario_base(args, kind: str, seed: int) -> dict:
    base = {
        "seed": seed, "model.name": args.model,
        "data.source": "fmnist", "data.num_clients": args.clients,
        "federation.rounds": args.rounds, "federation.clients_per_round": args.per_round,
        "federation.local_epochs": args.epochs, "federation.batch_size": 20, "federation.lr": 0.05,
        "federation.eval_every": args.eval_every, "tracking.enabled": not args.no_track,
        "federation.device": args.device, "tracking.experiment": args.experiment,
    }
    if kind in ("dir01", "dir01 mixed"):
        base.update({"data.max_samples": args.max_samples,
                     "data.partition.kind": "dirichlet", "data.partition.alpha": 0.1})
    else:
        base.update({"data.max_samples": args.cluster_max_samples, "data.test_fraction": args.cluster_test_fraction,
                     "data.partition.kind": kind, "data.partition.alpha": args.cluster_alpha,
                     "data.partition.num_clusters": args.clusters})
    return base


def ckt(public_size: int, **hp) -> dict:
    out = {"method.name": "perfed_ckt", "method.public_size": public_size}
    out.update({f"method.{k}": v for k, v in hp.items()})
    return out


def rows_of(args) -> list[tuple[str, str, dict]]:
    """(group, label, method overrides); the group's Local row is its reference."""
    k_true, kind, n = args.clusters, args.cluster_kind, args.public_size
    out = [("dir01", f"PerFed-CKT k=2 λ={lam:g}", ckt(n, k=2, lam=lam)) for lam in args.lam]
    out += [
        ("dir01", LOCAL, {"method.name": "local"}),
        ("dir01", "FedAvg", {"method.name": "fedavg"}),
        (kind, f"PerFed-CKT k={k_true} λ={args.cluster_lam:g}", ckt(n, k=k_true, lam=args.cluster_lam)),
        (kind, f"PerFed-CKT k=1 λ={args.cluster_lam:g} (no clustering)", ckt(n, k=1, lam=args.cluster_lam)),
        (kind, LOCAL, {"method.name": "local"}),
    ]
    if args.mixed:
        out += [("dir01 mixed", f"PerFed-CKT k=2 λ={args.lam[0]:g} (3 archs)",
                 ckt(n, k=2, lam=args.lam[0], architectures=MIXED)),
                ("dir01 mixed", LOCAL, ckt(n, k=2, lam=0.0, architectures=MIXED))]
    return out


def measure(summary) -> dict:
    f = summary.final
    nan = float("nan")
    return {"bytes": f.get("comm/total_bytes", 0.0), "ari_true": f.get("cluster/ari", nan),
            "ari_arch": f.get("cluster/ari_arch", nan), "public_overlap": f.get("ckt/public_overlap", nan),
            "acc_p10": f.get("test/acc_p10", nan)}


COLUMNS = [("acc_p10", "p10 acc %", 100.0, 2), ("ari_true", "ARI true", 1.0, 3), ("ari_arch", "ARI arch", 1.0, 3),
           ("public_overlap", "public overlap", 1.0, 0)]


def headline(summary: list[dict], args) -> dict[str, float]:
    by = {(r["group"], r["row"]): r for r in summary}
    ckt_dir = by.get(("dir01", f"PerFed-CKT k=2 λ={args.lam[0]:g}"))
    fedavg = by.get(("dir01", "FedAvg"))
    clu_k = by.get((args.cluster_kind, f"PerFed-CKT k={args.clusters} λ={args.cluster_lam:g}"))
    clu_1 = by.get((args.cluster_kind, f"PerFed-CKT k=1 λ={args.cluster_lam:g} (no clustering)"))
    out: dict[str, float] = {}
    if ckt_dir:
        out.update({"dir01/ckt_minus_local_mean": ckt_dir["delta_mean"], "dir01/ckt_minus_local_std": ckt_dir["delta_std"],
                    "dir01/public_overlap": ckt_dir["public_overlap_mean"]})
    if ckt_dir and fedavg:
        out["comm/fedavg_over_ckt"] = fedavg["bytes_mean"] / ckt_dir["bytes_mean"]
    if clu_k and clu_1:
        diffs = [clu_k["values"][s] - clu_1["values"][s] for s in clu_k["values"] if s in clu_1["values"]]
        out["clustered/k_true_minus_k1_mean"] = sum(diffs) / len(diffs) if diffs else float("nan")
        out["clustered/k_true_minus_local_mean"] = clu_k["delta_mean"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30,
                        help="rounds (the clustered comparison needs models trained enough that their "
                             "logits reveal the clusters: ARI ≤ 0.5 at 10 rounds)")
    parser.add_argument("--eval-every", type=int, default=2, help="rounds between evaluations")
    parser.add_argument("--last", type=int, default=3, help="evaluations averaged per run (default 3)")
    parser.add_argument("--model", default="cnn_fpfc",
                        help="every client's model (model.name; cnn_fpfc, 6.6 k parameters, keeps the 3-seed "
                             "table within ~20 minutes on 2 CPUs: each client computes logits on the whole "
                             "public set every round)")
    parser.add_argument("--mixed", action="store_true",
                        help="also the heterogeneous setting: 3 architectures, against Local on the same mix")
    parser.add_argument("--max-samples", type=int, default=2000,
                        help="Dir(0.1): pooled Fashion-MNIST samples used (2000: ~70 training samples per client; "
                             "the rest of the 70,000 is the disjoint public pool)")
    parser.add_argument("--epochs", type=int, default=2, help="local epochs per round")
    parser.add_argument("--public-size", type=int, default=1000,
                        help="public set size N = rows per round (spec default 2000; 1000 keeps CPU runs short)")
    parser.add_argument("--device", default="cpu", help="federation.device (cpu, cuda, auto)")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=10, help="clients sampled per round (0 = all)")
    parser.add_argument("--clusters", type=int, default=2, help="true clusters of the clustered scenario")
    parser.add_argument("--cluster-kind", default="label_shift", choices=("label_swap", "label_shift"),
                        help="clustered scenario: every label shifted by the cluster id, or FPFC's swap of "
                             "2 labels per cluster (there the all-client teacher is right on 8 of 10 classes)")
    parser.add_argument("--cluster-alpha", type=float, default=0.0,
                        help="Dirichlet α of the labels within the clustered scenario (0 = iid)")
    parser.add_argument("--lam", type=float, nargs="+", default=[0.1],
                        help="Dir(0.1): regulariser weight λ (the method's default); several values give one "
                             "row each (a λ sweep: --only dir01 --lam 0.03 0.1 0.3 1); the headline uses the first")
    parser.add_argument("--cluster-lam", type=float, default=1.0, help="clustered scenario: regulariser weight λ")
    parser.add_argument("--cluster-max-samples", type=int, default=4000,
                        help="clustered scenario: pooled samples (with --cluster-test-fraction 0.5, ~80 "
                             "training samples per client)")
    parser.add_argument("--cluster-test-fraction", type=float, default=0.5,
                        help="clustered scenario: test share of each client's samples")
    parser.add_argument("--experiment", default="perfed_ckt_table")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="dotted overrides applied to every run")
    parser.add_argument("--only", nargs="+", default=[], metavar="TEXT",
                        help="run only the groups whose name contains one of these (e.g. dir01)")
    parser.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    add_seeds_argument(parser)
    args = parser.parse_args(argv)

    try:
        seeds = check_seeds(args.seeds)
        plan = [r for r in rows_of(args) if not args.only or any(t in r[0] for t in args.only)]
        configs = {}
        for s in seeds:
            for group, label, method in plan:
                cfg = load(None, scenario_base(args, group, s) | method)
                configs[(group, label, s)] = with_overrides(cfg, args.set) if args.set else cfg
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    parent = TableRun("perfed_ckt_table", experiment=args.experiment, track=not args.no_track,
                      params={k: v for k, v in vars(args).items() if k not in ("set", "seeds")}
                      | {"set": " ".join(args.set), "seeds": " ".join(map(str, seeds))})
    start = time.perf_counter()
    rows = [Row(label, lambda s, g=group, lab=label: configs[(g, lab, s)], group=group, measure=measure)
            for group, label, _ in plan]
    records = run_rows(parent, rows, seeds, last=args.last)
    summary = aggregate(records, reference=LOCAL)
    notes = [f"Fashion-MNIST, {args.clients} clients, {args.per_round} per round, {args.rounds} rounds, "
             f"{args.epochs} local epochs, model {args.model} for every client (the mixed group: {', '.join(MIXED)}); "
             f"dir01: Dir(0.1) over {args.max_samples} images; {args.cluster_kind}: {args.clusters} clusters, "
             f"{args.cluster_max_samples} images, test share {args.cluster_test_fraction}. Public set "
             f"{args.public_size} images no client holds (public overlap = rows shared with client data). "
             f"bytes: training traffic per run, both directions."]
    text = markdown(summary, columns=COLUMNS, last=args.last, notes=notes,
                    text_columns=[("bytes", lambda r: format_bytes(r.get("bytes_mean", 0.0)))])
    print("\n== PerFed-CKT table ==")
    print(text)
    head = headline(summary, args)
    head["time/total_s"] = time.perf_counter() - start
    print("\n== headline ==")
    for key, value in head.items():
        print(f"  {key} = {value:.4f}" if abs(value) < 1e4 else f"  {key} = {value:,.0f}")
    parent.log_metrics({k: v for k, v in head.items() if v == v})
    parent.finish([{k: v for k, v in r.items() if k != "values"} for r in summary], "perfed_ckt_table", text,
                  runs=records)
    if parent.run_id:
        print("\n" + run_hint(parent.run_id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
