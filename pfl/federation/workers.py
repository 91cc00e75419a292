"""The worker pool: a round's clients computed in ``federation.workers`` processes (Ray actors).

**Where it sits.** The exchange (:mod:`pfl.federation.exchange`) loads a part's states, hands the
part to its runner and saves what comes back; with ``federation.workers: N > 1`` the runner is a
:class:`WorkerPool`. The server side of every trip — the method's server object, the server's side
of the wire's stages (a codec's mirrors, the records of what it sent), the ledger, the client
store, sampling and the callbacks — stays in the run's process. Each worker
(:class:`pfl.federation.worker_side.WorkerRun`) builds the model, the method's client object, the
client side of the stages and the client data itself from the config (data from the partition
cache): nothing of the data set is shipped, ever.

**What crosses, per call** (a part — a round's training, an evaluation — goes as up to
:data:`BLOCKS_PER_WORKER` calls per worker, or one each when
the workers hold every CPU of the cluster; see Same bits):
the phase, the side's name (:mod:`pfl.federation.sides`), the lineage's round, the method's
hyperparameters, and for each of the worker's clients its delivered downlink and its loaded state;
back come each client's reply (already through its side of the wire: compressed, attacked), what
the simulator observes (an evaluation row) and its new state, with the counters the client sides
of the stages keep for the round's metrics and the clients a batched cohort ran alone. Measured
per round as ``workers/sent_bytes`` and ``workers/received_bytes``.

**Same bits.** A client's step is a function of its downlink, its state and generators seeded by
(seed, round, client, purpose), so where it runs does not change it. Replies are delivered and
states saved in the part's client order, whichever worker finishes first. The part is cut, in its
order, into blocks of about equal training data dealt to the workers in turn (:meth:`WorkerPool.blocks`):
blocks finish in about the order they are delivered in, so the run's process unpacks, saves and
folds the first blocks' clients while the workers compute the last ones. Which worker computes a
client only balances the work.

**Faults.** A worker that dies (a killed process, out of memory) is started again and its clients
of the call run again from the same downlinks and states — the same bits; ``workers/restarts``
counts it and a warning says so. A worker that cannot start (resources no node has, a device it
cannot see, an error building the run) stops the run with a ConfigError naming
``federation.worker_resources`` (the CLI's exit status 2).

**Backends.** ``ray`` (the default): actors on the cluster ``RAY_ADDRESS`` names, else on a Ray
instance started here (:func:`pfl.tune.ray_session.init_ray`, the files a run reads shipped by
:func:`pfl.tune.runtime_env.worker_runtime_env`); inside a process that already runs Ray (a sweep's
trial) the actors join that session. ``PFL_WORKER_BACKEND=local`` runs the workers' code in this
process — the same objects built apart and the same packed messages, without Ray: the quick tests.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import weakref
from typing import TYPE_CHECKING, Any, Mapping

from ..schema import ConfigError, to_dict
from .sides import spec_of
from .wire import ClientSide, Phase
from .worker_side import Packed, WorkerActor, WorkerRun, data_signature, dumps, loads, share_equal

if TYPE_CHECKING:
    from .messages import Message

log = logging.getLogger(__name__)

BACKEND_ENV = "PFL_WORKER_BACKEND"
#: a worker that dies this many times on one call stops the run (a client that always kills it)
MAX_RESTARTS = 3
#: how long the workers may take to start (scheduling, building the data and the model)
START_TIMEOUT_S = 600.0
#: environment a worker needs from the run's process (the partition cache it reads)
CARRIED_ENV = ("PFL_CACHE_DIR",)
RESOURCES = "federation.worker_resources"
#: a part is sent as this many blocks per worker when the cluster has a CPU beyond the workers' (the
#: run's process then delivers the first blocks while the workers compute the last); else one block each,
#: as the extra calls cost more CPU than the overlap saves when the workers hold every core
#: (pipelines/bench_workers.py on 2 CPUs: 2 workers 1.46x one process with 3 blocks, 1.59x with 1)
BLOCKS_PER_WORKER = 3


class WorkerLost(RuntimeError):
    """A worker's process is gone (killed, out of memory, its node lost)."""


class _LocalWorker:
    def __init__(self, init: Packed, slot: int):
        self.run = WorkerRun(**loads(init))

    def ready(self) -> dict:
        return self.run.ready()

    def submit(self, payload: Packed) -> Packed:
        return payload

    def get(self, ref: Packed) -> Packed:
        return self.run.run(ref)

    def kill(self) -> None:
        pass


