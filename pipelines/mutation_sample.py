"""The truth tests' mutation score on a random sample of mutmut's mutants (docs/verification.md).

A uniform random sample of ``[tool.mutmut]``'s mutants (10,594 over the scope of issue 42) estimates
the score with a stated interval; pipelines/mutation_score.py runs and scores the whole set (with the
equivalent mutants left out) and times a sample to say how long that takes:

    mutmut run --max-children 1 pfl.aggregation.x_weighted_average__mutmut_1   # generate the mutants
    mutmut run --max-children 1 $(python3 pipelines/mutation_sample.py list --n 200 --seed 32)
    python3 pipelines/mutation_sample.py score --n 200 --seed 32

``list`` prints the sampled mutant names (the same for the same mutants, ``--n`` and ``--seed``);
``score`` reads mutmut's results (``mutants/**/*.meta``) for them and prints killed, survived,
without a covering test, timeouts and not yet run, the score killed / (killed + survived + no tests
+ timeouts) with its 95 % Wilson interval, the score per file, and every survivor (``mutmut show
NAME`` prints its diff).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# mutmut 3's exit codes (mutmut/stats.py)
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 36: "timeout",
          24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", None: "not run"}


def results(root: Path = ROOT) -> dict[str, int | None]:
    """Every mutant name → its exit code (None: not run yet)."""
    out: dict[str, int | None] = {}
    for meta in sorted((root / "mutants").rglob("*.meta")):
        out.update(json.loads(meta.read_text())["exit_code_by_key"])
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


def file_of(name: str) -> str:
    return name.split(".x", 1)[0]


def score(codes: dict[str, int | None], chosen: list[str]) -> str:
    status = {m: STATUS.get(codes[m], "other") for m in chosen}
    count = Counter(status.values())
    judged = [m for m, s in status.items() if s in ("killed", "survived", "no tests", "timeout")]
    killed = sum(status[m] == "killed" for m in judged)
    lo, hi = wilson(killed, len(judged))
    counts = ", ".join(f"{k} {v}" for k, v in sorted(count.items()))
    lines = [f"sample: {len(chosen)} of {len(codes)} mutants; {counts}",
             f"score: killed / judged = {killed} / {len(judged)} = "
             + (f"{100 * killed / len(judged):.1f} % (95 % Wilson interval {100 * lo:.1f}–{100 * hi:.1f} %)"
                if judged else "–"),
             "", "per file (killed / judged):"]
    for f in sorted({file_of(m) for m in judged}):
        mine = [m for m in judged if file_of(m) == f]
        lines.append(f"  {f:<32} {sum(status[m] == 'killed' for m in mine)} / {len(mine)}")
    rest = sorted(m for m in judged if status[m] != "killed")
    if rest:
        lines += ["", "not killed (mutmut show NAME):"] + [f"  {status[m]:<9} {m}" for m in rest]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("list", "score"))
    parser.add_argument("--n", type=int, default=200, help="sampled mutants (default 200)")
    parser.add_argument("--seed", type=int, default=32, help="the sample's seed (default 32)")
    args = parser.parse_args(argv)
    codes = results()
    if not codes:
        print("no mutants: run `mutmut run --max-children 1 pfl.aggregation.x_weighted_average__mutmut_1` "
              "first (it generates every mutant)", file=sys.stderr)
        return 2
    if args.n < 1:
        print(f"--n must be at least 1, got {args.n}", file=sys.stderr)
        return 2
    chosen = sample(codes, args.n, args.seed)
    print("\n".join(chosen) if args.action == "list" else score(codes, chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
