"""Local: every client trains only its own model; nothing is ever sent."""

from __future__ import annotations

from ..federation.messages import Message
from ..training import Params
from . import register
from .base import ClientHandle, Method


@register
class Local(Method):
    name = "local"
    description = "Local training only (no communication)"

    def configure(self) -> None:
        self.init = self.ctx.init_params()  # every client regenerates it from the run seed

    def init_client(self, client: ClientHandle) -> None:
        # the same start as the federated methods, so the comparison is about collaboration only
        client.state["params"] = {k: v.clone() for k, v in self.init.items()}

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> None:
        result = client.train(client.state["params"], rnd)
        client.state["params"] = result.params
        client.state["train_loss"] = result.mean_loss
        return None

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        return client.state["params"]

    # newcomers (docs/methods/fpfc.md §8): a newcomer trains alone, one local update per join step
    newcomer_rule = "trains alone (newcomers.rounds local updates)"

    def join_active(self, step: int) -> list[int]:
        return list(self.ctx.newcomers)

    def join_update(self, rnd: int, step: int, client: ClientHandle, msg: Message | None) -> None:
        return self.local_update(rnd, client, msg)
