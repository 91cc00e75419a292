"""FedALA's table (tables/fedala.yaml): FedAvg vs FedALA, ALA plugged into other methods, s and p,
what ALA costs; every row × seed a Ray Tune trial.

    python3 pipelines/fedala_table.py [--rounds 8] [--max-samples 3000] [--eval-every 1]
                                      [--rows fedavg fedala ditto ditto+ala ...] [--seeds 0 1 2]

The same as ``pfl table tables/fedala.yaml --set federation.rounds=8 ...``.
"""

import sys
from pathlib import Path

from pfl.tables.cli import main

if __name__ == "__main__":
    sys.exit(main(table=Path(__file__).resolve().parents[1] / "tables" / "fedala.yaml",
                  legacy={"--rounds": "federation.rounds", "--max-samples": "data.max_samples",
                          "--eval-every": "federation.eval_every"}))
