"""Compression at the delivery boundary: what is encoded, relative to what, and with whose memory.

**What is compressed.** Per tensor of a message: floating tensors of at least ``min_numel``
entries (``compression.min_numel``, default 256) are encoded; smaller ones, integer tensors (IFCA's
cluster index) and structured payloads (FedSLR's factor pairs) travel as they are. Each encoded
tensor costs its :class:`~pfl.federation.messages.Encoded` payload's bits; the ledger counts those.

**Uplink: the update.** An uplink tensor that has a *reference* — by default the tensor of the same
name and shape in the downlink the client received this round (a method may say otherwise with
:meth:`pfl.methods.base.Method.update_reference`; IFCA: the cluster model it chose) — is sent as
the compressed update ``C(trained − received)`` and reconstructed by the server as ``received +
decoded``. Without a reference (SCAFFOLD's Δy and Δc, which already are updates; PerFed-CKT's
logits; PACFL's one-shot basis; a FedPD upload after a skipped round) the value itself is compressed.
With ``compression.error_feedback`` the client keeps a memory e per tensor in its own state
(``client.state["compression"]["ef"]``, checkpointed with it): it sends ``C(u + e)`` and keeps
``e ← u + e − C(u + e)``.

**Downlink: the change since the client's copy.** The client keeps a replica of every compressible
downlink tensor (what it decoded last time, ``client.state["compression"]["replica"]``) and the
server an identical mirror per client (server state, checkpointed); a tensor is sent as
``C(value − replica)`` and both sides set ``replica ← replica + decoded``. The first time a name
reaches a client (no replica yet, or another shape) it is sent dense. Because the next difference is
taken to the *decoded* replica, the compression error of one round is sent again in the next: the
downlink scheme is error feedback by construction and has no separate option. It costs N model
copies on the server.

**Randomness.** Every encoding draws from a generator seeded by (run seed, round, client,
direction, tensor name), so runs are reproducible and a resumed run continues exactly.

Methods that compress inside their own protocol (DIANA's shifted differences, MARINA's coin,
LAG's lazy uploads; ``Method.compresses_uplink``) build their payloads with the same compressor
objects and :func:`encode_update`; the codec passes their uplink through unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

import torch

from ..federation.messages import Encoded, Entry, Message, Payload
from ..federation.wire import Phase, Stage
from .compressors import Compressor, HalfPrecision, build

if TYPE_CHECKING:
    from ..methods.base import ClientHandle, Method

STATE_KEY = "compression"
Params = dict[str, torch.Tensor]
GeneratorFor = Callable[[str], torch.Generator]


def compressible(t: object, min_numel: int) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() >= max(min_numel, 1)


def has_reference(t: torch.Tensor, ref: torch.Tensor | None) -> bool:
    return (ref is not None and isinstance(ref, torch.Tensor) and ref.is_floating_point()
            and ref.shape == t.shape)


def compress_tensor(comp: Compressor, t: torch.Tensor, gen: torch.Generator | None, where: str = "") -> Encoded:
    """``comp`` on one tensor (flattened, computed in float32); the payload's decoded tensor has
    ``t``'s shape and dtype."""
    v = t.detach().reshape(-1).to(torch.float32)
    try:
        enc = comp.compress(v, gen)
    except ValueError as err:
        raise ValueError(f"{comp.name} on tensor {where!r}: {err}") from None
    return Encoded(enc.decoded.view(t.shape).to(t.dtype), enc.bits, enc.values)


