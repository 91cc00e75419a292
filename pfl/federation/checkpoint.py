"""Checkpoint files: a run's complete state written atomically, read back safely, for one config.

A checkpoint holds the format version, the config the run started with, the model state (the
lineage's round, hyperparameters and server state,
:meth:`pfl.federation.simulator.Simulator.lineage_state`, and the client store's part:
:meth:`pfl.federation.store.ClientStore.write_checkpoint`), the run's accounting (rounds executed,
time, history, ledger) and an ``extra`` part (the round loop puts its callbacks' states there). It
is written to a temporary file; then it is sealed with its length and CRC-32, its segments, the
file and the folders are synced and the file renamed into place (:mod:`.durable`): a killed run
never leaves half a file, and a host crash none whose rename landed before its data. Sealing and
syncing take as long as the write itself (the CRC reads the file back; the device is slower than
the page cache), so a periodic checkpoint may do that part in the background (``background=True``,
as orbax's and torch's asynchronous checkpoints do): training goes on, the next checkpoint of the
same path first waits for it (:func:`wait_checkpoint`), and until the rename the previous
checkpoint stands. It is read only if its checksum matches, with
``torch.load(weights_only=True)``: anything but tensors and plain containers is refused. A
checkpoint that cannot be used — missing, empty, truncated, damaged, another version's, another
run's — is one :class:`CheckpointError` naming the file and what is wrong with it.

The client part of a memory store is every client's state, in the file. A disk store's is its
index, and the segment files it needs sit in the folder ``<checkpoint>.clients/`` next to the file
(hard links of the store's immutable segments: a checkpoint adds only what was written since the
previous one, and drops what it no longer needs after the file is in place). A disk checkpoint
resumes into either store; a memory checkpoint too.

On resume the saved and current configs are compared; only :data:`RESUMABLE_CHANGES` may differ.
"""

from __future__ import annotations

import pickle
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..resolver import resolve
from ..schema import ConfigError, flatten
from .diskstore import find_snapshots, is_disk_part, materialized, segment_names
from .durable import check_seal, replace_durably, seal, sync_dir, sync_file
from .records import prune_checkpoint_dir
from .state import decode, encode
from .store import StoreError

CHECKPOINT_FORMAT = 4   # 3: no checksums (pfl before Nov 27, 2026)
#: config keys a resumed run may change: the round budget, tracking, and settings that do not
#: change what is computed (threads, checkpoint period, where client state is kept, the memory budgets,
#: the worker processes)
RESUMABLE_CHANGES = ("federation.rounds", "federation.threads", "federation.checkpoint_every",
                     "federation.client_state_device", "federation.client_store", "federation.client_memory_gb",
                     "federation.client_store_dir", "federation.server_memory_gb", "federation.workers",
                     "federation.worker_resources.", "tracking.")


class CheckpointError(ConfigError):
    """A checkpoint cannot be used for this run (missing, damaged, unsafe, another version's or
    another experiment's); the command line prints it as one line and exits 2."""


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
        checkpoint = directory.with_name(directory.name.removesuffix(".clients"))   # clients_dir's inverse
        raise CheckpointError("--checkpoint", _other_version(checkpoint, state.get("format")))
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


_persister: ThreadPoolExecutor | None = None
_pending: dict[Path, Future] = {}   # checkpoints being synced and renamed in the background


def _persist(tmp: Path, path: Path, segments: set[str]) -> None:
    """Seal ``tmp``; sync the checkpoint's segments (a clean file syncs at once), its folder and
    ``tmp``; rename it to ``path``; drop the segments it no longer needs."""
    directory = clients_dir(path)
    try:
        seal(tmp)
        for name in sorted(segments):
            sync_file(directory / name)
        if segments:
            sync_dir(directory)
        sync_file(tmp)
        replace_durably(tmp, path)   # a killed run never leaves a half-written checkpoint
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise StoreError(f"cannot write the checkpoint {path}: {err.strerror or err}") from err
    prune_checkpoint_dir(directory, segments)


