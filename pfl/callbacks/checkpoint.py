"""Checkpoints to a file: every ``every`` rounds and when the run stops between rounds.

The file holds the simulator's complete state and the callbacks' (the MLflow run id, a
pipeline's position), written atomically and durably; it loads with ``torch.load(weights_only=True)``.
A periodic checkpoint is synced to the device in the background while training goes on; the last
one is in place before the run ends (:func:`pfl.federation.checkpoint.save_checkpoint`).
"""

from __future__ import annotations

from pathlib import Path

from ..federation.checkpoint import wait_checkpoint
from ..federation.loop import Callback, LoopResult


class Checkpointer(Callback):
    def __init__(self, path: str | Path, every: int = 0):
        self.path = Path(path)
        self.every = every

    def on_round(self, loop, metrics: dict[str, float]) -> None:
        if self.every and loop.sim.executed % self.every == 0:
            loop.save(self.path, background=True)

    def on_end(self, loop, result: LoopResult) -> None:
        if result.clean:  # interrupted mid-round, the state is not a round boundary: keep the last file
            loop.save(self.path)
        else:
            wait_checkpoint(self.path)   # the last periodic one, in place before the run ends
