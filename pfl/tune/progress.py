"""A sweep's console: short trial labels and one line per trial event instead of Tune's status table."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from .path_report import SEGMENT_END_NAMES
from .results import failure_reason

# hyperparameters a label writes as the symbols the method notes use
SYMBOLS = {"lam": "λ", "rho": "ρ"}


def _short(value: Any) -> str:
    if isinstance(value, str):  # YAML reads 1.0e12 (no exponent sign) as a string; the config as a number
        try:
            value = float(value)
        except ValueError:
            return value
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def trial_label(searched: dict[str, Any], prefix: str = "", suffix: str = "") -> str:
    """``fedprox mu=0.043 lr=0.05``, ``λ=0.6 separate``: the last part of each searched key (more
    where two would collide; FPFC's λ and ρ as their symbols) with its value, between ``prefix``
    and ``suffix``. MLflow cuts long nested names, so what tells trials apart goes first."""
    keys = list(searched)
    short = {k: k.rsplit(".", 1)[-1] for k in keys}
    tails = {k: k if list(short.values()).count(short[k]) > 1 else short[k] for k in keys}
    parts = [f"{SYMBOLS.get(tails[k], tails[k])}={_short(searched[k])}" for k in keys]
    return " ".join(p for p in [prefix, *parts, suffix] if p)


class ProgressLines:
    """A Tune callback that prints one short line per trial event instead of Tune's status table:
    a trial's start, its evaluations (at most one line per ``every`` seconds per trial, and always
    at a λ-path stage or playoff end), and its end."""

    def __new__(cls, write: Callable[[str], None], label: Callable[[Any], str], metric: str, every: float = 20.0):
        from ray.tune import Callback

        class _Progress(Callback):
            def __init__(self):
                self.setup()

            def setup(self, **info):  # also on resume (Tune restores this object from its state)
                self.last: dict[str, float] = {}
                self.started = time.perf_counter()

            def _line(self, trial, text: str) -> None:
                stamp = time.perf_counter() - self.started
                write(f"[{stamp:6.0f} s] {label(trial)}: {text}")

            def on_trial_start(self, iteration, trials, trial, **info):
                self._line(trial, "started")

            def on_trial_result(self, iteration, trials, trial, result, **info):
                event = "stage/lambda" in result or "playoff/lambda" in result
                now = time.perf_counter()
                if not event and now - self.last.get(trial.trial_id, -1e9) < every:
                    return
                self.last[trial.trial_id] = now
                parts = [f"round {int(result.get('round', 0))}"]
                for key, name in ((metric, metric), ("test/acc_mean", "test acc"), ("cluster/num", "clusters")):
                    if key in result and (key != "test/acc_mean" or metric != key):
                        value = result[key]
                        parts.append(f"{name} {int(value)}" if key == "cluster/num" else f"{name} {value:.4f}")
                for kind in ("stage", "playoff"):
                    if f"{kind}/lambda" in result:
                        why = SEGMENT_END_NAMES.get(result.get(f"{kind}/end"), "")
                        rounds = result.get(f"{kind}/rounds")
                        how = ", ".join(x for x in (why, f"{rounds:.0f} rounds" if rounds is not None else "") if x)
                        parts.append(f"{kind} λ={result[f'{kind}/lambda']:g} ended ({how + ', ' if how else ''}"
                                     f"val {result.get(f'{kind}/val_acc', float('nan')):.4f})")
                self._line(trial, " | ".join(parts))

            def on_trial_complete(self, iteration, trials, trial, **info):
                value = (trial.last_result or {}).get(metric)
                self._line(trial, "finished" + (f" ({metric} {value:.4f})" if isinstance(value, float) else ""))

            def on_trial_error(self, iteration, trials, trial, **info):
                error_file = Path(getattr(trial, "error_file", "") or "")
                text = error_file.read_text() if error_file.is_file() else ""
                self._line(trial, f"failed: {failure_reason(None, text)}")

        return _Progress()


__all__ = ["ProgressLines", "trial_label"]
