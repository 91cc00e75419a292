"""Compression at the delivery boundary: what is encoded, relative to what, and with whose memory.

The codec is a wire stage (:class:`pfl.federation.wire.Stage`, key ``compression``) that acts on
training traffic only (an :class:`~pfl.federation.wire.Only` wrapper: evaluation and join messages
are never compressed). What it does with an entry follows the *declared kind* of its part
(:mod:`pfl.federation.messages`), never its name.

**What is compressed.** Per tensor: floating tensors of at least ``min_numel`` entries
(``compression.min_numel``, default 256) in every part but ``Scalars``; smaller ones, integer
tensors, a model's running statistics (BatchNorm's, named as the model names them: a variance
must stay positive and they are two numbers a channel) and structured payloads (FedSLR's factor
pairs) travel as they are. Each encoded tensor
costs its :class:`~pfl.federation.messages.Encoded` payload's bits; the ledger counts those.

**Downlink: the change to the client's copy.** For a part the receiver keeps (``Model``, ``State``)
the client holds a replica h of every compressible tensor (``client.state["compression"]["replica"]``)
and the server an identical mirror per client, kept in the run's client store (the memory
``compression/mirror``: bounded by the store's budget, snapshotted and checkpointed with the client
states, so a 100,000-client run does not hold 100,000 model copies in memory). The server sends
C(x − h) and both sides set h ← h + α·C(x − h), with α = 1 for a contractive compressor and
α = 1/(1 + ω) for an unbiased one (ω of that tensor, :meth:`Compressor.omega`). That is the
*contractive form* C' of the compressor (:func:`~pfl.compression.compressors.contractive`): E‖v −
C'(v)‖² ≤ (1 − δ)‖v‖² with δ > 0, so the replica's error obeys e⁺ = (e + Δ) − C'(e + Δ) and stays
within a bound set by how far x moves per round (docs/methods/compression.md §0b). With the
unscaled unbiased C the same recursion multiplies the error by up to √ω per round and diverges. The
first time a tensor reaches a client (no replica yet, or another shape) it is sent dense. Parts the
receiver does not keep (``Update``, ``Logits``) are compressed as values, message by message.

**Uplink.** A ``Model`` part names the downlink part of its trip it relates to, and each tensor is
sent as C(y − r), r the client's decoded copy of that part (a method bug — neither named, or a part
this trip did not carry — stops the run naming the part). ``base`` (trained from it): the server
applies the change to what it *meant* to send, x + (y − r) — with a lossy downlink the replica's
error stays with the client and never enters the server's model. ``ref`` (a model the client keeps
on its own, only compared with the part): the server reconstructs the client's value, r + (y − r).
Without downlink compression r = x and the two agree. Every other part is compressed as its values.
With ``compression.error_feedback`` the client keeps a memory e per tensor in its state
(``client.state["compression"]["ef"]``): it sends C(u + e) and keeps e ← u + e − C(u + e); the
checks (:mod:`.checks`) allow it for contractive compressors only (and identity).

**Randomness.** Every encoding draws from a generator seeded by (run seed, round, client,
direction, part/tensor), so runs are reproducible and a resumed run continues exactly.

Methods that compress inside their own protocol (DIANA's shifted differences, MARINA's coin,
LAG's lazy uploads; ``Method.compresses_uplink``) build their payloads with the same compressor
objects and :func:`encode_update`; the codec passes their uplink through unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Collection, Mapping

import torch

from ..federation.messages import Encoded, Entry, Message, Model, Part, Payload
from ..federation.store import ClientMemory, LocalMemory
from ..federation.wire import Only, Phase, Stage, register_stage
from ..models.functional import buffer_names
from .base import bits_of
from .compressors import Compressor, HalfPrecision, Identity, build, contractive

if TYPE_CHECKING:
    from ..methods.base import ClientHandle, Method

STATE_KEY = "compression"
MIRRORS = "compression/mirror"   # the client store's memory of the server's mirrors
Params = dict[str, torch.Tensor]
GeneratorFor = Callable[[str], torch.Generator]


def compressible(t: object, min_numel: int, name: str = "", dense: Collection[str] = ()) -> bool:
    """Whether entry ``name`` (``part/entry`` or ``entry``) is encoded; ``dense``: entry names sent as
    they are whatever their size (a model's running statistics)."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() >= max(min_numel, 1)
            and not (dense and name.rpartition("/")[2] in dense))


