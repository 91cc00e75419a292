"""Benchmark: one run's clients on N worker processes (``federation.workers``), against one process.

    python3 pipelines/bench_workers.py [--methods fedavg ditto] [--workers 1 2] [--clients 1000]
                                       [--per-round 50] [--rounds 4] [--repeat 1] [--no-pool-of-one]
                                       [--no-track] [--flower PYTHON]

FedAvg and Ditto on Fashion-MNIST Dir(0.1) with the CNN (``cnn_fedavg``), ``--clients`` clients,
``--per-round`` a round, one local epoch; each (method, workers) in a fresh process, and a pool of one
worker (row ``1 (pool)``: what the pool costs against one process): one warm-up round
(the workers start and build their data), then ``--rounds`` timed training rounds, no evaluation.
Reported: s/round (wall), the driver's CPU s/round, the CPU s/round of every process (the driver and,
through ``/proc``, Ray's worker processes), the peak resident memory of the driver plus the workers'
at the end (a sum of resident sets: shared pages count once per process), the proportional set sizes
of the driver and the workers at the end summed (``PSS MiB``: a shared page split among its users),
the bytes shipped to and from the workers per round (``workers/sent_bytes``, ``received_bytes``)
and the speed-up over one process. Every row's model after the rounds is digested: equal digests
say the workers computed the same bits; its accuracy on every client's test split pooled is a
sanity value. The table goes to MLflow (``bench_workers``).

``--flower PYTHON`` adds, for ``fedavg``, the same work in Flower's simulation with as many Ray actors
as workers (rows ``flower``): ``pipelines/bench_flower.py`` run by ``PYTHON``, a Python with Flower,
e.g. a venv beside the system packages (Flower pins its own Ray; pfl stays importable)::

    python3 -m venv --system-site-packages .venv-flower && .venv-flower/bin/pip install "flwr[simulation]==1.42.0"
    python3 pipelines/bench_workers.py --methods fedavg --flower .venv-flower/bin/python

The recipe (bench_flower's docstring): the partition, the CNN and its initial weights, each round's
clients and the clients' SGD (batches, order, learning rate, threads: a client's update has the same
bits) are pfl's; Flower's ``FedAvg`` (``Strategy.start``) sends to those clients' nodes and averages the
replies its own way (numpy, Σ (w_k/W)·x_k in arrival order), so its model differs from pfl's (and
with the number of actors) at float rounding, which training amplifies: compare the accuracies, not
the bits (``same bits`` –). Flower's rows measure the
same things (times between the strategy's per-round ``evaluate_fn`` calls; the actors by the pids
they report); it counts no bytes (sent/received –). × one process: against pfl's in-process row.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

from pfl import bench

FLOWER = Path(__file__).with_name("bench_flower.py")


def _worker_pids(sim) -> list[int]:
    """The worker processes of the run's pool (none in one process)."""
    return [int(p) for p in getattr(sim.exchange.runner, "pids", {}).values()]


def child(spec: dict) -> dict:
    import torch

    from pfl.federation.loop import RoundLoop
    from pfl.federation.simulator import Simulator
    from pfl.resolver import load
    from pfl.training import evaluate
    from pfl.tune.space import load_scenario

    overrides = {"method.name": spec["method"], "model.name": "cnn_fedavg", "data.num_clients": spec["clients"],
                 "federation.clients_per_round": spec["per_round"], "federation.local_epochs": 1,
                 "federation.rounds": 10**6, "federation.eval_every": 10**6, "federation.workers": spec["workers"],
                 "tracking.enabled": False}
    sim = Simulator(load(None, overrides, load_scenario("fmnist_dir01")))
    if spec.get("pool"):   # the pool's own cost: its one worker does what this process would
        from pfl.federation.workers import start_pool

        sim.exchange.runner = start_pool(sim, sim.exchange.runner, n=1)
    RoundLoop(sim, []).run(until=1)                 # the workers start, build their data and model
    pids = _worker_pids(sim)
    cpu0, _ = bench.proc_cpu_and_rss(pids)
    own0 = time.process_time()
    start = time.perf_counter()
    times, sent, received = [], [], []
    for _ in range(spec["rounds"]):
        t = time.perf_counter()
        RoundLoop(sim, []).run(until=sim.round + 1)
        times.append(time.perf_counter() - t)
        metrics = sim.history[-1]
        sent.append(metrics.get("workers/sent_bytes", 0.0))
        received.append(metrics.get("workers/received_bytes", 0.0))
    wall = time.perf_counter() - start
    cpu1, rss = bench.proc_cpu_and_rss(pids)
    pss = bench.pss_mib([os.getpid(), *pids])
    own = time.process_time() - own0
    peak = bench.peak_rss_mib() + rss
    model = sim.method.global_params() or sim.personal_params(0)
    digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in model.values())).hexdigest()[:12]
    clients = list(sim.data.clients)
    acc = evaluate(sim.ctx.model, model, torch.cat([c.x_test for c in clients]),
                   torch.cat([c.y_test for c in clients])).acc
    close = getattr(sim.exchange.runner, "close", None)
    if close:
        close()
    return {"s_per_round": statistics.median(times), "wall_s": wall, "driver_cpu_s": own / spec["rounds"],
            "all_cpu_s": (own + cpu1 - cpu0) / spec["rounds"], "peak_mib": peak, "pss_mib": pss,
            "sent_mb": statistics.mean(sent) / 1e6, "received_mb": statistics.mean(received) / 1e6, "digest": digest,
            "workers_seen": len(pids), "test_acc": acc}


def measure(spec: dict, flower: str | None = None) -> dict:
    """One row in a fresh process: pfl's (:func:`child`), or with ``flower`` (a Python) Flower's."""
    if flower:
        return bench.run_json([flower, str(FLOWER), json.dumps(spec)], f"Flower {spec}")
    return bench.run_child(__file__, spec, f"pfl {spec}")


