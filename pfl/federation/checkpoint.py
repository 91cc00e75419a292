"""Checkpoint files: a run's complete state written atomically, read back safely, for one config.

A checkpoint holds the format version, the config the run started with, the model state
(:meth:`pfl.federation.simulator.Simulator.model_state`: the lineage's round, hyperparameters,
server state, every client's state), the run's accounting (rounds executed, time, history,
ledger) and an ``extra`` part (the round loop puts its callbacks' states there). It is written to a
temporary file and renamed, so a killed run never leaves half a file, and read with
``torch.load(weights_only=True)``: anything but tensors and plain containers is refused.

On resume the saved and current configs are compared; only :data:`RESUMABLE_CHANGES` may differ.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from ..resolver import resolve
from ..schema import ConfigError, flatten
from .state import decode, encode

CHECKPOINT_FORMAT = 2
#: config keys a resumed run may change: the round budget, tracking, and settings that do not
#: change what is computed (threads, checkpoint period, where client state is kept)
RESUMABLE_CHANGES = ("federation.rounds", "federation.threads", "federation.checkpoint_every",
                     "federation.client_state_device", "tracking.")


class CheckpointError(ConfigError):
    """A checkpoint cannot be used for this run (unsafe content, or another experiment's)."""


def config_differences(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ between two resolved configs, except :data:`RESUMABLE_CHANGES`.

    A key the saved config lacks counts with its default (a checkpoint written before a setting
    existed, e.g. ``attack.*`` or ``method.aggregator``, ran with what is now its default)."""
    try:
        saved = resolve(saved).to_dict()
    except ConfigError:
        pass  # not a config this version accepts: compare it as it is
    a, b = flatten(saved), flatten(current)
    out = {}
    for key in sorted(set(a) | set(b)):
        if key.startswith(RESUMABLE_CHANGES) or key in RESUMABLE_CHANGES:
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            out[key] = (a.get(key, "<absent>"), b.get(key, "<absent>"))
    return out


def run_state(sim) -> dict:
    """Everything a simulator must remember to continue exactly (see the module docstring)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "config": sim.start_config,
        "model": sim.model_state(),
        # the last evaluation's per-client rows: a run restored after its last round (cut off
        # while it wrote its artifacts) still has its client table
        "run": {"executed": sim.executed, "elapsed": sim.elapsed, "history": sim.history,
                "ledger": sim.ledger.state_dict(), "client_table": sim.last_client_table},
    }


def load_run_state(sim, state: dict) -> None:
    """Continue ``sim`` from ``state`` (:func:`run_state`), if it belongs to this run's config."""
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError("--checkpoint", f"checkpoint format {state.get('format')!r} is not "
                                              f"{CHECKPOINT_FORMAT} (written by another pfl version)")
    differ = config_differences(state["config"], sim.start_config)
    if differ:
        listed = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, a, b in ((k, *v) for k, v in differ.items()))
        raise CheckpointError(", ".join(differ), f"the checkpoint belongs to a run with another config "
                                                 f"({listed}); only the round budget and tracking may "
                                                 "change on resume")
    sim.load_model_state(state["model"])
    run = state["run"]
    sim.executed = int(run["executed"])
    sim.elapsed = float(run["elapsed"])
    sim.history = list(run["history"])
    sim.ledger.load_state_dict(run["ledger"])
    sim.last_client_table = run.get("client_table")  # absent in checkpoints of earlier versions


def save_checkpoint(sim, path: str | Path, extra: dict | None = None) -> Path:
    """Write ``sim``'s state (and ``extra``, e.g. callbacks' state) atomically to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = run_state(sim)
    if extra:
        state["extra"] = extra
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(encode(state, "checkpoint"), tmp)
    tmp.replace(path)  # a killed run never leaves a half-written checkpoint
    return path


def load_checkpoint(sim, path: str | Path) -> dict:
    """Continue ``sim`` from the checkpoint at ``path``; returns its ``extra`` part."""
    state = read_checkpoint(path)
    load_run_state(sim, state)
    return state.get("extra", {})


def read_checkpoint(path: str | Path) -> dict:
    """A checkpoint's content; tensors and plain containers only (``weights_only=True``)."""
    path = Path(path)
    try:
        raw = torch.load(path, map_location=None if torch.cuda.is_available() else "cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError("--checkpoint", f"{path} is not a pfl checkpoint that loads safely (tensors "
                                              f"and plain containers only): {first}") from None
    if not isinstance(raw, dict):
        raise CheckpointError("--checkpoint", f"{path} does not hold a pfl checkpoint")
    return decode(raw)


__all__ = ["CHECKPOINT_FORMAT", "CheckpointError", "RESUMABLE_CHANGES", "config_differences", "load_checkpoint",
           "read_checkpoint", "run_state", "save_checkpoint"]
