"""The client sides of a run's exchanges, each with a name a worker process rebuilds it from.

A client side (:data:`pfl.federation.wire.ClientSide`) is a closure over the run: the method's
client object, the config, the round. A worker of the pool (:mod:`pfl.federation.workers`) holds its
own copies of those, built from the config, so what crosses to it is the side's name and arguments
(``side.spec``, e.g. ``("training", (3,))``), never the closure; :meth:`ClientSides.side` turns the
name back into the same closure there. A side without a spec (a test's or a pipeline's own) runs in
the run's process.

:class:`ClientSides` is mixed into the simulator and into the pool's worker: both have ``cfg``,
``ctx``, ``data``, ``client_role``, ``method`` (only its class is read here), ``population`` and
``round`` (the lineage's: the evaluation's untrained rule asks which clients have trained so far).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..evaluation import evaluate_plan
from ..methods.base import EvalPlan
from . import eval_modes
from .wire import ClientSide

if TYPE_CHECKING:
    from ..methods.base import ClientHandle
    from .messages import Message

#: the sides a spec may name (a worker builds nothing else)
SIDES = {"training": "training_side", "evaluation": "evaluation_side", "personal": "personal_side",
         "test": "test_side", "join": "join_side"}


def named(side: ClientSide, name: str, *args: Any) -> ClientSide:
    side.spec = (name, args)  # type: ignore[attr-defined]
    return side


def spec_of(side: ClientSide) -> tuple | None:
    return getattr(side, "spec", None)


class ClientSides:
    """The named client sides (see the module docstring)."""

    def side(self, spec: tuple) -> ClientSide:
        name, args = spec
        return getattr(self, SIDES[name])(*args)

    def sample(self, rnd: int) -> list[int]:
        """The clients of round ``rnd``: ``clients_per_round`` of the members (newcomers never)."""
        return self.population.sample(rnd)  # type: ignore[attr-defined]

    def training_side(self, rnd: int) -> ClientSide:
        """The client side of a training exchange: the method's local update."""
        side: ClientSide = lambda client, msg: (self.client_role.local_update(rnd, client, msg), None)  # noqa: E731
        # evaluation.when, local_model: evaluations around it
        return named(eval_modes.fit_side(self, rnd, side), "training", rnd)

    def evaluation_side(self, rnd: int, joined: tuple[int, ...] = ()) -> ClientSide:
        """An evaluation's client side: the method's plan (the untrained rule applied; ``joined``: the
        newcomers a join step trained, which the simulator knows and a worker is told) and the row."""
        task, with_global = self.data.task, self.cfg.federation.eval_global
        trained_newcomers = frozenset(joined)

        def plan_and_row(client: "ClientHandle", msg: "Message | None"):
            plan = eval_modes.adjust_plan(self, client, self.client_role.eval_plan(rnd, client, msg), trained_newcomers)
            return plan.reply, evaluate_plan(client, plan, task, with_global)
        return named(plan_and_row, "evaluation", rnd, tuple(sorted(trained_newcomers)))

    def personal_side(self, rnd: int) -> ClientSide:
        """The model a client is evaluated with, kept by the simulator (``personal_models``)."""
        def personal(client: "ClientHandle", msg: "Message | None"):
            plan = self.client_role.eval_plan(rnd, client, msg)
            return plan.reply, plan.personal
        return named(personal, "personal", rnd)

    def test_side(self) -> ClientSide:
        """A received model tested on the client's test split; nothing goes back (``evaluate_models``)."""
        task = self.data.task

        def test(client: "ClientHandle", msg: "Message"):
            return None, evaluate_plan(client, EvalPlan(msg.tensors()), task, False)
        return named(test, "test")

    def join_side(self, rnd: int, step: int) -> ClientSide:
        """A newcomer's join step (:mod:`pfl.federation.newcomers`)."""
        side: ClientSide = lambda client, msg: (self.client_role.join_update(rnd, step, client, msg), None)  # noqa: E731
        return named(side, "join", rnd, step)


__all__ = ["ClientSides", "SIDES", "named", "spec_of"]
