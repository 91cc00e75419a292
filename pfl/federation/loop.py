"""The one round loop. Everything around it is a callback (``pfl/callbacks/``, one file each).

``RoundLoop(sim, callbacks).run(until)`` runs rounds until ``until`` (default:
``federation.rounds``) or until a callback raises :class:`StopTraining` (diverged: ``FAILED``; a
pipeline's schedule is done: ``FINISHED``). When the round budget is reached, the newcomers (if the
config holds some) join (:func:`pfl.federation.newcomers.join_newcomers`) and their ``newcomer/*``
metrics go into ``summary``. The simulator never builds a loop: whoever runs it does
(:func:`pfl.callbacks.divergence.run_rounds` is the loop with only the divergence check). Every
path through ``pfl run``, the Ray Tune trainables (the FPFC λ path included) and the comparison
pipelines is this loop with a different list of callbacks. Callbacks are called in list order; a
callback that adds to the round's metrics (the λ path's stage records) comes before those that log
them.

A checkpoint is the simulator's state plus the state of every callback with a ``key``
(:meth:`RoundLoop.save` / :meth:`RoundLoop.load`, files by :mod:`pfl.federation.checkpoint`), so a
pipeline that steers the run resumes exactly where it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from .checkpoint import load_checkpoint, save_checkpoint
from .newcomers import join_newcomers

if TYPE_CHECKING:
    from .simulator import Simulator

log = logging.getLogger(__name__)


@dataclass
class LoopResult:
    status: str          # FINISHED, FAILED or KILLED (MLflow's run statuses)
    reason: str = ""
    clean: bool = True   # stopped between rounds: the state is consistent and may be saved


class StopTraining(Exception):
    """Raised by a callback to end the run after the current round."""

    def __init__(self, status: str = "FINISHED", reason: str = ""):
        super().__init__(reason or status)
        self.status = status
        self.reason = reason


class Callback:
    """A hook around the round loop. ``key`` names its part of a checkpoint (empty: stateless)."""

    key: ClassVar[str] = ""

    def on_start(self, loop: "RoundLoop") -> None:
        """Before the first round this process runs (also after a resume)."""

    def wants_eval(self, loop: "RoundLoop", rnd: int) -> bool | None:
        """Whether round ``rnd`` must (True) or must not (False) evaluate; None: the config's schedule."""
        return None

    def on_round(self, loop: "RoundLoop", metrics: dict[str, float]) -> None:
        """After every round; may add to ``metrics`` or raise :class:`StopTraining` (the later
        callbacks still see this round)."""

    def on_end(self, loop: "RoundLoop", result: LoopResult) -> None:
        """Always called once, with how the run ended."""

    def write_artifacts(self, loop: "RoundLoop", outdir: Path) -> list[tuple[Path, str | None]]:
        """Files (path, artifact folder) the tracking callback logs for a finished run."""
        return []

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any) -> None:
        pass


class RoundLoop:
    def __init__(self, sim: "Simulator", callbacks: Sequence[Callback] = ()):
        self.sim = sim
        self.callbacks = list(callbacks)
        self.summary: dict[str, float] = {}   # end-of-run metrics callbacks contribute
        self.result: LoopResult | None = None

    # ---- checkpoints ---------------------------------------------------------------------------
    def callback_states(self) -> dict[str, Any]:
        return {cb.key: cb.state_dict() for cb in self.callbacks if cb.key}

    def save(self, path: str | Path, background: bool = False) -> Path:
        return save_checkpoint(self.sim, path, extra={"callbacks": self.callback_states()}, background=background)

    def load(self, path: str | Path) -> None:
        extra = load_checkpoint(self.sim, path)
        states = extra.get("callbacks", {})
        for cb in self.callbacks:
            if cb.key and cb.key in states:
                cb.load_state_dict(states[cb.key])

    # ---- running -------------------------------------------------------------------------------
    def eval_decision(self, rnd: int) -> bool | None:
        votes = [cb.wants_eval(self, rnd) for cb in self.callbacks]
        if any(v is True for v in votes):
            return True
        if any(v is False for v in votes):
            return False
        return None

    def run(self, until: float | None = None) -> LoopResult:
        sim = self.sim
        end = sim.cfg.federation.rounds if until is None else until
        try:
            for cb in self.callbacks:
                cb.on_start(self)
            while sim.round < end:
                metrics = sim.run_round(evaluate=self.eval_decision(sim.round))
                stop: StopTraining | None = None
                for cb in self.callbacks:  # a stop request ends the run after every callback saw the round
                    try:
                        cb.on_round(self, metrics)
                    except StopTraining as request:
                        stop = stop or request
                if stop is not None:
                    raise stop
            if sim.round >= sim.cfg.federation.rounds:  # training done: newcomers join (if any)
                self.summary.update(join_newcomers(sim))
            result = LoopResult("FINISHED")
        except StopTraining as stop:
            result = LoopResult(stop.status, stop.reason)
        except KeyboardInterrupt:
            self._end(LoopResult("KILLED", "interrupted", clean=False))
            raise
        except Exception as err:
            self._end(LoopResult("FAILED", f"{type(err).__name__}: {err}", clean=False))
            raise
        self._end(result)
        return result

    def _end(self, result: LoopResult) -> None:
        self.result = result
        for cb in self.callbacks:
            try:
                cb.on_end(self, result)
            except Exception:
                if result.status == "FINISHED" and result.clean:
                    raise
                log.exception("callback %s failed while the run was ending (%s)", type(cb).__name__, result.status)


__all__ = ["Callback", "LoopResult", "RoundLoop", "StopTraining"]