def wait_checkpoint(path: str | Path | None = None) -> None:
    """Wait until the checkpoint being written in the background to ``path`` (to every path: None)
    is in place; raises the :class:`StoreError` of one that failed."""
    for key in [Path(path)] if path is not None else list(_pending):
        job = _pending.pop(key, None)
        if job is not None:
            job.result()


def save_checkpoint(sim, path: str | Path, extra: dict | None = None, background: bool = False) -> Path:
    """Write ``sim``'s state (and ``extra``, e.g. callbacks' state) atomically and durably to ``path``;
    with ``background``, return once the file is written, and seal, sync and rename it on a thread
    (see the module docstring).

    A write that fails (an unwritable folder, a full disk) raises :class:`StoreError` naming the
    path (for a background one: at the next checkpoint of the path or :func:`wait_checkpoint`) and
    leaves the previous checkpoint as it was."""
    global _persister
    path = Path(path)
    wait_checkpoint(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        state = run_state(sim, clients_dir(path), extra)
        torch.save(encode(state, "checkpoint"), tmp)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise StoreError(f"cannot write the checkpoint {path}: {err.strerror or err}") from err
    segments = segment_names(state["model"]["clients"])
    if not background:
        _persist(tmp, path, segments)
        return path
    if _persister is None:
        _persister = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pfl-checkpoint")
    _pending[path] = _persister.submit(_persist, tmp, path, segments)
    return path


def load_checkpoint(sim, path: str | Path) -> dict:
    """Continue ``sim`` from the checkpoint at ``path``; returns its ``extra`` part."""
    wait_checkpoint(path)
    return load_run_state(sim, read_checkpoint(path), clients_dir(path))


def _other_version(path: Path, fmt: Any) -> str:
    return (f"{path} was written by another pfl version (checkpoint format {fmt!r}; this pfl reads format "
            f"{CHECKPOINT_FORMAT}): finish that run with the pfl that wrote it, or start it again")


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location=None if torch.cuda.is_available() else "cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError("--checkpoint", f"{path} names code to run, which a pfl checkpoint never does "
                                              f"(refused; tensors and plain containers only): {first}") from None
    except (RuntimeError, AttributeError, TypeError, EOFError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError("--checkpoint", f"{path} is damaged or not a checkpoint: {first}") from None


def read_checkpoint(path: str | Path) -> dict:
    """A checkpoint's content, once its checksum matches; tensors and plain containers only
    (``weights_only=True``)."""
    path = Path(path)
    try:
        problem = check_seal(path)
    except FileNotFoundError:
        raise CheckpointError("--checkpoint", f"{path} does not exist") from None
    except OSError as err:
        raise CheckpointError("--checkpoint", f"cannot read {path}: {err.strerror or err}") from None
    if problem == "unsealed":   # a complete zip without pfl's trailer: an earlier pfl's, or cut at the trailer
        raw = _load(path)
        fmt = raw.get("format") if isinstance(raw, dict) else None
        if fmt == CHECKPOINT_FORMAT:
            problem = "is truncated: it ends where its checksum trailer should begin"
        else:
            raise CheckpointError("--checkpoint", _other_version(path, fmt) if isinstance(raw, dict) and "format" in raw
                                  else f"{path} does not hold a pfl checkpoint")
    if problem:
        raise CheckpointError("--checkpoint", f"{path} {problem} (a damaged checkpoint: resume from another "
                                              "one, or start the run again)")
    raw = _load(path)
    if not isinstance(raw, dict):
        raise CheckpointError("--checkpoint", f"{path} does not hold a pfl checkpoint")
    return decode(raw)


__all__ = ["CHECKPOINT_FORMAT", "CheckpointError", "RESUMABLE_CHANGES", "clients_dir", "config_differences",
           "load_checkpoint", "read_checkpoint", "run_state", "save_checkpoint", "wait_checkpoint"]
