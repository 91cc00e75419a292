"""Benchmark: one run's clients on N worker processes (``federation.workers``), against one process.

    python3 pipelines/bench_workers.py [--methods fedavg ditto] [--workers 1 2] [--clients 1000]
                                       [--per-round 50] [--rounds 4] [--no-track]

FedAvg and Ditto on Fashion-MNIST Dir(0.1) with the CNN (``cnn_fedavg``), ``--clients`` clients,
``--per-round`` a round, one local epoch; each (method, workers) in a fresh process: one warm-up round
(the workers start and build their data), then ``--rounds`` timed training rounds, no evaluation.
Reported: s/round (wall), the driver's CPU s/round, the CPU s/round of every process (the driver and,
through ``/proc``, Ray's worker processes), the peak resident memory of the driver plus the workers,
the bytes shipped to and from the workers per round (``workers/sent_bytes``, ``received_bytes``)
and the speed-up over one process. Every row's model after the rounds is digested: equal digests
say the workers computed the same bits. The table goes to MLflow (``bench_workers``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD_FLAG = "--child"


def _proc_cpu_and_rss(pids: list[int]) -> tuple[float, float]:
    """CPU seconds (user + system) and resident MiB of processes by pid, read from /proc."""
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    cpu = rss = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / tick
            rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page / 2**20
        except (OSError, IndexError, ValueError):
            continue
    return cpu, rss


def _worker_pids(sim) -> list[int]:
    """The worker processes of the run's pool (none in one process)."""
    return [int(p) for p in getattr(sim.exchange.runner, "pids", {}).values()]


def child(spec: dict) -> dict:
    from pfl.federation.loop import RoundLoop
    from pfl.federation.simulator import Simulator
    from pfl.resolver import load
    from pfl.tune.space import load_scenario

    overrides = {"method.name": spec["method"], "model.name": "cnn_fedavg", "data.num_clients": spec["clients"],
                 "federation.clients_per_round": spec["per_round"], "federation.local_epochs": 1,
                 "federation.rounds": 10**6, "federation.eval_every": 10**6, "federation.workers": spec["workers"],
                 "tracking.enabled": False}
    sim = Simulator(load(None, overrides, load_scenario("fmnist_dir01")))
    RoundLoop(sim, []).run(until=1)                 # the workers start, build their data and model
    pids = _worker_pids(sim)
    cpu0, _ = _proc_cpu_and_rss(pids)
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
    cpu1, rss = _proc_cpu_and_rss(pids)
    own = time.process_time() - own0
    model = sim.method.global_params() or sim.personal_params(0)
    digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in model.values())).hexdigest()[:12]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 + rss
    close = getattr(sim.exchange.runner, "close", None)
    if close:
        close()
    return {"s_per_round": statistics.median(times), "wall_s": wall, "driver_cpu_s": own / spec["rounds"],
            "all_cpu_s": (own + cpu1 - cpu0) / spec["rounds"], "peak_mib": peak,
            "sent_mb": statistics.mean(sent) / 1e6, "received_mb": statistics.mean(received) / 1e6, "digest": digest,
            "workers_seen": len(pids)}


def measure(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, CHILD_FLAG, json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [CHILD_FLAG]:
        print(json.dumps(child(json.loads(argv[1]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["fedavg", "ditto"])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-track", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for method in args.methods:
        for n in args.workers:
            spec = {"method": method, "workers": n, "clients": args.clients, "per_round": args.per_round,
                    "rounds": args.rounds}
            r = {"method": method, "workers": n, **measure(spec)}
            rows.append(r)
            print(f"{method} workers {n}: {r['s_per_round']:.2f} s/round, CPU {r['all_cpu_s']:.2f} s/round "
                  f"(driver {r['driver_cpu_s']:.2f}), peak {r['peak_mib']:,.0f} MiB, shipped "
                  f"{r['sent_mb']:.1f} / {r['received_mb']:.1f} MB a round, model {r['digest']}", flush=True)
    base = {r["method"]: r for r in rows if r["workers"] == 1}
    lines = [f"== bench_workers: FMNIST Dir(0.1), cnn_fedavg, {args.clients} clients, {args.per_round} a round, "
             f"{args.rounds} rounds, {os.cpu_count()} CPUs ==", "",
             "| method | workers | s/round | × one process | CPU s/round (all) | driver CPU | peak MiB | "
             "sent MB/round | received MB/round | same bits |", "|" + "---|" * 10]
    for r in rows:
        ref = base.get(r["method"])
        speed = f"{ref['s_per_round'] / r['s_per_round']:.2f}" if ref else "–"
        same = "ref" if r is ref else "yes" if ref and ref["digest"] == r["digest"] else "NO"
        lines.append(f"| {r['method']} | {r['workers']} | {r['s_per_round']:.2f} | {speed} | {r['all_cpu_s']:.2f} | "
                     f"{r['driver_cpu_s']:.2f} | {r['peak_mib']:,.0f} | {r['sent_mb']:.1f} | {r['received_mb']:.1f} | "
                     f"{same} |")
    text = "\n".join(lines)
    print("\n" + text)
    if not args.no_track:
        import tempfile

        from pfl.runner import write_table
        from pfl.tracking import Tracker, run_hint

        tracker = Tracker.start(None, "bench_workers", tags={"pfl.pipeline": "bench_workers"})
        tracker.log_params(vars(args))
        for r in rows:
            tracker.log_metrics({f"{r['method']}/{k}": float(r[k]) for k in
                                 ("s_per_round", "all_cpu_s", "driver_cpu_s", "peak_mib", "sent_mb", "received_mb")},
                                step=r["workers"])
        with tempfile.TemporaryDirectory() as tmp:
            write_table(tracker, [{k: v for k, v in r.items()} for r in rows], "bench_workers", text, Path(tmp))
        tracker.end("FINISHED")
        print(run_hint(tracker.run_id, what="MLflow run"))
    return 1 if any(r["workers"] > 1 and base.get(r["method"]) and base[r["method"]]["digest"] != r["digest"]
                    for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
