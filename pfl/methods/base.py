"""The method interface: what the server sends, what a client does, what the server does next.

The simulator owns the round loop, sampling, message delivery (and so communication accounting),
evaluation and logging. A method fills in the hooks below. Server state lives on the method
object; each client's private state lives in its :class:`ClientHandle` and is only handed to the
method together with that client, so a method cannot read another client's state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from ..federation.messages import Message
from ..training import Params, TrainResult, local_sgd

if TYPE_CHECKING:
    from ..data import ClientData
    from ..federation.context import RunContext


@dataclass
class NoHparams:
    """This method has no hyperparameters of its own."""


class ClientHandle:
    """One client as a method sees it: its id, its own data, its own persistent state."""

    def __init__(self, cid: int, data: "ClientData", state: dict, ctx: "RunContext"):
        self.cid = cid
        self.data = data
        self.state = state
        self.ctx = ctx

    @property
    def model(self) -> torch.nn.Module:
        return self.ctx.model_for(self.cid)

    @property
    def n_train(self) -> int:
        return len(self.data.y_train)

    def generator(self, rnd: int, tag: str = "train") -> torch.Generator:
        return self.ctx.generator(rnd, self.cid, tag)

    def train(self, params: Params, rnd: int, *, x: torch.Tensor | None = None,
              y: torch.Tensor | None = None, tag: str = "train", **overrides: Any) -> TrainResult:
        """The shared local-SGD loop on this client's training split with the run's defaults.

        Federation settings (lr schedule, epochs/steps, batch size, momentum, weight decay) are the
        defaults; any keyword of :func:`pfl.training.local_sgd` overrides them.
        """
        fed = self.ctx.cfg.federation
        kwargs: dict[str, Any] = dict(
            lr=self.ctx.lr(rnd), epochs=fed.local_epochs, steps=fed.local_steps,
            batch_size=fed.batch_size, momentum=fed.momentum, weight_decay=fed.weight_decay,
            task=self.ctx.data.task, generator=self.generator(rnd, tag),
        )
        kwargs.update(overrides)
        return local_sgd(self.model, params,
                         self.data.x_train if x is None else x,
                         self.data.y_train if y is None else y, **kwargs)


class Method:
    """Base class of every federated method. Subclasses are registered by name."""

    name: ClassVar[str] = ""
    Hparams: ClassVar[type] = NoHparams
    description: ClassVar[str] = ""
    #: attributes that make up the server state (saved in checkpoints)
    server_attrs: ClassVar[tuple[str, ...]] = ()
    # the server step is correct for one reply at a time (federation.driver=async)
    supports_async: ClassVar[bool] = False

    def __init__(self, hparams: Any, ctx: "RunContext"):
        self.hp = hparams
        self.ctx = ctx

    # ---- lifecycle -------------------------------------------------------------------------
    def setup(self) -> None:
        """Initialise the server state (called once, before round 0)."""

    def init_client(self, client: ClientHandle) -> None:
        """Initialise ``client.state`` (called once per client, before round 0)."""

    # ---- one round ---------------------------------------------------------------------------
    def begin_round(self, rnd: int, sampled: list[int]) -> None:
        """Server-side work before messages go out (e.g. one stacked computation for all)."""

    def broadcast(self, rnd: int, cid: int) -> Message | None:
        """The downlink message for sampled client ``cid`` (server side)."""
        return None

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message | None:
        """Client side: read the message, train, return the uplink message."""
        raise NotImplementedError

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        """Server side: update the server state from the uplink messages of this round."""

    # ---- evaluation --------------------------------------------------------------------------
    def global_params(self) -> Params | None:
        """The global model, if the method has one."""
        return None

    def personal_params(self, client: ClientHandle) -> Params:
        """The model client ``client`` is evaluated with (default: the global model)."""
        params = self.global_params()
        if params is None:
            raise NotImplementedError(f"{self.name} must define personal_params")
        return params

    def eval_forward(self, client: ClientHandle) -> Callable[[Params, torch.Tensor], torch.Tensor] | None:
        """A custom forward for evaluation (None: the client's model as is)."""
        return None

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        """Method-specific metrics logged at evaluation rounds (e.g. cluster/num)."""
        return {}

    def artifacts(self, outdir: str) -> list[str]:
        """Write method-specific artifacts (tables, plots) at the end of a run; return paths."""
        return []

    # ---- checkpoints -------------------------------------------------------------------------
    def server_state(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.server_attrs}

    def load_server_state(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def hparams_dict(hp: Any) -> dict[str, Any]:
    return dataclasses.asdict(hp) if dataclasses.is_dataclass(hp) else {}
