"""FedSLR's λ table (tables/fedslr_lambda.yaml): rank, parameters and downlink bytes fall as λ grows;
mixed vs low-rank vs FedAvg accuracy; every row × seed a Ray Tune trial.

    python3 pipelines/fedslr_lambda.py [--rounds 40] [--max-samples 20000] [--scenario fmnist_dir01]
                                       [--seeds 0 1 2] [--set key=value ...]

The same as ``pfl table tables/fedslr_lambda.yaml``; other λ: ``--set`` cannot change a grid, copy
the table file and edit its grid. ``--rounds N`` also evaluates once, at round N, as the table does.
"""

import sys
from pathlib import Path

from pfl.tables.cli import main

if __name__ == "__main__":
    sys.exit(main(table=Path(__file__).resolve().parents[1] / "tables" / "fedslr_lambda.yaml",
                  legacy={"--rounds": "federation.rounds federation.eval_every", "--max-samples": "data.max_samples"}))