def has_reference(t: torch.Tensor, ref: torch.Tensor | None) -> bool:
    return (ref is not None and isinstance(ref, torch.Tensor) and ref.is_floating_point()
            and ref.shape == t.shape)


def compress_tensor(comp: Compressor, t: torch.Tensor, gen: torch.Generator | None, where: str = "") -> Encoded:
    """``comp`` on one tensor (flattened, computed in float32); the payload's decoded tensor has
    ``t``'s shape and dtype (``identity`` books the dtype's bits, like a dense tensor)."""
    v = t.detach().reshape(-1).to(torch.float32)
    try:
        enc = comp.compress(v, gen)
    except ValueError as err:
        raise ValueError(f"{comp.name} on tensor {where!r}: {err}") from None
    bits = t.numel() * t.element_size() * 8 if isinstance(comp, Identity) else enc.bits
    return Encoded(enc.decoded.view(t.shape).to(t.dtype), bits, enc.values)


def encode_update(comp: Compressor | None, tensors: Mapping[str, Entry], reference: Mapping[str, torch.Tensor] | None,
                  generator: GeneratorFor, min_numel: int = 256, memory: dict[str, torch.Tensor] | None = None,
                  flushed: list[int] | None = None, dense: Collection[str] = ()) -> tuple[dict[str, Entry], Params]:
    """Encode ``tensors``, each as the change to its ``reference`` tensor where it has one.

    Returns the entries (Encoded payloads whose ``decoded`` is the decoded change, or the decoded
    value where there is no reference; other entries unchanged) and what the receiver will
    reconstruct for every entry. ``memory`` (error feedback) is updated in place; ``flushed``
    accumulates [non-zeros sent as 0, non-zeros] of a half-precision encoding. ``comp=None`` sends
    everything as it is, and so are the entries named in ``dense``.
    """
    reference = reference or {}
    entries: dict[str, Entry] = {}
    values: Params = {}
    for name, t in tensors.items():
        if comp is None or not compressible(t, min_numel, name, dense):
            entries[name] = t
            if isinstance(t, (torch.Tensor, Payload)):
                values[name] = t if isinstance(t, torch.Tensor) else t.dense()
            continue
        ref = reference.get(name)
        delta = has_reference(t, ref)
        target = t - ref if delta else t
        if memory is not None:
            e = memory.get(name)
            if e is not None and e.shape == t.shape:
                target = target + e
        enc = compress_tensor(comp, target, generator(name), name)
        if memory is not None:
            memory[name] = target - enc.decoded
        if flushed is not None and isinstance(comp, HalfPrecision):
            nz = target != 0
            flushed[0] += int((nz & (enc.decoded == 0)).sum())
            flushed[1] += int(nz.sum())
        entries[name] = enc
        values[name] = ref + enc.decoded if delta else enc.decoded
    return entries, values


def decode_update(entries: Mapping[str, Entry], reference: Mapping[str, torch.Tensor] | None) -> Params:
    """The receiver's side of :func:`encode_update`: every entry as the tensor it stands for."""
    reference = reference or {}
    out: Params = {}
    for name, e in entries.items():
        if isinstance(e, Encoded):
            ref = reference.get(name)
            out[name] = ref + e.decoded if has_reference(e.decoded, ref) else e.decoded
        elif isinstance(e, Payload):
            out[name] = e.dense()
        else:
            out[name] = e
    return out


def spec_omega(comp: Compressor | None, shapes: Mapping[str, torch.Size | tuple], min_numel: int = 256) -> float:
    """ω of a whole message (blocks: the max over its compressed tensors [docs/methods/seminar.md §2.0]);
    0 without a compressor. Tensors below ``min_numel`` are sent dense (ω = 0)."""
    if comp is None:
        return 0.0
    omegas = [comp.omega(int(torch.Size(s).numel())) for s in shapes.values()
              if int(torch.Size(s).numel()) >= max(min_numel, 1)]
    return max(omegas, default=0.0)


