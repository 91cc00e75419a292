"""FPFC's newcomer experiment (paper §6.4.2, Table 3; tables/newcomers.yaml): how well devices that
join after training do, beside the paper's numbers; every method × scenario × seed a Ray Tune trial.

    python3 pipelines/newcomers.py [--preset paper] [--scenarios s1 fmnist_labelswap] [--methods fpfc local ...]
                                   [--rounds N] [--join-rounds N] [--fraction 0.2] [--seeds 0 1 2]

The same as ``pfl table tables/newcomers.yaml`` (``--scenarios`` selects groups, ``--methods`` rows).
"""

import re
import sys
from pathlib import Path

from pfl.tables.cli import main


def translate(argv: list[str]) -> list[str]:
    out, args = [], list(argv)
    while args:
        flag = args.pop(0)
        values = []
        while args and not args[0].startswith("--"):
            values.append(args.pop(0))
        if flag == "--scenarios":
            out += ["--only", "^(" + "|".join(map(re.escape, values)) + ")/"]
        elif flag == "--methods":
            out += ["--rows", *values]
        elif flag == "--rounds" and len(values) == 1 and values[0].isdigit():
            n = int(values[0])   # 20 evaluations a run and LG's warm-up half the rounds, as the table's sizes
            out += ["--set", f"federation.rounds={n}", f"federation.eval_every={max(1, n // 20)}",
                    "--row-set", f"lg:method.warmup_rounds={n // 2}"]
        else:
            out += [flag, *values]
    return out


if __name__ == "__main__":
    sys.exit(main(translate(sys.argv[1:]), table=Path(__file__).resolve().parents[1] / "tables" / "newcomers.yaml",
                  legacy={"--join-rounds": "newcomers.rounds",
                          "--fraction": "newcomers.fraction"}))
