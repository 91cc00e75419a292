"""Benchmark: sequential vs vectorized cohorts, and the limit of the same SGD steps batched.

    python pipelines/bench_cohort.py [--rounds 5] [--workloads s1 fmnist10 fmnist50 digits1000]
                                     [--device cpu|cuda] [--threads 1] [--scale] [--no-track]

For each workload the same run is built twice, ``federation.cohort=sequential`` and
``vectorized``, and ``--rounds`` training rounds of each are timed (after one warm-up round;
evaluation off), then one evaluation of every client. The **limit** is the same clients' local SGD
with the same minibatches done as one batched loop and nothing else — no messages, no server step,
no per-client Python — so ``vectorized / limit`` is what federating the computation costs.

Workloads: ``s1`` = FPFC on S1 (100 devices, 30 per round, 10 full-batch steps, softmax
regression); ``fmnist10`` / ``fmnist50`` = FedAvg on Fashion-MNIST Dirichlet(0.1) with the MLP, 10 /
50 clients per round (one local epoch of batch 32); ``digits1000`` = FedAvg on digits split over
1,000 clients (all train every round). ``--scale`` adds a memory check: Ditto and SCAFFOLD (per-
client state) on the Fashion-MNIST CNN with 1,000 clients, 100 per round in chunks of 50, peak
resident memory reported. Prints a table (s/round, ratios) and logs it with a plot to MLflow
(``bench_cohort``).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from pfl import bench

WORKLOADS = {
    "s1": {"scenario": "fpfc_s1", "set": {"method.name": "fpfc"}},
    "fmnist10": {"scenario": "fmnist_dir01", "set": {"method.name": "fedavg", "model.name": "mlp",
                                                     "federation.clients_per_round": 10, "federation.local_epochs": 1}},
    "fmnist50": {"scenario": "fmnist_dir01", "set": {"method.name": "fedavg", "model.name": "mlp",
                                                     "federation.clients_per_round": 50, "federation.local_epochs": 1}},
    "digits1000": {"scenario": None, "set": {"method.name": "fedavg", "data.source": "digits", "data.num_clients": 1000,
                                             "data.partition.kind": "iid", "data.partition.min_samples": 1, "data.val_fraction": 0.0,
                                             "data.test_fraction": 0.0, "federation.clients_per_round": 0,
                                             "federation.local_epochs": 1}},
}


def sync(device) -> None:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def build(workload: str, cohort: str, device: str, threads: int, extra: dict | None = None):
    from pfl.resolver import load
    from pfl.federation.simulator import Simulator
    from pfl.tune.space import load_scenario

    spec = WORKLOADS[workload]
    scenario = load_scenario(spec["scenario"]) if spec["scenario"] else None
    overrides = {**spec["set"], "federation.cohort": cohort, "federation.device": device,
                 "federation.threads": threads, "federation.rounds": 10**6, "federation.eval_every": 10**6,
                 "tracking.enabled": False, **(extra or {})}
    return Simulator(load(None, overrides, scenario))


def time_rounds(sim, rounds: int) -> float:
    from pfl.federation.loop import RoundLoop

    RoundLoop(sim, []).run(until=sim.round + 1)  # warm-up (allocations, first vmap trace)
    sync(sim.device)
    start = time.perf_counter()
    RoundLoop(sim, []).run(until=sim.round + rounds)
    sync(sim.device)
    return (time.perf_counter() - start) / rounds


def time_eval(sim, repeats: int = 2) -> float:
    """Best of ``repeats`` evaluations of every client, after one untimed (the first one pays for
    imports and allocations)."""
    times = []
    for i in range(repeats + 1):
        sync(sim.device)
        start = time.perf_counter()
        sim.evaluate()
        sync(sim.device)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def time_limit(sim, rounds: int) -> float:
    """The sampled clients' local SGD of the next rounds as one batched loop, nothing else."""
    from pfl.federation.batched import train_cohort
    from pfl.training import TrainCall

    times = []
    for rnd in range(sim.round, sim.round + rounds):
        calls = []
        for cid in sim.sample(rnd):
            client = sim.client(cid)
            fed = sim.cfg.federation
            kwargs = dict(lr=sim.ctx.lr(rnd), epochs=fed.local_epochs, steps=fed.local_steps,
                          batch_size=fed.batch_size, momentum=fed.momentum, weight_decay=fed.weight_decay,
                          task=sim.ctx.meta.task, generator=client.generator(rnd, "train"))
            start = sim.client_role.personal_params(rnd, client, sim.method.global_params()) \
                if sim.method.global_params() is not None else sim.personal_params(cid)
            calls.append(TrainCall(client.model, start, client.data.x_train, client.data.y_train, kwargs))
        sync(sim.device)
        t0 = time.perf_counter()
        train_cohort(calls)
        sync(sim.device)
        times.append(time.perf_counter() - t0)
    return statistics.mean(times)


