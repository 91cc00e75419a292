"""The round drivers ``federation.driver`` names: synchronous rounds or the asynchronous clock."""

from __future__ import annotations

from .async_clock import AsyncSimulator
from .simulator import Simulator


def simulator_for(cfg) -> type[Simulator]:
    """The simulator class of ``cfg.federation.driver`` (``sync``: :class:`Simulator`, ``async``:
    :class:`AsyncSimulator`)."""
    return AsyncSimulator if cfg.federation.driver == "async" else Simulator


__all__ = ["simulator_for"]
