"""Benchmark: populations beyond memory — 1,000 to 100,000 clients on one machine.

    python pipelines/bench_scale.py [--populations 1000 10000 100000] [--methods fedavg ditto]
                                    [--rounds 10] [--repeats 3] [--budget-gb 2] [--full-eval]
                                    [--long-rounds N] [--store-dir DIR] [--no-track]

Each row is one run in a fresh process: the ``crowd`` source (``pfl.data.crowd``: synthetic, no
download; 40 samples a client, 256 features, Dirichlet(0.5) label mixes, a feature shift per
client), an MLP with one hidden layer of 128 (34,186 parameters: Ditto's personal model is
137 kB), 100 clients a round, one local epoch, ``federation.client_store: auto`` with a budget of
``--budget-gb`` (plus a ``disk`` row at the smallest population, so both stores are timed on the same
clients). Measured in the child:

* **start-up s**: from the child's first line (before importing torch and pfl) until the simulator
  is built: imports, the population's labels and partition (the partition cache empty), the model
  (``sim_s`` in the CSV: the simulator's part, without the imports);
* **s/round**: mean wall time of training rounds 2..R (round 1 is a warm-up), no evaluation;
  **CPU s/round**: the process's CPU time over the same rounds (``time.process_time``: on a shared
  machine the wall time moves with the other jobs' load, the CPU time much less; waits on the disk
  are in the wall time only);
* **eval s**: one evaluation of ``federation.eval_clients`` = 1,000 clients (the same sample at
  every population);
* **ckpt s**: the first checkpoint after R rounds, then the next one after one more round, while training
  waits (a disk store links only the new segments); **ckpt MB**: the file and its segment folder;
* **store MB**: the disk store's segment files; **stored**: clients with a record;
* **peak RSS**: the process's peak resident set (``ru_maxrss``; the largest of the repeats, the
  first of which has the full evaluation), **base RSS** the resident set after the imports;
* with ``--full-eval``, **full eval s**: the final evaluation, every client;
* integrity: **CRC s/round** (records' CRC-32s made and checked, mean of rounds 1..R); of the checkpoint
  after one round, the records' CRC while training waits, then (on a thread) the time until it is
  sealed, synced and in place, with its CRC and fsync s (each timed in the child); **verify s**: a
  resume's check of it.

Each row runs ``--repeats`` times, all rows in turn before the next repeat, and the table shows
medians (``round_s_runs`` in the CSV: every run's s/round); the full evaluation is timed in the first
repeat only. **x 1k** is the median over the repeats of the row's s/round divided by the smallest
population's in the same repeat (the two ran minutes apart at most, so a change of the machine's
speed between repeats cancels), with the range over the repeats in brackets.

With ``--long-rounds N``, each method also runs N rounds at the largest population in one process,
and another table gives s/round in ten blocks of N/10 rounds with the clients stored and the store's
segments by then: whether a round gets slower as the store fills — what ten rounds cannot show. The
machine's load average before and after each run is in the table (times are noisy under load).

FPFC is not run: its server keeps θ and v, two dense (m, m, p) tensors: 2·m²·p·4 bytes with this
model, 2.7 GB at m = 100, 273 GB at m = 1,000; the table says so.

Prints the table, logs it (CSV, Markdown) and a plot (s/round, peak RSS, start-up and checkpoint
time against the population) to an MLflow run ``bench_scale``. The goals (issue 27): s/round at
100k within 1.3× of 1k; peak RSS at 100k ≤ 4 GiB with per-client personal models; start-up ≤ 30 s.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pfl import bench

FEATURES, HIDDEN, CLASSES = 256, 128, 10
PARAMS = FEATURES * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES
INTEGRITY = ("crc_round_s", "ckpt_crc_s", "ckpt_synced_after_s", "ckpt_seal_crc_s", "ckpt_fsync_s", "verify_s")


def bench_config(spec: dict, rounds: int, **extra):
    """The benchmark's run: ``spec``'s method and population on the crowd source, 100 clients a
    round, no scheduled evaluation; ``extra``: more config keys."""
    from pfl.resolver import load

    return load(None, {
        "data.source": "crowd", "data.num_clients": spec["clients"], "data.params.num_features": FEATURES,
        "data.cache": False, "method.name": spec["method"], "model.name": "mlp", "model.params.hidden": [HIDDEN],
        "federation.clients_per_round": 100, "federation.rounds": rounds,
        "federation.eval_every": 10**6, "federation.local_epochs": 1, "federation.lr": 0.05,
        "federation.client_store": spec["store"], "federation.client_memory_gb": spec["budget_gb"],
        "federation.client_store_dir": spec["store_dir"], "tracking.enabled": False, **extra})


def child_long(spec: dict) -> list[dict]:
    """One long run: s/round (wall and CPU) in ten blocks, and the store's size after each."""
    from pfl.federation.simulator import Simulator

    sim = Simulator(bench_config(spec, spec["rounds"] + 1))
    block = max(spec["rounds"] // 10, 1)
    out, wall, cpu = [], 0.0, 0.0
    for done in range(1, spec["rounds"] + 1):
        start, start_cpu = time.perf_counter(), time.process_time()
        sim.run_round(evaluate=False)
        wall += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
        if done % block == 0:
            disk = sim.store.kind == "disk"
            out.append({"rounds": done, "round_s": wall / block, "round_cpu_s": cpu / block,
                        "stored": int((sim.store.index["client"] >= 0).sum()) if disk else sim.num_clients,
                        "segments": sum(n is not None for n in sim.store.names) if disk else 0,
                        "store_mb": du(sim.store.root) if disk else 0.0})
            print(json.dumps({"progress": out[-1]}), file=sys.stderr, flush=True)
            wall = cpu = 0.0
    return out


def timed(owner, name: str, spent: dict) -> None:
    """``owner.name`` (a function) now adds the seconds of each call to ``spent[name]``."""
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = real(*args, **kwargs)
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return out
    setattr(owner, name, wrapper)


def child(spec: dict) -> dict | list[dict]:
    """One row (or, with ``long``, a long run's blocks), measured in this (fresh) process."""
    if spec.get("long"):
        return child_long(spec)
    t0 = time.perf_counter()
    base_load = os.getloadavg()[0]
    from pfl.federation import durable, records
    from pfl.federation.checkpoint import clients_dir, read_checkpoint, save_checkpoint, wait_checkpoint
    from pfl.federation.diskstore import check_checkpoint_records, is_disk_part
    from pfl.federation.simulator import Simulator

    spent: dict[str, float] = {}
    for owner, name in ((records, "checksum"), (durable, "file_crc"), (os, "fsync")):
        timed(owner, name, spent)

    base_rss = bench.rss_mib()
    cfg = bench_config(spec, spec["rounds"] + 10, **{"federation.eval_clients": 1000})
    t_cfg = time.perf_counter()
    sim = Simulator(cfg)
    startup = time.perf_counter() - t0
    rounds, cpu, crc_before = [], [], spent.get("checksum", 0.0)
    for _ in range(spec["rounds"]):
        start, start_cpu = time.perf_counter(), time.process_time()
        sim.run_round(evaluate=False)
        rounds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    crc_round = (spent.get("checksum", 0.0) - crc_before) / spec["rounds"]
    start = time.perf_counter()
    metrics = sim.evaluate()
    eval_s = time.perf_counter() - start
    ckpt, start = Path(spec["ckpt_dir"]) / "ckpt.pt", time.perf_counter()
    save_checkpoint(sim, ckpt, background=True)   # as a run's periodic checkpoints: synced on a thread
    ckpt_first = time.perf_counter() - start
    wait_checkpoint(ckpt)
    sim.run_round(evaluate=False)
    before, start = dict(spent), time.perf_counter()
    save_checkpoint(sim, ckpt, background=True)
    ckpt_next = time.perf_counter() - start
    wait_checkpoint(ckpt)
    synced_after = time.perf_counter() - start - ckpt_next
    cost = {k: spent.get(k, 0.0) - before.get(k, 0.0) for k in ("file_crc", "fsync", "checksum")}
    part, start = read_checkpoint(ckpt)["model"]["clients"], time.perf_counter()
    assert durable.check_seal(ckpt) is None
    if is_disk_part(part):
        check_checkpoint_records(part, clients_dir(ckpt))
    verify_s = time.perf_counter() - start
    out = {
        "startup_s": startup, "sim_s": startup - (t_cfg - t0),
        "round_s": statistics.mean(rounds[1:]) if len(rounds) > 1 else rounds[0],
        "round_cpu_s": statistics.mean(cpu[1:]) if len(cpu) > 1 else cpu[0],
        "rounds_s": [round(r, 3) for r in rounds], "eval_s": eval_s, "eval_acc": metrics.get("test/acc_mean"),
        "ckpt_first_s": ckpt_first, "ckpt_next_s": ckpt_next, "ckpt_mb": du(ckpt) + du(clients_dir(ckpt)),
        "store": sim.store.kind, "store_mb": du(sim.store.root) if sim.store.kind == "disk" else 0.0,
        "stored": int((sim.store.index["client"] >= 0).sum()) if sim.store.kind == "disk" else sim.num_clients,
        "built": getattr(sim.data.clients, "built", sim.num_clients), "base_rss_mib": base_rss,
        "load_before": base_load, "crc_round_s": crc_round, "ckpt_crc_s": cost["checksum"],
        "ckpt_seal_crc_s": cost["file_crc"], "ckpt_fsync_s": cost["fsync"], "ckpt_synced_after_s": synced_after, "verify_s": verify_s}
    if spec["full_eval"]:
        start = time.perf_counter()
        sim.evaluate(final=True)
        out["full_eval_s"] = time.perf_counter() - start
    out["peak_rss_mib"] = bench.peak_rss_mib()
    out["load_after"] = os.getloadavg()[0]
    return out


def du(path: Path) -> float:
    """MB of the files at ``path`` (each inode once)."""
    path = Path(path)
    files = [path] if path.is_file() else list(path.rglob("*")) if path.exists() else []
    sizes = {st.st_ino: st.st_size for st in (f.stat() for f in files if f.is_file())}   # each inode once
    return sum(sizes.values()) / 1e6


def measure(spec: dict):
    """``spec`` run in a fresh process (its own peak memory, its own imports)."""
    with tempfile.TemporaryDirectory(dir=spec["work"]) as tmp:
        spec = dict(spec, ckpt_dir=tmp, store_dir=spec["store_dir"] or tmp)
        return bench.run_child(__file__, spec, f"{spec['method']} at {spec['clients']} clients")


def ratio_cell(r: dict, key: str) -> str:
    """The median ratio to the smallest population over the repeats, and their range."""
    runs = r.get(f"{key}_ratios") or []
    if not runs:
        return "—"
    spread = f" ({min(runs):.2f}–{max(runs):.2f})" if len(runs) > 1 else ""
    return f"{statistics.median(runs):.2f}{spread}"


def fpfc_gb(m: int) -> float:
    return 2 * m * m * PARAMS * 4 / 1e9


def table(rows: list[dict]) -> str:
    head = ("| method | clients | store | start-up s | s/round | x 1k | eval s (1k) | full eval s "
            "| ckpt s (first, next) | ckpt MB | store MB | stored | peak RSS MiB | load |")
    head = head.replace("| x 1k |", "| x 1k | CPU s/round | CPU x 1k |")
    lines = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['method']} | {r['clients']:,} | — | not run: {r['skipped']} |" + " |" * 12)
            continue
        full = f"{r['full_eval_s']:.0f}" if "full_eval_s" in r else "—"
        lines.append(
            f"| {r['method']} | {r['clients']:,} | {r['store']} | {r['startup_s']:.1f} | {r['round_s']:.3f} | "
            f"{ratio_cell(r, 'round_s')} | {r['round_cpu_s']:.3f} | {ratio_cell(r, 'round_cpu_s')} | "
            f"{r['eval_s']:.1f} | {full} | {r['ckpt_first_s']:.2f}, "
            f"{r['ckpt_next_s']:.2f} | {r['ckpt_mb']:.0f} | {r['store_mb']:.0f} | {r['stored']:,} | "
            f"{r['peak_rss_mib']:.0f} | {r['load_before']:.1f}–{r['load_after']:.1f} |")
    return "\n".join(lines)


