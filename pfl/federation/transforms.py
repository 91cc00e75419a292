"""Message transforms at the delivery boundary, built from the config.

A transform is ``(msg, direction, rnd, cid) -> msg`` (direction: ``up``, ``down``, ``eval_up``,
``eval_down``, ``join_up``, ``join_down``). It runs on the wire (:meth:`pfl.federation.wire.Wire.deliver`),
on the receiver's copy after the sender let go of it and before the ledger counts it, so it can
rewrite what arrives (an attacker's uplink) without touching what the sender keeps. Features that
act on messages register a factory here when their module is imported (the attacks:
:mod:`pfl.federation.attacks`, imported by the simulator); the simulator builds the run's transforms
from the config in ``order`` (lower first: attacks, order 10).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .messages import Message

if TYPE_CHECKING:
    from ..config import ExperimentConfig
    from .context import RunContext

#: an uplink/downlink transform (attacks): (msg, direction, round, client) -> msg. It receives the
#: receiver's copy, so editing it in place cannot reach the sender's state.
Transform = Callable[[Message, str, int, int], Message]

TransformFactory = Callable[["ExperimentConfig", "RunContext"], list[Transform]]

_FACTORIES: list[tuple[int, str, TransformFactory]] = []


def register_transform_factory(name: str, factory: TransformFactory, order: int = 50) -> None:
    """``factory(cfg, ctx)`` returns the transforms the config asks for (often none)."""
    global _FACTORIES
    _FACTORIES = [f for f in _FACTORIES if f[1] != name] + [(order, name, factory)]
    _FACTORIES.sort(key=lambda f: (f[0], f[1]))


def build_transforms(cfg: "ExperimentConfig", ctx: "RunContext") -> list[Transform]:
    """The transforms the config asks for, from every registered factory, in order."""
    out: list = []
    for _, _, factory in _FACTORIES:
        out.extend(factory(cfg, ctx))
    return out


__all__ = ["Transform", "TransformFactory", "build_transforms", "register_transform_factory"]
