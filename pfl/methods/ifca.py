"""IFCA — Iterative Federated Clustering Algorithm (Ghosh et al. 2020), model-averaging variant.

The server keeps K cluster models. Every sampled client receives all K (one message, K·d values),
picks the one with the lowest loss on its whole training split, trains from it with the shared
local-SGD loop and returns its trained model together with the chosen index (a one-byte integer
tensor, so the choice is counted on the wire). Each cluster model becomes the average of the models
returned by the clients that chose it this round (unweighted, as the reference; ``weighting:
samples`` weights by training-set size); a model nobody chose is left as it is.

A client's personalized model is the cluster model it would pick now (lowest training loss) — also
for clients that were not sampled: at an evaluation every client receives the K models (counted as
``comm/eval_down_bytes``) and returns its choice (``comm/eval_up_bytes``). ``cluster/num`` and
``cluster/ari`` are computed from those choices.

Decisions where the spec is silent or we deviate from the FPFC repository (docs/methods/fpfc.md §9):

* ``init: independent`` (default) draws the K models from K independently seeded initialisations;
  identical starts (``init: shared``) make every client pick the same model (mode collapse) and are
  offered only to show that. The paper's random restarts are not run here (one run = one start).
* The choice uses the training split (the FPFC repository's MNIST code used the test split — a leak)
  and the average divides by the number of clients that chose the model (the repository's synthetic
  code divided by a wrong count).
* The index travels as ``uint8`` (K ≤ 256) or ``int32``: one byte for every practical K, not the
  ⌈log2 K⌉ bits of the paper; messages carry whole bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..aggregation import weighted_average
from ..clusters import assignment_metrics, write_assignment_table
from ..federation.messages import Message, Model, Scalars
from ..schema import hp
from ..training import Params
from . import register
from .base import ClientHandle, EvalPlan, Method


def index_tensor(index: int, num: int) -> torch.Tensor:
    """A chosen cluster index as the smallest integer tensor that holds ``num`` values."""
    return torch.tensor([index], dtype=torch.uint8 if num <= 256 else torch.int32)


# ---- IFCA ----------------------------------------------------------------------------------------

@dataclass
class IFCAHparams:
    """IFCA: K cluster models; each client trains the one with its lowest training loss."""
    k: int = hp(4, "number of cluster models K", low=1)
    init: str = hp("independent", "initialisation of the K models: independent seeded draws, or one "
                   "shared draw (collapses to one cluster; for comparison only)",
                   choices=("independent", "shared"))
    weighting: str = hp("uniform", "average of a cluster's returned models: uniform (reference) or by "
                        "training-set size", choices=("uniform", "samples"))


def _pack(models: Sequence[Params]) -> Message:
    """The K cluster models, one Model part each (``cluster0``, ``cluster1``, ...)."""
    return Message.of({f"cluster{j}": Model(dict(m)) for j, m in enumerate(models)})


def _unpack(msg: Message, k: int) -> list[Params]:
    return [msg.tensors(f"cluster{j}") for j in range(k)]


def _choice(msg: Message) -> int:
    return int(msg.tensors("choice")["cluster"][0])


@register
class IFCA(Method):
    name = "ifca"
    Hparams = IFCAHparams
    quick = {"method.k": 2}
    description = "Iterative federated clustering: K models, clients pick by lowest loss (Ghosh et al. 2020)"
    metric_names = ("cluster/num", "cluster/ari")

    def setup(self) -> None:
        k = self.hp.k
        if self.hp.init == "independent":
            self.models = [self.ctx.init_params("ifca", j) for j in range(k)]
        else:
            shared = self.ctx.init_params("ifca", 0)
            self.models = [{n: t.clone() for n, t in shared.items()} for _ in range(k)]
        self._labels: dict[int, int] | None = None  # every evaluated client's choice at the last evaluation

    def broadcast(self, rnd: int, cid: int) -> Message:
        return _pack(self.models)

    def _choose(self, client: ClientHandle, models: Sequence[Params]) -> int:
        d = client.data
        losses = [client.evaluate(m, d.x_train, d.y_train).loss for m in models]
        return int(np.argmin(losses))

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message:
        models = _unpack(msg, self.hp.k)
        j = self._choose(client, models)
        result = client.train(models[j], rnd)
        # the trained model is a change of the cluster model it started from (compression), and the
        # choice travels as a control value (dense, never attacked)
        return Message.of({"model": Model(result.params, base=f"cluster{j}"),
                           "choice": Scalars({"cluster": index_tensor(j, self.hp.k)})},
                          train_loss=result.mean_loss, n=client.n_train)

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        groups: dict[int, list[Message]] = {}
        for reply in replies.values():
            groups.setdefault(_choice(reply), []).append(reply)
        names = list(self.models[0])
        for j, members in groups.items():
            weights = [r.info["n"] for r in members] if self.hp.weighting == "samples" else None
            self.models[j] = weighted_average([r.tensors("model") for r in members], weights, names=names)

    # ---- evaluation: every client receives the K models, picks one and says which -----------------
    def eval_message(self, rnd: int, cid: int) -> Message:
        return _pack(self.models)

    def eval_plan(self, rnd: int, client: ClientHandle, msg: Message | None) -> EvalPlan:
        models = _unpack(msg, self.hp.k)
        j = self._choose(client, models)
        return EvalPlan(models[j], reply=Message.of({"choice": Scalars({"cluster": index_tensor(j, self.hp.k)})}))

    def eval_aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        self._labels = {cid: _choice(replies[cid]) for cid in sorted(replies)}

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        if self._labels is None:
            return {}
        return assignment_metrics(list(self._labels.values()), self.ctx.meta, list(self._labels))

    def cluster_assignment(self) -> dict[int, int] | None:
        return None if self._labels is None else dict(self._labels)

    newcomer_rule = "picks the cluster model with the lowest loss on its training data"

    def artifacts(self, outdir: str) -> list[str]:  # pragma: no mutate block (a file for a reader)
        if self._labels is None:
            return []
        return [write_assignment_table(outdir, "ifca_assignments.csv", list(self._labels.values()), self.ctx.meta,
                                       list(self._labels))]
