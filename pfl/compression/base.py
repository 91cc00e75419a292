"""The compressor interface: :class:`Compressor`, which every operator in :mod:`.compressors`
implements, and :class:`Scaled`, the contractive form C/(1 + ω) of any unbiased one
(:func:`~pfl.compression.compressors.contractive` picks the form error feedback and downlink
replicas use).

:mod:`.compressors` re-exports both, next to the operators, their bit formulas and the registry.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ..federation.messages import Encoded


class Compressor:
    """Base class. Subclasses set ``name``, ``Params`` and implement :meth:`compress`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Params: ClassVar[type] = object
    #: E C(v) = v and E‖C(v) − v‖² ≤ ω‖v‖² (:meth:`omega`)
    unbiased: ClassVar[bool] = False
    #: biased but contractive: E‖C(v) − v‖² ≤ (1 − δ)‖v‖² for some δ > 0 (top-k, unscaled rand-k,
    #: scaled sign, half precision), so error feedback and downlink replicas may use it as it is
    contractive: ClassVar[bool] = False

    def __init__(self, params: Any):
        self.p = params

    def compress(self, v: torch.Tensor, gen: torch.Generator | None = None) -> Encoded:
        """``v``: a 1-D float32 tensor. Returns the decoded vector (float32) and its bits."""
        raise NotImplementedError

    def omega(self, d: int) -> float:
        """Variance constant ω of an unbiased compressor on a d-vector (inf when biased)."""
        return 0.0 if self.unbiased else math.inf

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.p})"


def bits_of(comp: Compressor, d: int) -> int:
    """The bits ``comp`` sends for d entries: its formula, or for a compressor without one (natural,
    sign) a compression of zeros (their bits do not depend on the values; a fixed generator, so the
    global random stream is untouched)."""
    formula = getattr(comp, "bits", None)
    if formula is None:
        return int(comp.compress(torch.zeros(d), torch.Generator().manual_seed(0)).bits)
    return int(formula(d))


class Scaled(Compressor):
    """C/(1 + ω) of an unbiased C: E‖v − C(v)/(1+ω)‖² = ‖v‖² − 2‖v‖²/(1+ω) + E‖C(v)‖²/(1+ω)²
    ≤ (1 − 1/(1+ω))‖v‖², since E‖C(v)‖² ≤ (1 + ω)‖v‖² — contractive with δ = 1/(1 + ω), the best
    δ of any multiple αC (docs/methods/compression.md §"Downlink"). Same bits as C."""

    def __init__(self, inner: Compressor):
        super().__init__(inner.p)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]

    def compress(self, v: torch.Tensor, gen: torch.Generator | None = None) -> Encoded:
        enc = self.inner.compress(v, gen)
        return Encoded(enc.decoded / (1.0 + self.inner.omega(v.numel())), enc.bits, enc.values)

    def bits(self, d: int) -> int:
        return bits_of(self.inner, d)

    @property
    def contractive(self) -> bool:  # type: ignore[override]
        return True

    def __repr__(self) -> str:
        return f"Scaled({self.inner!r})"


__all__ = ["Compressor", "Scaled", "bits_of"]
