"""A worker of the pool (:mod:`pfl.federation.workers`): the client half of a run in its own process.

:class:`WorkerRun` builds, from the run's resolved config, what a client step needs and nothing the
server has: the data (from the partition cache, each client built when it is first sent here), the
model (seeded as the simulator seeds it), the method's client object (its static part derived from
the config, no server state), the client side of the wire's stages (compression's decoding and
encoding, an attack) and the cohort runner ``federation.cohort`` asks for. Every call
(:meth:`WorkerRun.run`) brings a part's clients — their delivered downlinks and their states as the
run's store loaded them — with the side's name (:mod:`pfl.federation.sides`), the lineage's round
and the method's hyperparameters (a pipeline may change them between rounds), and returns each
client's reply (through its side of the wire), what the simulator observes (an evaluation row) and
its new state. Nothing stays here between calls but the data and the built objects, so any worker
can take any client and a run may resume with another number of workers.

Both directions are one ``torch.save`` byte string (:func:`dumps`): tensors keep their dtypes,
values and aliasing (a state that names one tensor twice gets it back once), and its length is what
crosses between the processes (``workers/sent_bytes``, ``workers/received_bytes``). A downlink
tensor equal to another client's of the same call crosses once (:func:`share_equal`).
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from ..data import load_federated
from ..methods import ClientHandle, get_method
from ..models import build_model
from ..models.custom import prepare_model
from ..schema import from_dict, to_dict
from .cohort import cohort_runner
from .comm import CommLedger
from .context import FederationMeta, RunContext, resolve_device
from .messages import Message
from .newcomers import newcomer_clients
from .population import Population
from .sides import ClientSides
from .wire import Wire, build_stages

#: set in a worker's environment: its slot in the pool (tests and logs tell workers apart by it)
WORKER_ENV = "PFL_WORKER"


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loads(data: bytes, device: torch.device | str = "cpu") -> Any:
    # the pool's own messages between its processes (never a file a user hands over)
    return torch.load(io.BytesIO(data), map_location=device, weights_only=False)


def _node() -> str:
    """The Ray node this process runs on ("local" outside Ray)."""
    import sys

    ray = sys.modules.get("ray")  # a worker of the local backend never imports Ray
    if ray is None or not ray.is_initialized():
        return "local"
    return ray.get_runtime_context().get_node_id()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _map_tensors(downs: list[Message | None], fn) -> list[Message | None]:
    """The downlinks with every plain tensor entry replaced by ``fn(part name, entry name, tensor)``,
    in client order (the order both sides of the pool walk a call in)."""
    return [None if msg is None else
            Message({name: part.replace({k: fn(name, k, e) if isinstance(e, torch.Tensor) else e
                                         for k, e in part.entries.items()})
                     for name, part in msg.parts.items()}, msg.info)
            for msg in downs]


def share_equal(downs: list[Message | None]) -> list[Message | None]:
    """The downlinks of one call with every plain tensor that equals, bit for bit, the same entry of
    an earlier client's downlink replaced by that tensor: ``torch.save`` writes a storage once, so
    the global model a round sends to every client crosses once a call instead of once a client
    (the worker gives each client its own copy again: :func:`own_copies`)."""
    seen: dict[tuple, torch.Tensor] = {}

    def first_equal(name: str, k: str, e: torch.Tensor) -> torch.Tensor:
        first = seen.setdefault((name, k, e.dtype, tuple(e.shape), e.device), e)
        return first if first is not e and torch.equal(_bits(first), _bits(e)) else e

    return _map_tensors(downs, first_equal)


def own_copies(downs: list[Message | None]) -> list[Message | None]:
    """Undo :func:`share_equal` on the worker: a tensor an earlier client of the call already holds
    is copied, so a client that edits its downlink in place edits its own."""
    held: set[int] = set()

    def own(name: str, k: str, e: torch.Tensor) -> torch.Tensor:
        ptr = e.untyped_storage().data_ptr()
        out = e.clone() if ptr in held and e.numel() else e
        held.add(ptr)
        return out

    return _map_tensors(downs, own)


def data_signature(data) -> tuple:
    """What a worker's data must share with the run's: the partition and the clients' sizes. A run
    given data not built from its config (a test's own) cannot use workers."""
    return (data.partition_hash, len(data.clients), data.num_classes, tuple(data.input_shape),
            tuple(data.client_sizes()))


class WorkerRun(ClientSides):
    """The client half of a run (see the module docstring)."""

    def __init__(self, config: dict, data_capacity: float | None = None):
        from ..resolver import resolve

        cfg = resolve(config)
        self.cfg = cfg
        fed = cfg.federation
        if fed.threads:
            torch.set_num_threads(fed.threads)
        self.device = resolve_device(fed.device)
        self.data = load_federated(cfg.data, cfg.seed, on_demand=True).to(self.device)
        if data_capacity is not None:
            self.data.keep_at_most(data_capacity)
        torch.manual_seed(cfg.seed)  # as the simulator builds its model
        model = build_model(cfg.model.name, cfg.model.params, self.data.input_shape,
                            self.data.num_classes).to(self.device)
        model = prepare_model(model, cfg, self.data)
        self.ctx = RunContext(cfg=cfg, meta=FederationMeta.of(self.data), model=model, device=self.device,
                              newcomers=newcomer_clients(cfg, len(self.data.clients)))
        self.population = Population(self.ctx, self.data.client_ids)
        method_cls = get_method(cfg.method.name)
        _, self.client_role = method_cls.create(cfg.method.hparams, self.ctx, setup=False)
        self.method = self.client_role  # the sides read only its class
        self.wire = Wire(CommLedger(), build_stages(cfg, self.ctx, self.client_role))
        self.runner = cohort_runner(fed, method_cls, self.device, model)
        self.round = 0

    def ready(self) -> dict:
        return {"device": self.device.type, "data": data_signature(self.data), "pid": os.getpid(), "node": _node()}

    def run(self, payload: bytes) -> bytes:
        call = loads(payload, self.device)
        self.round = call["round"]
        if call["hparams"] != to_dict(self.client_role.hp):  # plain data: composed methods' classes are made at run time
            hparams = from_dict(type(self.client_role.hp), call["hparams"], "method")
            self.client_role.set_hparams(hparams)
            self.cfg.method.hparams = hparams
        phase, side = call["phase"], self.side(call["spec"])
        jobs = call["jobs"]
        jobs = list(zip([cid for cid, _, _ in jobs], own_copies([down for _, down, _ in jobs]),
                        [state for _, _, state in jobs]))
        self.data.prefetch([cid for cid, _, _ in jobs])
        handles: dict[int, ClientHandle] = {}

        def job(cid: int, down, state: dict):
            def work(compute):
                handles[cid] = client = ClientHandle(cid, self.data.clients[cid], state, self.ctx,
                                                     self.client_role.client_model(cid), compute)
                return self.wire.client_side(phase, client, down, side)
            return work

        results = self.runner.run({cid: job(cid, down, state) for cid, down, state in jobs})
        return dumps({"results": [(cid, *results[cid], handles[cid].state) for cid, _, _ in jobs],
                      "sequential": sorted(self.runner.take_sequential()),
                      "tallies": self.wire.stages.take_tallies()})


class WorkerActor:
    """The Ray actor around a :class:`WorkerRun` (``ray.remote`` is applied where the pool starts)."""

    def __init__(self, init: bytes, slot: int):
        os.environ[WORKER_ENV] = str(slot)
        self.worker = WorkerRun(**loads(init))

    def ready(self) -> dict:
        return self.worker.ready()

    def run(self, payload: bytes) -> bytes:
        return self.worker.run(payload)


__all__ = ["WORKER_ENV", "WorkerActor", "WorkerRun", "data_signature", "dumps", "loads", "own_copies", "share_equal"]
