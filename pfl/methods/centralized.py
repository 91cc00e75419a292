"""Centralized: the reference row every pFL table is read against — one model trained on the pooled
training data of every member, with the budget in samples the federated run would process.

Not a federated method: nothing is ever sent (the ledger records nothing). The engine gives a
method that declares ``pooled = True`` the members' training splits as one pool
(:meth:`attach_pool`, :class:`pfl.federation.pooled.Pool`) and measures its evaluations without
the wire (:class:`pfl.federation.pooled.Measurement`): the one model is evaluated as a global model
on every client's validation and test splits, so ``test/*`` and ``global/*`` are the same model's.

**The budget in samples** (docs/methods/baselines.md, "Centralized"): round r processes exactly the
samples the federated round would — Σ over the round's sampled clients (the same draw,
``Population.sample(r)``) of what the shared loop feeds client i in a round
(:func:`round_samples`: ``local_epochs × n_i``, or with ``federation.local_steps`` s the samples of s
minibatches, a batch never larger than the client's split). In expectation that is
``clients_per_round × local_epochs × mean member train size``. The pooled model spends it as
⌈budget / B⌉ minibatch steps of B = ``federation.batch_size`` samples drawn from the pool without
replacement (one shuffled pass after another; B ≤ 0 or ≥ the pool: full-pool steps), at the round's
learning rate, momentum and weight decay (momentum restarts every round, as a client's does).
``centralized/samples`` is what it processed, cumulative; ``centralized/budget`` the federated
count, cumulative (they differ by less than one batch a round, pool-pass ends aside).

Choices of ours: the pool is the members' training splits (validation and test splits stay with
their clients; newcomers join after training and are not in it); steps are sequential, so the
reference has the same data and sample budget but not the federated run's parallel steps; a
newcomer is evaluated with the final model.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from ..federation.messages import Message
from ..training import Params, local_sgd
from . import register
from .base import ClientHandle, Method

if TYPE_CHECKING:
    from ..config import FederationConfig


def round_samples(n: int, fed: "FederationConfig") -> int:
    """The samples the shared local-SGD loop processes on a client with ``n`` training samples in
    one round (what :func:`pfl.training.batches` yields for the federation's settings)."""
    if n <= 0:
        return 0
    b = fed.batch_size
    if fed.local_steps is None:
        return fed.local_epochs * n
    if b <= 0 or b >= n:
        return fed.local_steps * n
    per_pass = math.ceil(n / b)
    passes, rest = divmod(fed.local_steps, per_pass)
    return passes * n + rest * b


def pool_steps(budget: int, pool: int, batch_size: int) -> tuple[int, int]:
    """(steps, samples) of the pooled model's round: ⌈budget / B⌉ minibatches of B from a pool of
    ``pool`` samples, and how many samples they hold (a pass's last batch may be shorter)."""
    if budget <= 0 or pool <= 0:
        return 0, 0
    b = pool if batch_size <= 0 or batch_size >= pool else batch_size
    steps = math.ceil(budget / b)
    per_pass = math.ceil(pool / b)
    passes, rest = divmod(steps, per_pass)
    return steps, passes * pool + rest * b


@register
class Centralized(Method):
    name = "centralized"
    description = ("Reference row: one model on the pooled training data of every member, the federated "
                   "run's budget in samples; no communication")
    #: the engine attaches the members' pooled training data and evaluates without the wire
    pooled: ClassVar[bool] = True
    attackable_uplink = False
    uplink_note = "nothing (no federation)"
    newcomer_rule = "is evaluated with the final pooled model"
    metric_names = ("centralized/samples", "centralized/budget")

    def configure(self) -> None:
        self.init = self.ctx.init_params()

    def setup(self) -> None:
        self.global_model: Params = {k: v.clone() for k, v in self.init.items()}
        self.samples = 0      # processed by the pooled model, cumulative
        self.budget = 0       # the federated run's count, cumulative
        self.train_loss = float("nan")

    def attach_pool(self, pool: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The engine's pooled training data (called once, before round 0; a cache, never saved)."""
        self._pool = pool

    def global_params(self) -> Params:
        return self.global_model

    def round_budget(self, sampled: list[int]) -> int:
        """The samples the federated round over ``sampled`` would process."""
        sizes = self.ctx.meta.client_sizes
        return sum(round_samples(int(sizes[c]), self.ctx.cfg.federation) for c in sampled)

    def begin_round(self, rnd: int, sampled: list[int]) -> None:
        x, y = self._pool()
        fed = self.ctx.cfg.federation
        budget = self.round_budget(sampled)
        steps, seen = pool_steps(budget, len(y), fed.batch_size)
        if steps:
            result = local_sgd(self.ctx.model, self.global_model, x, y, lr=self.ctx.lr(rnd), steps=steps,
                               batch_size=fed.batch_size, task=self.ctx.meta.task, momentum=fed.momentum,
                               weight_decay=fed.weight_decay, generator=self.ctx.generator(rnd, "centralized"))
            self.global_model = dict(result.params)
            self.train_loss = result.mean_loss
        self.budget += budget
        self.samples += seen

    def broadcast(self, rnd: int, cid: int) -> Message | None:
        return None

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> None:
        return None  # the clients do nothing: their training data is in the pool

    def round_metrics(self, rnd: int) -> dict[str, float]:
        out: dict[str, Any] = {"centralized/samples": float(self.samples), "centralized/budget": float(self.budget)}
        if math.isfinite(self.train_loss):
            out["train/loss"] = self.train_loss
        return out

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        return {"centralized/samples": float(self.samples), "centralized/budget": float(self.budget)}
