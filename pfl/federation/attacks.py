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

Where it acts: a wire stage (:mod:`pfl.federation.wire`) on the sender's side of the uploads of
malicious clients — training uploads (``up``) and the uploads of the newcomer join phase
(``join_up``); evaluation replies (``eval_up``: IFCA's cluster choice) are left alone, and so is
every downlink. "Malicious only" and "training and join only" are an :class:`~pfl.federation.wire.Only`
wrapper around the stage, ``scope: head`` a :class:`~pfl.federation.wire.Masked` one. The stage
writes new tensors instead of editing the reply, so the attacker's kept state is what it trained
(its local computation is honest; only what it sends is not). What it rewrites follows the
message's declared parts (:mod:`pfl.federation.messages`): the floating-point entries of every part
but ``Scalars`` (IFCA's chosen cluster index travels honestly, so the attacker poisons the cluster it
picked); ``info`` (sample count, training loss) is kept. What "the upload" is follows the method: a
model (FedAvg, FPFC, IFCA, Ditto's global task, ...), an update (CFL's Δθ, SCAFFOLD's Δy and Δc), or
PACFL's one-shot data basis (a Byzantine client may send any basis). A method whose uplink carries
no model content at all (PerFed-CKT: public-set logits) declares ``attackable_uplink = False`` and a
config that attacks it is refused (``attack.kind``).

With compression. The attack and the codec are two stages of one chain, in the order
``federation.stages`` declares. ``[attack, compression]`` (the default): a Byzantine client behind a
compressed uplink — the attacker's upload is encoded like anyone's. ``[compression, attack]``: the
attacker sends arbitrary values in the slots of its encoded message — an ``Encoded`` payload keeps
its format and bit count, and the attack rewrites the values it carries (its non-zero entries; a
sign flip scales them). The methods that encode their own uplink (DIANA, MARINA, LAG) are attacked
the second way whatever the order, since their messages are already encoded when any stage sees them.

Cohorts: the sequential and the vectorized path (``federation.cohort``) both run every client's
side of the wire separately (:meth:`pfl.federation.wire.Wire.client_side`), so the attack needs no
fallback — the attacked uploads are the same seeded draws and the benign ones agree up to float
rounding (tested).

``attack.scope: head`` rewrites only the entries of the model's head (its last layer, by
:func:`pfl.models.layer_groups`; in any part, an entry counts by its name): the FPFC paper
attacks "the personalization layers" in its CNN experiments, where FPFC clusters only the last layer
and averages the rest FedAvg-style — with ``scope: model`` the attackers also poison that average,
which FPFC's SCAD penalty does not protect (see pipelines/robustness.py).

The evaluation summary of an attacked run is over the benign clients (``attack/benign_clients`` of
them); ``client_metrics.csv`` keeps every client with a ``malicious`` column and the malicious ids
are the artifact ``attack_malicious.csv``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..config import round_share
from ..models import layer_groups
from .context import derive_seed
from .messages import Encoded, Message, Payload
from .wire import Masked, Only, Phase, Stage, register_stage

if TYPE_CHECKING:
    from ..config import ExperimentConfig
    from ..methods.base import ClientHandle, Method
    from .context import RunContext

#: the phases whose uploads an attacker rewrites: training and the newcomer join phase
PHASES = ("train", "join")


def malicious_clients(cfg: "ExperimentConfig", num_clients: int) -> tuple[int, ...]:
    """The malicious clients of a run (sorted ids; empty without an attack), drawn once from its seed."""
    if cfg.attack.kind == "none":
        return ()
    count = round_share(num_clients, cfg.attack.fraction)
    rng = np.random.default_rng(derive_seed(cfg.seed, "attack", "malicious"))
    return tuple(sorted(int(i) for i in rng.choice(num_clients, size=count, replace=False)))


def attack_tensors(tensors: dict[str, torch.Tensor], kind: str, std: float,
                   generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The attacked values of the floating-point ``tensors`` of one upload (new tensors, in the
    order given; one scalar c or s per upload)."""
    if kind == "same_value":
        c = float(torch.randn((), generator=generator, dtype=torch.float64)) * std
        return {k: torch.full_like(t, c) for k, t in tensors.items()}
    if kind == "sign_flip":
        s = abs(float(torch.randn((), generator=generator, dtype=torch.float64))) * std
        return {k: t * -s for k, t in tensors.items()}
    if kind == "gaussian":
        out = {}
        for k, t in tensors.items():
            noise = torch.randn(t.shape, generator=generator, dtype=torch.float32) * std
            out[k] = noise.to(device=t.device, dtype=t.dtype)
        return out
    raise ValueError(f"unknown attack {kind!r}")


class Attack(Stage):
    """A Byzantine client's upload replaced on its way out (see the module docstring); the stage
    itself attacks every upload it is given (:func:`attack_stage` restricts it)."""

    key = "attack"

    def __init__(self, kind: str, std: float, seed: int):
        self.kind, self.std, self.seed = kind, std, seed

    def generator(self, rnd: int, cid: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(derive_seed(self.seed, "attack", rnd, cid))
        return g

    def send_up(self, phase: Phase, client: "ClientHandle", msg: Message, notes: dict) -> Message:
        values: dict[tuple[str, str], torch.Tensor] = {}
        for pname, part in msg.parts.items():
            if part.control:
                continue
            for name, e in part.entries.items():
                t = e.decoded if isinstance(e, Encoded) else e
                if isinstance(e, Payload) and not isinstance(e, Encoded):
                    raise TypeError(f"attack: part {pname!r} holds a {type(e).__name__} payload ({name!r}), "
                                    "which an attack cannot rewrite")
                if t.is_floating_point():
                    values[pname, name] = t
        if not values:
            return msg
        flat = {f"{p}/{n}": t for (p, n), t in values.items()}
        attacked = attack_tensors(flat, self.kind, self.std, self.generator(phase.rnd, client.cid))
        parts = {}
        for pname, part in msg.parts.items():
            entries = dict(part.entries)
            for name, e in part.entries.items():
                if (pname, name) not in values:
                    continue
                new = attacked[f"{pname}/{name}"]
                if isinstance(e, Encoded):  # the same format: new values in the slots it carries
                    new = torch.where(e.decoded != 0, new, torch.zeros_like(new))
                    new = Encoded(new, e.bits, e.values)
                entries[name] = new
            parts[pname] = part.replace(entries)
        return msg.replace(parts)


def attack_stage(cfg: "ExperimentConfig", ctx: "RunContext", method: "Method") -> Stage | None:
    """The run's attack: :class:`Attack` on the training and join uploads of its malicious clients
    (and only on the head's entries with ``attack.scope: head``); None without one."""
    malicious = malicious_clients(cfg, ctx.num_clients)
    if not malicious:
        return None
    a = cfg.attack
    std = {"same_value": a.same_value_std, "sign_flip": a.sign_flip_std, "gaussian": a.gaussian_std}[a.kind]
    stage: Stage = Attack(a.kind, std, cfg.seed)
    if a.scope == "head":
        head = frozenset(layer_groups(ctx.model).head)
        stage = Masked(stage, lambda part, name: name in head)
    return Only(stage, phases=PHASES, clients=malicious)


register_stage("attack", attack_stage)

__all__ = ["Attack", "PHASES", "attack_stage", "attack_tensors", "malicious_clients"]
