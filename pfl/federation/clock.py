"""Simulated device delays: how long one local update of a device takes (no wall clock involved).

The delay model (docs/methods/fpfc.md §7, our reading; the paper's is unverified): device i has a speed
s_i ~ LogNormal(0, σ) drawn once per run; one local update of device i takes

    τ_i = c · work_i / s_i + latency,   latency ~ Exp(mean ``latency``)

where work_i is the number of sample-gradients of one local update under the federation settings
(full batch: n_i per step). ``c`` sets the time unit (c = 1: one sample-gradient at speed 1). The
spec writes the latency mean as 0.1·c; with c = 1 the default ``latency = 0.1`` is that value (it is
negligible next to the compute term, as in the spec). Every draw comes from a generator seeded by
(run seed, 'clock', dispatch number, client), so a resumed run continues on the same clock.

Synchronous rounds take max τ_i over the sampled set (FPFC reports that sum as ``time/sim_clock``
from its ``extra_metrics``); the asynchronous driver (:mod:`.async_clock`) orders arrivals by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import FederationConfig


@dataclass
class DelayConfig:
    """Parameters of the simulated device delays (see the module docstring)."""
    c: float = 1.0               # simulated time per sample-gradient at speed 1
    speed_sigma: float = 0.5     # log-std of the device speeds
    latency: float = 0.1         # mean network latency per update (Exp), in simulated time

    @classmethod
    def from_hparams(cls, hp: Any) -> "DelayConfig":
        """The clock fields of a method's hyperparameters (``clock_c`` ...) or the defaults."""
        base = cls()
        return cls(c=getattr(hp, "clock_c", base.c),
                   speed_sigma=getattr(hp, "clock_speed_sigma", base.speed_sigma),
                   latency=getattr(hp, "clock_latency", base.latency))


def samples_per_update(fed: FederationConfig, n: int) -> int:
    """Sample-gradients in one local update of a client with ``n`` training samples."""
    if n <= 0:
        return 0
    full = fed.batch_size <= 0 or fed.batch_size >= n
    if fed.local_steps is not None:
        return fed.local_steps * (n if full else fed.batch_size)
    return fed.local_epochs * n


class DelayModel:
    """τ_i for every (dispatch, client): fixed speeds, fresh latency per dispatch."""

    def __init__(self, ctx, config: DelayConfig | None = None):
        self.ctx = ctx
        self.config = config or DelayConfig()
        m = ctx.num_clients
        sigma = self.config.speed_sigma
        self.speed = (ctx.rng("clock", "speed").lognormal(0.0, sigma, m) if sigma > 0 else np.ones(m))
        fed = ctx.cfg.federation
        self.work = np.array([samples_per_update(fed, n) for n in ctx.meta.client_sizes], dtype=float)

    def tau(self, k: int, cid: int) -> float:
        compute = self.config.c * self.work[cid] / self.speed[cid]
        lat = self.config.latency
        if lat > 0:
            compute += float(self.ctx.rng("clock", k, cid).exponential(lat))
        return float(compute)


__all__ = ["DelayConfig", "DelayModel", "samples_per_update"]
