"""Benchmark: Ray Tune overhead — the same trials through the sweep pipeline vs a plain loop.

    python pipelines/bench_tune.py [--space search_spaces/fpfc.yaml] [--trials 2] [--rounds 600] [--no-track]

Both sides run the same configurations (a grid over the space's first searched key) with
MLflow tracking on, one trial at a time on one CPU (``max_concurrent: 1``), so
the difference is Ray's and Tune's own cost: process start, scheduling, result plumbing and
checkpoints. Prints a table and logs it to MLflow (experiment ``pfl-bench``, run ``bench_tune``;
``--no-track`` leaves that run out, the measured trials log theirs all the same).

The default is FPFC on S1 (trials of about two minutes). Most of the overhead is a fixed start-up
cost (Ray itself, then a worker process importing torch, Ray and MLflow for every trial: about
25 s for four 2-second digits trials), so the ratio depends on the trial length: measure with the
trial lengths you intend to run.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

from pfl import bench


def main(argv: list[str] | None = None) -> int:
    parser = bench.parser(__doc__)
    parser.add_argument("--space", default=str(Path(__file__).resolve().parents[1] / "search_spaces" / "fpfc.yaml"))
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--storage", default="ray_results")
    args = parser.parse_args(argv)

    import numpy as np
    import pandas as pd

    from pfl.config import apply_overrides
    from pfl.resolver import resolve
    from pfl.runner import run_experiment
    from pfl.tune.space import base_config, load_space
    from pfl.tune.sweep import run_sweep

    space = load_space(args.space)
    key, dist = next(iter(space.distributions.items()))
    if dist.type in ("choice", "grid"):
        values = list(dist.values)[: args.trials]
    elif dist.type == "loguniform":
        values = [float(v) for v in np.geomspace(dist.low, dist.high, args.trials)]
    else:
        values = [float(v) for v in np.linspace(dist.low, dist.high, args.trials)]
    grid_space = copy.deepcopy(space)
    grid_space.search = {key: {"type": "grid", "values": values}}
    grid_space.validate("")
    grid_space.searcher, grid_space.num_samples, grid_space.max_concurrent = "grid", 1, 1
    grid_space.scheduler = None
    grid_space.resources.cpu = 1
    overrides = [f"federation.rounds={args.rounds}", "tracking.experiment=pfl-bench"]

    # plain loop first (it also warms the partition cache for both sides)
    raw = base_config(grid_space, overrides)
    t0 = time.perf_counter()
    for value in values:
        cfg = resolve(apply_overrides(raw, {key: value, "federation.threads": 1}))
        run_experiment(cfg, progress=None)
    plain = time.perf_counter() - t0

    result = run_sweep(grid_space, overrides=overrides + ["federation.threads=1"], name="bench-tune",
                       storage=args.storage, progress=None)
    tuned = result.wall_s
    table = pd.DataFrame([{"trials": len(values), "rounds": args.rounds, "plain_loop_s": round(plain, 1),
                           "ray_tune_s": round(tuned, 1), "overhead": round(tuned / plain - 1, 3)}])
    print(table.to_string(index=False))
    bench.track(args, "bench_tune", table.to_dict("records"), experiment="pfl-bench",
                params={"trials": len(values), "key": key},
                metrics={"bench/plain_s": plain, "bench/tune_s": tuned, "bench/overhead": tuned / plain - 1})
    return 0


if __name__ == "__main__":
    sys.exit(bench.main(main))
