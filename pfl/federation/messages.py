"""What crosses the wire between server and clients, what each part of it is, and how big it is.

A :class:`Message` is a set of named **parts** plus ``info``. A part is a typed group of named
entries (Flower's typed records): its *class* says what it carries, and so how the stages of the
wire (:mod:`pfl.federation.wire`: compression, attacks) treat it; its name only identifies it.

==========  =====================================================================================
kind        what it is, and how compression treats it (:mod:`pfl.compression.codec`)
==========  =====================================================================================
``Model``   model parameters, or a model-shaped quantity the receiver keeps (a pull target, a
            shared body). Downlink: sent as the change to the copy the client already holds (its
            replica of this part). Uplink: sent as the change to a downlink part of its trip — the
            one it was trained from, ``base`` (FedAvg: ``base="model"``; IFCA: the cluster it
            picked), and the server applies that change to what it meant to send; or, for a model
            the client keeps on its own (FPFC's w_i, FedSplit's z_j), one it is close to, ``ref``,
            and the server gets the client's value.
``State``   a state or control variate the receiver keeps (SCAFFOLD's c, a data basis).
            Downlink: as a change to the client's replica, like ``Model``; uplink: its values.
``Update``  a change (SCAFFOLD's Δy and Δc, CFL's Δθ, a method's own encoded difference): its values.
``Logits``  outputs on shared inputs (PerFed-CKT): its values.
``Scalars`` small or integer control values (IFCA's cluster index, LAG's threshold and skip flag):
            never compressed, never rewritten by an attack.
==========  =====================================================================================

An entry is either a tensor (counted as ``numel × element_size`` bytes) or a structured payload
that knows its own wire size: a low-rank factor pair (:class:`LowRank`) or an encoded vector
(:class:`Encoded`, a compressed tensor whose bit count comes from the encoding). The ledger counts
every delivered message, so communication is measured from what was sent. ``info`` carries small
control data that is never model or data content and is not counted (a sample count, a loss, flags).

Delivery hands the receiver :meth:`Message.copy`: tensors that share no storage with what the
sender keeps, so an in-place edit by the receiver can never reach the sender's state.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Collection, Iterator, Mapping, Union

import torch

from ..training import HANDED_OVER
from .state import checkpointable, clone


class Payload:
    """A structured message entry. Subclasses define the wire size and the dense value."""

    def nbytes(self) -> int:
        raise NotImplementedError

    def num_params(self) -> int:
        """Number of scalar values on the wire (for ``comm/params_sent``)."""
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        raise NotImplementedError

    def copy(self) -> "Payload":
        """The receiver's own copy (no storage shared with the sender's)."""
        return clone(self)


@checkpointable
@dataclass
class LowRank(Payload):
    """A matrix sent as factors ``left @ right`` (left: rows×r, right: r×cols).

    ``shape`` is the shape of the tensor the product is reshaped into by ``unfold`` (the receiver's
    inverse of the sender's matrix view); ``None`` means the product itself.
    """
    left: torch.Tensor
    right: torch.Tensor
    shape: tuple[int, ...] | None = None

    @property
    def rank(self) -> int:
        return int(self.left.shape[1])

    def nbytes(self) -> int:
        return (self.left.numel() + self.right.numel()) * self.left.element_size()

    def num_params(self) -> int:
        return self.left.numel() + self.right.numel()

    def dense(self) -> torch.Tensor:
        return self.left @ self.right


@checkpointable
@dataclass
class Encoded(Payload):
    """An encoded tensor: ``decoded`` is what the receiver reconstructs, ``bits`` what was sent."""
    decoded: torch.Tensor
    bits: int
    values: int = 0  # scalar values on the wire (e.g. k for top-k), for comm/params_sent

    def nbytes(self) -> int:
        return math.ceil(self.bits / 8)

    def num_params(self) -> int:
        return self.values

    def dense(self) -> torch.Tensor:
        return self.decoded


Entry = Union[torch.Tensor, Payload]
Params = dict[str, torch.Tensor]


def entry_nbytes(entry: Entry) -> int:
    if isinstance(entry, torch.Tensor):
        return entry.numel() * entry.element_size()
    if isinstance(entry, Payload):
        return entry.nbytes()
    raise TypeError(f"message entries must be tensors or Payloads, got {type(entry).__name__}")


def entry_params(entry: Entry) -> int:
    if isinstance(entry, torch.Tensor):
        return entry.numel()
    return entry.num_params()


def dense(entry: Entry) -> torch.Tensor:
    return entry if isinstance(entry, torch.Tensor) else entry.dense()


def copy_entry(entry: Entry, kept: Collection[int] | None = None, shared: dict | None = None) -> Entry:
    """The receiver's own copy of ``entry``. ``kept``: the storages (``untyped_storage().data_ptr()``)
    of every tensor the sender still holds; a tensor its producer handed over
    (:func:`pfl.training.handed_over`, e.g. a freshly trained model) whose storage is not among them
    is held by nobody else and passes as it is (the copy would protect nothing), no longer marked.
    ``shared``: receivers that will not edit what they get (a worker pool packs it, each client then
    gets its own) share one copy of a tensor the sender has not changed since (same object, same
    version counter: every in-place operation bumps it), kept in this dict."""
    if not isinstance(entry, torch.Tensor):
        return entry.copy()
    if kept is not None and entry.__dict__.pop(HANDED_OVER, False) and entry.untyped_storage().data_ptr() not in kept:
        return entry
    if shared is None:
        return entry.detach().clone()
    source, version, copy = shared.get(id(entry), (None, -1, None))
    if source is not entry or version != entry._version:
        copy = entry.detach().clone()
        shared[id(entry)] = (entry, entry._version, copy)
    return copy


# ---- parts -------------------------------------------------------------------------------------

@dataclass
class Part:
    """A typed group of named entries (see the module docstring for the kinds)."""
    entries: dict[str, Entry] = field(default_factory=dict)

    kind: ClassVar[str] = ""
    #: the receiver keeps a copy of it, so a downlink sends its change to that copy
    held: ClassVar[bool] = False
    #: travels as it is: no compression, no attack
    control: ClassVar[bool] = False

    def tensors(self) -> Params:
        """Dense view of every entry (decoding payloads)."""
        return {k: dense(e) for k, e in self.entries.items()}

    def replace(self, entries: Mapping[str, Entry]) -> "Part":
        """The same kind of part (same declarations) with other entries."""
        return dataclasses.replace(self, entries=dict(entries))

    def nbytes(self) -> int:
        return sum(entry_nbytes(e) for e in self.entries.values())

    def num_params(self) -> int:
        return sum(entry_params(e) for e in self.entries.values())


@checkpointable
@dataclass
class Model(Part):
    """Model parameters (module docstring). On an uplink, ``base``: the downlink part of this trip the
    model was trained from (its change is sent and applied to the server's own copy of that part);
    ``ref``: a downlink part it is only compared with (its change is sent, its value received)."""
    base: str | None = None
    ref: str | None = None
    kind: ClassVar[str] = "model"
    held: ClassVar[bool] = True


@checkpointable
@dataclass
class State(Part):
    """A state or control variate the receiver keeps (SCAFFOLD's c; a data basis)."""
    kind: ClassVar[str] = "state"
    held: ClassVar[bool] = True


@checkpointable
@dataclass
class Update(Part):
    """A change (Δy, Δc, Δθ, an encoded difference)."""
    kind: ClassVar[str] = "update"


@checkpointable
@dataclass
class Logits(Part):
    """Outputs on inputs both sides share (PerFed-CKT's public-set logits and centroids)."""
    kind: ClassVar[str] = "logits"


@checkpointable
@dataclass
class Scalars(Part):
    """Small or integer control values; never compressed, never attacked."""
    kind: ClassVar[str] = "scalar"
    control: ClassVar[bool] = True


KINDS: dict[str, type[Part]] = {cls.kind: cls for cls in (Model, State, Update, Logits, Scalars)}


# ---- messages ----------------------------------------------------------------------------------

@checkpointable
@dataclass
class Message(Mapping[str, Part]):
    """Named typed parts sent in one direction to or from one client (module docstring).

    ``info`` carries small control data that is not part of the payload size (round numbers,
    flags): it must never hold model or data content.
    """
    parts: dict[str, Part] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for name, part in self.parts.items():
            if not isinstance(part, Part):
                raise TypeError(f"message part {name!r} must be a Part (Model, State, Update, Logits, Scalars), "
                                f"got {type(part).__name__}")

    def __getitem__(self, name: str) -> Part:
        return self.parts[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts.values())

    def num_params(self) -> int:
        return sum(p.num_params() for p in self.parts.values())

    def tensors(self, name: str | None = None) -> Params:
        """Dense tensors of part ``name`` (default: the message's only part; {} when it has none)."""
        if name is None:
            if not self.parts:
                return {}
            if len(self.parts) > 1:
                raise KeyError(f"the message has parts {list(self.parts)}; name the one to read")
            name = next(iter(self.parts))
        return self.parts[name].tensors()

    def params(self, *names: str) -> Params:
        """The dense tensors of the parts ``names`` (default: every part) in one dict: for parts that
        are disjoint pieces of one model (FPFC's clustered layers and shared body)."""
        out: Params = {}
        for name in names or tuple(self.parts):
            if name not in self.parts:
                continue
            for k, t in self.parts[name].tensors().items():
                if k in out:
                    raise KeyError(f"entry {k!r} is in more than one of the parts {names or list(self.parts)}")
                out[k] = t
        return out

    def copy(self, kept: Collection[int] | None = None, shared: dict | None = None) -> "Message":
        """What the receiver gets: every tensor copied (but handed-over ones the sender did not keep,
        ``kept``, and copies receivers share, ``shared``: see :func:`copy_entry`), ``info`` a new dict."""
        return Message({name: p.replace({k: copy_entry(e, kept, shared) for k, e in p.entries.items()})
                        for name, p in self.parts.items()}, dict(self.info))

    def replace(self, parts: Mapping[str, Part]) -> "Message":
        """The same message (same ``info``) with other parts."""
        return Message(dict(parts), self.info)

    @staticmethod
    def of(parts: Mapping[str, Part], **info: Any) -> "Message":
        return Message(dict(parts), dict(info))

    @staticmethod
    def model(params: Mapping[str, Entry], base: str | None = None, name: str = "model", **info: Any) -> "Message":
        """A message of one :class:`Model` part (``name``, default ``model``): what most methods send.
        On an uplink, ``base`` names the downlink part the model was trained from."""
        return Message({name: Model(dict(params), base=base)}, dict(info))


__all__ = ["Encoded", "Entry", "KINDS", "LowRank", "Logits", "Message", "Model", "Part", "Payload", "Scalars",
           "State", "Update", "dense", "entry_nbytes", "entry_params"]