def message_bits(comp: Compressor | None, shapes: Mapping[str, torch.Size | tuple], min_numel: int = 256) -> int:
    """Bits of one message of tensors of these shapes (dense fp32 where not compressed)."""
    total = 0
    for s in shapes.values():
        d = int(torch.Size(s).numel())
        if comp is None or d < max(min_numel, 1):
            total += 32 * d
        else:
            total += 8 * ((bits_of(comp, d) + 7) // 8)
    return total


def _flat(part_name: str, entries: Mapping[str, Entry]) -> dict[str, Entry]:
    """A part's entries under their wire keys ``part/entry`` (generators, replicas, memories)."""
    return {f"{part_name}/{k}": e for k, e in entries.items()}


def _unflat(part_name: str, flat: Mapping[str, Entry]) -> dict[str, Entry]:
    n = len(part_name) + 1
    return {k[n:]: e for k, e in flat.items()}


class Codec(Stage):
    """The simulator's compression of training messages (``compression`` config section; see the
    module docstring). Server side: :meth:`send_down`, :meth:`sent`, :meth:`receive_up`; client side:
    :meth:`receive_down`, :meth:`send_up`."""

    key = STATE_KEY

    def __init__(self, cfg, ctx, own_uplink: bool = False):
        self.ctx = ctx
        self.min_numel = int(cfg.min_numel)
        model = getattr(ctx, "model", None)  # running statistics: always sent as they are
        self.dense = buffer_names(model) if model is not None else frozenset()
        self.error_feedback = bool(cfg.error_feedback)
        up = None if own_uplink else build(cfg.uplink)
        self.up = contractive(up) if up is not None and self.error_feedback else up
        down = build(cfg.downlink)
        self.down = None if down is None else contractive(down)
        self.down_values = down               # parts the receiver does not keep: compressed as values
        # server: what each client's replicas hold (downlink); the run's store once bound
        self._mirrors: ClientMemory = LocalMemory(MIRRORS)
        self._legacy: dict[int, Params] = {}  # mirrors a checkpoint of an earlier pfl kept in this stage's state
        # server: the values it meant to send, for the encoded tensors of a trip not yet completed
        self.pending: dict[int, Params] = {}
        self._flushed = [0, 0]                # this round: non-zeros sent as 0 by fp16/bf16, non-zeros

    @property
    def active(self) -> bool:
        return self.up is not None or self.down is not None

    def bind_store(self, store) -> None:
        self._mirrors = store.memory(MIRRORS)

    def mirror(self, cid: int) -> Params:
        """What client ``cid``'s replicas hold, as the server keeps it (``{}`` before its first downlink)."""
        kept = self._mirrors.load(cid)
        legacy = self._legacy.pop(cid, None)
        return dict(kept) if kept or legacy is None else legacy

    @property
    def mirrors(self) -> dict[int, Params]:
        """Every client's mirror (inspection and tests: costs the population)."""
        self._settle_legacy()
        return self._mirrors.entries()

    def _settle_legacy(self) -> None:
        for cid in list(self._legacy):
            self._mirrors.save(cid, self.mirror(cid))

    def _gen(self, rnd: int, cid: int, direction: str) -> GeneratorFor:
        return lambda name: self.ctx.generator(rnd, cid, "compress", direction, name)

    # ---- downlink ------------------------------------------------------------------------------
    def send_down(self, phase: Phase, cid: int, msg: Message) -> Message:
        """Server side: every compressible tensor of a kept part as C'(value − the client's
        replica); the mirror moves as the replica will."""
        if self.down is None:
            return msg
        mirror = self.mirror(cid)
        meant = self.pending.setdefault(cid, {})
        gen = self._gen(phase.rnd, cid, "down")
        parts: dict[str, Part] = {}
        for pname, part in msg.parts.items():
            if part.control:
                parts[pname] = part
                continue
            if not part.held:
                entries, _ = encode_update(self.down_values, _flat(pname, part.entries), None, gen, self.min_numel,
                                           flushed=self._flushed, dense=self.dense)
                parts[pname] = part.replace(_unflat(pname, entries))
                continue
            entries: dict[str, Entry] = {}
            for name, t in part.entries.items():
                key = f"{pname}/{name}"
                ref = mirror.get(key)
                if not compressible(t, self.min_numel, name, self.dense):
                    entries[name] = t
                elif not has_reference(t, ref):
                    entries[name] = t
                    mirror[key] = t.detach().clone()
                else:
                    enc, _ = encode_update(self.down, {key: t}, {key: ref}, gen, self.min_numel, flushed=self._flushed)
                    entries[name] = enc[key]
                    mirror[key] = ref + enc[key].decoded
                    meant[key] = t
            parts[pname] = part.replace(entries)
        self._mirrors.save(cid, mirror)
        return msg.replace(parts)

    def receive_down(self, phase: Phase, client: "ClientHandle", msg: Message, notes: dict) -> Message:
        """Client side: the downlink as values (replica + decoded change; replicas updated), and the
        client's record of it, the reference of its uplink models."""
        if self.down is not None:
            replica = client.state.setdefault(STATE_KEY, {}).setdefault("replica", {})
            parts: dict[str, Part] = {}
            for pname, part in msg.parts.items():
                entries: dict[str, Entry] = {}
                for name, e in part.entries.items():
                    key = f"{pname}/{name}"
                    if part.held and isinstance(e, Encoded):
                        replica[key] = replica[key] + e.decoded
                        entries[name] = replica[key].clone()
                    elif isinstance(e, Encoded):
                        entries[name] = e.decoded
                    else:
                        if part.held and compressible(e, self.min_numel, name, self.dense):
                            replica[key] = e.detach().clone()
                        entries[name] = e
                parts[pname] = part.replace(entries)
            msg = msg.replace(parts)
        if self.up is not None:
            notes["received"] = {p: {k: v.detach().clone() for k, v in part.tensors().items()}
                                 for p, part in msg.parts.items()}
        return msg

    def sent(self, phase: Phase, cid: int, msg: Message) -> dict | None:
        """The server's record of this trip: ``view``, what the client decoded from ``msg`` as the
        server knows it (the reference of the uplink models), and ``meant``, the values it encoded
        (the base a trained model's change is applied to)."""
        meant = self.pending.pop(cid, {})
        mirror = self.mirror(cid) if self.down is not None else {}
        out: dict[str, Params] = {}
        for pname, part in msg.parts.items():
            view: Params = {}
            for name, e in part.entries.items():
                key = f"{pname}/{name}"
                if part.held and isinstance(e, Encoded):
                    view[name] = mirror[key]
                elif self.up is None:  # nothing to decode: only the encoded tensors are rebased
                    continue
                elif isinstance(e, torch.Tensor):
                    view[name] = e.detach().clone()
                else:
                    view[name] = e.dense().detach().clone()
            out[pname] = view
        return {"view": out, "meant": meant}

    # ---- uplink --------------------------------------------------------------------------------
    def send_up(self, phase: Phase, client: "ClientHandle", msg: Message, notes: dict) -> Message:
        """Client side: every part encoded — a model as the change to its base, the rest as values."""
        if self.up is None:
            return msg
        memory = client.state.setdefault(STATE_KEY, {}).setdefault("ef", {}) if self.error_feedback else None
        received = notes.get("received") or {}
        gen = self._gen(phase.rnd, client.cid, "up")
        parts: dict[str, Part] = {}
        for pname, part in msg.parts.items():
            if part.control:
                parts[pname] = part
                continue
            reference = _flat(pname, self.base(pname, part, received)) if isinstance(part, Model) else None
            entries, _ = encode_update(self.up, _flat(pname, part.entries), reference, gen, self.min_numel, memory,
                                       self._flushed, dense=self.dense)
            parts[pname] = part.replace(_unflat(pname, entries))
        return msg.replace(parts)

    def base(self, pname: str, part: Model, received: Mapping[str, Params]) -> Params:
        """The tensors an uplink model part is sent as a change of: the downlink part it declares
        (``base`` or ``ref``), as the client decoded it."""
        name = part.base or part.ref
        ref = received.get(name) if name is not None else None
        if ref is None:
            raise RuntimeError(f"uplink part {pname!r} is a Model whose base {name!r} is not a part of this "
                               f"trip's downlink ({sorted(received)}); a model must name the downlink part it "
                               "started from or is close to (or be sent as an Update)")
        missing = [k for k, t in part.entries.items()
                   if compressible(t, self.min_numel, k, self.dense) and not has_reference(t, ref.get(k))]
        if missing:
            raise RuntimeError(f"uplink part {pname!r}: entries {missing} have no tensor of the same shape in its "
                               f"base part {name!r}")
        return ref

    def receive_up(self, phase: Phase, cid: int, msg: Message, sent: dict | None) -> Message:
        """Server side: every encoded tensor reconstructed; a model trained from a part this trip
        carried compressed (its ``base``) is the client's change applied to what the server meant to
        send (the replica's error stays with the client: the server's model is never its copy)."""
        sent = sent or {"view": {}, "meant": {}}
        parts: dict[str, Part] = {}
        for pname, part in msg.parts.items():
            rebase = isinstance(part, Model) and part.base is not None
            own = any(isinstance(e, Encoded) for e in part.entries.values())
            if self.up is None and (not rebase or own):
                # a method that encodes its own uplink (LAG) decodes it against the model it sent,
                # which is what the server meant to send: the change lands on the right base already
                parts[pname] = part
                continue
            ref_name = (part.base or part.ref) if isinstance(part, Model) else None
            view = sent["view"].get(ref_name, {}) if ref_name is not None else {}
            values = decode_update(part.entries, view) if self.up is not None else part.tensors()
            if rebase:
                for name in values:
                    meant = sent["meant"].get(f"{part.base}/{name}")
                    if meant is not None and name in view:
                        values[name] = meant + (values[name] - view[name])
            parts[pname] = part.replace(values)
        return msg.replace(parts)

    # ---- state and metrics ---------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``comm/fp16_flushed``: fraction of the non-zeros a half-precision encoding sent as 0 this
        round (of what it was given to encode: with error feedback, the update plus the memory)."""
        out = {}
        if any(isinstance(c, HalfPrecision) for c in (self.up, self.down)):
            out["comm/fp16_flushed"] = self._flushed[0] / self._flushed[1] if self._flushed[1] else 0.0
        self._flushed = [0, 0]
        return out

    def take_tallies(self) -> dict:
        out, self._flushed = ({"flushed": self._flushed} if self._flushed[1] else {}), [0, 0]
        return out

    def add_tallies(self, tallies: dict) -> None:
        self._flushed = [a + b for a, b in zip(self._flushed, tallies.get("flushed", (0, 0)))]

    def state_dict(self) -> dict:
        """The trips in flight (the asynchronous driver): the values they were meant to carry. The
        mirrors are in the client store, whose part of a checkpoint is written after this one."""
        if self.down is None:
            return {}
        self._settle_legacy()
        pending = {int(c): dict(m) for c, m in self.pending.items() if m}
        return {"pending": pending} if pending else {}

    def load_state_dict(self, state: dict) -> None:
        state = state or {}
        # a checkpoint of an earlier pfl kept the mirrors here; the store that is restored after
        # this replaces its memories, so they wait here until each is asked for or the next state_dict
        self._legacy = {int(c): dict(m) for c, m in state.get("mirrors", {}).items()}
        self.pending = {int(c): dict(m) for c, m in state.get("pending", {}).items()}


def codec_stage(cfg, ctx, method: "Method") -> Stage | None:
    """The run's compression stage on training traffic (None without compression)."""
    codec = Codec(cfg.compression, ctx, own_uplink=bool(method.compresses_uplink))
    return Only(codec, phases=("train",)) if codec.active else None


register_stage("compression", codec_stage)

__all__ = ["Codec", "STATE_KEY", "codec_stage", "compress_tensor", "compressible", "decode_update", "encode_update",
           "message_bits", "spec_omega"]
