"""Delivery: how a message gets from its sender to its receiver, and what acts on it on the way.

One trip of a message, in order:

1. **sender's stages** — each :class:`Stage` in declared order, on the sender's side (with the
   sender's state: a server-side stage keeps its own, a client-side one keeps it in
   ``client.state``), e.g. compression encoding a message for the wire;
2. **the wire** (:meth:`Wire.deliver`) — the message is copied (``Message.copy``: the receiver
   shares no storage with the sender), passed through the run's transforms
   (:mod:`pfl.federation.transforms`: an attacker rewriting its upload) and counted by the ledger,
   the only place bytes are counted;
3. **receiver's stages** — the same stages in reverse order, on the receiver's side (decoding).

Directions are named by the exchange's :class:`Phase`: ``down`` /
``up`` for training, ``eval_down`` / ``eval_up`` for evaluation, ``join_down`` / ``join_up`` for the
newcomers' join. A stage sees the phase and decides whether it acts (compression acts on training
traffic only).

A stage's hooks, for a message that is not None (the four ``send_*`` / ``receive_*`` return the
message to pass on):

* server side: ``send_down(phase, cid, msg)``; ``sent(phase, cid, msg)``, called with the delivered
  downlink before the client works on it, returns what the server keeps of this trip (its own
  record of what it sent); ``receive_up(phase, cid, msg, sent)`` gets that record back;
* client side: ``receive_down(phase, client, msg, notes)`` and ``send_up(phase, client, msg,
  notes)``, where ``notes`` is a dict that lives for this client's one trip (what the client
  remembers between receiving and replying, never sent).

``metrics()`` is logged with the round; ``state_dict()`` / ``load_state_dict()`` hold its
server-side state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .comm import CommLedger
from .messages import Message
from .transforms import Transform

if TYPE_CHECKING:
    from ..methods.base import ClientHandle

_DIRECTIONS = {"train": ("down", "up"), "eval": ("eval_down", "eval_up"), "join": ("join_down", "join_up")}


@dataclass(frozen=True)
class Phase:
    """What an exchange (:mod:`pfl.federation.exchange`) is for: ``kind`` (train, eval, join), the
    round ``rnd`` (it seeds the clients' generators), and the join step."""
    kind: str
    rnd: int
    step: int = 0

    def __post_init__(self):
        if self.kind not in _DIRECTIONS:
            raise ValueError(f"phase kind must be one of {', '.join(_DIRECTIONS)}, got {self.kind!r}")

    @property
    def down(self) -> str:
        return _DIRECTIONS[self.kind][0]

    @property
    def up(self) -> str:
        return _DIRECTIONS[self.kind][1]


#: the client side of a trip: (client, delivered downlink) -> (reply, what the client computed for
#: the simulator and does not send, e.g. an evaluation row)
ClientSide = Callable[["ClientHandle", "Message | None"], "tuple[Message | None, Any]"]


class Stage:
    """Acts on messages at both ends of the wire (see the module docstring). The default hooks
    pass every message on unchanged."""

    key: str = ""

    def send_down(self, phase: Phase, cid: int, msg: Message) -> Message:
        return msg

    def receive_down(self, phase: Phase, client: "ClientHandle", msg: Message, notes: dict) -> Message:
        return msg

    def send_up(self, phase: Phase, client: "ClientHandle", msg: Message, notes: dict) -> Message:
        return msg

    def sent(self, phase: Phase, cid: int, msg: Message) -> Any:
        return None

    def receive_up(self, phase: Phase, cid: int, msg: Message, sent: Any) -> Message:
        return msg

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Wire:
    """The run's delivery: stages at both ends, and between them copy → transforms → ledger."""

    def __init__(self, ledger: CommLedger, transforms: Sequence[Transform] = (), stages: Sequence[Stage] = ()):
        self.ledger = ledger
        self.transforms = list(transforms)
        self.stages = list(stages)

    def deliver(self, msg: Message | None, direction: str, rnd: int, cid: int) -> Message | None:
        """The receiver's copy of ``msg`` after the transforms, counted by the ledger."""
        if msg is None:
            return None
        msg = msg.copy()
        for transform in self.transforms:
            msg = transform(msg, direction, rnd, cid)
        self.ledger.record(msg, direction)
        return msg

    # ---- the two ends of one trip --------------------------------------------------------------
    def send_down(self, phase: Phase, cid: int, msg: Message | None) -> Message | None:
        """Server → client ``cid``: the sender's stages, then the wire."""
        if msg is not None:
            for stage in self.stages:
                msg = stage.send_down(phase, cid, msg)
        return self.deliver(msg, phase.down, phase.rnd, cid)

    def client_side(self, phase: Phase, client: "ClientHandle", down: Message | None,
                    work: ClientSide) -> tuple[Message | None, Any]:
        """On the client: the receiver's stages on ``down``, the client's ``work``, the sender's
        stages on its reply (before it goes on the wire)."""
        notes: dict = {}
        if down is not None:
            for stage in reversed(self.stages):
                down = stage.receive_down(phase, client, down, notes)
        reply, local = work(client, down)
        if reply is not None:
            for stage in self.stages:
                reply = stage.send_up(phase, client, reply, notes)
        return reply, local

    def sent(self, phase: Phase, cid: int, down: Message | None) -> list:
        """The server's records of a delivered downlink, one per stage, taken before the client
        works on it (the client may edit its copy in place)."""
        return [None if down is None else stage.sent(phase, cid, down) for stage in self.stages]

    def send_up(self, phase: Phase, cid: int, reply: Message | None, sent: list) -> Message | None:
        """Client ``cid`` → server: the wire, then the receiver's stages (``sent``: the server's
        records of this trip's downlink, :meth:`sent`)."""
        msg = self.deliver(reply, phase.up, phase.rnd, cid)
        if msg is not None:
            for stage, record in reversed(list(zip(self.stages, sent))):
                msg = stage.receive_up(phase, cid, msg, record)
        return msg

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for stage in self.stages:
            out.update(stage.metrics())
        return out


__all__ = ["ClientSide", "Phase", "Stage", "Wire"]
