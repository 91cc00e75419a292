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

Both directions are a :class:`Packed` message (:func:`dumps`): a pickle whose tensors' storages
travel beside it as raw byte buffers (pickle protocol 5's out-of-band buffers), so Ray writes each
storage once into its object store and the reader copies it once out of it; no ``torch.save`` zip,
no byte string copied on the way. Tensors keep their dtypes, bits, shapes, strides and aliasing (two
views of one storage arrive as views of one storage, a tensor named twice arrives once); the
header's length plus the buffers' is what crosses between the processes (``workers/sent_bytes``,
``workers/received_bytes``). A downlink tensor equal to another client's of the same call crosses
once (:func:`share_equal`).
"""

from __future__ import annotations

import functools
import io
import os
import pickle
from typing import Any, NamedTuple

import numpy as np
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


class Packed(NamedTuple):
    """A message between the pool's processes: the pickle and its storages' bytes."""
    header: bytes
    buffers: list

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(b.nbytes for b in self.buffers)


class _Storage:
    """A tensor storage on its way: pickled once however many tensors view it."""

    def __init__(self, data: np.ndarray, device: str):
        self.data, self.device = data, device

    def __reduce_ex__(self, protocol):
        return _storage, (pickle.PickleBuffer(self.data), self.device)


class _Pickler(pickle.Pickler):
    def __init__(self, file, buffers: list):
        super().__init__(file, protocol=5, buffer_callback=lambda b: buffers.append(np.frombuffer(b.raw(), np.uint8)))
        self.storages: dict[tuple, _Storage] = {}

    def reducer_override(self, obj):
        # a plain tensor: its storage as raw bytes (once) and where in it the tensor lies; anything
        # else (a Parameter, a tensor that needs its autograd graph, sparse) the default way
        if (type(obj) is not torch.Tensor or obj.requires_grad or obj.layout != torch.strided or obj.is_quantized
                or obj.is_nested or obj.is_conj() or obj.is_neg()):  # a lazy conjugate: its bits are not its values
            return NotImplemented
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), str(storage.device), storage.nbytes())
        held = self.storages.get(key)
        if held is None:
            raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).cpu()
            held = self.storages[key] = _Storage(raw.numpy(), str(storage.device))
        return _view, (held, obj.dtype, obj.storage_offset(), tuple(obj.shape), obj.stride())


def _storage(buf, device: str, to: torch.device | None = None) -> torch.Tensor:
    data = np.frombuffer(buf, np.uint8)
    out = torch.empty(data.size, dtype=torch.uint8)
    out.numpy()[:] = data   # the reader's own copy (Ray's buffers are read-only)
    return out.to(to if to is not None else device)


def _view(storage: torch.Tensor, dtype: torch.dtype, offset: int, shape: tuple, stride: tuple) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage.untyped_storage(), offset, shape, stride)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, buffers: list, device: torch.device | str | None):
        super().__init__(file, buffers=buffers)
        self.to = None if device is None else torch.device(device)

    def find_class(self, module, name):
        if module == __name__ and name == "_storage":
            return functools.partial(_storage, to=self.to)
        return super().find_class(module, name)


def dumps(obj: Any) -> Packed:
    buffers: list = []
    buf = io.BytesIO()
    _Pickler(buf, buffers).dump(obj)
    return Packed(buf.getvalue(), buffers)


def loads(packed: Packed, device: torch.device | str | None = None) -> Any:
    """``packed`` with every tensor on ``device`` (None: where it was sent from). The pool's own
    messages between its processes, never a file a user hands over."""
    header, buffers = packed
    return _Unpickler(io.BytesIO(header), list(buffers), device).load()


def _node() -> str:
    """The Ray node this process runs on ("local" outside Ray)."""
    import sys

    ray = sys.modules.get("ray")  # a worker of the local backend never imports Ray
    if ray is None or not ray.is_initialized():
        return "local"
    return ray.get_runtime_context().get_node_id()


def _bits(t: torch.Tensor) -> torch.Tensor:
    # the widest integer view the byte count allows: equal views ⇔ equal bits, and fewer elements
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    for dtype in (torch.int64, torch.int32):
        if raw.numel() % dtype.itemsize == 0:
            if raw.storage_offset() % dtype.itemsize:  # a view at an unaligned offset: an aligned copy
                raw = raw.clone()
            return raw.view(dtype)
    return raw


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
    an earlier client's downlink replaced by that tensor: :func:`dumps` packs a storage once, so
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

    def run(self, payload: Packed) -> Packed:
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
        # each client's answer and state packed apart: the run's process unpacks one at a time
        return dumps({"results": [(cid, dumps(results[cid]), dumps(handles[cid].state)) for cid, _, _ in jobs],
                      "sequential": sorted(self.runner.take_sequential()),
                      "tallies": self.wire.stages.take_tallies()})


class WorkerActor:
    """The Ray actor around a :class:`WorkerRun` (``ray.remote`` is applied where the pool starts)."""

    def __init__(self, init: Packed, slot: int):
        os.environ[WORKER_ENV] = str(slot)
        self.worker = WorkerRun(**loads(init))

    def ready(self) -> dict:
        return self.worker.ready()

    def run(self, payload: Packed) -> Packed:
        return self.worker.run(payload)


__all__ = ["WORKER_ENV", "Packed", "WorkerActor", "WorkerRun", "data_signature", "dumps", "loads", "own_copies", "share_equal"]
