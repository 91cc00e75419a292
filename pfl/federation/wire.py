"""Delivery: how a message gets from its sender to its receiver, and what acts on it on the way.

One trip of a message, in order:

1. the message is copied (``Message.copy``): from here on nothing shares storage with what the
   sender keeps, so no stage on the way and not the receiver can change the sender's state (a
   freshly trained model the client did not keep is handed over without a copy);
2. **the sender's side of every stage**, in the declared order (``federation.stages``): an attack
   rewriting a Byzantine client's upload, compression encoding the message, ...;
3. **the wire** (:meth:`Wire.deliver`): the ledger counts it, the only place bytes are counted;
4. **the receiver's side of every stage**, in reverse order (decoding).

A :class:`Stage` is one kind of thing for every feature that acts on messages (optax's
transformations: a stage with its own state, and a chain of stages is a stage). Its hooks, for a
message that is not None (the four ``send_*`` / ``receive_*`` return the message to pass on):

* server side: ``send_down(phase, cid, msg)``; ``sent(phase, cid, msg)``, called with the delivered
  downlink before the client works on it, returns what the server keeps of this trip (its own
  record of what it sent); ``receive_up(phase, cid, msg, sent)`` gets that record back;
* client side: ``receive_down(phase, client, msg, notes)`` and ``send_up(phase, client, msg,
  notes)``, where ``notes`` is this stage's dict for this client's one trip (what the client
  remembers between receiving and replying, never sent).

State lives with its side and under the stage's name (``key``): the server side's in
``state_dict()`` (the run's model state holds it as ``stages[key]``), the client side's in
``client.state[key]`` (saved with the client). ``metrics()`` is logged with the round.

Restrictions are wrappers, not flags (optax's ``masked`` / ``conditionally_transform``):
:class:`Only` runs a stage for some phases and clients only (an attack: training and join uploads
of the malicious clients; compression: training traffic), :class:`Masked` shows it only some entries
(an attack on the model's head). Directions are named by the exchange's :class:`Phase`: ``down`` /
``up`` for training, ``eval_down`` / ``eval_up`` for evaluation, ``join_down`` / ``join_up`` for the
newcomers' join.

Features register a stage factory under their name (:func:`register_stage`); the simulator builds
the run's :class:`Chain` from ``federation.stages`` (:func:`build_stages`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Sequence

from .comm import CommLedger
from .messages import Message, Part
from .state import storages

if TYPE_CHECKING:
    from ..config import ExperimentConfig
    from ..methods.base import ClientHandle, Method
    from .context import RunContext
    from .store import ClientStore

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

    def bind_store(self, store: "ClientStore") -> None:
        """The run's client store, before any message: a stage that keeps something per client
        (a downlink mirror) keeps it in a memory of the store (:meth:`ClientStore.memory`), bounded,
        snapshotted and checkpointed with the client states."""

    def take_tallies(self) -> dict:
        """What the client side counted for ``metrics`` since the last call, reset: a worker process
        (:mod:`pfl.federation.workers`) runs client sides on its own stage objects and hands this
        to the run's stage (:meth:`add_tallies`), whose metrics then count every client."""
        return {}

    def add_tallies(self, tallies: dict) -> None:
        pass


