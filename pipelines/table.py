"""Run a comparison table: ``python3 pipelines/table.py tables/baselines.yaml [--quick] [--seeds 0 1 2]``
(the same as ``pfl table``; ``--help`` lists the flags)."""

import sys

from pfl.tables.cli import main

if __name__ == "__main__":
    sys.exit(main())
