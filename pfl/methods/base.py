"""The method interface: what the server sends, what a client does, what the server does next.

A method class is instantiated twice per run, once for each side of the wire
(:meth:`Method.create`), and the simulator only ever calls a side's hooks on that side's object:

* **static** — :meth:`Method.configure` runs once and derives read-only values from the config
  (name lists, initial models regenerated from the run seed, a public data set). Both sides
  share them.
* **server side** — :meth:`setup` creates the server state; :meth:`begin_round`,
  :meth:`broadcast`, :meth:`receive` (each delivered reply as it arrives), :meth:`aggregate` (which
  sees only the delivered replies),
  :meth:`begin_eval`, :meth:`eval_message`, :meth:`eval_aggregate`, :meth:`extra_metrics`,
  :meth:`artifacts`. Every attribute the server object gets after ``configure`` is server state
  and goes into checkpoints (names starting with ``_`` are caches, recomputed, never saved).
* **client side** — :meth:`init_client`, :meth:`local_update`, :meth:`eval_plan` (with
  :meth:`personal_params`, :meth:`eval_forward`, :meth:`decode`). The client object holds the
  static values only and refuses new attributes, so a client step is a function of
  (hyperparameters and static config, its own :class:`ClientHandle`: data, persistent state,
  generators, and the delivered message) → (reply, new ``client.state``). It cannot read the
  server's state (there is none on its object) nor another client's (the handle holds one client).
* **newcomers** (``newcomers.fraction`` > 0: clients held out of training join after the last
  round, docs/methods/fpfc.md §8) — server side :meth:`join_begin`, :meth:`join_active`,
  :meth:`join_message`, :meth:`join_aggregate`; client side :meth:`join_update`. The default rule
  needs no join step: a newcomer is evaluated with what :meth:`eval_message` sends (FedAvg: the
  final global model; IFCA: the K models, of which it picks the lowest-loss one). Methods with
  another rule override them (:class:`FineTuneNewcomers` is the "fine-tune the global model" rule);
  the driver is :mod:`pfl.federation.newcomers`. During training a server sizes its federation by
  ``ctx.members`` (the newcomers are not in it).

Every server → client and client → server transfer is a :class:`~pfl.federation.messages.Message`
that the simulator copies and counts, evaluation-time transfers included (booked as
``comm/eval_*``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from ..config import round_share
from ..federation.cohort import DIRECT, Compute
from ..federation.messages import Message, Model
from ..training import EvalCall, EvalResult, Params, TrainCall, TrainResult

if TYPE_CHECKING:
    from ..data import ClientData
    from ..federation.context import RunContext

#: ``info`` flag of an evaluation message that carries the global model (for ``global/*``)
GLOBAL = "global"


@dataclass
class NoHparams:
    """This method has no hyperparameters of its own."""


class ClientHandle:
    """One client as its own step sees it: id, own data, own persistent state, own model object, and
    the compute object its training and evaluation requests go to (:mod:`pfl.federation.cohort`:
    computed at once, or batched with the other clients of a vectorized cohort)."""

    def __init__(self, cid: int, data: "ClientData | Callable[[], ClientData]", state: dict, ctx: "RunContext",
                 model: torch.nn.Module, compute: Compute = DIRECT):
        self.cid = cid
        self._data = data   # or a function that builds it, called when a step first reads it
        self.state = state
        self.ctx = ctx
        self.model = model
        self.compute = compute
        self.trained: Params | None = None  # the parameters its last training ended with (this step's)

    @property
    def data(self) -> "ClientData":
        if callable(self._data):
            self._data = self._data()
        return self._data

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
            task=self.ctx.meta.task, generator=self.generator(rnd, tag),
        )
        kwargs.update(overrides)
        result = self.compute.train(TrainCall(self.model, params, self.data.x_train if x is None else x,
                                              self.data.y_train if y is None else y, kwargs))
        self.trained = result.params
        return result

    def evaluate(self, params: Params, x: torch.Tensor, y: torch.Tensor,
                 forward: Callable[[Params, torch.Tensor], torch.Tensor] | None = None) -> EvalResult:
        """Mean loss and accuracy of ``params`` on (x, y) of this client (the one evaluation routine)."""
        return self.compute.evaluate(EvalCall(self.model, params, x, y, self.ctx.meta.task, forward))


@dataclass(frozen=True)
class ModelSize:
    """What a method's server memory depends on besides the population (:meth:`Method.server_bytes`):
    the model's parameter count ``params`` (p), those of its head (the last unit, or ``model.head``),
    one sample's features, the classes (0: regression) and the bytes of one parameter value."""
    params: int
    head: int
    features: int = 0
    classes: int = 0
    itemsize: int = 4

    def with_params(self, params: int) -> "ModelSize":
        """A model of ``params`` parameters with the same share of them in its head."""
        head = min(params, round(self.head * params / self.params)) if self.params else 0
        return dataclasses.replace(self, params=params, head=head)


