"""FPFC's robustness experiment (paper §6.4.1, Fig. 7, App. E.2; tables/robustness.yaml): the benign
devices' accuracy under Byzantine attacks; every grid point × seed a Ray Tune trial.

    python3 pipelines/robustness.py [--preset paper] [--scenarios s1 fmnist_labelswap] [--methods fpfc fedavg ...]
                                    [--attacks same_value sign_flip gaussian] [--fractions 0 0.2 0.4 0.6 0.8]
                                    [--scope model | head] [--rounds N] [--seeds 0 1 2]

The same as ``pfl table tables/robustness.yaml``: ``--scenarios``, ``--attacks`` and ``--fractions``
select the groups ``SCENARIO|ATTACK|FRACTION`` (fraction 0 is the clean run, shared by the attacks),
``--methods`` the rows, ``--scope`` sets ``attack.scope`` of every row (default: S1 the whole upload,
FMNIST label swap the last layer).
"""

import re
import sys
from pathlib import Path

from pfl.tables.cli import main

TABLE = Path(__file__).resolve().parents[1] / "tables" / "robustness.yaml"
GRID = {"--scenarios": ["s1", "fmnist_labelswap"], "--attacks": ["same_value", "sign_flip", "gaussian"],
        "--fractions": ["0", "0.2", "0.4", "0.6", "0.8"]}


def translate(argv: list[str]) -> list[str]:
    out, grid, rows, scope, args = [], dict(GRID), None, None, list(argv)
    while args:
        flag = args.pop(0)
        values = []
        while args and not args[0].startswith("--"):
            values.append(args.pop(0))
        if flag in grid:
            grid[flag] = [f"{float(v):g}" for v in values] if flag == "--fractions" else values
        elif flag == "--methods":
            rows = values
        elif flag == "--scope":
            scope = values[0] if values else None
        elif flag == "--rounds" and len(values) == 1 and values[0].isdigit():
            # 20 evaluations a run, as the table's own sizes have
            out += ["--set", f"federation.rounds={values[0]}", f"federation.eval_every={max(1, int(values[0]) // 20)}"]
        else:
            out += [flag, *values]
    alt = lambda xs: "(" + "|".join(map(re.escape, xs)) + ")"  # noqa: E731
    attacks = grid["--attacks"] + ["none"]
    out += ["--only", f"^{alt(grid['--scenarios'])}\\|{alt(attacks)}\\|{alt(grid['--fractions'])}/"]
    names = rows or ["fpfc", "fpfc_l1", "fedavg", "fedavg_median", "fedavg_krum", "local", "ifca", "cfl", "ditto"]
    out += ["--rows", *names]
    if scope:
        out += ["--row-set", *(f"{name}:attack.scope={scope}" for name in names)]
    return out


if __name__ == "__main__":
    sys.exit(main(translate(sys.argv[1:]), table=TABLE))
