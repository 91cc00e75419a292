"""Benchmark: one FPFC round on S1 (100 devices) against the bare local SGD it contains.

    python pipelines/bench_fpfc.py [--rounds 10] [--device cpu|cuda] [--threads N] [--no-track]

Runs FPFC on scenario S1 (docs/methods/fpfc.md §5.1: 100 devices, 30 per round, 10 full-batch steps,
p = 610) without evaluation and times, per round, (a) the clients' calls of the shared local-SGD
loop (:func:`pfl.training.local_sgd`), (b) the server's work (``begin_round``: all ζ_i in one
stacked op; ``aggregate``: the pair updates of the 30 × 100 × 610 rows touching the sampled set),
and (c) the whole round as the simulator runs it (messages, hooks). It prints the medians and the
ratios round / local SGD and server / local SGD, times the server's pair update alone for |A| = 30
and |A| = 100 on (100, 100, 610) tensors, and logs everything to an MLflow run ``bench_fpfc``.
"""

from __future__ import annotations

import statistics
import sys
import time

from pfl import bench
from pfl.callbacks.divergence import run_rounds


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = bench.parser(__doc__, experiment=True)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (after 2 warm-up rounds)")
    parser.add_argument("--device", default="cpu", help="federation.device")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--pair-update", default="once", choices=("once", "official_sequential"))
    args = parser.parse_args(argv)

    import torch

    import pfl.federation.cohort as cohort
    from pfl.resolver import load
    from pfl.federation.loop import Callback, RoundLoop
    from pfl.federation.simulator import Simulator
    from pfl.methods.fpfc import pair_update, zeta
    from pfl.prox import scad_prox

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load(None, {
        "data.source": "fpfc_synthetic", "data.num_clients": 100, "data.val_fraction": 0.0,
        "data.test_fraction": 0.2, "method.name": "fpfc", "method.pair_update": args.pair_update,
        "federation.clients_per_round": 30, "federation.batch_size": 0, "federation.local_steps": 10,
        "federation.lr": 0.1, "federation.rounds": 10**6, "federation.eval_every": 10**6,
        "federation.device": args.device, "federation.cohort": "sequential", "tracking.enabled": False, "seed": 1,
    })
    sim = Simulator(cfg)
    device = sim.device
    method = sim.method

    timers = {"local_sgd": 0.0, "server": 0.0}

    def timed(fn, key: str):
        def wrapper(*a, **kw):
            sync(device)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            sync(device)
            timers[key] += time.perf_counter() - t0
            return out
        return wrapper

    original_sgd = cohort.local_sgd  # what a client's compute calls (a sequential cohort)
    cohort.local_sgd = timed(original_sgd, "local_sgd")
    method.begin_round = timed(method.begin_round, "server")
    method.aggregate = timed(method.aggregate, "server")
    rows = []

    class RoundTimer(Callback):
        """Each timed round's wall time and its split (the loop's own rounds, synchronised)."""

        def on_start(self, loop):
            timers.update(local_sgd=0.0, server=0.0)
            sync(device)
            self.t0 = time.perf_counter()

        def on_round(self, loop, metrics):
            sync(device)
            total = time.perf_counter() - self.t0
            samples = sum(sim.data.clients[c].n_train for c in sim.sample(sim.round - 1))
            rows.append({"round": total, "local_sgd": timers["local_sgd"], "server": timers["server"],
                         "other": total - timers["local_sgd"] - timers["server"], "samples": samples})
            self.on_start(loop)

    try:
        run_rounds(sim, until=2)  # warm-up
        RoundLoop(sim, [RoundTimer()]).run(until=sim.round + args.rounds)
    finally:
        cohort.local_sgd = original_sgd

    med = {k: statistics.median(r[k] for r in rows) for k in ("round", "local_sgd", "server", "other", "samples")}
    other = med["other"]

    # the pair update alone on (m, m, p) = (100, 100, 610) tensors
    g = torch.Generator().manual_seed(0)
    m, p = 100, 610
    W = torch.randn(m, p, generator=g).to(device)
    theta = torch.zeros(m, m, p, device=device)
    v = torch.zeros(m, m, p, device=device)

    def prox(d):
        return scad_prox(d, 0.8, 1.0, 1e-3, 3.7)

    pair_times = {}
    for size in (30, 100):
        rows_idx = list(range(0, m, m // size))[:size]
        times = []
        for _ in range(5):
            sync(device)
            t0 = time.perf_counter()
            zeta(W, theta, v, torch.as_tensor(rows_idx, device=device), 1.0)
            pair_update(W, theta, v, rows_idx, prox, 1.0, args.pair_update)
            sync(device)
            times.append(time.perf_counter() - t0)
        pair_times[size] = statistics.median(times)

    print(f"FPFC on S1 (100 devices, 30 per round, 10 full-batch steps, p = 610), device {device}, "
          f"threads {torch.get_num_threads()}, {args.rounds} rounds (median):")
    print(f"  whole round            {med['round'] * 1e3:9.1f} ms")
    print(f"  clients' local_sgd     {med['local_sgd'] * 1e3:9.1f} ms  ({med['samples']:.0f} training samples "
          f"in the sampled set, 10 steps each)")
    print(f"  server (ζ + pairs)     {med['server'] * 1e3:9.1f} ms")
    print(f"  other (messages, hooks){other * 1e3:9.1f} ms")
    print(f"  ratio round / local_sgd  {med['round'] / med['local_sgd']:.3f}")
    print(f"  ratio server / local_sgd {med['server'] / med['local_sgd']:.3f}")
    for size, t in pair_times.items():
        print(f"  ζ + pair update alone, |A| = {size:3d}: {t * 1e3:8.1f} ms")

    summary = {"bench/round_ms": med["round"] * 1e3, "bench/local_sgd_ms": med["local_sgd"] * 1e3,
               "bench/server_ms": med["server"] * 1e3, "bench/other_ms": other * 1e3,
               "bench/ratio_round_local": med["round"] / med["local_sgd"],
               "bench/ratio_server_local": med["server"] / med["local_sgd"],
               "bench/pair_update_30_ms": pair_times[30] * 1e3, "bench/pair_update_100_ms": pair_times[100] * 1e3}
    per_round = [({f"bench/{k}_ms": r[k] * 1e3 for k in ("round", "local_sgd", "server")}, i) for i, r in enumerate(rows)]
    bench.track(args, "bench_fpfc", params={"device": str(device), "threads": torch.get_num_threads(), "clients": 100,
                                            "per_round": 30, "p": 610}, metrics=[(summary, None), *per_round])
    return 0


if __name__ == "__main__":
    sys.exit(bench.main(main))
