"""What a method may use of the run: config, data, model(s), device, seeded randomness."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

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


@dataclass
class RunContext:
    cfg: "ExperimentConfig"
    data: "FederatedData"
    model: torch.nn.Module
    device: torch.device
    #: per-client model objects where clients differ in architecture (PerFed-CKT); else ``model``
    client_models: dict[int, torch.nn.Module] = field(default_factory=dict)

    @property
    def seed(self) -> int:
        return self.cfg.seed

    @property
    def num_clients(self) -> int:
        return len(self.data.clients)

    def model_for(self, cid: int) -> torch.nn.Module:
        return self.client_models.get(cid, self.model)

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
        """Freshly initialised parameters of ``model`` (default: the run's model), seeded by parts."""
        from ..models.functional import init_params

        params = init_params(model or self.model, self.generator("init", *parts))
        return {k: v.to(self.device) for k, v in params.items()}
