"""What crosses the wire between server and clients, and how big it is.

A :class:`Message` is a mapping of names to entries. An entry is either a tensor (counted as
``numel × element_size`` bytes) or a structured payload that knows its own wire size: a low-rank
factor pair (:class:`LowRank`) or an encoded vector (:class:`Encoded`, e.g. a compressed update
whose bit count comes from the encoding, not from the decoded dense tensor). The simulator counts
every message it delivers, so communication is measured from what was sent.

Delivery hands the receiver :meth:`Message.copy`: tensors that share no storage with what the
sender keeps, so an in-place edit by the receiver or by a transform on the way (compression, an
attack) can never reach the sender's state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Collection, Iterator, Mapping, Union

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


def _moved(t: torch.Tensor, kept: Collection[int] | None) -> torch.Tensor:
    if kept is not None and t.__dict__.pop(HANDED_OVER, False) and t.untyped_storage().data_ptr() not in kept:
        return t
    return t.detach().clone()


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


@checkpointable
@dataclass
class Message(Mapping[str, Entry]):
    """Named tensors/payloads sent in one direction to or from one client.

    ``info`` carries small control data that is not part of the payload size (round numbers,
    flags): it must never hold model or data content.
    """
    entries: dict[str, Entry] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Entry:
        return self.entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def nbytes(self) -> int:
        return sum(entry_nbytes(e) for e in self.entries.values())

    def num_params(self) -> int:
        return sum(entry_params(e) for e in self.entries.values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Dense view of every entry (decoding payloads)."""
        return {k: dense(e) for k, e in self.entries.items()}

    def copy(self, kept: Collection[int] | None = None) -> "Message":
        """What the receiver gets: every tensor copied, ``info`` a new dict.

        ``kept``: the storages (``untyped_storage().data_ptr()``) of every tensor the sender still
        holds. A tensor its producer handed over (:func:`pfl.training.handed_over`, e.g. a freshly
        trained model) whose storage is not among them is held by nobody but this message: it
        passes as it is (the copy would protect nothing), and is no longer marked."""
        entries = {k: (_moved(e, kept) if isinstance(e, torch.Tensor) else e.copy()) for k, e in self.entries.items()}
        return Message(entries, dict(self.info))

    @staticmethod
    def of(tensors: Mapping[str, Entry], **info: Any) -> "Message":
        return Message(dict(tensors), dict(info))
