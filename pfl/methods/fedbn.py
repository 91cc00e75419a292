"""FedBN (Li, Jiang, Zhang, Kamp, Dou, ICLR 2021): FedAvg with the BatchNorm layers kept local.

Every client keeps its BatchNorm layers — their affine parameters (γ, β) *and* their running
statistics (mean, variance, ``num_batches_tracked``) — and never sends them; everything else is
FedAvg: a sampled client starts from the received shared parameters and its own BN layers, trains
all of them for the federation's local epochs, and sends the shared part; the server averages it
(FedAvg's weighting and robust aggregators, :meth:`FedAvg.reply_average`). The paper's Algorithm 1
aggregates every non-BN parameter with p_k = n_k/Σn and leaves BN to the client; it is written for
full participation and applies unchanged to a sampled round.

BN layers are recognised by module type (``torch.nn.modules.batchnorm._BatchNorm``: BatchNorm1d/2d/
3d, SyncBatchNorm), never by a name; a model without them makes FedBN FedAvg on every parameter (no
global model is reported either way). It is the partial-sharing machinery of
:mod:`pfl.methods.partial` with the shared part set to the non-BN names: a configuration, not a copy.

Choices the paper leaves open: a client's BN layers start at θ⁰'s (γ = 1, β = 0, mean 0, variance 1,
the same for every client), and a client never sampled is evaluated with those; a client is
evaluated with its own BN layers and the server's current shared part (the one it would receive
next; partial.py's convention), in eval mode (its running statistics). There is no global model:
without BN layers the shared part cannot classify, so no ``global/*`` metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from . import register
from .fedavg import FedAvgHparams
from .partial import PartialSharing


def batchnorm_names(model: nn.Module) -> list[str]:
    """The names of every BatchNorm layer's affine parameters and running statistics, by module type."""
    out = []
    for mname, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            prefix = f"{mname}." if mname else ""
            out += [prefix + n for n, _ in module.named_parameters(recurse=False)]
            out += [prefix + n for n, t in module.named_buffers(recurse=False) if t is not None]
    return out


@dataclass
class FedBNHparams(FedAvgHparams):
    """FedBN: FedAvg on every layer but BatchNorm, whose parameters and statistics stay on the client."""


@register
class FedBN(PartialSharing):
    name = "fedbn"
    Hparams = FedBNHparams
    description = "FedBN: FedAvg with BatchNorm layers (parameters and statistics) kept local (Li et al. 2021)"

    def shared_names(self) -> list[str]:
        local = set(batchnorm_names(self.ctx.model))
        return [n for n, _ in self.ctx.model.named_parameters() if n not in local]

    def shared_entries(self, names: list[str]) -> list[str]:
        # every entry but the BN layers' (an InstanceNorm's statistics, say, are shared)
        local = set(batchnorm_names(self.ctx.model))
        return [n for n in names if n not in local]


__all__ = ["FedBN", "FedBNHparams", "batchnorm_names"]
