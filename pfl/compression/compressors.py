"""Compressors: one vector in, one :class:`~pfl.federation.messages.Encoded` payload out.

A compressor maps a 1-D float tensor ``v`` (a tensor of a message, flattened) to what the receiver
reconstructs (``Encoded.decoded``, same length) and the number of bits its encoding takes on the
wire (``Encoded.bits``, from the formulas below, for the encoding actually produced). Randomness
comes only from the generator it is given (the codec seeds one per (run seed, round, client,
direction, tensor)), so a compressed run is reproducible and resumes exactly.

Formulas (docs/methods/seminar.md §2, docs/methods/compression.md; f_b = 32 bits per float, d = len(v),
⌈log2 d⌉ = bits of one index):

=================  ============================================  ==========  ==========================
name               decoded value                                 unbiased    bits
=================  ============================================  ==========  ==========================
identity           v                                             yes (ω=0)   f·d (f = the dtype's bits)
fp16 / bf16        v rounded to half precision (nearest even)    no          16d
pquant (p, s, b)   sign(v)‖v‖_p ξ/s per bucket of b, ξ_i =       yes         32⌈d/b⌉ + d⌈log2(2s+1)⌉
                   ⌊r_i⌋ + Be(r_i − ⌊r_i⌋), r_i = s|v_i|/‖v‖_p               (``packing: base``:
                                                                             32⌈d/b⌉ + 8⌈d/m⌉, m
                                                                             symbols per byte)
qsgd (s, b)        pquant(p=2)                                   yes         as pquant
terngrad (b)       pquant(p=∞, s=1), b = null: per tensor        yes         32 + 2d
natural            random rounding to a power of two             yes (1/8)   9d
randk (ratio)      (d/k)·v on k uniform indices (scale: false:   yes / no    32k + 32 (seed) or
                   v on them)                                                32k + min(k⌈log2 d⌉, d)
topk (ratio)       v on the k largest |v_i| (ties: lower index)  no          min(k(32+⌈log2 d⌉), d+32k)
sign               sign(v) (sign(0) = +1); scaled: ‖v‖₁/d·sign   no          d; scaled d + 32
=================  ============================================  ==========  ==========================

k = ⌈ratio·d⌉ (at least 1). ω (:meth:`Compressor.omega`) is the variance constant of the unbiased
ones, E‖C(v) − v‖² ≤ ω‖v‖²: QSGD min(b/s², √b/s) (the paper's, conservative), TernGrad (√b − 1)/2
(exact), other (p, s) min(b^{1/r}/s, b^{2/r}/(4s²)) with r = min(p, 2), rand-k d/k − 1, natural 1/8.
DIANA's, ADIANA's and MARINA's default step sizes are computed from it.

The interface every compressor implements, :class:`Compressor`, and :class:`Scaled` are in :mod:`.base`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..federation.messages import Encoded
from ..registry import Registry
from ..schema import ConfigError, from_dict, hp, to_dict
from .base import Compressor, Scaled

FLOAT_BITS = 32


def index_bits(d: int) -> int:
    """⌈log2 d⌉: bits of one index into a vector of ``d`` entries."""
    return max(d - 1, 0).bit_length()


def _uniform(n: int, gen: torch.Generator | None, like: torch.Tensor) -> torch.Tensor:
    """n uniforms in [0, 1) from ``gen`` (drawn on the CPU, so a seed gives the same values on any
    device), as ``like``'s device and float32."""
    return torch.rand(n, generator=gen).to(like.device)


# ---- identity and half precision --------------------------------------------------------------

@dataclass
class NoParams:
    """This compressor has no parameters."""


class Identity(Compressor):
    name = "identity"
    description = "no compression, sent as an encoded payload of the dtype's bits per entry (tests, DIANA with C = I)"
    Params = NoParams
    unbiased = True

    def compress(self, v: torch.Tensor, gen: torch.Generator | None = None) -> Encoded:
        return Encoded(v.clone(), FLOAT_BITS * v.numel(), v.numel())


@dataclass
class HalfParams:
    overflow: str = hp("error", "|v_i| beyond the fp16 range (≥ 65520): 'error' stops the run naming the "
                       "tensor, 'saturate' sends ±65504 (bf16 has fp32's range and never overflows)",
                       choices=("error", "saturate"))


class HalfPrecision(Compressor):
    name = "fp16"
    description = "IEEE half precision, round to nearest even (16 bits/entry; biased, relative error ≤ 2⁻¹¹)"
    Params = HalfParams
    contractive = True  # |round(v) − v| < |v| entrywise, flushes and saturation included
    dtype: ClassVar[torch.dtype] = torch.float16

    def compress(self, v: torch.Tensor, gen: torch.Generator | None = None) -> Encoded:
        if self.dtype == torch.float16:
            big = v.abs() >= 65520.0
            if bool(big.any()):
                if self.p.overflow == "error":
                    raise ValueError(f"{int(big.sum())} entries of magnitude ≥ 65520 overflow fp16 "
                                     f"(largest {float(v.abs().max()):.4g}); use compression.*.overflow=saturate "
                                     "or name=bf16")
                v = v.clamp(-65504.0, 65504.0)
        return Encoded(v.to(self.dtype).to(torch.float32), 16 * v.numel(), v.numel())


