"""FPFC's Table 1 on S1 (tables/fpfc_s1.yaml) or its FMNIST label-swap setting
(tables/fpfc_labelswap.yaml): FPFC, FPFC-L1 and the baselines, every row × seed a Ray Tune trial.

    python3 pipelines/reproduce_fpfc.py [--scenario s1 | fmnist_labelswap] [--preset quick | paper]
                                        [--methods fpfc fedavg ...] [--rounds N] [--lam 0.6] [--seeds 0 1 2]

The same as ``pfl table tables/fpfc_s1.yaml``; ``--lam``, ``--nu``, ``--nu-select`` set FPFC's row,
``--lam-l1``, ``--nu-l1`` FPFC-L1's, ``--size-scale`` S1's device sizes.
"""

import sys
from pathlib import Path

from pfl.tables.cli import main

TABLES = Path(__file__).resolve().parents[1] / "tables"
ROW_FLAGS = {"--lam": "fpfc:method.lam", "--nu": "fpfc:method.nu", "--nu-select": "fpfc:method.nu_select",
             "--lam-l1": "fpfc_l1:method.lam", "--nu-l1": "fpfc_l1:method.nu"}


def translate(argv: list[str]) -> tuple[str, list[str]]:
    """The table of ``--scenario`` and the other flags, the row flags as ``--row-set``."""
    args, table, rest = list(argv), "fpfc_s1", []
    while args:
        flag = args.pop(0)
        if flag == "--scenario" and args:
            table = {"s1": "fpfc_s1", "fmnist_labelswap": "fpfc_labelswap"}.get(args[0], args[0])
            args.pop(0)
        elif flag in ROW_FLAGS and args:
            rest += ["--row-set", f"{ROW_FLAGS[flag]}={args.pop(0)}"]
        else:
            rest.append(flag)
    if not (TABLES / f"{table}.yaml").is_file():
        raise SystemExit(f"config error: --scenario: unknown scenario {table!r}; allowed: s1, fmnist_labelswap")
    return table, rest


if __name__ == "__main__":
    name, argv = translate(sys.argv[1:])
    legacy = {"--rounds": "federation.rounds", "--eval-every": "federation.eval_every"}
    if name == "fpfc_s1":
        legacy["--size-scale"] = "data.params.size_scale"
    sys.exit(main(argv, table=TABLES / f"{name}.yaml", legacy=legacy))
