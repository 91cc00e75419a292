"""Communication compression (tables/compression.yaml): FedAvg, SCAFFOLD and FPFC × every compressor
up, down and both, and the seminar's methods; accuracy, bytes, their ratio to the uncompressed row
and the bytes to a target accuracy, every entry × seed a Ray Tune trial.

    python3 pipelines/compression_table.py [--quick] [--only fedavg/ diana 'fedavg/none$'] [--target ACC]
                                           [--seeds 0 1 2] [--set key=value] [--no-track] [--out DIR] [--quiet]

The same as ``pfl table tables/compression.yaml``; ``--only`` is a regular expression searched in
GROUP/ROW (rows are named as the entries: ``fpfc/qsgd_s1$``, ``'fpfc/topk_1_ef\\+'`` for the pairs),
``--target ACC`` one target accuracy for every scenario (default: per seed 95 % of the uncompressed
FedAvg's final accuracy, FPFC's on S1; it sets ``PFL_COMPRESSION_TARGET`` for the table's hook).
"""

import os
import sys
from pathlib import Path

from pfl.tables.builtin.compression import TARGET_ENV
from pfl.tables.cli import main


def target_flag(argv: list[str]) -> list[str]:
    """``--target ACC`` (or ``--target=ACC``) into the environment, the other flags for the table."""
    rest = []
    while argv:
        flag = argv.pop(0)
        if flag == "--target" or flag.startswith("--target="):
            value = flag.partition("=")[2] or (argv.pop(0) if argv else "")
            try:
                os.environ[TARGET_ENV] = str(float(value))
            except ValueError:
                print(f"config error: --target: expected an accuracy such as 0.7, got {value!r}", file=sys.stderr)
                raise SystemExit(2) from None
        else:
            rest.append(flag)
    return rest


if __name__ == "__main__":
    sys.exit(main(target_flag(sys.argv[1:]), table=Path(__file__).resolve().parents[1] / "tables" / "compression.yaml"))
