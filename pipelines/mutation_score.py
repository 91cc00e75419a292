"""The truth tests' mutation score over the whole scope of ``[tool.mutmut]`` (docs/verification.md,
"Mutation score"; issue 42): run every mutant, or time a sample to say how long that takes, and score.

mutmut 3 selects the tests per mutant itself: its stats run records which selected tests call each
mutated function (``mutants/mutmut-stats.json``), and a mutant runs only those, stopping at the first
failure (``pytest -x``), in a grandchild of a fork server that has only collected the tests
(``process_isolation = "forkserver"``). This script drives it in resumable batches and reads the
results (``mutants/**/*.meta``):

    python3 pipelines/mutation_score.py generate                 # mutants + stats (~2 min)
    python3 pipelines/mutation_score.py estimate --n 40 --seed 1 # time 40 random mutants, extrapolate
    python3 pipelines/mutation_score.py run --children 1         # every mutant not run yet (resumable)
    python3 pipelines/mutation_score.py score                    # killed / (all − equivalent), survivors

``run --names FILE`` runs the mutants named in FILE (one a line) instead, ``run --rerun`` runs even
those with a result (after a test was added). ``score --sample N --seed S`` scores a seeded uniform
sample of N (the ``estimate`` or ``sample`` action's names) instead of the whole set.

The equivalent mutants — those no test can kill because they compute the same thing — are listed in
``pipelines/mutation_equivalents.txt`` (``NAME  # reason``), each argued in a row of
docs/verification.md; ``score`` leaves them out of the denominator and names any that no longer exist.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENTS = ROOT / "pipelines" / "mutation_equivalents.txt"
BATCH = 150  # mutants per `mutmut run` call: results are saved per mutant, a stopped run loses little

# mutmut 3's exit codes (mutmut/stats.py); a timeout counts as not killed here (conservative)
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          35: "suspicious", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout",
          37: "caught by type check", -11: "segfault", -9: "segfault", None: "not run"}
DETECTED = ("killed", "caught by type check")


def results(root: Path = ROOT) -> dict[str, int | None]:
    """Every mutant name → its exit code (None: not run yet)."""
    out: dict[str, int | None] = {}
    for meta in sorted((root / "mutants").rglob("*.meta")):
        out.update(json.loads(meta.read_text())["exit_code_by_key"])
    return out


def covering_tests(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, float]]:
    """mutmut's stats: the tests that call each mutated function, and each test's duration (s)."""
    path = root / "mutants" / "mutmut-stats.json"
    if not path.exists():
        return {}, {}
    stats = json.loads(path.read_text())
    return ({k: set(v) for k, v in stats["tests_by_mangled_function_name"].items()},
            {k: float(v) for k, v in stats["duration_by_test"].items()})


def function_of(name: str) -> str:
    """The mangled function a mutant belongs to (the key of mutmut's stats)."""
    return re.sub(r"__mutmut_\d+$", "", name)


def file_of(name: str) -> str:
    return re.split(r"\.x(?:ǁ|_)", name, maxsplit=1)[0]


def read_equivalents(path: Path = EQUIVALENTS) -> dict[str, str]:
    """NAME → reason from the equivalents file (``NAME  # reason``; blank and ``#`` lines skipped)."""
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, reason = line.partition("#")
        out[name.strip()] = reason.strip()
    return out


def sample(names, n: int, seed: int) -> list[str]:
    names = sorted(names)
    return sorted(random.Random(seed).sample(names, min(n, len(names))))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def score(codes: dict[str, int | None], chosen: list[str], equivalents: dict[str, str]) -> str:
    """The report: counts, killed / (all − equivalent), per file, every survivor and stale equivalent."""
    status = {m: STATUS.get(codes[m], "other") for m in chosen}
    equivalent = [m for m in chosen if m in equivalents]
    judged = [m for m in chosen if m not in equivalents and status[m] != "not run"]
    killed = sum(status[m] in DETECTED for m in judged)
    count = Counter(status.values())
    whole = len(chosen) == len(codes)
    lines = [("full set" if whole else "sample") + f": {len(chosen)} of {len(codes)} mutants; "
             + ", ".join(f"{k} {v}" for k, v in sorted(count.items())),
             f"equivalent (pipelines/mutation_equivalents.txt): {len(equivalent)}"]
    if judged:
        lo, hi = wilson(killed, len(judged))
        interval = "" if whole and not count["not run"] else f" (95 % Wilson interval {100 * lo:.1f}–{100 * hi:.1f} %)"
        lines.append(f"score: killed / (run − equivalent) = {killed} / {len(judged)} = "
                     f"{100 * killed / len(judged):.1f} %{interval}")
    else:
        lines.append("score: – (nothing run yet)")
    if count["not run"]:
        lines.append(f"not run yet: {count['not run']} (`run` continues)")
    lines += ["", "per file (killed / judged):"]
    for f in sorted({file_of(m) for m in judged}):
        mine = [m for m in judged if file_of(m) == f]
        lines.append(f"  {f:<40} {sum(status[m] in DETECTED for m in mine):>5} / {len(mine)}")
    rest = sorted(m for m in judged if status[m] not in DETECTED)
    if rest:
        lines += ["", "not killed (mutmut show NAME):"] + [f"  {status[m]:<9} {m}" for m in rest]
    stale = sorted(set(equivalents) - set(codes))
    if stale:
        lines += ["", "equivalents that are no mutant now (renumbered? re-check them):"] + [f"  {m}" for m in stale]
    return "\n".join(lines)


def mutmut_run(names: list[str], children: int, log=sys.stdout) -> float:
    """``mutmut run`` over ``names`` in batches; returns the wall time in seconds."""
    start = time.perf_counter()
    for i in range(0, len(names), BATCH):
        batch = names[i:i + BATCH]
        proc = subprocess.run(["mutmut", "run", "--max-children", str(children), *batch], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail = [ln for ln in proc.stdout.replace("\r", "\n").splitlines() if "mutations/second" in ln]
        print(f"  batch {i // BATCH + 1}: {len(batch)} mutants, exit {proc.returncode}, "
              f"{tail[-1].strip() if tail else ''} ({time.perf_counter() - start:.0f} s so far)", file=log, flush=True)
        if proc.returncode not in (0,):
            print(proc.stdout[-3000:], file=log)
            raise SystemExit(f"mutmut run failed (exit {proc.returncode})")
    return time.perf_counter() - start


def estimate(codes: dict[str, int | None], names: list[str], seconds: float, children: int) -> str:
    """Extrapolate a timed sample to the whole set, two ways: the mean time per mutant × all, and
    scaled by the covering tests' recorded durations (a mutant costs about the tests it runs)."""
    tests, duration = covering_tests()
    cost = {m: sum(duration.get(t, 0.0) for t in tests.get(function_of(m), ())) for m in codes}
    n_all = len(codes)
    per = seconds / len(names)
    lines = [f"timed: {len(names)} mutants in {seconds:.0f} s with --max-children {children} "
             f"({per:.2f} s per mutant, including mutmut's start-up per batch)",
             f"estimate (mean × all): {n_all} × {per:.2f} s = {n_all * per / 3600:.1f} h"]
    sampled = sum(cost[m] for m in names)
    if sampled > 0:
        ratio = seconds / sampled
        lines.append(f"estimate (covering-test seconds × {ratio:.2f}, the sample's measured/recorded ratio): "
                     f"{ratio * sum(cost.values()) / 3600:.1f} h (recorded covering-test time of all "
                     f"mutants {sum(cost.values()) / 3600:.1f} h if every one survived)")
    no_tests = sum(1 for m in codes if not tests.get(function_of(m)))
    lines.append(f"mutants without a covering test (no run needed): {no_tests}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("generate", "run", "estimate", "sample", "score"))
    parser.add_argument("--children", type=int, default=1, help="mutmut's --max-children (default 1)")
    parser.add_argument("--n", type=int, default=40, help="estimate/sample: mutants drawn (default 40)")
    parser.add_argument("--seed", type=int, default=1, help="estimate/sample/score --sample: seed (default 1)")
    parser.add_argument("--sample", type=int, default=0, help="score: a seeded sample of this size (0: all)")
    parser.add_argument("--names", type=Path, help="run: the mutants named in this file only")
    parser.add_argument("--rerun", action="store_true", help="run: also mutants that have a result")
    args = parser.parse_args(argv)

    if args.action == "generate":
        # one named mutant: mutmut (re)generates every mutant and collects the stats, then runs that one
        first = "pfl.aggregation.x_weighted_average__mutmut_1"
        return subprocess.run(["mutmut", "run", "--max-children", str(args.children), first], cwd=ROOT).returncode
    codes = results()
    if not codes:
        print("no mutants: run `python3 pipelines/mutation_score.py generate` first", file=sys.stderr)
        return 2
    if min(args.n, args.children) < 1 or args.sample < 0:
        print("--n and --children must be at least 1, --sample at least 0", file=sys.stderr)
        return 2
    equivalents = read_equivalents()
    if args.action == "sample":
        print("\n".join(sample(codes, args.n, args.seed)))
        return 0
    if args.action == "score":
        chosen = sample(codes, args.sample, args.seed) if args.sample else sorted(codes)
        print(score(codes, chosen, equivalents))
        return 0
    if args.action == "estimate":
        names = sample(codes, args.n, args.seed)
        seconds = mutmut_run(names, args.children)
        print(estimate(codes, names, seconds, args.children))
        print()
        print(score(results(), names, equivalents))
        return 0
    # run
    if args.names:
        names = [n for n in args.names.read_text().split() if n in codes]
    else:
        names = sorted(m for m, c in codes.items() if args.rerun or c is None)
    names = [m for m in names if m not in equivalents]
    print(f"running {len(names)} mutants with --max-children {args.children} in batches of {BATCH}", flush=True)
    seconds = mutmut_run(names, args.children)
    print(f"done in {seconds / 60:.1f} min")
    print(score(results(), sorted(results()), equivalents))
    return 0


if __name__ == "__main__":
    sys.exit(main())
