"""Callbacks around the round loop (:mod:`pfl.federation.loop`), one concern per file.

* :mod:`.divergence` — ends a run whose loss is not finite (``FAILED``, with the reason);
  :func:`run_rounds` is the loop with only that check;
* :mod:`.progress` — one console line per evaluation;
* :mod:`.tracking` — the MLflow run: params, per-round metrics, artifacts, final status;
* :mod:`.checkpoint` — periodic and final checkpoints to a file;
* :mod:`.tune` — reports evaluation rounds (and checkpoints) to Ray Tune.
"""

from ..federation.loop import Callback, LoopResult, RoundLoop, StopTraining
from .checkpoint import Checkpointer
from .divergence import StopOnDivergence, run_rounds
from .progress import ProgressPrinter
from .tracking import MLflowLogger

__all__ = ["Callback", "Checkpointer", "LoopResult", "MLflowLogger", "ProgressPrinter", "RoundLoop",
           "StopOnDivergence", "StopTraining", "run_rounds"]
