"""PerFed-CKT's table (tables/perfed_ckt.yaml): accuracy against Local with the same model,
clustering against none, communication against FedAvg; every row × seed a Ray Tune trial.

    python3 pipelines/perfed_ckt_table.py [--rounds 30] [--model cnn_fpfc] [--only dir01 | mixed]
                                          [--seeds 0 1 2] [--set key=value ...]

The same as ``pfl table tables/perfed_ckt.yaml``; ``--only dir01`` adds its λ sweep, ``--only mixed``
the three-architecture setting.
"""

import sys
from pathlib import Path

from pfl.tables.cli import main

if __name__ == "__main__":
    sys.exit(main(table=Path(__file__).resolve().parents[1] / "tables" / "perfed_ckt.yaml",
                  legacy={"--rounds": "federation.rounds", "--model": "model.name",
                          "--eval-every": "federation.eval_every", "--device": "federation.device"}))