class Chain(Stage):
    """Stages in order: senders' sides first to last, receivers' sides last to first; the state of
    each under its own key."""

    def __init__(self, stages: Sequence[Stage] = ()):
        self.stages = list(stages)
        keys = [s.key for s in self.stages]
        if len(set(keys)) != len(keys) or not all(keys):
            raise ValueError(f"the stages of a chain need distinct non-empty keys, got {keys}")

    def send_down(self, phase, cid, msg):
        for stage in self.stages:
            msg = stage.send_down(phase, cid, msg)
        return msg

    def receive_down(self, phase, client, msg, notes):
        for stage in reversed(self.stages):
            msg = stage.receive_down(phase, client, msg, notes.setdefault(stage.key, {}))
        return msg

    def send_up(self, phase, client, msg, notes):
        for stage in self.stages:
            msg = stage.send_up(phase, client, msg, notes.setdefault(stage.key, {}))
        return msg

    def sent(self, phase, cid, msg):
        return [stage.sent(phase, cid, msg) for stage in self.stages]

    def receive_up(self, phase, cid, msg, sent):
        for stage, record in reversed(list(zip(self.stages, sent))):
            msg = stage.receive_up(phase, cid, msg, record)
        return msg

    def metrics(self):
        out: dict[str, float] = {}
        for stage in self.stages:
            out.update(stage.metrics())
        return out

    def state_dict(self):
        return {s.key: state for s in self.stages if (state := s.state_dict())}

    def load_state_dict(self, state):
        for stage in self.stages:
            stage.load_state_dict((state or {}).get(stage.key, {}))

    def bind_store(self, store):
        for stage in self.stages:
            stage.bind_store(store)

    def take_tallies(self):
        return {s.key: t for s in self.stages if (t := s.take_tallies())}

    def add_tallies(self, tallies):
        for stage in self.stages:
            if stage.key in tallies:
                stage.add_tallies(tallies[stage.key])


class Wrapper(Stage):
    """A stage around another: the inner stage's name, state and metrics."""

    def __init__(self, inner: Stage):
        self.inner = inner
        self.key = inner.key

    def metrics(self):
        return self.inner.metrics()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)

    def bind_store(self, store):
        self.inner.bind_store(store)

    def take_tallies(self):
        return self.inner.take_tallies()

    def add_tallies(self, tallies):
        self.inner.add_tallies(tallies)


class Only(Wrapper):
    """``inner`` acts only in phases of ``phases`` (kinds: train, eval, join) and only for the
    clients of ``clients``; elsewhere messages pass unchanged (None: no restriction)."""

    def __init__(self, inner: Stage, phases: Collection[str] | None = None, clients: Collection[int] | None = None):
        super().__init__(inner)
        self.phases = None if phases is None else frozenset(phases)
        self.clients = None if clients is None else frozenset(clients)

    def acts(self, phase: Phase, cid: int) -> bool:
        return (self.phases is None or phase.kind in self.phases) and (self.clients is None or cid in self.clients)

    def send_down(self, phase, cid, msg):
        return self.inner.send_down(phase, cid, msg) if self.acts(phase, cid) else msg

    def receive_down(self, phase, client, msg, notes):
        return self.inner.receive_down(phase, client, msg, notes) if self.acts(phase, client.cid) else msg

    def send_up(self, phase, client, msg, notes):
        return self.inner.send_up(phase, client, msg, notes) if self.acts(phase, client.cid) else msg

    def sent(self, phase, cid, msg):
        return self.inner.sent(phase, cid, msg) if self.acts(phase, cid) else None

    def receive_up(self, phase, cid, msg, sent):
        return self.inner.receive_up(phase, cid, msg, sent) if self.acts(phase, cid) else msg


class Masked(Wrapper):
    """``inner`` sees only the entries ``select(part, entry name)`` accepts (parts left empty are
    dropped from its view); the others travel unchanged in their places."""

    def __init__(self, inner: Stage, select: Callable[[Part, str], bool]):
        super().__init__(inner)
        self.select = select

    def _apply(self, msg: Message, hook: Callable[[Message], Message]) -> Message:
        view = {}
        for name, part in msg.parts.items():
            chosen = {k: e for k, e in part.entries.items() if self.select(part, k)}
            if chosen:
                view[name] = part.replace(chosen)
        if not view:
            return msg
        done = hook(msg.replace(view))
        parts = {}
        for name, part in msg.parts.items():
            changed = done.parts.get(name)
            parts[name] = part if changed is None else part.replace({**part.entries, **changed.entries})
        return Message(parts, done.info)

    def send_down(self, phase, cid, msg):
        return self._apply(msg, lambda m: self.inner.send_down(phase, cid, m))

    def receive_down(self, phase, client, msg, notes):
        return self._apply(msg, lambda m: self.inner.receive_down(phase, client, m, notes))

    def send_up(self, phase, client, msg, notes):
        return self._apply(msg, lambda m: self.inner.send_up(phase, client, m, notes))

    def sent(self, phase, cid, msg):
        return self.inner.sent(phase, cid, msg)

    def receive_up(self, phase, cid, msg, sent):
        return self._apply(msg, lambda m: self.inner.receive_up(phase, cid, m, sent))