class BFloat16(HalfPrecision):
    name = "bf16"
    description = "bfloat16, round to nearest even (16 bits/entry; biased, relative error ≤ 2⁻⁸, fp32 range)"
    dtype = torch.bfloat16


# ---- (p, s)-quantization and its presets ------------------------------------------------------

def _norm_p(x: torch.Tensor, p: float) -> torch.Tensor:
    """Row-wise ‖·‖_p of a (buckets, b) tensor."""
    if math.isinf(p):
        return x.abs().amax(dim=1)
    return torch.linalg.vector_norm(x, ord=p, dim=1)


@dataclass
class PQuantParams:
    p: float = hp(2.0, "norm ‖·‖_p the levels are relative to (2: QSGD; inf: TernGrad)", low=1.0, allow_inf=True)
    s: int = hp(7, "quantization levels per sign (1: ternary); ⌈log2(2s+1)⌉ bits per entry", low=1)
    bucket: int | None = hp(512, "entries per norm (one float each); null: one norm per tensor", low=1)
    packing: str = hp("fixed", "'fixed': ⌈log2(2s+1)⌉ bits per entry; 'base': m = ⌊log_{2s+1} 256⌋ "
                      "entries per byte (TernGrad: 5 trits/byte)", choices=("fixed", "base"))


