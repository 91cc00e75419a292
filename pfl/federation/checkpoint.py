"""Checkpoint files: a run's complete state written atomically, read back safely, for one config.

A checkpoint holds the format version, the config the run started with, the model state (the
lineage's round, hyperparameters and server state,
:meth:`pfl.federation.simulator.Simulator.lineage_state`, and the client store's part:
:meth:`pfl.federation.store.ClientStore.write_checkpoint`), the run's accounting (rounds executed,
time, history, ledger) and an ``extra`` part (the round loop puts its callbacks' states there). It
is written to a temporary file and renamed, so a killed run never leaves half a file, and read with
``torch.load(weights_only=True)``: anything but tensors and plain containers is refused.

The client part of a memory store is every client's state, in the file. A disk store's is its
index, and the segment files it needs sit in the folder ``<checkpoint>.clients/`` next to the file
(hard links of the store's immutable segments: a checkpoint adds only what was written since the
previous one, and drops what it no longer needs after the file is in place). A disk checkpoint
resumes into either store; a memory checkpoint too.

On resume the saved and current configs are compared; only :data:`RESUMABLE_CHANGES` may differ.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from ..resolver import resolve
from ..schema import ConfigError, flatten
from .diskstore import find_snapshots, is_disk_part, materialized, segment_names
from .records import prune_checkpoint_dir
from .state import decode, encode
from .store import StoreError

CHECKPOINT_FORMAT = 3
#: config keys a resumed run may change: the round budget, tracking, and settings that do not
#: change what is computed (threads, checkpoint period, where client state is kept)
RESUMABLE_CHANGES = ("federation.rounds", "federation.threads", "federation.checkpoint_every",
                     "federation.client_state_device", "federation.client_store", "federation.client_memory_gb",
                     "federation.client_store_dir", "tracking.")


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


def clients_dir(path: str | Path) -> Path:
    """The folder next to checkpoint ``path`` that holds a disk store's segments."""
    path = Path(path)
    return path.with_name(path.name + ".clients")


def run_state(sim, directory: Path, extra: dict | None = None) -> dict:
    """Everything a simulator must remember to continue exactly (see the module docstring);
    a disk store links its segments into ``directory``."""
    model = sim.lineage_state()
    model["clients"] = sim.store.write_checkpoint(directory, find_snapshots(extra))
    state = {
        "format": CHECKPOINT_FORMAT,
        "config": sim.start_config,
        "model": model,
        # the last evaluation's per-client rows: a run restored after its last round (cut off
        # while it wrote its artifacts) still has its client table
        "run": {"executed": sim.executed, "elapsed": sim.elapsed, "history": sim.history,
                "ledger": sim.ledger.state_dict(), "client_table": sim.last_client_table},
    }
    if extra:
        state["extra"] = extra
    return state


def load_run_state(sim, state: dict, directory: Path) -> dict:
    """Continue ``sim`` from ``state`` (:func:`run_state`), if it belongs to this run's config;
    returns its ``extra`` part (the disk snapshots in it made restorable by ``sim``'s store)."""
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError("--checkpoint", f"checkpoint format {state.get('format')!r} is not "
                                              f"{CHECKPOINT_FORMAT} (written by another pfl version)")
    differ = config_differences(state["config"], sim.start_config)
    if differ:
        listed = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, a, b in ((k, *v) for k, v in differ.items()))
        raise CheckpointError(", ".join(differ), f"the checkpoint belongs to a run with another config "
                                                 f"({listed}); only the round budget and tracking may "
                                                 "change on resume")
    extra = state.get("extra", {})
    part = state["model"]["clients"]
    try:
        if is_disk_part(part) and sim.store.kind != "disk":  # written by a disk store, read into memory
            part, extra = materialized(part, directory, extra, sim.store.new_state, sim.device)
        sim.load_lineage_state(state["model"])
        sim.store.read_checkpoint(part, directory, extra)
    except StoreError as err:
        raise CheckpointError("--checkpoint", str(err)) from None
    run = state["run"]
    sim.executed = int(run["executed"])
    sim.elapsed = float(run["elapsed"])
    sim.history = list(run["history"])
    sim.ledger.load_state_dict(run["ledger"])
    sim.last_client_table = run.get("client_table")  # absent in checkpoints of earlier versions
    return extra


def save_checkpoint(sim, path: str | Path, extra: dict | None = None) -> Path:
    """Write ``sim``'s state (and ``extra``, e.g. callbacks' state) atomically to ``path``.

    A write that fails (an unwritable folder, a full disk) raises :class:`StoreError` naming the
    path and leaves the previous checkpoint as it was."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        state = run_state(sim, clients_dir(path), extra)
        torch.save(encode(state, "checkpoint"), tmp)
        tmp.replace(path)  # a killed run never leaves a half-written checkpoint
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise StoreError(f"cannot write the checkpoint {path}: {err.strerror or err}") from err
    prune_checkpoint_dir(clients_dir(path), segment_names(state["model"]["clients"]))
    return path


def load_checkpoint(sim, path: str | Path) -> dict:
    """Continue ``sim`` from the checkpoint at ``path``; returns its ``extra`` part."""
    return load_run_state(sim, read_checkpoint(path), clients_dir(path))


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


__all__ = ["CHECKPOINT_FORMAT", "CheckpointError", "RESUMABLE_CHANGES", "clients_dir", "config_differences",
           "load_checkpoint", "read_checkpoint", "run_state", "save_checkpoint"]
