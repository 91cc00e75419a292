"""Message transforms at the delivery boundary, built from the config.

A transform is ``(msg, direction, rnd, cid) -> msg`` (direction: ``up``, ``down``, ``eval_up``,
``eval_down``). It runs on the receiver's copy after the sender let go of it and before the ledger
counts it, so it can rewrite what arrives (an attacker's uplink) without touching what the sender
keeps. Features that act on messages register a factory here; the simulator builds the run's
transforms from the config in ``order`` (lower first: attacks, order 10, rewrite an uplink before
anything that encodes it for the wire).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ..config import ExperimentConfig
    from .context import RunContext
    from .simulator import Transform

TransformFactory = Callable[["ExperimentConfig", "RunContext"], list["Transform"]]

_FACTORIES: list[tuple[int, str, TransformFactory]] = []


def register_transform_factory(name: str, factory: TransformFactory, order: int = 50) -> None:
    """``factory(cfg, ctx)`` returns the transforms the config asks for (often none)."""
    global _FACTORIES
    _FACTORIES = [f for f in _FACTORIES if f[1] != name] + [(order, name, factory)]
    _FACTORIES.sort(key=lambda f: (f[0], f[1]))


def _load_builtin() -> None:
    """Import the modules that register the built-in factories (attacks)."""
    from . import attacks  # noqa: F401


def build_transforms(cfg: "ExperimentConfig", ctx: "RunContext") -> list["Transform"]:
    _load_builtin()
    out: list = []
    for _, _, factory in _FACTORIES:
        out.extend(factory(cfg, ctx))
    return out


__all__ = ["TransformFactory", "build_transforms", "register_transform_factory"]
