"""Reference rows without a federation (``Method.pooled``: ``centralized``).

A pooled method trains one model on the members' training data put together and communicates
nothing. The simulator hands it a :class:`Pool` (the pooled training split, built once when first
asked for) and evaluates it through a :class:`Measurement` instead of the exchange: the same calls
(``evaluate``, ``personal_models``, ``evaluate_models``), every client's side run on what the server
side made, but nothing copied, staged or booked by the ledger — there is no wire to cross. A
client's state is still loaded and saved, so a method's client side behaves as in an exchange.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from .cohort import DIRECT
from .exchange import Arrival, HandleFactory, ServerSide
from .store import ClientStore
from .wire import ClientSide, Phase

if TYPE_CHECKING:
    from ..data import FederatedData


class Pool:
    """The training splits of ``members``, concatenated in client order (a cache: rebuilt, never saved)."""

    def __init__(self, data: "FederatedData", members: Sequence[int]):
        self.data = data
        self.members = list(members)
        self._xy: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._xy is None:
            parts = [self.data.clients[c] for c in self.members]
            self._xy = (torch.cat([p.x_train for p in parts]), torch.cat([p.y_train for p in parts]))
        return self._xy


class Measurement:
    """The exchange's call without the wire (see the module docstring)."""

    def __init__(self, store: ClientStore, handle: HandleFactory):
        self.store = store
        self.handle = handle

    def __call__(self, phase: Phase, clients: Sequence[int], server_side: ServerSide, client_side: ClientSide,
                 receive: Callable[[Arrival], None] | None = None) -> dict[int, Arrival]:
        out: dict[int, Arrival] = {}
        self.store.open()
        for cid in clients:
            client = self.handle(cid, self.store.load(cid), DIRECT)
            msg = server_side(cid)  # a copy, as a delivery makes: nothing shares the server's storage
            reply, local = client_side(client, None if msg is None else msg.copy())
            self.store.save(cid, client.state)
            arrival = Arrival(cid, reply, local)
            if receive is None:
                out[cid] = arrival
            else:
                receive(arrival)
        return out


__all__ = ["Measurement", "Pool"]
