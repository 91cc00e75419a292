"""Benchmark: what loading a user's data costs — LEAF JSON, CSV and Parquet, the first time and cached.

    python pipelines/bench_data.py [--writers 1000] [--repeats 1] [--compare-root DIR] [--dir /tmp/pfl-bench-data]
                                   [--keep] [--no-track]
    python pipelines/bench_data.py --pyarrow [--rows 1000000] [--clients 3400] [--features 256] [--repeats 3] ...

**Formats** (the default). Writes one FEMNIST-like data set three ways: ``--writers`` writers
(3,400 is FEMNIST's and the issue's scale) with 5 + log-normal samples each (20 on average), every
sample a 28×28 image as LEAF stores it (784 floats in [0, 1] at full precision: Fashion-MNIST's
pixels / 255 from Debian's files when found, else random pixels; labels 0..9), LEAF's own split
(a writer's last tenth is its test/ side):

* ``leaf``: LEAF's ``train/`` and ``test/`` folders, 100 writers per file;
* ``csv``: one file, columns ``label``, ``client`` and ``p0``..``p783``, the same rows;
* ``parquet``: one file, ``label``, ``client`` and one list column ``x`` of 784 float32.

Each is then loaded with ``pfl.data.load_federated`` (a natural partition of every writer, every
client's tensors built) in a fresh process, ``--repeats`` times:

* **first**: pfl's cache folder empty: LEAF and CSV parsed and converted into the cache
  (``pfl.data.converted``), the partition made and cached;
* **cached**: again, in another fresh process: the converted file and the partition from the cache.

Measured in the child: wall time of the load (imports excluded), the process's peak resident set
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) and its resident set after the imports (their
difference is what loading held at its peak), and the load time pfl itself reports
(``time/data_load_s``) with how it read the data. Sizes: the source (file or folder) and the
converted file in the cache; **x source** and **x features** are the load's peak above the imports
against the source's size and against the float32 features (samples × 784 × 4 bytes).
``--compare-root DIR`` also loads the LEAF folder and the CSV file twice each with the pfl package
found in DIR (e.g. an older commit: ``git archive <commit> pfl | tar -x -C DIR``), to compare with a
pfl that parsed them on every load. The files are in the page cache for every
measurement (just written or read): the times are parsing, decoding and copying, not the disk.

**--pyarrow**: the earlier measurement of a large Parquet file (``--rows`` samples of
``--features`` float32 in one list column, 62 classes, ``--clients`` writers with log-normal
sizes, rows in random order; 1,000,000 rows of 256 make 1.0 GB): ``pyarrow.parquet.read_table``
against pfl's first and cached load, each in a fresh process, alternating.

Prints a Markdown table (medians over the repeats) and logs it to an MLflow run ``bench_data``
unless ``--no-track``. The generated files are deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from pfl import bench

ROOT = bench.ROOT

CLASSES = 62
PIXELS = 784
WRITERS_PER_FILE = 100
MIB = 2**20

# a code string, not this script: with --compare-root it must import another pfl (one without pfl.bench)
CHILD = r"""
import json, os, resource, sys, time
root, kind, path, cache, clients = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
sys.path.insert(0, root)
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
reported, how = None, ""
if kind == "pyarrow":
    rows = pq.read_table(path).num_rows
else:
    data = {"source": "files", "params": {"path": path}}
    if clients:
        data["num_clients"] = clients
    fed = load_federated(from_dict(DataConfig, data, "data"), seed=0)
    rows = sum(c.n_train + c.n_val + c.n_test for c in fed.clients)
    reported, how = getattr(fed, "load_s", None), getattr(fed, "load_note", "")
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"seconds": seconds, "peak_mib": peak, "base_mib": base, "rows": rows, "reported_s": reported,
                  "how": how}))
