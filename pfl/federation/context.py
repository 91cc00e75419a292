"""What a method may use of the run: static config, model structure, device, seeded randomness.

:class:`RunContext` holds nothing that belongs to one party. It has no client's data (a client
step gets its own data through its :class:`~pfl.methods.base.ClientHandle`) and no server state,
so both sides of a method can hold it. What every party may know about the federation, the task,
the number of clients and their sizes (the simulated system's metadata: used by device-speed
models and exogenous assignments, never by a learning rule, which learns sizes from the replies),
and the true cluster ids (an oracle, only for metrics) is in :class:`FederationMeta`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..models.functional import init_params

if TYPE_CHECKING:
    from ..config import ExperimentConfig
    from ..data import FederatedData


def _key(part: object) -> int:
    if isinstance(part, (int, np.integer)):
        return int(part) & 0xFFFFFFFF
    return zlib.crc32(str(part).encode())


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from (seed, round, client, tag, ...): reproducible and order-sensitive."""
    seq = np.random.SeedSequence([_key(p) for p in parts])
    return int(seq.generate_state(1, dtype=np.uint64)[0]) & ((1 << 63) - 1)


@dataclass(frozen=True)
class FederationMeta:
    """What every party knows about the federation (no samples)."""
    task: str                          # "classification" or "regression"
    num_classes: int
    input_shape: tuple[int, ...]
    source: str
    client_sizes: tuple[int, ...]      # training samples per client
    true_clusters: np.ndarray | None   # oracle for cluster metrics only

    @property
    def num_clients(self) -> int:
        return len(self.client_sizes)

    @classmethod
    def of(cls, data: "FederatedData") -> "FederationMeta":
        return cls(task=data.task, num_classes=data.num_classes, input_shape=tuple(data.input_shape),
                   source=data.source, client_sizes=tuple(data.client_sizes()),
                   true_clusters=data.true_clusters)


@dataclass
class RunContext:
    cfg: "ExperimentConfig"
    meta: FederationMeta
    model: torch.nn.Module
    device: torch.device
    #: clients held out of training that join afterwards (``newcomers.fraction``; drawn from the seed)
    newcomers: tuple[int, ...] = ()

    @property
    def members(self) -> list[int]:
        """The clients that take part in training (all but the newcomers), ascending."""
        if not self.newcomers:
            return list(range(self.meta.num_clients))
        held = set(self.newcomers)
        return [c for c in range(self.meta.num_clients) if c not in held]

    @property
    def num_members(self) -> int:
        """How many clients take part in training (the federation's size during training)."""
        return self.meta.num_clients - len(self.newcomers)

    @property
    def seed(self) -> int:
        return self.cfg.seed

    @property
    def num_clients(self) -> int:
        return self.meta.num_clients

    def lr(self, rnd: int) -> float:
        fed = self.cfg.federation
        return fed.lr * fed.lr_decay ** (rnd // fed.lr_decay_every)

    def generator(self, *parts: object) -> torch.Generator:
        """A CPU torch generator seeded by (run seed, *parts), e.g. (round, client, 'train')."""
        g = torch.Generator()
        g.manual_seed(derive_seed(self.seed, *parts))
        return g

    def rng(self, *parts: object) -> np.random.Generator:
        return np.random.default_rng(derive_seed(self.seed, *parts))

    def init_params(self, *parts: object, model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
        """Freshly initialised parameters of ``model`` (default: the run's model), seeded by parts.

        Every party can regenerate them from the run seed, so sending them costs nothing.
        """
        params = init_params(model or self.model, self.generator("init", *parts))
        return {k: v.to(self.device) for k, v in params.items()}


def resolve_device(name: str) -> torch.device:
    """The torch device ``federation.device`` names on this machine (``auto``: CUDA when there is one)."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"federation.device={name!r} but CUDA is not available; use cpu or auto")
    return dev
