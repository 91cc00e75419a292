"""Ends a run whose training or evaluation loss is not finite: status FAILED, the reason kept."""

from __future__ import annotations

import math

from ..federation.loop import Callback, StopTraining


class StopOnDivergence(Callback):
    def on_round(self, loop, metrics: dict[str, float]) -> None:
        for key in ("train/loss", *sorted(k for k in metrics if k.endswith("loss_mean"))):
            value = metrics.get(key)
            if value is not None and not math.isfinite(value):
                what = "training loss" if key == "train/loss" else key
                raise StopTraining("FAILED", f"round {int(metrics['round']) + 1}: {what} is {value}")
