"""The sweeps' default trainable as Tune unpickles it: from a module that imports nothing heavy, so a
trial's actor is ready as soon as Ray's own modules are and torch and the round loop load inside the
trial (why that matters for short trials: :mod:`pfl.tables.cell`)."""

from __future__ import annotations

from typing import Any


def federated_trainable(config: dict[str, Any], setup: dict[str, Any]) -> None:
    """:func:`pfl.tune.trainable.federated_trainable`, imported when the trial starts."""
    from .trainable import federated_trainable as run

    run(config, setup)


__all__ = ["federated_trainable"]