def scale_check(device: str, threads: int) -> list[dict]:
    """Ditto and SCAFFOLD with 1,000 clients on the Fashion-MNIST CNN: peak memory."""
    rows = []
    for method in ("ditto", "scaffold"):
        sim = build("fmnist10", "vectorized", device, threads,
                    {"method.name": method, "model.name": "cnn_fedavg", "data.num_clients": 1000,
                     "federation.clients_per_round": 100, "federation.cohort_chunk": 50,
                     "data.partition.min_samples": 10})
        start = time.perf_counter()
        from pfl.federation.loop import RoundLoop

        RoundLoop(sim, []).run(until=2)
        rss = bench.peak_rss_mib() / 1024
        rows.append({"method": method, "clients": sim.num_clients, "rounds": 2,
                     "s_per_round": (time.perf_counter() - start) / 2, "peak_rss_gib": rss})
        del sim
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--scale", action="store_true", help="also the 1,000-client memory check")
    args = parser.parse_args(argv)

    rows = []
    for workload in args.workloads:
        seq = build(workload, "sequential", args.device, args.threads)
        t_seq = time_rounds(seq, args.rounds)
        e_seq = time_eval(seq)
        del seq
        vec = build(workload, "vectorized", args.device, args.threads)
        t_vec = time_rounds(vec, args.rounds)
        e_vec = time_eval(vec)
        t_lim = time_limit(vec, args.rounds)
        rows.append({"workload": workload, "clients/round": len(vec.sample(0)), "sequential_s": t_seq,
                     "vectorized_s": t_vec, "limit_s": t_lim, "speedup": t_seq / t_vec,
                     "overhead": t_vec / t_lim, "eval_sequential_s": e_seq, "eval_vectorized_s": e_vec,
                     "eval_speedup": e_seq / e_vec})
        r = rows[-1]
        print(f"{workload}: sequential {t_seq:.3f} s/round, vectorized {t_vec:.3f}, limit {t_lim:.3f} | "
              f"×{r['speedup']:.2f} faster, ×{r['overhead']:.2f} the limit | evaluation ×{r['eval_speedup']:.2f}",
              flush=True)
    print(f"\n== rounds: sequential vs vectorized cohorts ({args.device}, {args.threads} thread(s), "
          f"mean of {args.rounds} rounds) ==")
    print(f"{'workload':<11} {'clients':>7} {'seq s':>8} {'vec s':>8} {'limit s':>8} {'speedup':>8} "
          f"{'vec/limit':>9} {'eval seq':>9} {'eval vec':>9} {'eval ×':>7}")
    for r in rows:
        print(f"{r['workload']:<11} {r['clients/round']:>7} {r['sequential_s']:>8.3f} {r['vectorized_s']:>8.3f} "
              f"{r['limit_s']:>8.3f} {r['speedup']:>8.2f} {r['overhead']:>9.2f} {r['eval_sequential_s']:>9.3f} "
              f"{r['eval_vectorized_s']:>9.3f} {r['eval_speedup']:>7.2f}")
    scale = scale_check(args.device, args.threads) if args.scale else []
    for r in scale:
        print(f"scale: {r['method']} with {r['clients']} clients (FMNIST CNN, 100 per round, chunks of 50): "
              f"{r['s_per_round']:.1f} s/round, peak resident memory {r['peak_rss_gib']:.2f} GiB")

    def plots(out: Path) -> list[Path]:
        from pfl.plots import plt

        fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
        xs = range(len(rows))
        for offset, key, label in ((-0.27, "sequential_s", "sequential"), (0.0, "vectorized_s", "vectorized"),
                                   (0.27, "limit_s", "limit (batched SGD only)")):
            ax.bar([x + offset for x in xs], [r[key] for r in rows], width=0.26, label=label)
        ax.set_xticks(list(xs), [r["workload"] for r in rows])
        ax.set_ylabel("seconds per round")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title(f"cohorts on {args.device}, {args.threads} thread(s)")
        fig.tight_layout()
        fig.savefig(out / "bench_cohort.png")
        plt.close(fig)
        return [out / "bench_cohort.png"]

    metrics = {f"{r['workload']}/{k}": v for r in rows for k, v in r.items() if isinstance(v, float)}
    metrics.update({f"scale/{r['method']}/peak_rss_gib": r["peak_rss_gib"] for r in scale})
    bench.track(args, "bench_cohort", rows, metrics=metrics, plots=plots, plot_folder="plots")
    return 0


if __name__ == "__main__":
    sys.exit(bench.main(main))