"""


def measure(kind: str, path: Path, cache: Path, clients: int = 0, root: Path = ROOT) -> dict:
    """One load in a fresh process (``kind``: pfl or pyarrow), with ``cache`` as pfl's cache folder."""
    return bench.run_json([sys.executable, "-c", CHILD, str(root), kind, str(path), str(cache), str(clients)],
                          f"{kind} load of {path}")


def size_of(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ---- the formats benchmark --------------------------------------------------------------------

def pixels(seed: int = 0):
    """(images (N, 784) uint8, labels): Fashion-MNIST's when its files are here, else random."""
    import numpy as np

    try:
        from pfl.data.images import load_idx_pair

        x, y = load_idx_pair("fmnist", None, False)
        return x.reshape(len(x), -1), y, "Fashion-MNIST pixels"
    except Exception:  # noqa: BLE001 - no files: random pixels make the same amount of text
        rng = np.random.default_rng(seed)
        return rng.integers(0, 256, (20000, PIXELS), dtype=np.uint8), rng.integers(0, 10, 20000), "random pixels"


def write_child(spec: dict) -> list:
    """:func:`write_formats` in the child: [paths, samples, pixel source] as JSON values."""
    paths, samples, what = write_formats(Path(spec["folder"]), spec["writers"])
    return [{k: str(v) for k, v in paths.items()}, samples, what]


def write_formats(folder: Path, writers: int, seed: int = 0) -> tuple[dict[str, Path], int, str]:
    """The data set as a LEAF folder, a CSV file and a Parquet file; (paths, samples, pixel source)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    images, labels, what = pixels(seed)
    rng = np.random.default_rng(seed)
    sizes = 5 + np.minimum(rng.lognormal(np.log(12.0), 0.7, writers).astype(int), 400)
    paths = {"leaf": folder / "leaf", "csv": folder / "data.csv", "parquet": folder / "data.parquet"}
    for split in ("train", "test"):
        (paths["leaf"] / split).mkdir(parents=True, exist_ok=True)
    names = [f"p{j}" for j in range(PIXELS)]
    csv_schema = pa.schema([("label", pa.int64()), ("client", pa.string())] + [(n, pa.float64()) for n in names])
    pq_schema = pa.schema([("label", pa.int64()), ("client", pa.string()), ("x", pa.list_(pa.float32()))])
    total = 0
    with pcsv.CSVWriter(paths["csv"], csv_schema) as csv_out, pq.ParquetWriter(paths["parquet"], pq_schema) as pq_out:
        for first in range(0, writers, WRITERS_PER_FILE):
            blobs = {s: {"users": [], "num_samples": [], "user_data": {}} for s in ("train", "test")}
            rows_x, rows_y, rows_c = [], [], []
            for w in range(first, min(first + WRITERS_PER_FILE, writers)):
                user, n = f"f{w:04d}_{w % 100:02d}", int(sizes[w])
                take = rng.integers(0, len(images), n)
                x, y = images[take] / 255.0, labels[take]
                cut = n - max(1, n // 10)
                for split, part in (("train", slice(0, cut)), ("test", slice(cut, n))):
                    blobs[split]["users"].append(user)
                    blobs[split]["num_samples"].append(len(y[part]))
                    blobs[split]["user_data"][user] = {"x": x[part].tolist(), "y": y[part].tolist()}
                rows_x.append(x)
                rows_y.append(y)
                rows_c += [user] * n
            for split, blob in blobs.items():
                (paths["leaf"] / split / f"all_data_{first // WRITERS_PER_FILE}_niid_{split}.json").write_text(
                    json.dumps(blob))
            x, y = np.concatenate(rows_x), np.concatenate(rows_y).astype(np.int64)
            total += len(y)
            csv_out.write_table(pa.table([pa.array(y), pa.array(rows_c)] + [pa.array(x[:, j]) for j in range(PIXELS)],
                                         schema=csv_schema))
            flat = pa.array(x.astype(np.float32).reshape(-1))
            offsets = pa.array(np.arange(0, (len(y) + 1) * PIXELS, PIXELS, dtype=np.int32))
            lists = pa.ListArray.from_arrays(offsets, flat)
            pq_out.write_table(pa.table({"label": y, "client": rows_c, "x": lists}, schema=pq_schema))
    return paths, total, what


def formats(args) -> int:
    folder = Path(args.dir) / f"formats_{args.writers}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    started = time.perf_counter()
    # in a child, so that this process stays small: Linux starts a child's ru_maxrss at its parent's peak
    written, samples, what = bench.run_child(__file__, {"folder": str(folder), "writers": args.writers},
                                             "writing the data")
    paths = {k: Path(v) for k, v in written.items()}
    sizes = {k: size_of(p) for k, p in paths.items()}
    print(f"wrote {args.writers:,} writers, {samples:,} samples ({what}) in {time.perf_counter() - started:.0f} s: "
          + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in sizes.items()), flush=True)
    rows: list[dict] = []
    runs: dict[tuple[str, str], list[dict]] = {}
    cached_bytes: dict[str, int] = {}
    plan = [(k, paths[k], ROOT) for k in ("leaf", "csv", "parquet")]
    if args.compare_root:
        plan += [(f"{k} (--compare-root)", paths[k], Path(args.compare_root).resolve()) for k in ("leaf", "csv")]
    try:
        for r in range(args.repeats):
            for name, path, root in plan:
                cache = folder / f"cache-{name.split()[0]}-{root == ROOT}-{r}"
                shutil.rmtree(cache, ignore_errors=True)
                for load in ("first", "cached" if root == ROOT else "again"):
                    out = measure("pfl", path, cache, root=root)
                    runs.setdefault((name, load), []).append(out)
                    print(f"{name:<22} {load:<7} {out['seconds']:7.2f} s  peak {out['peak_mib']:6.0f} MiB "
                          f"(after imports {out['base_mib']:4.0f} MiB)  {out['how']}", flush=True)
                tables = list(cache.glob("table-*.parquet"))
                if tables:
                    cached_bytes[name] = tables[0].stat().st_size
                elif root == ROOT and name != "parquet":
                    raise RuntimeError(f"{name}: nothing was converted into {cache}")
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    for (name, load), outs in runs.items():
        med = {k: statistics.median(o[k] for o in outs) for k in ("seconds", "peak_mib", "base_mib")}
        source = sizes[name.split()[0]]
        reported = [o["reported_s"] for o in outs if o["reported_s"] is not None]
        rows.append({"data": name, "load": load, "source_mib": source / MIB,
                     "cache_mib": cached_bytes.get(name, 0) / MIB if load != "again" else 0.0,
                     "seconds": med["seconds"], "peak_mib": med["peak_mib"],
                     "load_peak_mib": med["peak_mib"] - med["base_mib"],
                     "x_source": (med["peak_mib"] - med["base_mib"]) / (source / MIB),
                     "x_features": (med["peak_mib"] - med["base_mib"]) / (samples * PIXELS * 4 / MIB),
                     "reported_s": statistics.median(reported) if reported else float("nan"),
                     "how": outs[0]["how"], "runs_s": " ".join(f"{o['seconds']:.2f}" for o in outs)})
    title = (f"loading {args.writers:,} writers, {samples:,} samples of 28x28 ({what}); median of {args.repeats}; "
             f"{bench.machine()}")
    header = ["data", "load", "source MiB", "cache file MiB", "s", "peak RSS MiB", "load peak MiB",
              "x source", "x features", "pfl's time/data_load_s", "how"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r['data']} | {r['load']} | {r['source_mib']:.0f} | "
                     f"{r['cache_mib']:.0f} | {r['seconds']:.2f} | {r['peak_mib']:.0f} | "
                     f"{r['load_peak_mib']:.0f} | {r['x_source']:.2f} | {r['x_features']:.2f} | "
                     f"{r['reported_s']:.2f} | {r['how'] or '-'} |")
    print(f"\n== {title} ==")
    print("\n".join(lines))
    track(args, "formats", {"writers": args.writers, "samples": samples, "pixels": what,
                            **{f"{k}_bytes": v for k, v in sizes.items()}}, rows, title, lines)
    return 0


# ---- the large-Parquet benchmark (--pyarrow) --------------------------------------------------

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


def large_parquet(args) -> int:
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
    feature_mib = args.rows * args.features * 4 / MIB
    results: dict[str, list[dict]] = {"pyarrow": [], "pfl (new)": [], "pfl (cached)": []}
    try:
        measure("pyarrow", path, folder / "warmup-cache", args.clients)  # into the page cache
        for r in range(args.repeats):
            cache = folder / f"cache{r}"
            shutil.rmtree(cache, ignore_errors=True)
            for kind in results:
                out = measure("pyarrow" if kind == "pyarrow" else "pfl", path, cache, args.clients)
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
    title = (f"loading {args.rows:,} rows, {args.features} float32 features, {args.clients:,} clients "
             f"({size / 2**30:.2f} GiB Parquet; float32 features {feature_mib:.0f} MiB; median of {args.repeats}; "
             f"{bench.machine()})")
    lines = [f"{'load':<13} {'s':>6} {'x pyarrow':>10} {'peak MiB':>9} {'load peak MiB':>14} {'x features':>11}"
             "  runs (s)"]
    for r in rows:
        lines.append(f"{r['load']:<13} {r['seconds']:6.2f} {r['x_pyarrow']:10.2f} {r['peak_mib']:9.0f} "
                     f"{r['load_peak_mib']:14.0f} {r['x_features']:11.2f}  {r['runs_s']}")
    print(f"\n== {title} ==")
    print("\n".join(lines))
    track(args, "pyarrow", {"rows": args.rows, "clients": args.clients, "features": args.features,
                            "file_bytes": size}, rows, title, lines)
    return 0


def track(args, mode: str, params: dict, rows: list[dict], title: str, lines: list[str]) -> None:
    """The table as an MLflow run ``bench_data`` (params, one metric per row and column, CSV and text)."""
    metrics = {}
    for r in rows:
        key = "_".join(str(r.get(k, "")) for k in ("data", "load") if r.get(k)) or r["load"]
        key = "".join(c if c.isalnum() or c in "_-" else "_" for c in key)
        metrics.update({f"{key}/{m}": float(r[m]) for m in ("seconds", "peak_mib", "load_peak_mib") if m in r})
    mine = {"formats": ("writers", "compare_root"), "pyarrow": ("rows", "clients", "features")}[mode]
    flags = SimpleNamespace(**{k: v for k, v in vars(args).items() if k in (*mine, "dir", "repeats", "keep", "no_track")})
    bench.track(flags, "bench_data", rows, f"{title}\n\n" + "\n".join(lines), params={"mode": mode, **params},
                metrics=metrics)


def main(argv: list[str] | None = None) -> int:
    parser = bench.parser(__doc__)
    parser.add_argument("--writers", type=int, default=1000, help="formats: writers (3400: FEMNIST's scale)")
    parser.add_argument("--compare-root", help="formats: also load LEAF and CSV with the pfl package in this folder")
    parser.add_argument("--pyarrow", action="store_true", help="the large-Parquet benchmark against pyarrow instead")
    parser.add_argument("--rows", type=int, default=1_000_000, help="--pyarrow: rows")
    parser.add_argument("--clients", type=int, default=3400, help="--pyarrow: clients")
    parser.add_argument("--features", type=int, default=256, help="--pyarrow: float32 features per row")
    parser.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "pfl-bench-data"))
    parser.add_argument("--repeats", type=int, default=None, help="default: 1 (formats), 3 (--pyarrow)")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.pyarrow else 1)
    return large_parquet(args) if args.pyarrow else formats(args)


if __name__ == "__main__":
    sys.exit(bench.main(main, child=write_child))
