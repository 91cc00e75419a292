"""Low-rank views of conv/linear weights and factorized messages (FedSLR's downlink).

Matrix view R_l of a weight tensor (docs/methods/fedslr.md §1, as the reference code does it):

* linear (out, in): the matrix itself;
* conv (out, in, k_h, k_w): move the kernel-row axis next to the output axis, i.e. view it as
  (out, k_h, in, k_w) and flatten to (out·k_h) × (in·k_w). A rank-r factor pair of that matrix is
  a (1×k_w) conv in→r followed by a (k_h×1) conv r→out, so low rank here means a cheaper layer;
  1×1 convs become out × in;
* any other ≥ 2-D tensor (e.g. conv1d (out, in, k)) is flattened to out × rest [our choice: the
  spec only defines 2-D and 4-D tensors].

:func:`threshold` applies singular-value soft-thresholding (:func:`pfl.prox.svt`) to that matrix
and keeps the balanced factors A = U_r·diag(√σ'), B = diag(√σ')·V_rᵀ, so the server can send A, B
without a second SVD. :func:`encode` builds message entries: a :class:`LowRank` payload when
(rows + cols)·r < rows·cols, the dense tensor otherwise; rank 0 gives a LowRank with empty factors
(0 bytes on the wire; the receiver still knows the layer's shape and gets zeros).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from .federation.messages import LowRank, Message
from .federation.state import checkpointable
from .prox import svt

Params = dict[str, torch.Tensor]


def matrix_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """(rows, cols) of the matrix view of a tensor of ``shape`` (ndim >= 2)."""
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"a matrix view needs a tensor with >= 2 dims, got shape {shape}")
    if len(shape) == 4:
        out, cin, kh, kw = shape
        return out * kh, cin * kw
    rest = 1
    for s in shape[1:]:
        rest *= s
    return shape[0], rest


def to_matrix(t: torch.Tensor) -> torch.Tensor:
    """R_l(t): the (rows × cols) matrix view of a weight tensor (see the module docstring)."""
    rows, cols = matrix_shape(t.shape)
    if t.ndim == 4:
        return t.permute(0, 2, 1, 3).reshape(rows, cols)
    return t.reshape(rows, cols)


def from_matrix(m: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """R_l⁻¹: the tensor of ``shape`` whose matrix view is ``m``."""
    shape = tuple(shape)
    if len(shape) == 4:
        out, cin, kh, kw = shape
        return m.reshape(out, kh, cin, kw).permute(0, 2, 1, 3).contiguous()
    return m.reshape(shape)


def factorized_count(rows: int, cols: int, rank: int) -> int:
    """Scalars on the wire for a rows × cols matrix of rank ``rank``: the smaller encoding."""
    return min((rows + cols) * rank, rows * cols)


@checkpointable
@dataclass
class LayerSVT:
    """One thresholded matrix tensor: its rank, its singular values and its balanced factors."""
    shape: tuple[int, ...]
    rank: int
    max_rank: int
    left: torch.Tensor    # rows × r
    right: torch.Tensor   # r × cols
    kept: torch.Tensor    # the r thresholded singular values σ − τ > 0

    @property
    def rows(self) -> int:
        return int(self.left.shape[0])

    @property
    def cols(self) -> int:
        return int(self.right.shape[1])

    def factorized(self) -> bool:
        """True when the factor pair is smaller than the dense matrix."""
        return (self.rows + self.cols) * self.rank < self.rows * self.cols

    def count(self) -> int:
        return factorized_count(self.rows, self.cols, self.rank)


def threshold(t: torch.Tensor, tau: float) -> tuple[torch.Tensor, LayerSVT]:
    """prox of τ‖R(·)‖_* at ``t``: the thresholded tensor (original shape) and its factors."""
    m = to_matrix(t)
    # float32 SVD can fail to converge on badly conditioned inputs; float64 is the fallback
    try:
        x, u, s, vh = svt(m, tau)
    except RuntimeError:
        x, u, s, vh = (v.to(m.dtype) for v in svt(m.double(), tau))
    root = s.sqrt()
    layer = LayerSVT(shape=tuple(t.shape), rank=int(s.numel()), max_rank=min(m.shape),
                     left=u * root, right=root[:, None] * vh, kept=s)
    return from_matrix(x, t.shape), layer


def encode(params: Mapping[str, torch.Tensor], layers: Mapping[str, LayerSVT]) -> dict:
    """Message entries for ``params``: factor pairs for the layers in ``layers`` where smaller."""
    entries: dict = {}
    for name, value in params.items():
        layer = layers.get(name)
        if layer is not None and layer.factorized():
            entries[name] = LowRank(layer.left, layer.right, shape=layer.shape)
        else:
            entries[name] = value
    return entries


def decode(msg: Message | Mapping) -> Params:
    """Dense tensors from a one-part message (or its entries), undoing the matrix view of every
    LowRank payload."""
    entries = next(iter(msg.parts.values())).entries if isinstance(msg, Message) and msg.parts else msg
    out: Params = {}
    for name, entry in entries.items():
        if isinstance(entry, LowRank):
            product = entry.dense()
            out[name] = product if entry.shape is None else from_matrix(product, entry.shape)
        elif isinstance(entry, torch.Tensor):
            out[name] = entry
        else:
            out[name] = entry.dense()
    return out


__all__ = ["LayerSVT", "decode", "encode", "factorized_count", "from_matrix", "matrix_shape",
           "threshold", "to_matrix"]
