"""Reports a run's evaluation rounds to Ray Tune, with a checkpoint every ``every`` rounds.

``round`` in every report is the number of rounds the trial has computed (Tune's and ASHA's time
attribute). The checkpoint is the loop's (:meth:`pfl.federation.loop.RoundLoop.save`), so a
restored trial continues its rounds, its pipeline position and its MLflow run. At the end of a
finished run the loop's summary (the λ path's selected λ, total rounds ...) is reported once more
with the final metrics.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from ..federation.loop import Callback, LoopResult

STATE_FILE = "state.pt"


def is_eval(metrics: dict[str, float]) -> bool:
    return "val/loss_mean" in metrics or "test/loss_mean" in metrics


class TuneReporter(Callback):
    def __init__(self, every: int = 5, run_id: Callable[[], str | None] = lambda: None, final: bool = True):
        self.every = max(1, int(every))
        self.final = final   # a checkpoint at the last round (a table's cell reports its record after it instead)
        self.run_id = run_id
        self.last_saved = None
        self.last_eval: dict[str, float] = {}

    def on_start(self, loop) -> None:
        self.last_saved = loop.sim.executed

    def _report(self, loop, metrics: dict[str, float], checkpoint: bool) -> None:
        from ray import tune

        report = {k: v for k, v in metrics.items() if k not in ("round", "step")}
        report.update(round=loop.sim.executed, mlflow_run_id=self.run_id() or "")
        if not checkpoint:
            tune.report(report)
            return
        self.last_saved = loop.sim.executed
        with tempfile.TemporaryDirectory() as tmp:
            loop.save(Path(tmp) / STATE_FILE)
            tune.report(report, checkpoint=tune.Checkpoint.from_directory(tmp))

    def on_round(self, loop, metrics: dict[str, float]) -> None:
        if not is_eval(metrics):
            return  # Tune sees evaluation rounds only, so every report holds the searched metric
        self.last_eval = dict(metrics)
        last = loop.sim.round >= loop.sim.cfg.federation.rounds
        due = loop.sim.executed - self.last_saved >= self.every
        self._report(loop, metrics, checkpoint=(last and self.final) or (due and not last))

    def on_end(self, loop, result: LoopResult) -> None:
        if result.status == "FINISHED" and loop.summary:
            # the last evaluation without the events of its round (a λ-path stage end), which the
            # final report would otherwise announce a second time
            events = tuple(p for cb in loop.callbacks for p in getattr(cb, "event_prefixes", ()))
            last = {k: v for k, v in self.last_eval.items() if not (events and k.startswith(events))}
            self._report(loop, {**last, **loop.summary}, checkpoint=False)
