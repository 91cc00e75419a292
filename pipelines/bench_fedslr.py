"""Benchmark: FedSLR's server SVD (singular-value thresholding of every matrix tensor) per round
vs. the clients' compute in that round.

    python pipelines/bench_fedslr.py [--scenario fmnist_dir01] [--rounds 5] [--max-samples 10000]
                                     [--models cnn_fedavg resnet18_gn] [--steps 50] [--set key=value ...]

Part 1 runs FedSLR in the simulator and times, per round, the server's SVT (the method records
it) and every client's local update (Phase I + Phase II). Part 2 times, per model, one SVT pass
over all its matrix tensors against one client's round of local SGD estimated as ``--steps``
minibatch steps (the paper's setting: 2 epochs × ⌈500/20⌉ = 50 steps) measured on random data.
Prints a table and logs the numbers to one MLflow run (``bench_fedslr``).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from pfl import bench
from pfl.config import apply_overrides
from pfl.resolver import load
from pfl.schema import ConfigError
from pfl.tune.space import load_scenario

MODEL_INPUTS = {"cnn_fedavg": ((1, 28, 28), 10), "cnn_fpfc": ((1, 28, 28), 10),
                "resnet18_gn": ((3, 32, 32), 100), "vgg11": ((3, 32, 32), 10), "mlp": ((784,), 10)}


def simulate(cfg) -> list[dict]:
    from pfl.federation.loop import Callback, RoundLoop
    from pfl.federation.simulator import Simulator

    sim = Simulator(cfg)
    method = sim.method
    client_times: list[float] = []
    training_side = sim.training_side

    def timed_side(rnd):  # each client's local update, timed
        work = training_side(rnd)

        def timed(client, msg):
            start = time.perf_counter()
            out = work(client, msg)
            client_times.append(time.perf_counter() - start)
            return out
        return timed

    sim.training_side = timed_side
    rows = []

    class RoundCosts(Callback):
        def on_round(self, loop, metrics):
            svd = sum(method.svd_seconds[self.before:]) if hasattr(self, "before") else sum(method.svd_seconds)
            rows.append({"round": int(metrics["round"]), "svd_s": svd, "clients_total_s": sum(client_times),
                         "client_mean_s": statistics.mean(client_times) if client_times else float("nan"),
                         "rank_mean": sum(l.rank for l in method.layers.values()) / max(1, len(method.layers))})
            client_times.clear()
            self.before = len(method.svd_seconds)

    RoundLoop(sim, [RoundCosts()]).run()
    return rows


def time_model(name: str, steps: int, batch: int, tau: float, reps: int = 3) -> dict:
    from torch.func import functional_call

    from pfl import lowrank
    from pfl.models import build_model, layer_groups

    shape, classes = MODEL_INPUTS[name]
    torch.manual_seed(0)
    model = build_model(name, {}, shape, classes)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    matrices = layer_groups(model).matrices
    svd_times = []
    for _ in range(reps):
        start = time.perf_counter()
        for k in matrices:
            lowrank.threshold(params[k], tau)
        svd_times.append(time.perf_counter() - start)
    x = torch.randn(batch, *shape)
    y = torch.randint(0, classes, (batch,))
    train = {k: v.requires_grad_(True) for k, v in params.items()}

    def step():
        loss = torch.nn.functional.cross_entropy(functional_call(model, train, (x,)), y)
        torch.autograd.grad(loss, list(train.values()))

    step()  # warm-up
    probe = max(2, min(10, steps))
    start = time.perf_counter()
    for _ in range(probe):
        step()
    step_s = (time.perf_counter() - start) / probe
    svd_s = min(svd_times)
    client_s = step_s * steps
    return {"model": name, "matrices": len(matrices), "params": sum(v.numel() for v in params.values()),
            "svd_s": svd_s, "step_s": step_s, "client_round_s": client_s, "ratio": svd_s / client_s}


def main(argv: list[str] | None = None) -> int:
    parser = bench.parser(__doc__)
    parser.add_argument("--scenario", default="fmnist_dir01")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-samples", type=int, default=10000)
    parser.add_argument("--lam", type=float, default=1e-3, help="λ of the simulated run")
    parser.add_argument("--models", nargs="*", default=["cnn_fedavg", "resnet18_gn"],
                        help=f"models for part 2 (of {', '.join(MODEL_INPUTS)}); none to skip")
    parser.add_argument("--steps", type=int, default=50, help="local steps per client round in part 2")
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    unknown = [m for m in args.models if m not in MODEL_INPUTS]
    if unknown:
        raise ConfigError("--models", f"unknown {unknown}; allowed: {', '.join(MODEL_INPUTS)}")
    raw = apply_overrides({}, load_scenario(args.scenario))
    raw = apply_overrides(raw, {"method.name": "fedslr", "method.lam": args.lam, "tracking.enabled": False,
                                "federation.rounds": args.rounds, "data.max_samples": args.max_samples,
                                "federation.eval_every": 10**6, "federation.eval_global": False})
    cfg = load(None, apply_overrides(raw, args.set))
    metrics: list[tuple[dict, int | None]] = []

    print(f"== part 1: simulated FedSLR ({args.scenario}, {cfg.model.name}, λ={args.lam:g}, "
          f"{cfg.federation.clients_per_round} clients/round, {torch.get_num_threads()} threads) ==")
    print("round | server SVT s | clients total s | per client s | SVT / per-client | SVT / total | rank mean")
    rows = simulate(cfg)
    for row in rows:
        print(f"{row['round']:>5} | {row['svd_s']:.4f} | {row['clients_total_s']:.2f} | {row['client_mean_s']:.3f} | "
              f"{row['svd_s'] / row['client_mean_s']:.4f} | {row['svd_s'] / row['clients_total_s']:.5f} | "
              f"{row['rank_mean']:.1f}")
        metrics.append(({"sim/svd_s": row["svd_s"], "sim/clients_total_s": row["clients_total_s"],
                         "sim/client_mean_s": row["client_mean_s"],
                         "sim/svd_over_client": row["svd_s"] / row["client_mean_s"]}, row["round"]))
    svd = statistics.mean(r["svd_s"] for r in rows)
    per_client = statistics.mean(r["client_mean_s"] for r in rows)
    total = statistics.mean(r["clients_total_s"] for r in rows)
    print(f"mean | {svd:.4f} | {total:.2f} | {per_client:.3f} | {svd / per_client:.4f} | {svd / total:.5f} |")
    metrics.append(({"sim/mean_svd_s": svd, "sim/mean_client_s": per_client,
                     "sim/mean_svd_over_client": svd / per_client, "sim/mean_svd_over_total": svd / total}, None))

    if args.models:
        tau = cfg.method.hparams.eta * args.lam
        print(f"\n== part 2: one SVT pass over all matrix tensors vs one client round "
              f"({args.steps} steps of batch {args.batch}, random data, τ={tau:g}) ==")
        print("model | matrices | params | SVT s | SGD step s | client round s | SVT / client round")
        for name in args.models:
            r = time_model(name, args.steps, args.batch, tau)
            print(f"{r['model']} | {r['matrices']} | {r['params']:,} | {r['svd_s']:.3f} | {r['step_s']:.4f} | "
                  f"{r['client_round_s']:.2f} | {r['ratio']:.4f}", flush=True)
            metrics.append(({f"{name}/svd_s": r["svd_s"], f"{name}/step_s": r["step_s"],
                             f"{name}/client_round_s": r["client_round_s"], f"{name}/svd_over_client": r["ratio"]},
                            None))
    bench.track(args, "bench_fedslr", params={"threads": torch.get_num_threads()}, metrics=metrics)
    return 0


if __name__ == "__main__":
    sys.exit(bench.main(main))
