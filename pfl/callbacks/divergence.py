"""Ends a run whose training or evaluation loss is not finite: status FAILED, the reason kept.

Under a Byzantine attack (``attack.kind`` set) a non-finite loss is a measured outcome of the
attack, not a failed configuration: the model the attackers poisoned is what the benign clients
get. The run then goes on (non-finite models are evaluated as they are: their accuracy is what
their arg-max predicts) and the round's metrics carry ``attack/diverged`` = 1.

:func:`run_rounds` is the round loop with only this check: how tests and benchmarks run a simulator.
"""

from __future__ import annotations

import math

from ..federation.loop import Callback, RoundLoop, StopTraining
from ..federation.simulator import DivergedError


class StopOnDivergence(Callback):
    def on_round(self, loop, metrics: dict[str, float]) -> None:
        for key in ("train/loss", *sorted(k for k in metrics if k.endswith("loss_mean"))):
            value = metrics.get(key)
            if value is not None and not math.isfinite(value):
                if loop.sim.cfg.attack.kind != "none":
                    metrics["attack/diverged"] = 1.0
                    return
                what = "training loss" if key == "train/loss" else key
                raise StopTraining("FAILED", f"round {int(metrics['round']) + 1}: {what} is {value}")


def run_rounds(sim, until: int | None = None) -> list[dict[str, float]]:
    """Run ``sim`` to round ``until`` (default: ``federation.rounds``; newcomers join at the end)
    with the divergence check; returns its history. A non-finite loss raises :class:`DivergedError`."""
    result = RoundLoop(sim, [StopOnDivergence()]).run(until)
    if result.status == "FAILED":
        raise DivergedError(result.reason)
    return sim.history
