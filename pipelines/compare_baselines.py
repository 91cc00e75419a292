"""The baselines on one scenario (tables/baselines.yaml): personalized accuracy, global accuracy,
total traffic, every method × seed a Ray Tune trial.

    python3 pipelines/compare_baselines.py [--quick] [--scenario fmnist_dir01] [--methods fedavg ditto ...]
                                           [--method-set ditto:method.lam=0.5] [--seeds 0 1 2] [--set key=value]

The same as ``pfl table tables/baselines.yaml``; ``--methods`` may name a method the table lacks.
"""

import sys
from pathlib import Path

from pfl.tables.cli import main

if __name__ == "__main__":
    sys.exit(main(table=Path(__file__).resolve().parents[1] / "tables" / "baselines.yaml"))