def members_of(m: int, cfg: Any) -> int:
    """The clients that train (newcomers join after training) among ``m``, for ``cfg``."""
    return m - round_share(m, cfg.newcomers.fraction)


def samples_everyone(m: int, cfg: Any) -> bool:
    """Every training client in every round (``federation.clients_per_round`` 0 or at least them)."""
    k = cfg.federation.clients_per_round
    return k == 0 or k >= members_of(m, cfg)


@dataclass
class EvalPlan:
    """What a client is evaluated with at an evaluation round (built client-side by :meth:`Method.eval_plan`)."""
    personal: Params                                       # the personalized model (``test/*``, ``val/*``)
    forward: Callable[[Params, torch.Tensor], torch.Tensor] | None = None  # custom forward of ``personal``
    global_model: Params | None = None                     # the global model as received (``global/*``)
    extra: dict[str, Params] = field(default_factory=dict)  # metric prefix → model, e.g. fpfc/readout
    reply: Message | None = None                           # evaluation uplink (IFCA's choice)


class Method:
    """Base class of every federated method. Subclasses are registered by name."""

    name: ClassVar[str] = ""
    Hparams: ClassVar[type] = NoHparams
    description: ClassVar[str] = ""
    # the server step is correct for one reply at a time (federation.driver=async)
    supports_async: ClassVar[bool] = False
    # the training uplink carries model content (a model, an update, a data basis) that a Byzantine
    # client can replace (pfl/federation/attacks.py); False refuses attack.kind for this method
    attackable_uplink: ClassVar[bool] = True
    uplink_note: ClassVar[str] = "model parameters"
    # one line: how a newcomer joins after training (README, pipelines/newcomers.py)
    newcomer_rule: ClassVar[str] = "evaluated with what the server sends for evaluation"
    #: how ``federation.cohort: auto`` runs its clients: "vectorized" (their training and evaluation
    #: requests batched, pfl.federation.cohort) or "sequential" (hooks with data-dependent control
    #: flow, e.g. Per-FedAvg's extra minibatches, PerFed-CKT's public-set batches)
    cohort: ClassVar[str] = "vectorized"
    #: metrics ``extra_metrics`` may report (``*`` matches any tail), checked by sweeps before Ray starts
    metric_names: ClassVar[tuple[str, ...]] = ()
    #: what a client that never trained is evaluated with (``evaluation.untrained_model: method``):
    #: "personal" — its personal model as :meth:`eval_plan` builds it (for Ditto, an untrained model) —
    #: or "global" — the global model it receives, when the method has one (pfl/federation/eval_modes.py)
    untrained_model: ClassVar[str] = "personal"
    #: a reference row without a federation (``centralized``): the engine attaches the members' pooled
    #: training data (``attach_pool``) and evaluates without the wire (pfl.federation.pooled)
    pooled: ClassVar[bool] = False
    #: "" — the simulator's codec compresses this method's uplink (``compression.uplink``);
    #: "unbiased" / "any" — the method compresses inside its own protocol (DIANA, MARINA, LAG) with
    #: the compressor ``compression.uplink`` names, which must be unbiased / may be any
    compresses_uplink: ClassVar[str] = ""
    #: non-empty: why every client must hold exactly what the server holds (a copy kept in step, a
    #: stored update both sides compare): a lossy ``compression.downlink`` is refused with this reason
    exact_downlink: ClassVar[str] = ""
    #: dotted config values with which a few-round run on a small config reaches this method's
    #: stateful paths (warm-up over, clusters split, every client sampled where it needs all): what
    #: the tests' every-method runs use (tests/helpers.py), declared here next to ``Hparams``
    quick: ClassVar[dict[str, Any]] = {}
    #: what in the server state grows with the population, in words (FPFC: its pairwise θ and v), for
    #: the memory check's refusal (pfl/server_memory.py); goes with :meth:`server_bytes`
    server_memory_note: ClassVar[str] = ""
    #: hyperparameter values that shrink that state ({field: value}; FPFC: shared_layers=body): the
    #: memory check says what each would need
    memory_options: ClassVar[dict[str, Any]] = {}

    @classmethod
    def server_bytes(cls, m: int, size: ModelSize, cfg: Any) -> int | None:
        """At most how many bytes of server state grow with the population: what the server keeps per
        client or per pair of clients once all ``m`` clients (newcomers included) have reported, for
        a model of ``size`` and the resolved config ``cfg`` (``method.hparams``, the federation). The
        few models a server keeps whatever m is are not counted. None (default): nothing grows with m.
        A run whose need does not fit is refused before any work (pfl/server_memory.py);
        tests/test_method_memory.py compares the number with the state a run holds."""
        return None

    @classmethod
    def server_work_bytes(cls, m: int, size: ModelSize, cfg: Any) -> int:
        """The most bytes of temporaries a round's server steps hold on top of that state, where they
        are of its order (FPFC: a pair update's (|A|, m, p) tensors); 0 (default): negligible."""
        return 0

    def __init__(self, hparams: Any, ctx: "RunContext"):
        self.hp = hparams
        self.ctx = ctx
        self.configure()

    @classmethod
    def create(cls, hparams: Any, ctx: "RunContext", setup: bool = True) -> tuple["Method", "Method"]:
        """The (server, client) objects of one run; see the module docstring. ``setup=False`` leaves
        the server without state (a worker process, pfl.federation.workers, uses only the client)."""
        server = cls(hparams, ctx)
        static = dict(vars(server))
        client = cls.__new__(cls)
        client.__dict__.update(static)
        client.__dict__["_role"] = "client"
        server.__dict__.update(_role="server", _static_names=frozenset(static))
        if setup:
            server.setup()
        return server, client

    def __setattr__(self, key: str, value: Any) -> None:
        if self.__dict__.get("_role") == "client":
            raise AttributeError(f"{type(self).__name__}: client-side code cannot set {key!r} on the method "
                                 "object (one object serves every client); keep it in client.state")
        super().__setattr__(key, value)

    def set_hparams(self, hparams: Any) -> None:
        """Replace the hyperparameters (a pipeline changing λ between rounds); both sides call this."""
        object.__setattr__(self, "hp", hparams)

    # ---- static --------------------------------------------------------------------------------
    def configure(self) -> None:
        """Derive read-only values from the config (runs once; shared by both sides)."""

    def client_model(self, cid: int) -> torch.nn.Module:
        """The model object client ``cid`` computes with (PerFed-CKT: its architecture)."""
        return self.ctx.model

    # ---- server side: lifecycle and one round ----------------------------------------------------
    def setup(self) -> None:
        """Initialise the server state (called once, before round 0)."""

    def begin_round(self, rnd: int, sampled: list[int]) -> None:
        """Server-side work before messages go out (e.g. one stacked computation for all)."""

    def broadcast(self, rnd: int, cid: int) -> Message | None:
        """The downlink message for sampled client ``cid``."""
        return None

    def receive(self, rnd: int, cid: int, reply: Message) -> Message:
        """A delivered training reply as it arrives, before :meth:`aggregate` (server side). Returns
        what ``aggregate`` gets for this client: the reply itself (default), or, once the method has
        folded the reply's content into a running aggregate, a message with its control data only."""
        return reply

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        """Update the server state from this round's delivered uplink messages (as :meth:`receive`
        returned them)."""

    def global_params(self) -> Params | None:
        """The global model, if the method has one."""
        return None

    # ---- server side: evaluation ---------------------------------------------------------------
    def begin_eval(self, rnd: int, final: bool) -> None:
        """Server-side work before the evaluation messages go out (FPFC: its read-out)."""

    def eval_message(self, rnd: int, cid: int) -> Message | None:
        """What client ``cid`` needs from the server to be evaluated (default: the global model)."""
        glob = self.global_params()
        return None if glob is None else Message.model(glob, **{GLOBAL: True})

    def eval_aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        """Receive the evaluation replies (IFCA: every client's cluster choice)."""

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        """Method-specific metrics logged at evaluation rounds (e.g. cluster/num)."""
        return {}

    def round_metrics(self, rnd: int) -> dict[str, float]:
        """Method-specific metrics logged every round, after the round's aggregation (FPFC: its ADMM
        residuals); cheap, since every round pays for them."""
        return {}

    def artifacts(self, outdir: str) -> list[str]:  # pragma: no mutate block (a file for a reader)
        """Write method-specific artifacts (tables, plots) at the end of a run; return paths."""
        return []

    def cluster_assignment(self) -> dict[int, int] | None:
        """Clustered methods: the cluster each client in the federation is in now (None: no clusters)."""
        return None

    # ---- server side: newcomers (after the last training round) ---------------------------------
    def join_begin(self, rnd: int, newcomers: list[int]) -> None:
        """The ``newcomers`` are about to join; ``rnd`` is the first join step's round number."""

    def join_active(self, step: int) -> list[int]:
        """The newcomers that take part in join step ``step`` (none: the join phase is over)."""
        return []

    def join_message(self, rnd: int, step: int, cid: int) -> Message | None:
        """The downlink to newcomer ``cid`` at join step ``step`` (round number ``rnd``)."""
        return None

    def join_aggregate(self, rnd: int, step: int, replies: dict[int, Message]) -> None:
        """Receive the newcomers' delivered uploads of one join step."""

    # ---- client side: newcomers ----------------------------------------------------------------
    def join_update(self, rnd: int, step: int, client: ClientHandle, msg: Message | None) -> Message | None:
        """A newcomer's work at join step ``step``: update ``client.state``, return the upload."""
        return None

    # ---- client side ---------------------------------------------------------------------------
    def init_client(self, client: ClientHandle) -> None:
        """Initialise ``client.state`` (called once per client, before round 0)."""

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message | None:
        """Read the message, train, update ``client.state``, return the uplink message."""
        raise NotImplementedError

    def decode(self, msg: Message) -> Params:
        """The dense tensors of a received message (FedSLR unfolds its factor pairs)."""
        return msg.tensors()

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        """The model this client is evaluated with, given what the evaluation message carried
        (default: that model itself, e.g. FedAvg's global model)."""
        if received is None:
            raise NotImplementedError(f"{self.name} must define personal_params")
        return received

    def fit_model(self, rnd: int, client: ClientHandle, msg: Message | None, when: str) -> Params | None:
        """The model ``evaluation.when`` evaluates around a local update: ``before`` with the training
        downlink ``msg``, ``after`` with the client's reply. Default: :meth:`personal_params` given the
        message's ``model`` part, else its first :class:`~pfl.federation.messages.Model` part (FedAvg:
        the received, then the trained model; SCAFFOLD: the received θ; Ditto: its personal model
        before and after); None (not evaluated) where that is not defined — a reply of updates only
        (SCAFFOLD, FedNova) has no ``after`` model unless the method overrides this."""
        names = [] if msg is None else ["model"] if "model" in msg else [k for k in msg if isinstance(msg[k], Model)]
        received = msg.tensors(names[0]) if names else None
        try:
            return self.personal_params(rnd, client, received)
        except NotImplementedError:
            return None

    def eval_forward(self, client: ClientHandle) -> Callable[[Params, torch.Tensor], torch.Tensor] | None:
        """A custom forward for evaluation (None: the client's model as is)."""
        return None

    def eval_plan(self, rnd: int, client: ClientHandle, msg: Message | None) -> EvalPlan:
        """Everything this client is evaluated with after round ``rnd``."""
        received = None if msg is None else self.decode(msg)
        glob = received if msg is not None and msg.info.get(GLOBAL) else None
        return EvalPlan(self.personal_params(rnd, client, received), self.eval_forward(client), glob)

    # ---- checkpoints ---------------------------------------------------------------------------
    def server_state(self) -> dict[str, Any]:
        """Every attribute set after ``configure`` (names starting with ``_`` are caches)."""
        static = self.__dict__.get("_static_names", frozenset())
        return {k: v for k, v in vars(self).items() if k not in static and not k.startswith("_")}

    def load_server_state(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def hparams_dict(hp: Any) -> dict[str, Any]:
    return dataclasses.asdict(hp) if dataclasses.is_dataclass(hp) else {}


class FineTuneNewcomers:
    """Newcomer rule "fine-tune the final global model" (docs/methods/fpfc.md §8: LG and Per-FedAvg).

    Join step 0 sends the server's ``global_model`` (every tensor); the newcomer trains it with the
    shared local-SGD loop for one local update per join step (``newcomers.finetune_rounds`` of them)
    and is evaluated with the result (``client.state["joined"]``; with 0 steps: the model itself).
    Nothing is uploaded.
    """

    newcomer_rule: ClassVar[str] = "fine-tunes the final global model (newcomers.finetune_rounds local updates)"

    def join_active(self, step: int) -> list[int]:
        steps = max(1, self.ctx.cfg.newcomers.finetune_rounds)  # type: ignore[attr-defined]
        return list(self.ctx.newcomers) if step < steps else []  # type: ignore[attr-defined]

    def join_message(self, rnd: int, step: int, cid: int) -> Message | None:
        return Message.model(dict(self.global_model)) if step == 0 else None  # type: ignore[attr-defined]

    def join_update(self, rnd: int, step: int, client: ClientHandle, msg: Message | None) -> Message | None:
        start = msg.tensors() if step == 0 else client.state["joined"]
        if self.ctx.cfg.newcomers.finetune_rounds == 0:  # type: ignore[attr-defined]
            client.state["joined"] = dict(start)
            return None
        client.state["joined"] = client.train(start, rnd, tag="join").params
        return None

    def eval_plan(self, rnd: int, client: ClientHandle, msg: Message | None) -> EvalPlan:
        if "joined" not in client.state:
            return super().eval_plan(rnd, client, msg)  # type: ignore[misc]
        glob = self.decode(msg) if msg is not None and msg.info.get(GLOBAL) else None  # type: ignore[attr-defined]
        return EvalPlan(client.state["joined"], global_model=glob)