def trial_bundles(fed, cpu: float, gpu: float) -> list[dict[str, float]]:
    """A Tune trial's placement group: its own bundle, then one per worker of ``federation.workers``
    (each ``federation.worker_resources``), so Ray starts a trial only when its workers fit too."""
    def bundle(c: float, g: float) -> dict[str, float]:
        return {k: v for k, v in (("CPU", float(c)), ("GPU", float(g))) if v > 0}

    workers = [bundle(fed.worker_resources.cpu, fed.worker_resources.gpu)] * (fed.workers if fed.workers > 1 else 0)
    return [bundle(cpu, gpu)] + workers


def _in_trial_bundle(slot: int) -> dict[str, Any]:
    """Inside a Tune trial whose placement group has a bundle for worker ``slot`` (trial_bundles):
    the scheduling strategy that puts the worker there (its node, maybe another one)."""
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = get_current_placement_group()
    if pg is None or pg.bundle_count <= slot + 1:
        return {}
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=slot + 1)}


class _RayWorker:
    def __init__(self, init: Any, slot: int, resources, env: dict[str, str]):
        import ray

        actor_class = ray.remote(WorkerActor)
        self.actor = actor_class.options(num_cpus=resources.cpu, num_gpus=resources.gpu, max_restarts=0,
                                         max_task_retries=0, runtime_env={"env_vars": env},
                                         **_in_trial_bundle(slot)).remote(init, slot)

    def ready(self) -> dict:
        import ray
        from ray import exceptions as rex

        try:
            return ray.get(self.actor.ready.remote(), timeout=START_TIMEOUT_S)
        except rex.GetTimeoutError:
            self.kill()
            raise ConfigError(RESOURCES, f"a worker did not start within {START_TIMEOUT_S:.0f} s (the cluster has "
                                         f"{_cluster_text()} and is busy, or no node can give what a worker asks "
                                         "for); ask for less or lower federation.workers") from None
        except rex.RayError as err:
            raise ConfigError(RESOURCES, f"a worker could not start: {_reason(err)}") from None

    def submit(self, payload: Packed):
        return self.actor.run.remote(payload)

    def get(self, ref) -> Packed:
        import ray
        from ray import exceptions as rex

        try:
            return ray.get(ref)
        except (rex.RayActorError, rex.WorkerCrashedError, rex.ObjectLostError, rex.OutOfMemoryError,
                rex.NodeDiedError) as err:
            raise WorkerLost(_reason(err)) from None
        except rex.RayTaskError as err:  # the client side itself failed: raised as in the run's process
            raise err.as_instanceof_cause() from None

    def kill(self) -> None:
        import ray

        if not ray.is_initialized():  # Ray is down (its exit hook ran): the actors went with it
            return
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as err:  # already gone
            log.debug("killing a worker: %s", err)


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return " ".join(line.strip() for line in text[:6])[:600]


def _cluster_text() -> str:
    import ray

    total = ray.cluster_resources()
    return f"{total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs"


def workers_that_fit(nodes: list[Mapping[str, float]], cpu: float, gpu: float) -> int:
    """How many workers asking for ``cpu`` and ``gpu`` the nodes (their total resources) can hold."""
    def per_node(res: Mapping[str, float]) -> int:
        counts = [math.floor(res.get(key, 0.0) / need + 1e-9) for key, need in (("CPU", cpu), ("GPU", gpu)) if need]
        return min(counts) if counts else 0
    return sum(per_node(r) for r in nodes)