def encode_update(comp: Compressor | None, tensors: Mapping[str, Entry], reference: Mapping[str, torch.Tensor] | None,
                  generator: GeneratorFor, min_numel: int = 256,
                  memory: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, Entry], Params]:
    """Encode ``tensors`` as updates of ``reference`` (see the module docstring).

    Returns the message entries (Encoded payloads whose ``decoded`` is the decoded *update*, or the
    decoded value where there is no reference; other entries unchanged) and what the receiver will
    reconstruct for every tensor entry. ``memory`` (error feedback) is updated in place.
    ``comp=None`` sends everything as it is.
    """
    reference = reference or {}
    entries: dict[str, Entry] = {}
    values: Params = {}
    for name, t in tensors.items():
        if comp is None or not compressible(t, min_numel):
            entries[name] = t
            if isinstance(t, torch.Tensor):
                values[name] = t
            elif isinstance(t, Payload):
                values[name] = t.dense()
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
            total += 8 * ((_bits_of(comp, d) + 7) // 8)
    return total


def _bits_of(comp: Compressor, d: int) -> int:
    if hasattr(comp, "bits"):
        return int(comp.bits(d))  # type: ignore[attr-defined]
    return int(comp.compress(torch.zeros(d), torch.Generator().manual_seed(0)).bits)


class Codec(Stage):
    """The simulator's compression of training messages (``compression`` config section): a wire
    stage (:class:`pfl.federation.wire.Stage`) that acts on the ``train`` phase only, so evaluation
    and join messages are never compressed.

    Server side: :meth:`encode_down`, :meth:`server_view`, :meth:`decode_up`; client side:
    :meth:`decode_down`, :meth:`encode_up`.
    """

    key = "codec"

    def __init__(self, cfg, ctx, method: "Method", client_role: "Method | None" = None):
        self.ctx = ctx
        self.method = method
        self.client_role = client_role if client_role is not None else method
        self.min_numel = int(cfg.min_numel)
        self.error_feedback = bool(cfg.error_feedback)
        self.up = None if method.compresses_uplink else build(cfg.uplink)
        self.down = build(cfg.downlink)
        self.mirrors: dict[int, Params] = {}  # server: what each client decoded last (downlink)
        self._flushed = [0, 0]                # this round: non-zeros sent as 0 by fp16/bf16, non-zeros

    @property
    def active(self) -> bool:
        return self.up is not None or self.down is not None

    def _gen(self, rnd: int, cid: int, direction: str) -> GeneratorFor:
        return lambda name: self.ctx.generator(rnd, cid, "compress", direction, name)

    def _count_flushed(self, comp: Compressor, sent: Mapping[str, Entry], targets: Mapping[str, torch.Tensor]) -> None:
        if not isinstance(comp, HalfPrecision):
            return
        for name, e in sent.items():
            if isinstance(e, Encoded) and name in targets:
                nz = targets[name] != 0
                self._flushed[0] += int((nz & (e.decoded == 0)).sum())
                self._flushed[1] += int(nz.sum())

    # ---- the stage's hooks ----------------------------------------------------------------------
    def send_down(self, phase: Phase, cid: int, msg: Message) -> Message:
        return self.encode_down(msg, phase.rnd, cid) if phase.kind == "train" else msg

    def receive_down(self, phase: Phase, client: "ClientHandle", msg: Message, notes: dict) -> Message:
        if phase.kind != "train":
            return msg
        msg = self.decode_down(msg, client)
        if self.up is not None:  # the client's own record of what it received: the update's reference
            notes["received"] = {k: v.detach().clone() for k, v in msg.tensors().items()}
        return msg

    def send_up(self, phase: Phase, client: "ClientHandle", msg: Message, notes: dict) -> Message:
        if phase.kind != "train":
            return msg
        return self.encode_up(msg, phase.rnd, client, notes.get("received"), self.client_role)

    def sent(self, phase: Phase, cid: int, msg: Message) -> Params | None:
        # what the client decoded, as the server knows it: the reference of the uplink's updates
        return self.server_view(msg, cid) if phase.kind == "train" and self.up is not None else None

    def receive_up(self, phase: Phase, cid: int, msg: Message, sent: Params | None) -> Message:
        if phase.kind != "train" or self.up is None:
            return msg
        return self.decode_up(msg, phase.rnd, sent, self.method)

    # ---- downlink ------------------------------------------------------------------------------
    def encode_down(self, msg: Message, rnd: int, cid: int) -> Message:
        """Server side: every compressible tensor as C(value − the client's replica)."""
        if self.down is None:
            return msg
        mirror = self.mirrors.setdefault(cid, {})
        gen = self._gen(rnd, cid, "down")
        entries: dict[str, Entry] = {}
        targets: Params = {}
        for name, t in msg.entries.items():
            if not compressible(t, self.min_numel):
                entries[name] = t
                continue
            ref = mirror.get(name)
            if not has_reference(t, ref):
                entries[name] = t
                mirror[name] = t.detach().clone()
                continue
            targets[name] = t - ref
            enc = compress_tensor(self.down, targets[name], gen(name), name)
            entries[name] = enc
            mirror[name] = ref + enc.decoded
        self._count_flushed(self.down, entries, targets)
        return Message(entries, msg.info)

    def decode_down(self, msg: Message | None, client: "ClientHandle") -> Message | None:
        """Client side: the downlink as values (replica + decoded change); replicas updated."""
        if self.down is None or msg is None:
            return msg
        replica = client.state.setdefault(STATE_KEY, {}).setdefault("replica", {})
        entries: dict[str, Entry] = {}
        for name, e in msg.entries.items():
            if isinstance(e, Encoded):
                value = replica[name] + e.decoded
                replica[name] = value
                entries[name] = value.clone()
            else:
                if compressible(e, self.min_numel):
                    replica[name] = e.detach().clone()
                entries[name] = e
        return Message(entries, msg.info)

    def server_view(self, msg: Message | None, cid: int) -> Params | None:
        """What the server knows client ``cid`` decoded from ``msg`` (its own copy)."""
        if msg is None:
            return None
        mirror = self.mirrors.get(cid, {}) if self.down is not None else {}
        out: Params = {}
        for name, e in msg.entries.items():
            if isinstance(e, Encoded) and name in mirror:
                out[name] = mirror[name]
            elif isinstance(e, torch.Tensor):
                out[name] = e.detach().clone()
            elif isinstance(e, Payload):
                out[name] = e.dense().detach().clone()
        return out

    # ---- uplink --------------------------------------------------------------------------------
    def encode_up(self, reply: Message | None, rnd: int, client: "ClientHandle", received: Params | None,
                  method: "Method") -> Message | None:
        """Client side: the reply with its tensors encoded as updates of what the client received."""
        if self.up is None or reply is None:
            return reply
        memory = (client.state.setdefault(STATE_KEY, {}).setdefault("ef", {}) if self.error_feedback else None)
        reference = method.update_reference(rnd, received, reply)
        entries, _ = encode_update(self.up, reply.entries, reference, self._gen(rnd, client.cid, "up"),
                                   self.min_numel, memory)
        if isinstance(self.up, HalfPrecision):
            targets = {k: (reply.entries[k] - reference[k] if has_reference(reply.entries[k], reference.get(k))
                           else reply.entries[k]) for k, e in entries.items() if isinstance(e, Encoded)}
            self._count_flushed(self.up, entries, targets)
        return Message(entries, reply.info)

    def decode_up(self, msg: Message | None, rnd: int, sent: Params | None, method: "Method") -> Message | None:
        """Server side: the delivered reply with every encoded tensor reconstructed."""
        if self.up is None or msg is None:
            return msg
        reference = method.update_reference(rnd, sent, msg)
        return Message(dict(decode_update(msg.entries, reference)), msg.info)

    # ---- state and metrics ---------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``comm/fp16_flushed``: fraction of the non-zeros a half-precision encoding sent as 0 this round."""
        out = {}
        comp = self.up if isinstance(self.up, HalfPrecision) else self.down
        if isinstance(comp, HalfPrecision):
            out["comm/fp16_flushed"] = self._flushed[0] / self._flushed[1] if self._flushed[1] else 0.0
        self._flushed = [0, 0]
        return out

    def state_dict(self) -> dict:
        return {"mirrors": {int(c): dict(m) for c, m in self.mirrors.items()}} if self.down is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self.mirrors = {int(c): dict(m) for c, m in (state or {}).get("mirrors", {}).items()}


__all__ = ["Codec", "STATE_KEY", "compress_tensor", "compressible", "decode_update", "encode_update",
           "message_bits", "spec_omega"]
