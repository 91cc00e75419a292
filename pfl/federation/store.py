"""The client-state store: where every client's persistent state waits between its steps.

A client step loads its state, works on it (on the run's device) and the store saves what it
left; nothing else reads or writes client state. The engine asks a store for:

* :meth:`ClientStore.load` / :meth:`~ClientStore.save` — one client's state for one step;
* :meth:`~ClientStore.memory` — a server-side per-client memory (:class:`ClientMemory`: what the
  server keeps *about* each client, e.g. a wire stage's copy of what it last sent the client),
  kept, snapshotted and checkpointed with the client states;
* :meth:`~ClientStore.snapshot` / :meth:`~ClientStore.restore` — a copy of every client's state
  that later steps cannot change (the λ path's finalists), cheap where the backend allows;
* :meth:`~ClientStore.write_checkpoint` / :meth:`~ClientStore.read_checkpoint` — the client part
  of a checkpoint file (:mod:`.checkpoint`); a backend may keep files next to it;
* :meth:`~ClientStore.states` — every client's state as a list, for inspection and tests only:
  it costs the whole population.

Two backends: :class:`MemoryStore` keeps the states in a list (on the run's device or in host
memory, ``federation.client_state_device``); :class:`pfl.federation.diskstore.DiskStore` keeps
them in files and holds only the clients of the current step in memory.
``federation.client_store`` chooses (:func:`plan_store`: ``auto`` = memory while everything fits in
``federation.client_memory_gb``).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..schema import ConfigError
from .state import clone, nbytes, to_device

log = logging.getLogger(__name__)

GiB = 2 ** 30


class StoreError(RuntimeError):
    """Client states cannot be written (the message names the path and the reason)."""


class DamagedFileError(StoreError):
    """A checkpoint or segment file is empty, truncated, or does not match its checksum (the message
    names the file, and the client for a record): nothing may be trained on it."""


class ClientMemory:
    """One server-side per-client memory of a store (:meth:`ClientStore.memory`).

    ``load(cid)`` is what the server kept about client ``cid`` (``{}`` before anything was
    kept); ``save(cid, value)`` keeps ``value`` (plain data, like a client state). A wire stage
    that keeps one model copy per client (a downlink mirror) keeps it here instead of in a dict
    of its own, so it is bounded, snapshotted and checkpointed like the client states."""

    def __init__(self, store: "ClientStore", name: str):
        self.store = store
        self.name = name

    def load(self, cid: int) -> dict:
        return self.store.load(cid, self.name)

    def save(self, cid: int, value: dict) -> None:
        self.store.save(cid, value, self.name)

    def entries(self) -> dict[int, dict]:
        """Every client's non-empty entry (inspection and tests: costs the population)."""
        return self.store.memories().get(self.name, {})


class LocalMemory(ClientMemory):
    """A per-client memory in a dict of its own: a stage's until it is bound to a run's store
    (a stage used on its own, as tests do)."""

    def __init__(self, name: str = "local"):
        self.name = name
        self._entries: dict[int, dict] = {}

    def load(self, cid: int) -> dict:
        return self._entries.get(cid, {})

    def save(self, cid: int, value: dict) -> None:
        if value:
            self._entries[cid] = value
        else:
            self._entries.pop(cid, None)

    def entries(self) -> dict[int, dict]:
        return dict(self._entries)


