"""Benchmark: loading a user's Parquet file costs about what reading it costs.

    python pipelines/bench_data.py [--rows 1000000] [--clients 3400] [--features 256] [--dir /tmp/pfl-bench]
                                   [--repeats 3] [--keep] [--no-track]

Writes a FEMNIST-sized table (``--rows`` samples of ``--features`` float32 values in one list column,
62 classes, ``--clients`` writers whose sizes are log-normal, rows in random order; 1,000,000 rows of
256 values make a 1.0 GB file) unless it exists, then measures, each in a fresh process and
alternating, ``--repeats`` times:

* ``pyarrow``: ``pyarrow.parquet.read_table(path)`` (all columns, Arrow's threads);
* ``pfl (new)``: ``pfl.data.load_federated`` of ``data.source: files`` with a natural partition of
  every client, the partition cache empty: the table read, clients grouped, every client's
  stratified train/val/test split made, every tensor built, the partition written to the cache;
* ``pfl (cached)``: the same with the partition taken from the cache.

Memory is each process's peak resident set (``ru_maxrss``) and its resident set after the imports,
before loading; the difference is what loading itself held at its peak. The targets are pfl's load
≤ 2× the pyarrow read and its peak ≤ 2× the float32 feature array. The file is in the page cache
for every measurement (it was just written or read), so the times are decoding and copying, not
the disk. Prints the table (medians) and logs it to an MLflow run ``bench_data``. The generated
file is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CLASSES = 62

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {root!r})
kind, path, clients, cache = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
import os
os.environ["PFL_CACHE_DIR"] = cache
import numpy as np, pyarrow.parquet as pq, torch
from pfl.config import DataConfig
from pfl.data import load_federated
from pfl.schema import from_dict

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

base = rss_mib()
start = time.perf_counter()
if kind == "pyarrow":
    table = pq.read_table(path)
    rows = table.num_rows
else:
    cfg = from_dict(DataConfig, {{"source": "files", "num_clients": clients, "params": {{"path": path}}}}, "data")
    fed = load_federated(cfg, seed=0)
    rows = sum(c.n_train + c.n_val + c.n_test for c in fed.clients)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"seconds": seconds, "peak_mib": peak, "base_mib": base, "rows": rows}}))
"""


def generate(path: Path, rows: int, clients: int, features: int, seed: int = 0) -> None:
    """The table, written in row groups so that generating it never holds it twice."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    weights = rng.lognormal(0.0, 0.6, clients)
    floor = min(20, rows // clients)
    sizes = floor + rng.multinomial(rows - floor * clients, weights / weights.sum())
    client = rng.permutation(np.repeat(np.arange(clients, dtype=np.int32), sizes))
    label = rng.integers(0, CLASSES, rows)
    schema = pa.schema([("label", pa.int64()), ("client", pa.int32()), ("x", pa.list_(pa.float32()))])
    step = 65536
    tmp = path.with_suffix(".tmp")
    with pq.ParquetWriter(tmp, schema) as writer:
        for start in range(0, rows, step):
            n = min(step, rows - start)
            values = rng.standard_normal(n * features, dtype=np.float32)
            x = pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * features, features, dtype=np.int32)),
                                         pa.array(values))
            writer.write_table(pa.table({"label": label[start:start + n], "client": client[start:start + n],
                                         "x": x}, schema=schema), row_group_size=step)
    tmp.rename(path)


def measure(kind: str, path: Path, clients: int, cache: Path) -> dict:
    code = CHILD.format(root=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", code, kind, str(path), str(clients), str(cache)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, default=3400)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "pfl-bench-data"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the generated file")
    parser.add_argument("--no-track", action="store_true")
    args = parser.parse_args(argv)

    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"bench_{args.rows}x{args.features}_{args.clients}.parquet"
    if not path.exists():
        free = shutil.disk_usage(folder).free
        need = args.rows * (args.features * 4 + 16) * 1.2
        if free < need:
            print(f"not enough room in {folder}: {free / 2**30:.1f} GiB free, about {need / 2**30:.1f} GiB needed")
            return 2
        started = time.perf_counter()
        generate(path, args.rows, args.clients, args.features)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.0f} s")
    size = path.stat().st_size
    feature_mib = args.rows * args.features * 4 / 2**20
    results: dict[str, list[dict]] = {"pyarrow": [], "pfl (new)": [], "pfl (cached)": []}
    try:
        measure("pyarrow", path, args.clients, folder / "warmup-cache")  # into the page cache
        for r in range(args.repeats):
            cache = folder / f"cache{r}"
            shutil.rmtree(cache, ignore_errors=True)
            for kind in results:
                out = measure("pyarrow" if kind == "pyarrow" else "pfl", path, args.clients, cache)
                results[kind].append(out)
                print(f"{kind:<13} {out['seconds']:6.2f} s  peak {out['peak_mib']:6.0f} MiB "
                      f"(after imports {out['base_mib']:4.0f} MiB)", flush=True)
            if not list(cache.glob("*.parquet")):
                raise RuntimeError("the partition cache was not written")
    finally:
        for c in folder.glob("*cache*"):
            shutil.rmtree(c, ignore_errors=True)
        if not args.keep:
            path.unlink(missing_ok=True)
    rows = []
    reference = statistics.median(r["seconds"] for r in results["pyarrow"])
    for kind, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        peak = statistics.median(r["peak_mib"] for r in runs)
        base = statistics.median(r["base_mib"] for r in runs)
        rows.append({"load": kind, "seconds": seconds, "x_pyarrow": seconds / reference, "peak_mib": peak,
                     "load_peak_mib": peak - base, "x_features": (peak - base) / feature_mib,
                     "runs_s": " ".join(f"{r['seconds']:.2f}" for r in runs)})
    load = os.getloadavg()[0]
    print(f"\n== loading {args.rows:,} rows, {args.features} float32 features, {args.clients:,} clients "
          f"({size / 2**30:.2f} GiB Parquet; float32 features {feature_mib:.0f} MiB; median of {args.repeats}; "
          f"{os.cpu_count()} CPUs, load average {load:.1f}) ==")
    print(f"{'load':<13} {'s':>6} {'x pyarrow':>10} {'peak MiB':>9} {'load peak MiB':>14} {'x features':>11}  runs (s)")
    for r in rows:
        print(f"{r['load']:<13} {r['seconds']:6.2f} {r['x_pyarrow']:10.2f} {r['peak_mib']:9.0f} "
              f"{r['load_peak_mib']:14.0f} {r['x_features']:11.2f}  {r['runs_s']}")
    if not args.no_track:
        import pandas as pd

        from pfl.tracking import Tracker, run_hint

        tracker = Tracker.start(None, "bench_data", tags={"pfl.pipeline": "bench_data"})
        tracker.log_params({"rows": args.rows, "clients": args.clients, "features": args.features,
                            "file_bytes": size, "repeats": args.repeats, "cpus": os.cpu_count(),
                            "load_average": round(load, 1)})
        for r in rows:
            key = r["load"].replace(" ", "").replace("(", "_").replace(")", "")
            tracker.log_metrics({f"{key}/seconds": r["seconds"], f"{key}/x_pyarrow": r["x_pyarrow"],
                                 f"{key}/peak_mib": r["peak_mib"], f"{key}/load_peak_mib": r["load_peak_mib"]})
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "bench_data.csv"
            pd.DataFrame(rows).to_csv(out, index=False)
            tracker.log_artifact(out)
        tracker.end("FINISHED")
        print(run_hint(tracker.run_id, what="MLflow run"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