class PQuant(Compressor):
    name = "pquant"
    description = "(p, s)-quantization: unbiased random rounding of |v_i|/‖v‖_p to s levels, per bucket"
    Params = PQuantParams
    unbiased = True

    def levels_bits(self, d: int) -> int:
        s = self.p.s
        symbols = 2 * s + 1
        if self.p.packing == "base":
            per_byte = 0
            while symbols ** (per_byte + 1) <= 256:
                per_byte += 1
            if per_byte:
                return 8 * math.ceil(d / per_byte)
        return d * index_bits(symbols)

    def buckets(self, d: int) -> int:
        return 1 if self.p.bucket is None else math.ceil(d / self.p.bucket)

    def bits(self, d: int) -> int:
        return FLOAT_BITS * self.buckets(d) + self.levels_bits(d)

    def quantize(self, v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The decoded vector for given uniforms ``u`` (one per entry); deterministic."""
        d = v.numel()
        b = d if self.p.bucket is None else min(self.p.bucket, d)
        nb = math.ceil(d / b) if d else 0
        pad = nb * b - d
        x = torch.nn.functional.pad(v, (0, pad)).view(nb, b)
        uu = torch.nn.functional.pad(u, (0, pad)).view(nb, b)
        s = float(self.p.s)
        norm = _norm_p(x, self.p.p).unsqueeze(1)
        safe = torch.where(norm > 0, norm, torch.ones_like(norm))
        r = (s * x.abs() / safe).clamp_(0.0, s)
        low = r.floor()
        xi = low + (uu < (r - low)).to(r.dtype)
        out = torch.sign(x) * norm * xi / s
        return out.reshape(-1)[:d]

    def compress(self, v: torch.Tensor, gen: torch.Generator | None = None) -> Encoded:
        d = v.numel()
        return Encoded(self.quantize(v, _uniform(d, gen, v)), self.bits(d), self.buckets(d))

    def omega(self, d: int) -> float:
        b = d if self.p.bucket is None else min(self.p.bucket, d)
        s, p = self.p.s, self.p.p
        if p == 2:
            return min(b / s**2, math.sqrt(b) / s)
        if math.isinf(p) and s == 1:
            return (math.sqrt(b) - 1) / 2
        r = min(p, 2.0)
        return min(b ** (1 / r) / s, b ** (2 / r) / (4 * s**2))


@dataclass
class QSGDParams:
    s: int = hp(7, "quantization levels (1: 2 bits/entry, 7: 4 bits, 127: 8 bits)", low=1)
    bucket: int | None = hp(512, "entries per norm (QSGD's practice: 512); null: one norm per tensor", low=1)
    packing: str = hp("fixed", "'fixed': ⌈log2(2s+1)⌉ bits per entry; 'base': several entries per byte",
                      choices=("fixed", "base"))


class QSGD(PQuant):
    name = "qsgd"
    description = "QSGD (Alistarh et al. 2017) = pquant with p = 2"
    Params = QSGDParams

    def __init__(self, params: QSGDParams):
        super().__init__(PQuantParams(p=2.0, s=params.s, bucket=params.bucket, packing=params.packing))
        self.preset = params


@dataclass
class TernGradParams:
    bucket: int | None = hp(None, "entries per scale ‖v‖_∞; null: one per tensor (TernGrad)", low=1)
    packing: str = hp("fixed", "'fixed': 2 bits per entry; 'base': 5 trits per byte", choices=("fixed", "base"))


class TernGrad(PQuant):
    name = "terngrad"
    description = "TernGrad (Wen et al. 2017) = pquant with p = ∞, s = 1: ‖v‖_∞·sign(v)·Be(|v_i|/‖v‖_∞)"
    Params = TernGradParams

    def __init__(self, params: TernGradParams):
        super().__init__(PQuantParams(p=math.inf, s=1, bucket=params.bucket, packing=params.packing))
        self.preset = params


def power_of_two_below(a: torch.Tensor) -> torch.Tensor:
    """The largest power of two ≤ a (0 where a = 0), exactly: frexp gives a = m·2^e with m ∈ [0.5, 1)
    (a float32 log2 rounds the values just below a power up to it)."""
    _, exponent = torch.frexp(a)
    return torch.where(a > 0, torch.ldexp(torch.ones_like(a), exponent - 1), torch.zeros_like(a))


class Natural(Compressor):
    name = "natural"
    description = "natural compression: unbiased random rounding to a power of two (9 bits/entry, ω = 1/8)"
    Params = NoParams
    unbiased = True

    def compress(self, v: torch.Tensor, gen: torch.Generator | None = None) -> Encoded:
        u = _uniform(v.numel(), gen, v)
        a = v.abs()
        nz = a > 0
        low = power_of_two_below(a)
        prob = torch.where(nz, (a - low) / torch.where(nz, low, torch.ones_like(low)), torch.zeros_like(a))
        mag = torch.where(u < prob, 2 * low, low)
        return Encoded(torch.sign(v) * mag, 9 * v.numel(), v.numel())

    def omega(self, d: int) -> float:
        return 1 / 8


# ---- sparsification --------------------------------------------------------------------------

def _k(ratio: float, d: int) -> int:
    return min(d, max(1, math.ceil(ratio * d)))


@dataclass
class RandKParams:
    ratio: float = hp(0.1, "fraction ρ of entries kept, k = ⌈ρd⌉", low=0.0, high=1.0, low_open=True)
    scale: bool = hp(True, "multiply the kept entries by d/k (unbiased, ω = d/k − 1); false: biased "
                     "(δ = k/d, use error feedback)")
    indices: str = hp("seed", "'seed': the receiver regenerates the indices from the public key (32 bits); "
                      "'explicit': send them, min(k⌈log2 d⌉, d) bits", choices=("seed", "explicit"))


class RandK(Compressor):
    name = "randk"
    description = "random-k sparsification: k uniform entries, scaled by d/k"
    Params = RandKParams

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return bool(self.p.scale)

    @property
    def contractive(self) -> bool:  # type: ignore[override]
        return not self.p.scale  # E‖C(v) − v‖² = (1 − k/d)‖v‖²

    def bits(self, d: int) -> int:
        k = _k(self.p.ratio, d)
        index = FLOAT_BITS if self.p.indices == "seed" else min(k * index_bits(d), d)
        return FLOAT_BITS * k + index

    def compress(self, v: torch.Tensor, gen: torch.Generator | None = None) -> Encoded:
        d = v.numel()
        k = _k(self.p.ratio, d)
        idx = torch.randperm(d, generator=gen)[:k].to(v.device)
        out = torch.zeros_like(v)
        out[idx] = v[idx] * (d / k if self.p.scale else 1.0)
        return Encoded(out, self.bits(d), k)

    def omega(self, d: int) -> float:
        return d / _k(self.p.ratio, d) - 1 if self.p.scale else math.inf


@dataclass
class TopKParams:
    ratio: float = hp(0.01, "fraction ρ of entries kept, k = ⌈ρd⌉ (the largest |v_i|)", low=0.0, high=1.0,
                      low_open=True)


class TopK(Compressor):
    name = "topk"
    description = "top-k sparsification: the k largest |v_i| (ties: lower index); biased, use error feedback"
    Params = TopKParams
    contractive = True  # ‖C(v) − v‖² ≤ (1 − k/d)‖v‖²

    def bits(self, d: int) -> int:
        k = _k(self.p.ratio, d)
        return min(k * (FLOAT_BITS + index_bits(d)), d + FLOAT_BITS * k)

    def compress(self, v: torch.Tensor, gen: torch.Generator | None = None) -> Encoded:
        d = v.numel()
        k = _k(self.p.ratio, d)
        # stable sort of −|v|: equal magnitudes keep index order, so ties go to the lower index
        idx = torch.sort(-v.abs(), stable=True).indices[:k]
        out = torch.zeros_like(v)
        out[idx] = v[idx]
        return Encoded(out, self.bits(d), k)


@dataclass
class SignParams:
    scaled: bool = hp(True, "multiply by ‖v‖₁/d (EF-signSGD, one float more); false: plain sign(v)")


class Sign(Compressor):
    name = "sign"
    description = "sign compression, 1 bit/entry (sign(0) = +1); scaled by ‖v‖₁/d by default; biased, use EF"
    Params = SignParams

    @property
    def contractive(self) -> bool:  # type: ignore[override]
        # scaled: ‖C(v) − v‖² = ‖v‖² − ‖v‖₁²/d, δ = ‖v‖₁²/(d‖v‖²) ≥ 1/d; plain sign(v) has norm √d
        # whatever ‖v‖ is, so no δ > 0 bounds its error
        return bool(self.p.scaled)

    def compress(self, v: torch.Tensor, gen: torch.Generator | None = None) -> Encoded:
        d = v.numel()
        signs = torch.where(v >= 0, torch.ones_like(v), -torch.ones_like(v))
        if self.p.scaled:
            return Encoded(signs * (v.abs().sum() / max(d, 1)), d + FLOAT_BITS, 1)
        return Encoded(signs, d, 0)


# ---- the contractive form ----------------------------------------------------------------------

def contractive(comp: Compressor) -> Compressor:
    """The form of ``comp`` that error feedback and downlink replicas use: ``comp`` itself when it is
    contractive (or exact), C/(1 + ω) when it is unbiased (:class:`Scaled`). A compressor that is
    neither (plain sign) has none: ValueError (the config checks refuse it before training)."""
    if comp.unbiased:
        return comp if isinstance(comp, Identity) else Scaled(comp)
    if comp.contractive:
        return comp
    raise ValueError(f"{comp.name} with these parameters is neither unbiased nor contractive")


# ---- registry and config ---------------------------------------------------------------------

COMPRESSORS: Registry[type[Compressor]] = Registry("compressor", "compression.uplink.name", also=("none",))
for _cls in (Identity, HalfPrecision, BFloat16, PQuant, QSGD, TernGrad, Natural, RandK, TopK, Sign):
    COMPRESSORS.register(_cls.name, _cls)
#: ``name`` values of ``compression.uplink`` / ``compression.downlink``
NAMES = ("none", *COMPRESSORS.names())


@dataclass(frozen=True)
class CompressorSpec:
    """A validated ``compression.uplink`` / ``.downlink`` value: the compressor's name and its
    parameters as that compressor's ``Params`` dataclass (documented, range-checked fields, like a
    method's Hparams). Written back to YAML as ``{name, ...params}``."""
    name: str = "none"
    params: Any = None

    def build(self) -> Compressor | None:
        """The compressor (None for ``none``)."""
        return None if self.name == "none" else COMPRESSORS[self.name](self.params)

    def to_dict(self) -> dict:
        return {"name": self.name, **(to_dict(self.params) if self.params is not None else {})}

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]