class ClientStore:
    """Every client's persistent state, by client id (see the module docstring).

    ``space`` names whose state: ``"client"`` (the client's own, :meth:`load` / :meth:`save`
    by default) or a server-side memory's name (:meth:`memory`)."""

    kind = ""
    CLIENT = "client"

    def load(self, cid: int, space: str = CLIENT) -> dict:
        """Client ``cid``'s state on the run's device, for one step."""
        raise NotImplementedError

    def save(self, cid: int, state: dict, space: str = CLIENT) -> None:
        """Keep ``state`` as client ``cid``'s state."""
        raise NotImplementedError

    def memory(self, name: str) -> ClientMemory:
        """The server-side per-client memory ``name`` (see :class:`ClientMemory`)."""
        if not name or name == self.CLIENT:
            raise ValueError(f"a client memory needs a name other than {self.CLIENT!r}")
        return ClientMemory(self, name)

    def open(self) -> None:
        """Before the first step: make sure states can be kept (a disk store creates its folder)."""

    def flush(self) -> None:
        """Make every saved state durable in the backend (a disk store writes its buffer)."""

    def snapshot(self) -> Any:
        """A copy of every state that later steps cannot change (restore with :meth:`restore`)."""
        raise NotImplementedError

    def restore(self, snapshot: Any) -> None:
        raise NotImplementedError

    def write_checkpoint(self, directory: Path, snapshots: Sequence[Any] = ()) -> Any:
        """The client part of a checkpoint (plain data); ``directory`` may receive files, and
        ``snapshots`` (found in the checkpoint's other parts) must stay restorable from it."""
        raise NotImplementedError

    def read_checkpoint(self, part: Any, directory: Path, extra: Any = None) -> None:
        """Continue from a checkpoint's client part (``extra``: the checkpoint's other parts,
        whose snapshots this store must be able to restore)."""
        raise NotImplementedError

    def states(self) -> list[dict]:
        """Every client's state, in client order (inspection and tests: costs the whole population)."""
        raise NotImplementedError

    def memories(self) -> dict[str, dict[int, dict]]:
        """Every server-side memory's non-empty entries (inspection and tests)."""
        raise NotImplementedError

    def replace(self, states: Sequence[dict], memories: dict | None = None) -> None:
        """Replace every client's state (and the server-side memories)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release files and folders the store made (never a checkpoint's)."""

    def __len__(self) -> int:
        raise NotImplementedError


def memory_part(part: Any) -> tuple[list, dict]:
    """(states, memories) of a memory store's snapshot or checkpoint part."""
    if isinstance(part, dict) and "states" in part:
        return list(part["states"]), {str(k): {int(c): v for c, v in m.items()} for k, m in part["memories"].items()}
    if isinstance(part, (list, tuple)):
        return list(part), {}
    raise TypeError(f"not a client-state part: {type(part).__name__}")


class MemoryStore(ClientStore):
    """States in a list; tensors on ``where`` between steps, on ``device`` during them."""

    kind = "memory"

    def __init__(self, states: Sequence[dict], device: torch.device, where: torch.device,
                 new_state: Callable[[int], dict] | None = None):
        self.device = device
        self.where = where
        self.new_state = new_state
        self._states = [to_device(s, where) for s in states]
        self._memories: dict[str, dict[int, dict]] = {}

    def load(self, cid: int, space: str = ClientStore.CLIENT) -> dict:
        if space == self.CLIENT:
            return to_device(self._states[cid], self.device)
        return to_device(self._memories.get(space, {}).get(cid, {}), self.device)

    def save(self, cid: int, state: dict, space: str = ClientStore.CLIENT) -> None:
        if space == self.CLIENT:
            self._states[cid] = to_device(state, self.where)
        elif state:
            self._memories.setdefault(space, {})[cid] = to_device(state, self.where)
        else:
            self._memories.get(space, {}).pop(cid, None)

    def _part(self) -> Any:
        # without server-side memories the part is the list of states, as checkpoints always held
        if not any(self._memories.values()):
            return self._states
        return {"states": self._states, "memories": self._memories}

    def snapshot(self) -> Any:
        return clone(self._part())

    def restore(self, snapshot: Any) -> None:
        self.replace(*memory_part(clone(snapshot)))

    def write_checkpoint(self, directory: Path, snapshots: Sequence[Any] = ()) -> Any:
        return self._part()

    def read_checkpoint(self, part: Any, directory: Path, extra: Any = None) -> None:
        self.replace(*memory_part(part))  # (a disk store's part is made a memory part by pfl.federation.checkpoint)

    def states(self) -> list[dict]:
        return self._states

    def memories(self) -> dict[str, dict[int, dict]]:
        return {k: v for k, v in self._memories.items() if v}

    def replace(self, states: Sequence[dict], memories: dict | None = None) -> None:
        self._states = [to_device(s, self.where) for s in states]
        self._memories = {k: {int(c): to_device(v, self.where) for c, v in m.items()}
                          for k, m in (memories or {}).items()}

    def __len__(self) -> int:
        return len(self._states)


def choose_state_device(choice: str, device: torch.device, sample_state: dict, model: torch.nn.Module,
                        num_clients: int) -> torch.device:
    """``federation.client_state_device``: where per-client state lives between its steps."""
    if choice == "device" or device.type == "cpu":
        return device
    if choice == "cpu":
        return torch.device("cpu")
    # auto on an accelerator: every client's state must fit in half the free memory
    per_client = state_estimate(sample_state, model)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else float("inf")
    where = torch.device("cpu") if per_client * num_clients > 0.5 * free else device
    log.info("client state on %s (%d clients × ~%d bytes; %.0f MB free on %s)", where, num_clients,
             per_client, free / 2**20, device)
    return where


