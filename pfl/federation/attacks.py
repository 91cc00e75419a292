"""Byzantine clients: a fixed subset of clients whose training uploads are rewritten on the wire.

The attacks of the FPFC paper's robustness experiment (§6.4.1, Fig. 7, App. E.2), whose definitions
and noise levels come from its reference [37] (Lin, Han, Li, Zhang, NeurIPS 2022; their code's
``robust_server.py``), docs/methods/fpfc.md §8. A malicious client b, instead of its upload u_b, sends
(fresh randomness for every upload):

* ``same_value``: c·1, one scalar c ~ N(0, σ²) per upload (σ = ``attack.same_value_std``, 100);
* ``sign_flip``:  −|s|·u_b, one s ~ N(0, σ²) per upload (σ = ``attack.sign_flip_std``, 10);
* ``gaussian``:   i.i.d. N(0, σ²) entries (σ = ``attack.gaussian_std``, 100).

"One upload" is one message: the scalars c and s are shared by all its tensors. The malicious
clients are round(m·``attack.fraction``) clients drawn once from the run's seed
(:func:`malicious_clients`), so they are the same in every round and after a resume; the draw is
independent of every other random choice of the run.

Where it acts: a transform at the delivery boundary (order 10, before anything that encodes a
message for the wire) on the uploads of malicious clients — training uploads (``up``) and the
uploads of the newcomer join phase (``join_up``); evaluation replies (``eval_up``: IFCA's cluster choice) are left
alone, and so is every downlink. It rewrites the receiver's copy, so the attacker's kept state is
what it trained (its local computation is honest; only what it sends is not). Only floating-point
tensors are rewritten: integer tensors are control values (IFCA's chosen cluster index travels
honestly, so the attacker poisons the cluster it picked) and ``info`` (sample count, training loss)
is kept. What "the upload" is follows the method: a model (FedAvg, FPFC, IFCA, Ditto's global task,
...), an update (CFL's Δθ, SCAFFOLD's Δy and Δc), or PACFL's one-shot data basis (a Byzantine
client may send any basis: the attack rewrites it like a model). A method whose uplink carries no
model content at all (PerFed-CKT: public-set logits) declares ``attackable_uplink = False`` and a
config that attacks it is refused (``attack.kind``). Structured payloads (an ``Encoded`` compressed
vector, a ``LowRank`` factor pair) are not rewritten: attacks do not combine with uplink
compression — :func:`pfl.resolver.resolve` refuses ``compression.uplink`` and the methods that encode
their own uplink (``compresses_uplink``: DIANA, MARINA, LAG) before any training, and meeting such a
payload anyway raises a ConfigError naming ``attack.kind``. (Supporting them would mean attacking
before the client's encoding, as a client-side wire stage ahead of the codec: an attacker that
sends a well-formed compressed message; not done.)

Cohorts: the sequential and the vectorized path (``federation.cohort``) both deliver every client's
upload separately on the wire (:meth:`pfl.federation.wire.Wire.deliver`), so the attack needs no
fallback — the attacked uploads are the same seeded draws and the benign ones agree up to float
rounding (tested).

``attack.scope: head`` rewrites only the tensors of the model's head (its last layer, by
:func:`pfl.models.layer_groups`; an entry ``prefix/name`` counts by its ``name``): the FPFC paper
attacks "the personalization layers" in its CNN experiments, where FPFC clusters only the last layer
and averages the rest FedAvg-style — with ``scope: model`` the attackers also poison that average,
which FPFC's SCAD penalty does not protect (see pipelines/robustness.py).

The evaluation summary of an attacked run is over the benign clients (``attack/benign_clients`` of
them); ``client_metrics.csv`` keeps every client with a ``malicious`` column and the malicious ids
are the artifact ``attack_malicious.csv``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from ..config import round_share
from ..models import layer_groups
from ..schema import ConfigError
from .context import derive_seed
from .messages import Message
from .transforms import register_transform_factory

if TYPE_CHECKING:
    from ..config import ExperimentConfig
    from .context import RunContext

#: order of the attack transform: before any encoding of the message for the wire
ORDER = 10
#: the directions an attacker rewrites: training uploads and the newcomer join phase's uploads
UPLOADS = ("up", "join_up")


def malicious_clients(cfg: "ExperimentConfig", num_clients: int) -> tuple[int, ...]:
    """The malicious clients of a run (sorted ids; empty without an attack), drawn once from its seed."""
    if cfg.attack.kind == "none":
        return ()
    count = round_share(num_clients, cfg.attack.fraction)
    rng = np.random.default_rng(derive_seed(cfg.seed, "attack", "malicious"))
    return tuple(sorted(int(i) for i in rng.choice(num_clients, size=count, replace=False)))


def attack_tensors(tensors: dict[str, torch.Tensor], kind: str, std: float, generator: torch.Generator,
                   only: Callable[[str], bool] | None = None) -> None:
    """Rewrite the floating-point ``tensors`` of one upload in place (integer tensors are kept;
    with ``only``, just the names it accepts)."""
    names = [k for k, t in tensors.items() if t.is_floating_point() and (only is None or only(k))]
    if kind == "same_value":
        c = float(torch.randn((), generator=generator, dtype=torch.float64)) * std
        for k in names:
            tensors[k].fill_(c)
    elif kind == "sign_flip":
        s = abs(float(torch.randn((), generator=generator, dtype=torch.float64))) * std
        for k in names:
            tensors[k].mul_(-s)
    elif kind == "gaussian":
        for k in names:
            t = tensors[k]
            noise = torch.randn(t.shape, generator=generator, dtype=torch.float32) * std
            t.copy_(noise.to(device=t.device, dtype=t.dtype))
    else:
        raise ValueError(f"unknown attack {kind!r}")


class Attack:
    """The uplink transform of a run's malicious clients (see the module docstring)."""

    def __init__(self, cfg: "ExperimentConfig", num_clients: int, head: list[str] | None = None):
        self.kind = cfg.attack.kind
        self.head = None if cfg.attack.scope == "model" else frozenset(head or ())
        self.std = {"same_value": cfg.attack.same_value_std, "sign_flip": cfg.attack.sign_flip_std,
                    "gaussian": cfg.attack.gaussian_std}[self.kind]
        self.seed = cfg.seed
        self.malicious = frozenset(malicious_clients(cfg, num_clients))

    def generator(self, rnd: int, cid: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(derive_seed(self.seed, "attack", rnd, cid))
        return g

    def __call__(self, msg: Message, direction: str, rnd: int, cid: int) -> Message:
        if direction not in UPLOADS or cid not in self.malicious:
            return msg
        tensors = {}
        for k, entry in msg.entries.items():
            if not isinstance(entry, torch.Tensor):
                raise ConfigError("attack.kind", f"the upload of client {cid} holds a {type(entry).__name__} "
                                                 f"payload ({k!r}); attacks rewrite plain tensors and do not "
                                                 "combine with uplink compression")
            tensors[k] = entry
        attack_tensors(tensors, self.kind, self.std, self.generator(rnd, cid),
                       None if self.head is None else self.in_head)
        return msg

    def in_head(self, name: str) -> bool:
        """Whether a message entry carries a head tensor (its name, possibly behind a method's
        ``prefix/``, e.g. SCAFFOLD's ``dy/``)."""
        return name in self.head or name.rsplit("/", 1)[-1] in self.head


def _attack_transforms(cfg: "ExperimentConfig", ctx: "RunContext") -> list:
    if cfg.attack.kind == "none" or round_share(ctx.num_clients, cfg.attack.fraction) == 0:
        return []
    head = None
    if cfg.attack.scope == "head":
        head = list(layer_groups(ctx.model).head)
    return [Attack(cfg, ctx.num_clients, head)]


register_transform_factory("attack", _attack_transforms, order=ORDER)

__all__ = ["Attack", "ORDER", "attack_tensors", "malicious_clients"]
