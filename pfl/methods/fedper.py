"""FedPer (Arivazhagan, Aggarwal, Singh, Choudhary 2019): federated base layers, personal head.

The model is split as FedRep splits it (:func:`pfl.models.layer_groups`): the body (every unit but
the last) is shared, the head (the last unit) is each client's own. A sampled client starts from the
received body and its own head, trains *all* layers jointly for the federation's local epochs (the
difference from FedRep, which alternates head and body) and sends its body; the server averages the
bodies (FedAvg's rule, weighting and robust aggregators). Only the body crosses the wire.

It is the partial-sharing machinery of :mod:`pfl.methods.partial` with the shared part set to the
body and the plain joint local training: a configuration of :class:`PartialSharing`, not a copy.
Decisions: the paper's "personalization layers" are the top K_P layers with K_P a choice; here the
last layer unit (K_P = 1, the paper's and PFLlib's usual setting). Own heads start at θ⁰'s head (the
same initialisation for every client); a client is evaluated with its own head and the server's
current body (partial.py's convention). No global model (the body alone cannot classify).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models import layer_groups
from . import register
from .fedavg import FedAvgHparams
from .partial import PartialSharing


@dataclass
class FedPerHparams(FedAvgHparams):
    """FedPer: FedAvg on the body; the head stays on the client (no hyperparameters of its own)."""


@register
class FedPer(PartialSharing):
    name = "fedper"
    Hparams = FedPerHparams
    description = "FedPer: shared base layers, personal head trained jointly (Arivazhagan et al. 2019)"

    def shared_names(self) -> list[str]:
        return list(layer_groups(self.ctx.model).body)
