"""FedProto (Tan et al., AAAI 2022): clients share class prototypes, never model parameters.

Every client keeps its own whole model (from θ⁰, as Local). The server keeps one global prototype
P̄_c per class c: a vector in the representation space (the head's input, :mod:`pfl.models.features`).
A sampled client receives the global prototypes that exist and trains its model on

    CE(w; x, y) + λ · ‖R_w(x) − P̄_y‖² / D

per sample, the second term only for samples whose class has a global prototype (D: the
representation's size, so the term is the mean squared difference per coordinate, as the authors'
code's MSE). Then it computes its local prototypes with the trained model, C_{k,c} = the mean of
R_w(x) over its training samples of class c, and uploads them with its class counts n_{k,c}. The
server sets P̄_c to the mean of the uploaded C_{k,c} over the clients that hold class c.

Decisions the paper leaves open: its aggregation formula weighs C_{k,c} by |D_{k,c}| with a
normaliser that reads either as a plain or as a sample-weighted mean; the authors' code takes the
plain mean over clients, the default here (``proto_weighting: uniform``; ``samples`` weighs by
n_{k,c}). Local prototypes are computed after training with the final model (the paper's
definition; the code averages the representations seen during the last epoch). Under client
sampling a class no sampled client holds keeps its previous global prototype. A client is
evaluated with its own model's output (the paper's main protocol; its nearest-prototype read-out is
not offered). λ = 1 (the authors' code). Traffic: the prototypes of the classes present, each way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..federation.messages import Message, Scalars, State
from ..models.functional import in_mode
from ..models.features import features_and_logits, head_module_name
from ..schema import ConfigError, hp
from ..training import Params, Term
from . import register
from .base import ClientHandle, Method


@dataclass
class FedProtoHparams:
    """FedProto: prototype regularisation λ and how the server averages prototypes."""
    lam: float = hp(1.0, "weight λ of the prototype distance (authors' code 1; grid 0.1, 1, 5, 10); 0 is Local",
                    low=0.0)
    proto_weighting: str = hp("uniform", "global prototype = plain mean over the clients holding the class "
                              "(authors' code) or weighted by their class counts", choices=("uniform", "samples"))


@dataclass
class ProtoLoss(Term):
    """Per-sample CE + λ·mask[y]·mean_d (R_w(x) − P̄[y])² (module docstring)."""
    model: torch.nn.Module
    head: str
    protos: torch.Tensor  # (classes, D): the global prototypes, zero rows where there is none
    mask: torch.Tensor    # (classes,): 1 where class c has a global prototype
    lam: float

    def __call__(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z, out = features_and_logits(self.model, self.head, params, x)
        dist = ((z.flatten(1) - self.protos[y]) ** 2).mean(1)
        return F.cross_entropy(out, y, reduction="none") + self.lam * self.mask[y] * dist


@register
class FedProto(Method):
    name = "fedproto"
    Hparams = FedProtoHparams
    description = "FedProto: clients exchange class prototypes, not models (Tan et al. 2022)"
    uplink_note = "class prototypes (mean representations) and class counts"
    newcomer_rule = "is evaluated with its own untrained model (θ⁰): it never joined"

    def configure(self) -> None:
        meta = self.ctx.meta
        if meta.task != "classification":
            raise ConfigError("method.name", "fedproto needs a classification task (prototypes are per class)")
        self.init: Params = self.ctx.init_params()
        self.head = head_module_name(self.ctx.model)
        probe = torch.zeros((1, *meta.input_shape), device=self.ctx.device)
        with torch.no_grad(), in_mode(self.ctx.model, train=False):  # one sample: BatchNorm by its statistics
            self.dim = int(features_and_logits(self.ctx.model, self.head, self.init, probe)[0].flatten(1).shape[1])
        self.classes = int(meta.num_classes)

    def setup(self) -> None:
        self.protos = torch.zeros(self.classes, self.dim, device=self.ctx.device)
        self.known = torch.zeros(self.classes, dtype=torch.bool, device=self.ctx.device)

    def broadcast(self, rnd: int, cid: int) -> Message:
        return Message.of({"protos": State({str(c): self.protos[c] for c in range(self.classes) if self.known[c]})})

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        received = msg.tensors("protos") if msg is not None and "protos" in msg else {}
        device = client.data.y_train.device
        protos = torch.zeros(self.classes, self.dim, device=device)
        mask = torch.zeros(self.classes, device=device)
        for c, p in received.items():
            protos[int(c)], mask[int(c)] = p, 1.0
        params = client.state.get("params", self.init)
        loss = ProtoLoss(client.model, self.head, protos, mask, self.hp.lam) if self.hp.lam else None
        result = client.train(params, rnd, loss=loss)
        client.state["params"] = result.params
        local, counts = self.local_prototypes(client, result.params)
        present = [c for c in range(self.classes) if counts[c] > 0]
        return Message.of({"protos": State({str(c): local[c] for c in present}),
                           "counts": Scalars({"counts": counts})}, train_loss=result.mean_loss, n=client.n_train)

    def local_prototypes(self, client: ClientHandle, params: Params) -> tuple[torch.Tensor, torch.Tensor]:
        """(classes, D) class means of the representations of the client's training split under
        ``params`` (zero rows for absent classes) and the (classes,) int32 counts."""
        x, y = client.data.x_train, client.data.y_train
        sums = torch.zeros(self.classes, self.dim, device=y.device)
        with torch.no_grad(), in_mode(client.model, train=False):  # inference: BatchNorm by its statistics
            for start in range(0, len(y), 4096):  # the evaluation routine's chunk: bounded memory
                z = features_and_logits(client.model, self.head, params, x[start:start + 4096])[0].flatten(1)
                sums.index_add_(0, y[start:start + 4096], z)
        counts = torch.bincount(y, minlength=self.classes)
        return sums / counts.clamp_min(1).unsqueeze(1).to(sums.dtype), counts.to(torch.int32)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        total = torch.zeros_like(self.protos)
        weight = torch.zeros(self.classes, device=self.protos.device)
        for reply in replies.values():
            counts = reply.tensors("counts")["counts"].to(weight.device)
            for c, p in reply.tensors("protos").items():
                w = float(counts[int(c)]) if self.hp.proto_weighting == "samples" else 1.0
                total[int(c)] += w * p.to(total.device)
                weight[int(c)] += w
        seen = weight > 0
        # new tensors, not in-place writes: a snapshot of the server state may hold the old ones
        self.protos = torch.where(seen.unsqueeze(1), total / weight.clamp_min(1e-30).unsqueeze(1), self.protos)
        self.known = self.known | seen

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        return client.state.get("params", self.init)