def _median_row(seen: list[dict]) -> dict:
    """One row from its repeats: each number's median, the s/round range, the digests (equal: the
    same bits every time, else marked)."""
    out = dict(seen[0])
    for k, v in seen[0].items():
        if isinstance(v, float):
            out[k] = statistics.median(r[k] for r in seen)
    out["range"] = (min(r["s_per_round"] for r in seen), max(r["s_per_round"] for r in seen))
    if len({r["digest"] for r in seen}) > 1:
        out["digest"] = "differs between repeats"
    return out


def _mb(r: dict, key: str) -> str:
    return f"{r[key]:.1f}" if key in r else "–"


def main(argv: list[str]) -> int:
    parser = bench.parser(__doc__)
    parser.add_argument("--methods", nargs="+", default=["fedavg", "ditto"])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--flower", metavar="PYTHON", help="a Python with flwr[simulation]: add Flower's fedavg rows")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure every row this many times, in turn; the table gives medians and the s/round range")
    parser.add_argument("--no-pool-of-one", action="store_true",
                        help="leave out the row of a pool of one worker (what the pool costs against one process)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat: {args.repeat} (allowed: >= 1)")
    if args.flower and not (Path(args.flower).is_file() and os.access(args.flower, os.X_OK)):
        parser.error(f"--flower: {args.flower!r} is not an executable Python (make one: see this script's docstring)")
    plan = []
    for method in args.methods:
        for framework in ["pfl"] + (["flower"] if args.flower and method == "fedavg" else []):
            pool_of_one = framework == "pfl" and 1 in args.workers and not args.no_pool_of_one
            for n in args.workers + (["1 (pool)"] if pool_of_one else []):
                spec = {"clients": args.clients, "per_round": args.per_round, "rounds": args.rounds}
                spec.update({"actors": n} if framework == "flower" else
                            {"method": method, "workers": 1, "pool": True} if n == "1 (pool)" else
                            {"method": method, "workers": n})
                plan.append(({"framework": framework, "method": method, "workers": n}, spec))
    runs: list[list[dict]] = [[] for _ in plan]
    for rep in range(args.repeat):   # the rows in turn, again and again: slow spells of the machine hit them all
        for (row, spec), seen in zip(plan, runs):
            r = {**row, **measure(spec, args.flower if row["framework"] == "flower" else None)}
            seen.append(r)
            print(f"[{rep + 1}/{args.repeat}] {r['framework']} {r['method']} "
                  f"{'actors' if r['framework'] == 'flower' else 'workers'} {r['workers']}: "
                  f"{r['s_per_round']:.2f} s/round, CPU {r['all_cpu_s']:.2f} s/round (driver "
                  f"{r['driver_cpu_s']:.2f}), peak {r['peak_mib']:,.0f} MiB, shipped {_mb(r, 'sent_mb')} / "
                  f"{_mb(r, 'received_mb')} MB a round, model {r['digest']}, test acc {r['test_acc']:.2%}",
                  flush=True)
    rows = [_median_row(seen) for seen in runs]
    base = {r["method"]: r for r in rows if r["workers"] == 1 and r["framework"] == "pfl"}
    pooled = lambda r: r["framework"] == "pfl" and r["workers"] != 1  # noqa: E731  (N workers or a pool of one)
    lines = [f"== bench_workers: FMNIST Dir(0.1), cnn_fedavg, {args.clients} clients, {args.per_round} a round, "
             f"{args.rounds} rounds, {args.repeat} repeat(s): medians, {bench.machine()} ==", "",
             "| framework | method | workers (Flower: actors) | s/round | × one process | CPU s/round (all) | "
             "driver CPU | peak MiB | PSS MiB | sent MB/round | received MB/round | same bits | test acc % |", "|" + "---|" * 13]
    for r in rows:
        ref = base.get(r["method"])
        speed = f"{ref['s_per_round'] / r['s_per_round']:.2f}" if ref else "–"
        same = ("–" if r["framework"] != "pfl" or ref is None else "ref" if r is ref
                else "yes" if ref["digest"] == r["digest"] else "NO")
        spread = f" ({r['range'][0]:.2f}–{r['range'][1]:.2f})" if args.repeat > 1 else ""
        lines.append(f"| {r['framework']} | {r['method']} | {r['workers']} | {r['s_per_round']:.2f}{spread} | {speed} | "
                     f"{r['all_cpu_s']:.2f} | {r['driver_cpu_s']:.2f} | {r['peak_mib']:,.0f} | {r['pss_mib']:,.0f} | "
                     f"{_mb(r, 'sent_mb')} | {_mb(r, 'received_mb')} | {same} | {100 * r['test_acc']:.2f} |")
    text = "\n".join(lines)
    print("\n" + text)

    def prefix(r: dict) -> str:   # pfl's rows by method (a pool of one apart), Flower's by framework
        name = r["method"] if r["framework"] == "pfl" else f"{r['framework']}_{r['method']}"
        return name + ("_pool" if r["workers"] == "1 (pool)" else "")

    keys = ("s_per_round", "all_cpu_s", "driver_cpu_s", "peak_mib", "pss_mib", "sent_mb", "received_mb", "test_acc")
    metrics = [({f"{prefix(r)}/{k}": float(r[k]) for k in keys if k in r},
                r["workers"] if isinstance(r["workers"], int) else 1) for r in rows]
    bench.track(args, "bench_workers", rows, text, metrics=metrics)
    return 1 if any(pooled(r) and base.get(r["method"]) and base[r["method"]]["digest"] != r["digest"]
                    for r in rows) else 0


if __name__ == "__main__":
    sys.exit(bench.main(main, child=child))