class WorkerPool:
    """The exchange's runner with ``federation.workers`` > 1 (see the module docstring). ``local``
    is the in-process runner for a side without a name; ``own_stages``: the run was given stages
    the config does not make, which a worker could not build (everything then runs here)."""

    def __init__(self, sim, local, own_stages: bool = False, n: int | None = None):
        self.sim = sim
        self.local = local
        fed = sim.cfg.federation
        self.n = n or fed.workers  # n: a pool of another size (bench_workers' pool of one)
        self.resources = fed.worker_resources
        self.own_stages = own_stages
        capacity = sim.plan.data_capacity if sim.plan.kind == "disk" else None
        self.init = dumps({"config": sim.cfg.to_dict(), "data_capacity": capacity})
        self.sizes = list(sim.data.client_sizes())
        self.signature = data_signature(sim.data)
        self.workers: list[Any] = [None] * self.n
        self.backend = os.environ.get(BACKEND_ENV, "ray")
        if self.backend not in ("ray", "local"):
            raise ConfigError(BACKEND_ENV, f"{self.backend!r} is not a worker backend; allowed: ray, local")
        self.env = {k: os.environ[k] for k in CARRIED_ENV if k in os.environ}
        self.sequential: set[int] = set()
        self.pids: dict[int, int] = {}   # each worker's process (a restart changes it)
        self.nodes: dict[int, str] = {}  # each worker's Ray node (workers/nodes: how many they span)
        self.turn = 0
        self.per_worker = BLOCKS_PER_WORKER  # blocks per worker (:meth:`blocks`); 1 when the workers fill the cluster
        self.sent = self.received = self.restarts = 0
        self._finalizer = weakref.finalize(self, _kill_all, self.workers)
        if own_stages:
            log.warning("federation.workers=%d: this run was given wire stages its config does not make; its clients "
                        "run in this process", self.n)

    # ---- the runner's interface ----------------------------------------------------------------
    def parts(self, cids):
        return [list(cids)]  # a window's clients at once: every worker gets its share of one call

    def run(self, jobs):
        out: dict[int, Any] = {}
        for part in self.local.parts(list(jobs)):
            out.update(self.local.run({cid: jobs[cid] for cid in part}))
        return out

    def take_sequential(self) -> set[int]:
        out, self.sequential = self.sequential | self.local.take_sequential(), set()
        return out

    def round_metrics(self) -> dict[str, float]:
        out = {"workers/sent_bytes": float(self.sent), "workers/received_bytes": float(self.received),
               "workers/restarts": float(self.restarts), "workers/nodes": float(len(set(self.nodes.values())))}
        self.sent = self.received = self.restarts = 0
        return out

    def ships(self, side: ClientSide) -> bool:
        """Whether the workers compute this side (its clients' downlinks are packed, never edited here)."""
        return spec_of(side) is not None and not self.own_stages

    def ship(self, phase: Phase, downs: Mapping[int, "Message | None"], states: Mapping[int, dict],
             side: ClientSide) -> Mapping[int, tuple] | None:
        """Every client of ``downs`` computed by the workers: ``{cid: (answer, state)}``, functions
        that unpack the client's (reply, local) and its new state when called (the run's process then
        holds one reply at a time, not a part's); None when this side cannot go to a worker (it has
        no name). Asking for a client waits only for its block (:meth:`blocks`): the exchange
        delivers the first blocks' replies while the workers compute the last ones."""
        if not downs or not self.ships(side):
            return None
        spec = spec_of(side)
        self.start()
        common = {"phase": phase, "spec": spec, "round": self.sim.round, "hparams": to_dict(self.sim.method.hp)}
        calls = []
        for slot, group in self.blocks(list(downs)):
            payload = dumps({**common, "jobs": list(zip(group, share_equal([downs[c] for c in group]),
                                                        [states[c] for c in group]))})
            calls.append(_Call(slot, group, payload, self._submit(slot, payload)))
        return _Arrivals(self, calls)

    def blocks(self, cids: list[int]) -> list[tuple[int, list[int]]]:
        """The clients of a call in ``per_worker`` × workers runs of the part's order, each
        about as much training data (plus one per client) as the others, dealt to the workers in
        turn: each worker gets its share, and blocks finish in about the order they are delivered
        in (a call of one client goes to the workers in turn)."""
        slots = [(self.turn + i) % self.n for i in range(self.n)]
        self.turn += 1
        weights = [self.sizes[c] + 1 for c in cids]
        count = min(len(cids), self.n * self.per_worker)
        total, out, start, acc = sum(weights), [], 0, 0
        for i, w in enumerate(weights):
            acc += w
            # a block ends where the running weight passes its share, leaving a client for each later block
            if acc * count >= total * (len(out) + 1) or len(cids) - i - 1 < count - len(out):
                out.append(cids[start:i + 1])
                start = i + 1
        return [(slots[b % self.n], block) for b, block in enumerate(out) if block]

    # ---- the workers ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the workers that are not running (all of them at first; after :meth:`close`).
        Another pool of this process gives its workers back first: a pipeline's earlier runs keep
        their simulators, whose idle workers would otherwise hold the cluster's CPUs and leave these
        waiting (a closed pool starts its workers again when next used)."""
        missing = [slot for slot, w in enumerate(self.workers) if w is None]
        if not missing:
            return
        for other in list(_LIVE):
            if other is not self:
                other.close()
        _LIVE.add(self)
        if self.backend == "ray":
            self._ray_session()
        for slot in missing:
            self.workers[slot] = self._spawn(slot)
        for slot in missing:
            self._check(slot, self.workers[slot].ready())

    def close(self) -> None:
        """Stop the workers (their Ray resources go back); a later call starts them again."""
        _kill_all(self.workers)

    def _spawn(self, slot: int):
        if self.backend == "local":
            return _LocalWorker(self.init, slot)
        return _RayWorker(self._init_ref, slot, self.resources, self.env)

    def _check(self, slot: int, ready: dict) -> None:
        self.pids[slot] = ready["pid"]
        self.nodes[slot] = ready["node"]
        if ready["device"] != self.sim.device.type:
            raise ConfigError(RESOURCES, f"the run computes on {self.sim.device.type} but a worker on "
                                         f"{ready['device']} (a worker sees a GPU only when it asks for one: gpu > 0; "
                                         f"federation.device={self.sim.cfg.federation.device!r})")
        if tuple(ready["data"]) != tuple(self.signature):
            raise ConfigError("federation.workers", "the workers built other client data than the run's (a run "
                                                    "given data not made from its config); allowed here: 1")

    def _submit(self, slot: int, payload: Packed):
        self.sent += payload.nbytes
        return self.workers[slot].submit(payload)

    def _result(self, call: "_Call", calls: list["_Call"]) -> Packed:
        """The packed answer of ``call``. A worker that died is replaced, and its calls not yet
        fetched (this one included) go to the new one: the same downlinks and states."""
        for attempt in range(MAX_RESTARTS + 1):
            try:
                data = self.workers[call.slot].get(call.ref)
                self.received += data.nbytes
                return data
            except WorkerLost as err:
                slot = call.slot
                if attempt == MAX_RESTARTS:
                    raise RuntimeError(f"worker {slot} died {attempt + 1} times on the same clients; last: {err}") \
                        from None
                log.warning("worker %d died (%s); a new one runs its clients again", slot, err)
                self.restarts += 1
                self.workers[slot].kill()
                self.workers[slot] = self._spawn(slot)
                self._check(slot, self.workers[slot].ready())
                for other in calls:
                    if other.slot == slot and not other.fetched:
                        other.ref = self._submit(slot, other.payload)
        raise AssertionError("unreachable")

    def _ray_session(self) -> None:
        import ray

        if not ray.is_initialized():
            from ..tune.ray_session import init_ray
            from ..tune.runtime_env import worker_runtime_env

            shipped = worker_runtime_env([self.sim.cfg], ship_data=bool(os.environ.get("RAY_ADDRESS")),
                                         env_vars=self.env)
            where = init_ray(runtime_env=shipped.runtime_env)
            log.info("federation.workers=%d: Ray %s", self.n, where)
            # exit hooks run last-registered first: this one stops the workers before Ray's own
            # shutdown, which otherwise may meet a replaced actor mid-teardown (a SIGSEGV at exit)
            atexit.register(_close_live)
        if not hasattr(self, "_init_ref"):
            self._init_ref = ray.put(self.init)
        cpu, gpu = self.resources.cpu, self.resources.gpu
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        fit = workers_that_fit(nodes, cpu, gpu)
        self.per_worker = BLOCKS_PER_WORKER if fit > self.n else 1
        if fit < self.n:
            raise ConfigError(RESOURCES, f"{self.n} workers of {{cpu: {cpu:g}, gpu: {gpu:g}}} do not fit the Ray "
                                         f"cluster ({_cluster_text()}; {fit} fit): ask for less per worker or lower "
                                         "federation.workers")


class _Call:
    """One block of a part on its way to a worker and back."""

    def __init__(self, slot: int, group: list[int], payload: Packed, ref: Any):
        self.slot, self.group, self.payload, self.ref, self.fetched = slot, group, payload, ref, False


class _Arrivals(Mapping):
    """A shipped part's clients → (answer, state) unpackers; a client's block is fetched when the
    client is first asked for, the blocks before it first (their tallies count in one order)."""

    def __init__(self, pool: WorkerPool, calls: list[_Call]):
        self.pool, self.calls, self.got = pool, calls, {}
        self.order = [cid for call in calls for cid in call.group]
        self.next = 0

    def __getitem__(self, cid: int) -> tuple:
        while cid not in self.got:
            call = self.calls[self.next]  # the blocks up to cid's, in order
            self.next += 1
            answer = loads(self.pool._result(call, self.calls), self.pool.sim.device)
            call.fetched, call.payload = True, None
            for c, reply, state in answer["results"]:
                self.got[c] = (functools.partial(loads, reply, self.pool.sim.device),
                               functools.partial(loads, state, self.pool.sim.device))
            self.pool.sequential.update(answer["sequential"])
            self.pool.sim.wire.stages.add_tallies(answer["tallies"])
        return self.got[cid]

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


#: the pools of this process whose workers may be running
_LIVE: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


def _close_live() -> None:
    for pool in list(_LIVE):
        pool.close()


def _kill_all(workers: list) -> None:
    for slot, worker in enumerate(workers):
        if worker is not None:
            worker.kill()
            workers[slot] = None


def start_pool(sim, local, own_stages: bool = False, n: int | None = None) -> WorkerPool:
    """The run's pool, its workers started (so that one that cannot start stops the run before it
    begins); ``n`` workers instead of ``federation.workers``."""
    pool = WorkerPool(sim, local, own_stages, n)
    if not own_stages:
        pool.start()
    return pool


__all__ = ["BACKEND_ENV", "MAX_RESTARTS", "WorkerLost", "WorkerPool", "start_pool", "workers_that_fit"]
