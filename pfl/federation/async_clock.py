"""The asynchronous driver: an event-driven simulator on the simulated device delays (:mod:`.clock`).

:class:`AsyncSimulator` runs the same Method hooks without rounds: every device works all the time;
when device i's upload arrives the server immediately runs ``aggregate`` with that single reply,
computes i's next message (``begin_round`` with the one-element set, then ``broadcast``) and i
starts again. Logged "rounds" group ``federation.clients_per_round`` arrivals, so round r of an
asynchronous run and round r of a synchronous run contain the same number of device updates and of
messages; ``time/sim_clock`` is then the simulated time each needed for them. A device's trip is the
exchange (:mod:`.exchange`) in its two halves: the downlink is delivered when the device is
dispatched, its work and upload when it arrives.

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

from .clock import DelayConfig, DelayModel
from .simulator import Simulator
from .wire import Phase


class AsyncSimulator(Simulator):
    """Event-driven run of a Method: one aggregate per arriving device (see the module docstring).

    A method takes part if its ``aggregate`` accepts a single reply and its ``begin_round`` /
    ``broadcast`` can serve one device at a time (FPFC: asyncFPFC). The method's attribute
    ``external_clock`` is set to True so it does not also advance a synchronous clock.
    """

    def __init__(self, cfg, data=None, stages=None, delay: DelayConfig | None = None):
        super().__init__(cfg, data=data, stages=stages)
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
        msg = self.exchange.send(Phase("train", k), cid, self.method.broadcast(k, cid))
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
            # the trip's second half: the device computes on the message it received when dispatched
            reply = self.exchange.complete(Phase("train", k), {cid: msg}, self.training_side(k))[cid].reply
            if reply is not None:
                if "train_loss" in reply.info:
                    losses.append(float(reply.info["train_loss"]))
                self.method.aggregate(k, {cid: reply})
            self.arrivals += 1
            self._dispatch(cid, arrival)
        return self.close_round(rnd, start, losses, self.ctx.lr(self.tick),
                                {"time/sim_clock": self.clock, "async/arrivals": float(self.arrivals)},
                                evaluate=evaluate)

    def lineage_state(self) -> dict:
        # the messages in flight and the clock belong to the lineage: a restored state resumes them
        state = super().lineage_state()
        state["async"] = {"clock": self.clock, "tick": self.tick, "arrivals": self.arrivals,
                          "queue": list(self.queue), "started": self.started}
        return state

    def load_lineage_state(self, state: dict) -> None:
        super().load_lineage_state(state)
        extra = state["async"]
        self.clock, self.tick, self.arrivals = extra["clock"], extra["tick"], extra["arrivals"]
        self.queue = [tuple(entry) for entry in extra["queue"]]
        heapq.heapify(self.queue)
        self.started = extra["started"]


__all__ = ["AsyncSimulator"]