def state_estimate(sample_state: dict, model: torch.nn.Module) -> int:
    """Bytes one client's state may take: at least one model copy (most methods create their
    state on a client's first step, so a fresh state says little)."""
    return max(nbytes(sample_state), sum(p.numel() * p.element_size() for p in model.parameters()))


def memory_store(num_clients: int, new_state: Callable[[int, torch.device], dict], choice: str,
                 device: torch.device, model: torch.nn.Module, first: dict | None = None) -> MemoryStore:
    """Every client's initial state (``new_state(cid, where)``) in memory, kept where ``choice`` says.

    The first client's state (made on the run's device) decides where the others go."""
    if not num_clients:
        return MemoryStore([], device, device)
    first = new_state(0, device) if first is None else first
    where = choose_state_device(choice, device, first, model, num_clients)
    states = [to_device(first, where)] + [new_state(cid, where) for cid in range(1, num_clients)]
    return MemoryStore(states, device, where, new_state=lambda cid: new_state(cid, device))


_LIBC: Any = None


def release_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    A run on the disk store builds and frees clients' data and states one window after another;
    glibc keeps what was freed for reuse, fragmented, so the resident memory grows with the
    clients seen: an evaluation of 100,000 clients peaked at 3,955 MiB with a 2 GiB budget, and
    at 3,003 MiB trimming before each window (0.5 ms a window; pipelines/bench_scale.py's setting)."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim  # noqa: B018  (glibc only)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def default_budget() -> float:
    """``federation.client_memory_gb: null``: a quarter of the machine's physical memory."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 4
    except (ValueError, OSError, AttributeError):
        return 4 * GiB


@dataclass
class StorePlan:
    """What :func:`plan_store` decided: the backend, and how the memory budget is split."""
    kind: str                 # memory | disk
    budget: float             # bytes (client_memory_gb)
    data_capacity: float      # bytes of featurized client data kept (math.inf: every client, built at start)
    flush_bytes: int          # a disk store's write buffer
    window: int | None        # at most this many clients of one exchange in memory at once (None: all)
    round_bytes: float        # what one round's sampled clients need (data and state)


def plan_store(fed, num_clients: int, members: int, state_bytes: int, data_bytes: np.ndarray) -> StorePlan:
    """Where client states and data live (``federation.client_store``, ``client_memory_gb``).

    ``memory`` keeps every state and every client's data in memory, built at start (the budget
    is not applied). ``disk`` keeps states in files and builds a client's data when it is
    sampled, keeping recent clients within the budget; one round's sampled clients must fit in
    it (else a :class:`ConfigError` naming ``federation.client_memory_gb`` and the size needed).
    ``auto`` is ``memory`` while every client's state (``state_bytes`` each) and data fit."""
    budget = default_budget() if fed.client_memory_gb is None else fed.client_memory_gb * GiB
    k = members if fed.clients_per_round == 0 or fed.clients_per_round >= members else fed.clients_per_round
    k = max(k, 1)
    largest = np.sort(np.asarray(data_bytes, dtype=np.float64))[::-1][:k]
    round_bytes = k * float(state_bytes) + float(largest.sum())
    total = num_clients * float(state_bytes) + float(np.sum(data_bytes))
    if fed.client_store == "memory" or (fed.client_store == "auto" and total <= budget):
        return StorePlan("memory", budget, math.inf, 0, None, round_bytes)
    flush = int(min(64 * 2**20, budget / 8))
    if round_bytes + flush > budget:
        need = (round_bytes + flush) / GiB
        raise ConfigError("federation.client_memory_gb",
                          f"{budget / GiB:.3g} GiB cannot hold one round: its {k} sampled clients' data and state "
                          f"need {round_bytes / GiB:.3g} GiB, plus {flush / GiB:.3g} GiB of write buffer; set it to at "
                          f"least {math.ceil(need * 100) / 100:.2f}")
    return StorePlan("disk", budget, budget - k * float(state_bytes) - flush, flush, k, round_bytes)


__all__ = ["ClientMemory", "ClientStore", "DamagedFileError", "GiB", "LocalMemory", "MemoryStore", "StoreError",
           "StorePlan", "choose_state_device",
           "default_budget", "memory_part", "memory_store", "plan_store", "release_heap", "state_estimate"]
