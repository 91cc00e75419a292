"""The exchange: the one way the server and its clients talk.

``exchange(phase, clients, server_side, client_side)`` is every federated step of a run: training
rounds, evaluation, the models a pipeline asks for (``personal_models``, ``evaluate_models``), the
newcomers' join and, split in its two halves, the asynchronous driver. For each client:

1. ``server_side(cid)`` — the server's downlink (None: nothing is sent);
2. the downlink is delivered (:meth:`pfl.federation.wire.Wire.send_down`: copy, stages, ledger);
3. the client's state is loaded from the store, the client's side runs — ``client_side(client,
   msg)`` returns ``(reply, local)``, where ``local`` is what the simulator observes about the
   client and never sends (an evaluation row) — and the state is saved;
4. the reply is delivered (:meth:`~pfl.federation.wire.Wire.send_up`) and handed to ``receive``.

Step 3 runs through the run's cohort (:mod:`pfl.federation.cohort`): one client at a time, or the
clients of a part together with their training and evaluation requests batched. It is the same
code path; the cohort only decides which clients form a part (:meth:`parts`) and which compute
object their handles get. With a ``window`` (a store that keeps states on disk), the clients go to
the cohort at most ``window`` at a time, so an evaluation of every client holds only a window's
states and data in memory. With ``federation.workers`` > 1 the runner is a worker pool
(:mod:`pfl.federation.workers`): step 3 of a whole part runs in worker processes, which get the
delivered downlinks and loaded states and give back replies, locals and new states; steps 1, 2 and 4
and the store stay here, in the part's client order.

Every client of ``clients`` ends as an :class:`Arrival`. Without ``receive`` the exchange returns
them all; with it, each arrival goes to ``receive`` as soon as it is delivered (a part at a time)
and nothing is kept, which is what a streaming aggregate (a running weighted sum) needs.

:class:`Phase` is the exchange's frozen context: its kind (``train``, ``eval``, ``join``), the
round whose generators and learning rate apply, and the join step; it names the directions the
ledger books the traffic under.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .cohort import Compute, Job
from .messages import Message
from .store import ClientStore
from .wire import ClientSide, Phase, Wire

if TYPE_CHECKING:
    from ..methods.base import ClientHandle

@dataclass
class Arrival:
    """One client's end of an exchange: its delivered reply (None: it sent nothing) and what its
    side computed for the simulator (``local``, never sent)."""
    cid: int
    reply: Message | None
    local: Any = None


ServerSide = Callable[[int], "Message | None"]
#: builds the handle a client step works with: (cid, state loaded from the store, compute object)
HandleFactory = Callable[[int, dict, Compute], "ClientHandle"]


class Exchange:
    """The run's exchange (see the module docstring): a wire, a client store, a cohort runner."""

    def __init__(self, wire: Wire, store: ClientStore, runner, handle: HandleFactory, window: int | None = None,
                 prefetch: Callable[[list[int]], None] | None = None):
        self.wire = wire
        self.store = store
        self.runner = runner   # pfl.federation.cohort.Sequential or Cohort, or pfl.federation.workers.WorkerPool
        self.handle = handle
        self.window = window
        self.prefetch = prefetch  # builds a window's client data together (data built on demand)

    def __call__(self, phase: Phase, clients: Sequence[int], server_side: ServerSide, client_side: ClientSide,
                 receive: Callable[[Arrival], None] | None = None) -> dict[int, Arrival]:
        out: dict[int, Arrival] = {}
        clients = list(clients)
        step = self.window or max(len(clients), 1)
        for start in range(0, len(clients), step):
            if self.prefetch is not None:
                self.prefetch(clients[start:start + step])
            for part in self.runner.parts(clients[start:start + step]):
                shared = {} if getattr(self.runner, "ships", lambda side: False)(client_side) else None
                downs = {cid: self.send(phase, cid, server_side(cid), shared) for cid in part}
                out.update(self.complete(phase, downs, client_side, receive))
        return out

    def send(self, phase: Phase, cid: int, msg: Message | None, shared: dict | None = None) -> Message | None:
        """The first half: ``msg`` delivered to client ``cid`` (the asynchronous driver sends a
        device its message when it dispatches it, and completes the trip when the device is done);
        ``shared``: see :meth:`Wire.send_down`."""
        return self.wire.send_down(phase, cid, msg, shared)

    def complete(self, phase: Phase, downs: Mapping[int, Message | None], client_side: ClientSide,
                 receive: Callable[[Arrival], None] | None = None) -> dict[int, Arrival]:
        """The second half: every client of ``downs`` (together, one cohort part) works on its
        delivered downlink and its reply is delivered back."""
        self.store.open()
        sent = {cid: self.wire.sent(phase, cid, downs[cid]) for cid in downs}
        states = {cid: self.store.load(cid) for cid in downs}
        # a worker pool (pfl.federation.workers) runs the part's client sides in its processes and
        # hands back, per client, functions that unpack (reply, local) and the new state when called:
        # this process then holds one reply at a time; None: this side runs here
        ship = getattr(self.runner, "ship", None)
        shipped = ship(phase, downs, states, client_side) if ship is not None else None
        if shipped is not None:
            reply_of = lambda cid: shipped[cid][0]()  # noqa: E731
            state_of = lambda cid: shipped[cid][1]()  # noqa: E731
        else:
            clients: dict[int, ClientHandle] = {}

            def job(cid: int) -> Job:
                def run(compute: Compute):
                    clients[cid] = client = self.handle(cid, states[cid], compute)
                    return self.wire.client_side(phase, client, downs[cid], client_side)
                return run

            results = self.runner.run({cid: job(cid) for cid in downs})
            reply_of = results.__getitem__
            state_of = lambda cid: clients[cid].state  # noqa: E731
        out: dict[int, Arrival] = {}
        for cid in downs:  # one client at a time: a pool's later blocks are still computing
            self.store.save(cid, state_of(cid))
            reply, local = reply_of(cid)
            arrival = Arrival(cid, self.wire.send_up(phase, cid, reply, sent[cid]), local)
            if receive is None:
                out[cid] = arrival
            else:
                receive(arrival)
        return out


__all__ = ["Arrival", "Exchange", "HandleFactory", "Phase", "ServerSide"]
