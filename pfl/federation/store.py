"""The client-state store: where every client's persistent state waits between its steps.

A client step loads its state, works on it (on the run's device) and the store saves what it
left; nothing else reads or writes client state. The engine uses only :meth:`ClientStore.load`,
:meth:`~ClientStore.save` and, for checkpoints and snapshots, :meth:`~ClientStore.states` /
:meth:`~ClientStore.replace`, so another backend (on disk, for federations whose states do not
fit in memory) is a subclass with those four methods.

:class:`MemoryStore` keeps the states in a list, on the run's device or in host memory
(``federation.client_state_device``; :func:`choose_state_device`).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from .state import nbytes, to_device

log = logging.getLogger(__name__)


class ClientStore:
    """Every client's persistent state, by client id (the interface; see the module docstring)."""

    def load(self, cid: int) -> dict:
        """Client ``cid``'s state on the run's device, for one step (its tensors may be the stored
        ones: what the step leaves is handed back with :meth:`save`)."""
        raise NotImplementedError

    def save(self, cid: int, state: dict) -> None:
        """Keep ``state`` as client ``cid``'s state."""
        raise NotImplementedError

    def states(self) -> list[dict]:
        """Every client's state, in client order (checkpoints, snapshots)."""
        raise NotImplementedError

    def replace(self, states: Sequence[dict]) -> None:
        """Replace every client's state (a checkpoint or snapshot being restored)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class MemoryStore(ClientStore):
    """States in a list; tensors on ``where`` between steps, on ``device`` during them."""

    def __init__(self, states: Sequence[dict], device: torch.device, where: torch.device):
        self.device = device
        self.where = where
        self._states = [to_device(s, where) for s in states]

    def load(self, cid: int) -> dict:
        return to_device(self._states[cid], self.device)

    def save(self, cid: int, state: dict) -> None:
        self._states[cid] = to_device(state, self.where)

    def states(self) -> list[dict]:
        return self._states

    def replace(self, states: Sequence[dict]) -> None:
        self._states = [to_device(s, self.where) for s in states]

    def __len__(self) -> int:
        return len(self._states)


def choose_state_device(choice: str, device: torch.device, sample_state: dict, model: torch.nn.Module,
                        num_clients: int) -> torch.device:
    """``federation.client_state_device``: where per-client state lives between its steps."""
    if choice == "device" or device.type == "cpu":
        return device
    if choice == "cpu":
        return torch.device("cpu")
    # auto on an accelerator: every client's state must fit in half the free memory, counting
    # at least one model copy per client (most state is created on a client's first step)
    per_client = max(nbytes(sample_state), sum(p.numel() * p.element_size() for p in model.parameters()))
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else float("inf")
    where = torch.device("cpu") if per_client * num_clients > 0.5 * free else device
    log.info("client state on %s (%d clients × ~%d bytes; %.0f MB free on %s)", where, num_clients,
             per_client, free / 2**20, device)
    return where


def initial_store(num_clients: int, new_state: Callable[[int, torch.device], dict], choice: str,
                  device: torch.device, model: torch.nn.Module) -> MemoryStore:
    """Every client's initial state (``new_state(cid, where)``), kept where ``choice`` says.

    The first client's state is made on the run's device and decides where the others go."""
    if not num_clients:
        return MemoryStore([], device, device)
    first = new_state(0, device)
    where = choose_state_device(choice, device, first, model, num_clients)
    return MemoryStore([first] + [new_state(cid, where) for cid in range(1, num_clients)], device, where)


__all__ = ["ClientStore", "MemoryStore", "choose_state_device", "initial_store"]