def integrity_table(rows: list[dict]) -> str:
    """What checksums and synced writes cost, beside the round and the checkpoint they are part of."""
    lines = ["| method | clients | store | CRC s/round | % of s/round | ckpt s | CRC s in it | % of ckpt | then in "
             "place s | CRC s | fsync s | verify s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("skipped"):
            continue
        lines.append(f"| {r['method']} | {r['clients']:,} | {r['store']} | {r['crc_round_s']:.4f} | "
                     f"{100 * r['crc_round_s'] / r['round_s']:.1f} | {r['ckpt_next_s']:.3f} | {r['ckpt_crc_s']:.3f} | "
                     f"{100 * r['ckpt_crc_s'] / r['ckpt_next_s']:.0f} | {r['ckpt_synced_after_s']:.3f} | "
                     f"{r['ckpt_seal_crc_s']:.3f} | {r['ckpt_fsync_s']:.3f} | {r['verify_s']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(20, 3.6))
    keys = [("round_s", "s/round (wall)"), ("round_cpu_s", "CPU s/round"), ("peak_rss_mib", "peak RSS (MiB)"), ("startup_s", "start-up (s)"),
            ("ckpt_next_s", "checkpoint after one round (s)")]
    series = sorted({(r["method"], r["store_choice"]) for r in rows if not r.get("skipped")})
    for ax, (key, label) in zip(axes, keys):
        for method, store in series:
            pts = sorted((r["clients"], r[key]) for r in rows
                         if not r.get("skipped") and r["method"] == method and r["store_choice"] == store)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{method} ({store})")
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("clients")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def long_table(long_runs: dict[str, list[dict]], refs: dict[str, float]) -> str:
    """The long runs' blocks; x 1k: against the smallest population's s/round of the first table."""
    lines = ["| method | rounds done | s/round | x 1k | CPU s/round | clients stored | segments | store MB |",
             "|---|---|---|---|---|---|---|---|"]
    for method, blocks in long_runs.items():
        for b in blocks:
            ratio = f"{b['round_s'] / refs[method]:.2f}" if refs.get(method) else "—"
            lines.append(f"| {method} | {b['rounds']:,} | {b['round_s']:.3f} | {ratio} | {b['round_cpu_s']:.3f} | "
                         f"{b['stored']:,} | {b['segments']} | {b['store_mb']:,.0f} |")
    return "\n".join(lines)


def plot_long(long_runs: dict[str, list[dict]], clients: int, refs: dict[str, float], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    for color, (method, blocks) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], long_runs.items()):
        x = [b["rounds"] for b in blocks]
        ax.plot(x, [b["round_s"] for b in blocks], marker="o", color=color, label=f"{method}: wall")
        ax.plot(x, [b["round_cpu_s"] for b in blocks], marker=".", linestyle="--", color=color,
                label=f"{method}: CPU (with the writer thread)")
        if refs.get(method):
            ax.axhline(1.3 * refs[method], color=color, linestyle=":", linewidth=1,
                       label=f"{method}: 1.3 × s/round at the smallest population")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("rounds done")
    ax.set_ylabel("s/round (mean over the block)")
    ax.set_title(f"s/round as the store fills ({clients:,} clients, 100 a round)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = bench.parser(__doc__)
    parser.add_argument("--populations", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--methods", nargs="+", default=["fedavg", "ditto"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="runs per row, in turn (the table shows medians)")
    parser.add_argument("--budget-gb", type=float, default=2.0, help="federation.client_memory_gb")
    parser.add_argument("--full-eval", action="store_true", help="also time an evaluation of every client")
    parser.add_argument("--long-rounds", type=int, default=0,
                        help="also run each method this many rounds at the largest population (s/round as the store fills)")
    parser.add_argument("--store-dir", default=None, help="federation.client_store_dir (default: a temporary folder)")
    args = parser.parse_args(argv)
    for name, least in (("rounds", 1), ("repeats", 1), ("long_rounds", 0)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(args, name)}")

    work = Path(tempfile.mkdtemp(prefix="pfl-bench-scale-"))
    smallest = min(args.populations)
    plan = [(method, m, "auto") for method in args.methods for m in sorted(args.populations)]
    plan += [(method, smallest, "disk") for method in args.methods if "ditto" == method]
    runs: dict[tuple, list[dict]] = {row: [] for row in plan}
    try:
        for rep in range(args.repeats):  # the rows in turn, so a change of the machine's load hits them alike
            for method, m, store in plan:
                spec = {"method": method, "clients": m, "store": store, "rounds": args.rounds,
                        "budget_gb": args.budget_gb, "store_dir": args.store_dir, "work": str(work),
                        "full_eval": args.full_eval and rep == 0}
                runs[(method, m, store)].append(r := measure(spec))
                print(f"{method:<7} {m:>7,} {store:<5} -> {r['store']:<6} start-up {r['startup_s']:5.1f} s  "
                      f"{r['round_s']:.2f} s/round ({r['round_cpu_s']:.2f} CPU)  eval {r['eval_s']:.1f} s  ckpt {r['ckpt_first_s']:.2f}/"
                      f"{r['ckpt_next_s']:.2f} s  peak {r['peak_rss_mib']:.0f} MiB  load {r['load_before']:.1f}",
                      flush=True)
        long_runs = {}
        for method in args.methods if args.long_rounds else ():
            spec = {"method": method, "clients": max(args.populations), "store": "auto", "rounds": args.long_rounds,
                    "budget_gb": args.budget_gb, "store_dir": args.store_dir, "work": str(work), "long": True}
            long_runs[method] = measure(spec)
            last = long_runs[method][-1]
            print(f"{method:<7} {spec['clients']:>7,} long run: {args.long_rounds} rounds, the last "
                  f"{args.long_rounds // 10} at {last['round_s']:.3f} s/round ({last['round_cpu_s']:.3f} CPU), "
                  f"{last['stored']:,} clients stored", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows: list[dict] = []
    for (method, m, store), done in runs.items():
        row = dict(done[0])
        for key in ("startup_s", "round_s", "round_cpu_s", "eval_s", "ckpt_first_s", "ckpt_next_s", *INTEGRITY):
            row[key] = statistics.median(r[key] for r in done)
        row["peak_rss_mib"] = max(r["peak_rss_mib"] for r in done)  # the worst (the full evaluation's run)
        row["round_s_runs"] = " ".join(f"{r['round_s']:.5f}" for r in done)
        row["load_before"] = min(r["load_before"] for r in done)
        row["load_after"] = max(r["load_after"] for r in done)
        row.update(method=method, clients=m, store_choice=store)
        rows.append(row)
    for r in rows:
        ref = (r["method"], smallest, "auto")
        for key in ("round_s", "round_cpu_s"):  # repeat by repeat: the runs of one repeat ran close in time
            if ref in runs:
                r[f"{key}_ratios"] = [a[key] / b[key] for a, b in zip(runs[(r["method"], r["clients"], r["store_choice"])],
                                                                      runs[ref])]
        r["x_1k"] = statistics.median(r.get("round_s_ratios") or [float("nan")])
        r["cpu_x_1k"] = statistics.median(r.get("round_cpu_s_ratios") or [float("nan")])
    rows += [{"method": "fpfc", "clients": m, "skipped": f"θ and v need {fpfc_gb(m):,.0f} GB (2·m²·p floats, "
              f"p = {PARAMS:,})"} for m in sorted(args.populations)]
    text = table(rows) + "\n\nWhat integrity costs (medians over the repeats):\n\n" + integrity_table(rows)
    title = (f"== bench_scale: crowd source, MLP 256-128-10 ({PARAMS:,} parameters), 100 clients a round, "
             f"{args.rounds} rounds, client_memory_gb {args.budget_gb:g}, {os.cpu_count()} CPUs ==")
    refs = {r["method"]: r["round_s"] for r in rows
            if not r.get("skipped") and r["clients"] == smallest and r["store_choice"] == "auto"}
    report = title + "\n" + text
    if long_runs:
        report += (f"\n\n== s/round as the store fills: {max(args.populations):,} clients, {args.long_rounds} "
                   "rounds ==\n" + long_table(long_runs, refs))
    print("\n" + report)
    metrics = [({f"{r['method']}_{r['store_choice']}/{k}": float(r[k]) for k in
                 ("startup_s", "round_s", "round_cpu_s", "x_1k", "cpu_x_1k", "eval_s", "ckpt_first_s",
                  "ckpt_next_s", "ckpt_mb", "store_mb", "peak_rss_mib", "load_before", *INTEGRITY)}, r["clients"])
               for r in rows if not r.get("skipped")]
    metrics += [({f"{method}_long/{k}": float(b[k]) for k in ("round_s", "round_cpu_s", "stored")}, b["rounds"])
                for method, blocks in long_runs.items() for b in blocks]

    def plots(out: Path) -> list[Path]:
        drawn = [plot(rows, out / "bench_scale.png")]
        if long_runs:
            drawn.append(plot_long(long_runs, max(args.populations), refs, out / "bench_scale_long.png"))
        return drawn

    bench.track(args, "bench_scale", rows, report, params={"params": PARAMS}, metrics=metrics, plots=plots)
    return 0


if __name__ == "__main__":
    sys.exit(bench.main(main, child=child))
