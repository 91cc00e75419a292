"""Simulated wall clock: device delays, and an event-driven (asynchronous) simulator.

The delay model (docs/methods/fpfc.md §7, our reading; the paper's is unverified): device i has a speed
s_i ~ LogNormal(0, σ) drawn once per run; one local update of device i takes

    τ_i = c · work_i / s_i + latency,   latency ~ Exp(mean ``latency``)

where work_i is the number of sample-gradients of one local update under the federation settings
(full batch: n_i per step). ``c`` sets the time unit (c = 1: one sample-gradient at speed 1). The
spec writes the latency mean as 0.1·c; with c = 1 the default ``latency = 0.1`` is that value (it is
negligible next to the compute term, as in the spec). Every draw comes from a generator seeded by
(run seed, 'clock', dispatch number, client), so a resumed run continues on the same clock.

Synchronous rounds take max τ_i over the sampled set (FPFC reports that sum as
``time/sim_clock`` from its ``extra_metrics``). :class:`AsyncSimulator` runs the same Method hooks
without rounds: every device works all the time; when device i's upload arrives the server
immediately runs ``aggregate`` with that single reply, computes i's next message (``begin_round``
with the one-element set, then ``broadcast``) and i starts again. Logged "rounds" group
``federation.clients_per_round`` arrivals, so round r of an asynchronous run and round r of a
synchronous run contain the same number of device updates and of messages; ``time/sim_clock`` is
then the simulated time each needed for them.

Choices of ours (no source): all devices are active from time 0 (the asynchronous run dispatches
every device at once; its first arrivals are the fastest devices); a device's local update is
computed when its upload arrives, from the message it received when it was dispatched (so between
dispatch and arrival it keeps, and is evaluated with, its previous model); the ``rnd`` passed to
the hooks of an asynchronous run is the dispatch number, so learning-rate schedules
(``federation.lr_decay_every``) count dispatches, not rounds.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import FederationConfig
from .simulator import Simulator


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


class AsyncSimulator(Simulator):
    """Event-driven run of a Method: one aggregate per arriving device (see the module docstring).

    A method takes part if its ``aggregate`` accepts a single reply and its ``begin_round`` /
    ``broadcast`` can serve one device at a time (FPFC: asyncFPFC). The method's attribute
    ``external_clock`` is set to True so it does not also advance a synchronous clock.
    """

    def __init__(self, cfg, data=None, transforms=None, delay: DelayConfig | None = None):
        super().__init__(cfg, data=data, transforms=transforms)
        self.delays = DelayModel(self.ctx, delay or DelayConfig.from_hparams(self.method.hp))
        self.method.external_clock = True
        self.clock = 0.0
        self.tick = 0          # dispatches so far (the ``rnd`` of the hooks)
        self.arrivals = 0
        self.queue: list[tuple] = []   # heap of (arrival time, dispatch, client, down message)
        self.started = False

    @property
    def arrivals_per_round(self) -> int:
        k, m = self.cfg.federation.clients_per_round, self.ctx.num_members
        return m if k == 0 or k >= m else k

    def _dispatch(self, cid: int, now: float) -> None:
        k = self.tick
        self.tick += 1
        self.method.begin_round(k, [cid])
        msg = self.deliver(self.method.broadcast(k, cid), "down", k, cid)
        heapq.heappush(self.queue, (now + self.delays.tau(k, cid), k, cid, msg))

    def run_round(self, evaluate: bool | None = None) -> dict[str, float]:
        rnd = self.round
        start = time.perf_counter()
        if not self.started:
            self.started = True
            for cid in self.ctx.members:  # newcomers join after training (pfl/federation/newcomers.py)
                self._dispatch(cid, 0.0)
        losses = []
        for _ in range(self.arrivals_per_round):
            arrival, k, cid, msg = heapq.heappop(self.queue)
            self.clock = arrival
            reply = self.client_step(k, cid, msg)
            if reply is not None:
                if "train_loss" in reply.info:
                    losses.append(float(reply.info["train_loss"]))
                self.method.aggregate(k, {cid: reply})
            self.arrivals += 1
            self._dispatch(cid, arrival)
        return self.close_round(rnd, start, losses, self.ctx.lr(self.tick),
                                {"time/sim_clock": self.clock, "async/arrivals": float(self.arrivals)},
                                evaluate=evaluate)

    def model_state(self) -> dict:
        # the messages in flight and the clock belong to the lineage: a restored state resumes them
        state = super().model_state()
        state["async"] = {"clock": self.clock, "tick": self.tick, "arrivals": self.arrivals,
                          "queue": list(self.queue), "started": self.started}
        return state

    def load_model_state(self, state: dict) -> None:
        super().load_model_state(state)
        extra = state["async"]
        self.clock, self.tick, self.arrivals = extra["clock"], extra["tick"], extra["arrivals"]
        self.queue = [tuple(entry) for entry in extra["queue"]]
        heapq.heapify(self.queue)
        self.started = extra["started"]


__all__ = ["AsyncSimulator", "DelayConfig", "DelayModel", "samples_per_update"]