# ---- the registry of stage factories -------------------------------------------------------------

#: ``factory(cfg, ctx, method)`` -> the stage the config asks for, or None
StageFactory = Callable[["ExperimentConfig", "RunContext", "Method"], "Stage | None"]
_FACTORIES: dict[str, StageFactory] = {}


def register_stage(name: str, factory: StageFactory) -> None:
    """Make ``name`` a value of ``federation.stages``; its factory builds the run's stage (often none)."""
    _FACTORIES[name] = factory


def stage_names() -> tuple[str, ...]:
    return tuple(sorted(_FACTORIES))


def build_stages(cfg: "ExperimentConfig", ctx: "RunContext", method: "Method") -> Chain:
    """The run's stages, in the order ``federation.stages`` declares."""
    stages = []
    for name in cfg.federation.stages:
        stage = _FACTORIES[name](cfg, ctx, method)
        if stage is not None:
            stages.append(stage)
    return Chain(stages)


class Wire:
    """The run's delivery: a copy, a chain of stages at both ends, and the ledger between them."""

    def __init__(self, ledger: CommLedger, stages: Chain | None = None):
        self.ledger = ledger
        self.stages = stages if stages is not None else Chain()

    def deliver(self, msg: Message | None, direction: str) -> Message | None:
        """``msg`` on the wire: counted by the ledger."""
        if msg is not None:
            self.ledger.record(msg, direction)
        return msg

    # ---- the two ends of one trip --------------------------------------------------------------
    def send_down(self, phase: Phase, cid: int, msg: Message | None, shared: dict | None = None) -> Message | None:
        """Server → client ``cid``: a copy, the sender's stages, then the wire. ``shared``: the
        clients of a part a worker pool packs share unchanged copies (:func:`.messages.copy_entry`)
        when no stage sees them (a stage may edit the message it is given)."""
        if msg is not None:
            msg = self.stages.send_down(phase, cid, msg.copy(shared=None if self.stages.stages else shared))
        return self.deliver(msg, phase.down)

    def client_side(self, phase: Phase, client: "ClientHandle", down: Message | None,
                    work: ClientSide) -> tuple[Message | None, Any]:
        """On the client: the receiver's stages on ``down``, the client's ``work``, and on a copy of
        its reply the sender's stages (before it goes on the wire)."""
        notes: dict = {}
        if down is not None:
            down = self.stages.receive_down(phase, client, down, notes)
        reply, local = work(client, down)
        if reply is not None:
            # a freshly trained model the client did not keep goes on without a copy (Message.copy);
            # should a stage keep what it sends, the reply is copied after all
            reply = self.stages.send_up(phase, client, reply.copy(storages(client.state)), notes)
            if storages(reply.parts) & storages(client.state):
                reply = reply.copy()
        return reply, local

    def sent(self, phase: Phase, cid: int, down: Message | None) -> list:
        """The server's records of a delivered downlink, taken before the client works on it (the
        client may edit its copy in place)."""
        return [None] * len(self.stages.stages) if down is None else self.stages.sent(phase, cid, down)

    def send_up(self, phase: Phase, cid: int, reply: Message | None, sent: list) -> Message | None:
        """Client ``cid`` → server: the wire, then the receiver's stages (``sent``: the server's
        records of this trip's downlink, :meth:`sent`)."""
        msg = self.deliver(reply, phase.up)
        if msg is not None:
            msg = self.stages.receive_up(phase, cid, msg, sent)
        return msg

    def metrics(self) -> dict[str, float]:
        return self.stages.metrics()


__all__ = ["Chain", "ClientSide", "Masked", "Only", "Phase", "Stage", "Wire", "Wrapper", "build_stages",
           "register_stage", "stage_names"]
