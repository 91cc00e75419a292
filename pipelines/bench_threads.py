"""Benchmark: wall time of real runs with different torch thread counts, idle and under load.

    python pipelines/bench_threads.py [--threads 1 2 0] [--repeats 2] [--workloads s1 fmnist] [--no-track]

Each cell runs ``pfl run --no-track`` as its own process (so torch's thread pool is set up as a user
would get it) and measures its wall time. Workloads: ``s1`` = FPFC on the synthetic scenario S1
(100 devices, 30 per round, 10 full-batch steps), 20 rounds, evaluated every 10; ``fmnist`` = FedProx
on Fashion-MNIST Dirichlet(0.1) (100 clients, 10 per round, the CNN), 1 round. ``threads 0`` is
torch's own default (one thread per core). Load: ``idle``, and ``busy`` = a second job running at
the same time (another process doing PyTorch matrix products on every core, as a neighbour's
training job would). The conditions alternate so that drifts in the machine's state hit all cells.
Prints the table (median of the repeats) and logs it, with every measurement, to one MLflow run
(``bench_threads``); a cell that exceeds ``--timeout`` is reported as such, never as a time.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pfl import bench

WORKLOADS = {
    "s1": ["--scenario", "fpfc_s1", "--set", "method.name=fpfc", "federation.rounds=20", "federation.eval_every=10"],
    "fmnist": ["--scenario", "fmnist_dir01", "--set", "method.name=fedprox", "federation.rounds=1"],
}

BUSY = """
import torch
torch.set_num_threads({threads})
a = torch.randn(1024, 1024)
while True:
    a = (a @ a).clamp_(-1, 1)
"""


def run_once(workload: str, threads: int, timeout: float) -> float | None:
    cmd = [sys.executable, "-m", "pfl", "run", "--no-track", *WORKLOADS[workload], f"federation.threads={threads}"]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              cwd=Path(__file__).resolve().parents[1])
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = bench.parser(__doc__)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a cell is given up")
    args = parser.parse_args(argv)

    from pfl.config import FederationConfig

    default = FederationConfig().threads
    cores = os.cpu_count()
    times: dict[tuple[str, str, int], list[float | None]] = {}
    for _ in range(args.repeats):
        for load in ("idle", "busy"):
            busy = None
            if load == "busy":
                busy = subprocess.Popen([sys.executable, "-c", BUSY.format(threads=cores)])
                time.sleep(2)
            try:
                for workload in args.workloads:
                    for threads in args.threads:
                        seconds = run_once(workload, threads, args.timeout)
                        times.setdefault((workload, load, threads), []).append(seconds)
                        shown = "timeout" if seconds is None else f"{seconds:.1f} s"
                        print(f"{workload:<7} {load:<5} threads={threads}: {shown}", flush=True)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
    rows = []
    for (workload, load, threads), values in sorted(times.items()):
        done = [v for v in values if v is not None]
        rows.append({"workload": workload, "load": load,
                     "threads": f"{threads}" + (" (pfl default)" if threads == default else "")
                     + (" (torch default)" if threads == 0 else ""),
                     "median_s": statistics.median(done) if len(done) == len(values) else float("nan"),
                     "runs": " ".join("timeout" if v is None else f"{v:.1f}" for v in values)})
    print(f"\n== wall time of `pfl run` by torch threads ({cores} cores; median of {args.repeats}) ==")
    print(f"{'workload':<8} {'load':<5} {'threads':<22} {'median s':>9}  runs")
    for r in rows:
        median = "timeout" if r["median_s"] != r["median_s"] else f"{r['median_s']:.1f}"
        print(f"{r['workload']:<8} {r['load']:<5} {r['threads']:<22} {median:>9}  {r['runs']}")
    bench.track(args, "bench_threads", rows, params={"cores": cores, "default_threads": default},
                metrics={f"{r['workload']}/{r['load']}/threads_{r['threads'].split()[0]}_s": r["median_s"] for r in rows})
    return 0


if __name__ == "__main__":
    sys.exit(bench.main(main))
