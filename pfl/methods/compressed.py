"""What the methods that compress inside their own protocol share (DIANA, ADIANA, MARINA, LAG):
the compressor ``compression.uplink`` names (the same objects the simulator's codec uses), its ω,
the generators of their encodings, and the full-participation check of the methods that need it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..compression import Compressor, build, message_bits, spec_omega
from ..schema import ConfigError

if TYPE_CHECKING:
    from ..federation.context import RunContext


def uplink_compressor(ctx: "RunContext") -> tuple[Compressor | None, int]:
    """The ``compression.uplink`` compressor (None: send dense) and ``compression.min_numel``."""
    cfg = ctx.cfg.compression
    return build(cfg.uplink), int(cfg.min_numel)


def model_shapes(ctx: "RunContext") -> dict[str, torch.Size]:
    return {k: p.shape for k, p in ctx.model.named_parameters()}


def model_omega(ctx: "RunContext") -> float:
    """ω of one compressed model-sized message: the max over its compressed tensors."""
    comp, min_numel = uplink_compressor(ctx)
    return spec_omega(comp, model_shapes(ctx), min_numel)


def model_bits_ratio(ctx: "RunContext") -> float:
    """bits of one compressed model-sized message / bits of the dense one (fp32)."""
    comp, min_numel = uplink_compressor(ctx)
    shapes = model_shapes(ctx)
    dense = 32 * sum(int(s.numel()) for s in shapes.values())
    return message_bits(comp, shapes, min_numel) / dense if dense else 1.0


def generators(ctx: "RunContext", rnd: int, cid: int, tag: str = ""):
    """name -> generator of one encoding, seeded by (run seed, round, client, 'compress', 'up', tag, name)."""
    return lambda name: ctx.generator(rnd, cid, "compress", "up", tag, name)


def full_participation(ctx: "RunContext") -> bool:
    """Every member (newcomers are not: they join after training) in every round."""
    k = ctx.cfg.federation.clients_per_round
    return k == 0 or k >= ctx.num_members


def require_full_participation(ctx: "RunContext", method: str, why: str) -> None:
    if not full_participation(ctx):
        raise ConfigError("federation.clients_per_round",
                          f"{method} needs every client in every round ({why}); set 0 (all) or at least "
                          f"the {ctx.num_members} training clients, got {ctx.cfg.federation.clients_per_round}")


__all__ = ["full_participation", "generators", "model_bits_ratio", "model_omega", "model_shapes",
           "require_full_participation", "uplink_compressor"]