def resolve_spec(raw: Any, path: str) -> CompressorSpec:
    """Validate ``{name, ...params}`` (or an already resolved spec) into a :class:`CompressorSpec`
    with every parameter.

    Raises :class:`~pfl.schema.ConfigError` naming e.g. ``compression.uplink.s`` and the allowed
    values."""
    if isinstance(raw, CompressorSpec):
        raw = raw.to_dict()
    if raw is None:
        raw = {"name": "none"}
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a mapping {{name: ..., <parameters>}}, got {raw!r}")
    raw = dict(raw)
    name = raw.pop("name", "none")
    if name is None:
        name = "none"
    if name != "none" and name not in COMPRESSORS:
        raise COMPRESSORS.unknown(name, f"{path}.name")
    if name == "none":
        if raw:
            raise ConfigError(f"{path}.{next(iter(raw))}", "name=none takes no parameters; allowed: name")
        return CompressorSpec()
    return CompressorSpec(name, from_dict(COMPRESSORS[name].Params, raw, path))


def build(spec: CompressorSpec | dict | None) -> Compressor | None:
    """The compressor a spec names (None for ``none``); a dict is validated first."""
    if spec is None:
        return None
    if not isinstance(spec, CompressorSpec):
        spec = resolve_spec(spec, "compression")
    return spec.build()


def describe_compressors() -> list[tuple[str, str, type]]:
    return [(name, cls.description, cls.Params) for name, cls in COMPRESSORS.items()]


__all__ = ["COMPRESSORS", "FLOAT_BITS", "NAMES", "BFloat16", "Compressor", "HalfPrecision", "Identity",
           "CompressorSpec", "Natural", "PQuant", "QSGD", "RandK", "Scaled", "Sign", "TernGrad", "TopK", "build",
           "contractive",
           "describe_compressors", "index_bits", "resolve_spec"]
