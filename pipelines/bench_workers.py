"""Benchmark: one run's clients on N worker processes (``federation.workers``), against one process.

    python3 pipelines/bench_workers.py [--methods fedavg ditto] [--workers 1 2] [--clients 1000]
                                       [--per-round 50] [--rounds 4] [--no-track] [--flower PYTHON]

FedAvg and Ditto on Fashion-MNIST Dir(0.1) with the CNN (``cnn_fedavg``), ``--clients`` clients,
``--per-round`` a round, one local epoch; each (method, workers) in a fresh process: one warm-up round
(the workers start and build their data), then ``--rounds`` timed training rounds, no evaluation.
Reported: s/round (wall), the driver's CPU s/round, the CPU s/round of every process (the driver and,
through ``/proc``, Ray's worker processes), the peak resident memory of the driver plus the workers,
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
            "all_cpu_s": (own + cpu1 - cpu0) / spec["rounds"], "peak_mib": peak,
            "sent_mb": statistics.mean(sent) / 1e6, "received_mb": statistics.mean(received) / 1e6, "digest": digest,
            "workers_seen": len(pids), "test_acc": acc}


def measure(spec: dict, flower: str | None = None) -> dict:
    """One row in a fresh process: pfl's (:func:`child`), or with ``flower`` (a Python) Flower's."""
    if flower:
        return bench.run_json([flower, str(FLOWER), json.dumps(spec)], f"Flower {spec}")
    return bench.run_child(__file__, spec, f"pfl {spec}")


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
    args = parser.parse_args(argv)
    if args.flower and not (Path(args.flower).is_file() and os.access(args.flower, os.X_OK)):
        parser.error(f"--flower: {args.flower!r} is not an executable Python (make one: see this script's docstring)")
    rows = []
    for method in args.methods:
        for framework in ["pfl"] + (["flower"] if args.flower and method == "fedavg" else []):
            for n in args.workers:
                spec = {"clients": args.clients, "per_round": args.per_round, "rounds": args.rounds}
                spec.update({"actors": n} if framework == "flower" else {"method": method, "workers": n})
                r = {"framework": framework, "method": method, "workers": n,
                     **measure(spec, args.flower if framework == "flower" else None)}
                rows.append(r)
                print(f"{framework} {method} {'actors' if framework == 'flower' else 'workers'} {n}: "
                      f"{r['s_per_round']:.2f} s/round, CPU {r['all_cpu_s']:.2f} s/round (driver "
                      f"{r['driver_cpu_s']:.2f}), peak {r['peak_mib']:,.0f} MiB, shipped {_mb(r, 'sent_mb')} / "
                      f"{_mb(r, 'received_mb')} MB a round, model {r['digest']}, test acc {r['test_acc']:.2%}",
                      flush=True)
    base = {r["method"]: r for r in rows if r["workers"] == 1 and r["framework"] == "pfl"}
    lines = [f"== bench_workers: FMNIST Dir(0.1), cnn_fedavg, {args.clients} clients, {args.per_round} a round, "
             f"{args.rounds} rounds, {bench.machine()} ==", "",
             "| framework | method | workers (Flower: actors) | s/round | × one process | CPU s/round (all) | "
             "driver CPU | peak MiB | sent MB/round | received MB/round | same bits | test acc % |", "|" + "---|" * 12]
    for r in rows:
        ref = base.get(r["method"])
        speed = f"{ref['s_per_round'] / r['s_per_round']:.2f}" if ref else "–"
        same = ("–" if r["framework"] != "pfl" or ref is None else "ref" if r is ref
                else "yes" if ref["digest"] == r["digest"] else "NO")
        lines.append(f"| {r['framework']} | {r['method']} | {r['workers']} | {r['s_per_round']:.2f} | {speed} | "
                     f"{r['all_cpu_s']:.2f} | {r['driver_cpu_s']:.2f} | {r['peak_mib']:,.0f} | {_mb(r, 'sent_mb')} | "
                     f"{_mb(r, 'received_mb')} | {same} | {100 * r['test_acc']:.2f} |")
    text = "\n".join(lines)
    print("\n" + text)
    metrics = [({f"{r['method'] if r['framework'] == 'pfl' else r['framework'] + '_' + r['method']}/{k}": float(r[k])
                 for k in ("s_per_round", "all_cpu_s", "driver_cpu_s", "peak_mib", "sent_mb", "received_mb", "test_acc")
                 if k in r}, r["workers"]) for r in rows]
    bench.track(args, "bench_workers", rows, text, metrics=metrics)
    return 1 if any(r["framework"] == "pfl" and r["workers"] > 1 and base.get(r["method"])
                    and base[r["method"]]["digest"] != r["digest"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(bench.main(main, child=child))
