"""One federated run: its parts, one training round, evaluation, and the run's state.

``Simulator(cfg)`` builds a run from its config: the data on the run's device, the shared model
object, the method's server and client objects, the population (:mod:`.population`: members,
newcomers, malicious clients), the client-state store (:mod:`.store`: in memory, or on disk with the
clients' data built when sampled, :mod:`.diskstore`), the wire (:mod:`.wire`: its stages — an
attack, compression — in the declared order, and the ledger) and the exchange (:mod:`.exchange`)
through which every message travels. It does not drive itself: the round loop
(:class:`pfl.federation.loop.RoundLoop`) calls :meth:`run_round`, with callbacks around it;
checkpoint files are :mod:`.checkpoint`'s. Every random choice is drawn from a generator seeded by
(seed, round, client, purpose), so a run resumed from a checkpoint continues exactly as the
uninterrupted run would have.

Two round counters: ``round`` is the model lineage's round (it seeds the generators, drives the
learning-rate schedule and is set back when a pipeline restores an earlier model state, as the λ
path's playoff does); ``executed`` counts the rounds this run has computed and never decreases (the
metrics' ``step``, and what cumulative counters are indexed by).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..compression import codec  # noqa: F401  (registers the compression stage)
from ..config import ExperimentConfig
from ..data import load_federated
from ..evaluation import summarize
from ..methods import ClientHandle, Method, get_method
from ..models import build_model
from ..models.custom import prepare_model
from ..schema import from_dict, to_dict
from ..server_memory import check_server_memory, declares_memory, model_size
from . import attacks  # noqa: F401  (registers the attack stage)
from . import eval_modes
from .cohort import DIRECT, Cohort, Compute, cohort_runner
from .comm import CommLedger
from .context import FederationMeta, RunContext, resolve_device
from .diskstore import DiskStore
from .exchange import Exchange, Phase
from .messages import Message
from .newcomers import newcomer_clients
from .pooled import Measurement, Pool
from .sides import ClientSides
from .population import Population
from .state import clone, to_device, tree_map
from .store import ClientStore, memory_store, plan_store, release_heap, state_estimate
from .wire import Chain, Stage, Wire, build_stages


#: a disk-store run returns freed heap memory to the system after windows of this many bytes
TRIM_BYTES = 64 * 2**20


class DivergedError(RuntimeError):
    """Training produced a non-finite loss."""


class Simulator(ClientSides):
    def __init__(self, cfg: ExperimentConfig, data=None, stages: list[Stage] | None = None):
        self.cfg = cfg
        self.start_config = cfg.to_dict()  # what a checkpoint is compared with on resume
        fed = cfg.federation
        if fed.threads:
            torch.set_num_threads(fed.threads)
        self.device = resolve_device(fed.device)
        # data built when a client is first asked for; all of it at once below if the store keeps
        # everything in memory (federation.client_store)
        loaded = data if data is not None else load_federated(cfg.data, cfg.seed, on_demand=True)
        start = time.perf_counter()
        self.data = loaded.to(self.device)
        # loading the data (time/data_load_s): the file's reading, also when the config's check did it
        # (LEAF, CSV: parsing into the cache, or reading from it), the partition, moving it, building it
        self.data_load_s = getattr(loaded, "load_s", 0.0) + time.perf_counter() - start
        self.data_note: str = getattr(loaded, "load_note", "")
        torch.manual_seed(cfg.seed)  # only model construction; all later draws use derived generators
        model = build_model(cfg.model.name, cfg.model.params, self.data.input_shape,
                            self.data.num_classes).to(self.device)
        model = prepare_model(model, cfg, self.data)  # buffers, output shape, model.head: one-line errors
        self.ctx = RunContext(cfg=cfg, meta=FederationMeta.of(self.data), model=model, device=self.device,
                              newcomers=newcomer_clients(cfg, len(self.data.clients)))
        self.population = Population(self.ctx, self.data.client_ids)
        self.newcomers_joined = False          # the newcomers have joined (evaluated with everyone)
        self.join_result: dict | None = None   # their metrics, once joined
        self.join_trained: set[int] = set()    # the newcomers a join step trained (no longer untrained)
        method_cls = get_method(cfg.method.name)
        if declares_memory(method_cls):  # population-bound server state (FPFC's θ, v): refused before it is made
            check_server_memory(cfg, len(self.data.clients),
                                model_size(model, self.data.input_shape, self.data.num_classes), device=self.device)
        self.method: Method
        self.client_role: Method
        self.method, self.client_role = method_cls.create(cfg.method.hparams, self.ctx)
        self.ledger = CommLedger()
        # the run's stages in declared order (federation.stages), then any a caller adds
        chain = build_stages(cfg, self.ctx, self.method)
        self.wire = Wire(self.ledger, Chain(chain.stages + list(stages or [])))
        self.round = 0       # the lineage's next round
        self.executed = 0    # rounds computed by this run
        self.history: list[dict[str, float]] = []
        self.elapsed = 0.0
        self.last_client_table: list[dict] | None = None
        self._untrimmed = 0.0   # bytes of windows since the heap was last trimmed (disk store)
        self.store = self._make_store(model)
        self.wire.stages.bind_store(self.store)  # a stage's per-client server memories live in the store
        runner = cohort_runner(fed, method_cls, self.device, model)
        self.vectorized = isinstance(runner, Cohort)
        if fed.workers > 1:  # the clients' steps in worker processes; only such a run imports Ray
            from .workers import start_pool
            runner = start_pool(self, runner, own_stages=bool(stages))
        self.exchange = Exchange(self.wire, self.store, runner, self._handle, window=self.plan.window,
                                 prefetch=self._next_window if self.plan.window else None)
        self.eval_exchange: Exchange | Measurement = self.exchange  # what evaluations go through
        if method_cls.pooled:  # a reference row: the pooled training data, nothing sent (pfl.federation.pooled)
            self.method.attach_pool(Pool(self.data, self.ctx.members))  # type: ignore[attr-defined]
            self.eval_exchange = Measurement(self.store, self._handle)

    def _make_store(self, model: torch.nn.Module) -> ClientStore:
        """The client-state store ``federation.client_store`` asks for (:func:`.store.plan_store`)."""
        fed = self.cfg.federation
        first = self._new_client_state(0, self.device) if self.num_clients else {}
        self.plan = plan_store(fed, self.num_clients, self.ctx.num_members, state_estimate(first, model),
                               self.data.client_nbytes())
        if self.plan.kind == "memory":
            if fed.workers <= 1:  # with workers they build their clients' data; here only what is asked for
                start = time.perf_counter()
                self.data = self.data.materialized()  # every client's data, built once
                self.data_load_s += time.perf_counter() - start
            return memory_store(self.num_clients, self._new_client_state, fed.client_state_device, self.device,
                                model, first)
        self.data.keep_at_most(self.plan.data_capacity)
        return DiskStore(fed.client_store_dir, self.num_clients, lambda cid: self._new_client_state(cid, self.device),
                         self.device, self.plan.flush_bytes)

    def _next_window(self, cids: list[int]) -> None:
        """Before an exchange's next clients (disk store): build their data, and every
        :data:`TRIM_BYTES` of windows return the freed memory (trimming costs the page faults of
        touching that memory again, so not every window)."""
        self._untrimmed += self.plan.round_bytes
        if self._untrimmed >= TRIM_BYTES:
            release_heap()
            self._untrimmed = 0.0
        self.data.prefetch(cids)

    # ---- clients -------------------------------------------------------------------------------
    @property
    def num_clients(self) -> int:
        return len(self.data.clients)

    @property
    def malicious(self) -> frozenset[int]:
        return self.population.malicious

    def stage(self, key: str) -> Stage | None:
        """The run's stage named ``key`` (``attack``, ``compression``) without its wrappers; None
        when the run has none."""
        for stage in self.wire.stages.stages:
            if stage.key == key:
                while hasattr(stage, "inner"):
                    stage = stage.inner
                return stage
        return None

    @property
    def client_states(self) -> list[dict]:
        """Every client's stored state (for inspection and tests: a disk store reads them all)."""
        return self.store.states()

    def _handle(self, cid: int, state: dict, compute: Compute = DIRECT) -> ClientHandle:
        # the client's data built when the step first reads it: a method's first states rarely do,
        # and a run with workers keeps none here it does not need
        return ClientHandle(cid, lambda: self.data.clients[cid], state, self.ctx, self.client_role.client_model(cid),
                            compute)

    def _new_client_state(self, cid: int, where: torch.device) -> dict:
        handle = self._handle(cid, {})
        self.client_role.init_client(handle)
        return to_device(handle.state, where)

    def client(self, cid: int) -> ClientHandle:
        """Client ``cid`` as its own step sees it (for inspection; the stored state itself when it
        lives on the run's device)."""
        return self._handle(cid, self.store.load(cid))

    # ---- one round -----------------------------------------------------------------------------
    def run_round(self, evaluate: bool | None = None) -> dict[str, float]:
        """Run the next round; returns its metrics (with evaluation metrics on evaluation rounds;
        ``evaluate`` overrides the schedule)."""
        rnd = self.round
        start = time.perf_counter()
        sampled = self.sample(rnd)
        self.method.begin_round(rnd, sampled)
        replies: dict[int, Message] = {}
        losses: list[float] = []
        fits: list[dict] = []   # evaluation.when's rows (pfl.federation.eval_modes)

        def receive(arrival) -> None:
            if arrival.local is not None:
                fits.append(arrival.local)
            if arrival.reply is not None:
                # the method may fold the reply in now (a running sum) and keep only its control data
                replies[arrival.cid] = self.method.receive(rnd, arrival.cid, arrival.reply)
                if "train_loss" in arrival.reply.info:
                    losses.append(float(arrival.reply.info["train_loss"]))

        self.exchange(Phase("train", rnd), sampled, lambda cid: self.method.broadcast(rnd, cid),
                      self.training_side(rnd), receive)
        self.method.aggregate(rnd, replies)
        return self.close_round(rnd, start, losses, self.ctx.lr(rnd), eval_modes.fit_metrics(self, fits),
                                evaluate=evaluate)

    def close_round(self, rnd: int, start: float, losses: list[float], lr: float,
                    extra: dict[str, float] | None = None, evaluate: bool | None = None) -> dict[str, float]:
        """Book the finished round ``rnd``: timing, loss, evaluation when due, communication,
        ``extra``; appended to the history."""
        self.ledger.close_round()
        method_metrics = self.method.round_metrics(rnd)  # part of the round's work and time
        round_time = time.perf_counter() - start
        self.elapsed += round_time
        self.round += 1
        self.executed += 1
        metrics: dict[str, float] = {"round": float(rnd), "step": float(self.executed),
                                     "time/round_s": round_time, "lr": lr}
        metrics.update(method_metrics)
        if losses:
            metrics["train/loss"] = float(np.mean(losses))
        if self.is_eval_round(rnd) if evaluate is None else evaluate:
            metrics.update(self.evaluate(final=self.round >= self.cfg.federation.rounds))
        metrics.update(self.ledger.metrics())
        metrics.update(self.wire.metrics())
        alone = self.exchange.runner.take_sequential()
        if alone:  # a batched cohort ran these clients one at a time (pfl.federation.cohort)
            metrics["cohort/sequential_clients"] = float(len(alone))
        metrics.update(self.exchange.runner.round_metrics())  # a worker pool's traffic and restarts
        metrics.update(extra or {})
        metrics["time/elapsed_s"] = self.elapsed
        self.history.append(metrics)
        return metrics

    def is_eval_round(self, rnd: int) -> bool:
        fed = self.cfg.federation
        return (rnd + 1) % fed.eval_every == 0 or rnd + 1 >= fed.rounds

    # ---- evaluation ----------------------------------------------------------------------------
    def evaluate(self, final: bool = False) -> dict[str, float]:
        """Every client's personalized model (and the global model, and the method's extra models)
        on its own validation and test splits."""
        rnd = self.round - 1
        self.method.begin_eval(rnd, final)
        task = self.data.task
        # the members (and the newcomers once they joined); federation.eval_clients: a fixed sample
        # of them, except at the final evaluation
        cids = self.population.evaluated(self.newcomers_joined, final)
        arrivals = self.eval_exchange(Phase("eval", rnd), cids, lambda cid: self.method.eval_message(rnd, cid),
                                      self.evaluation_side(rnd, tuple(self.join_trained)))
        replies = {cid: arrivals[cid].reply for cid in cids if arrivals[cid].reply is not None}
        rows = [self.population.mark(arrivals[cid].local) for cid in cids]
        self.method.eval_aggregate(rnd, replies)
        self.last_client_table = rows
        summarized = self.summary_rows(rows)
        metrics = summarize(summarized, task)
        metrics.update(eval_modes.eval_metrics(self, summarized))  # evaluation.server_test, trained_apart
        if self.malicious:
            metrics["attack/benign_clients"] = float(len(summarized))
        if self.cfg.federation.eval_clients:
            metrics["eval/clients"] = float(len(cids))
        metrics.update(self.method.extra_metrics(rnd, final=final))
        return metrics

    def evaluation_clients(self) -> list[int]:
        """The clients evaluated now: the members, and the newcomers once they have joined."""
        return self.population.evaluated(self.newcomers_joined)

    def summary_rows(self, rows: list[dict]) -> list[dict]:
        """The rows ``test/*``, ``val/*``, ``global/*`` summarise: benign members (malicious clients
        and newcomers are reported apart)."""
        return self.population.summary_rows(rows)

    def artifacts(self, outdir: str | Path) -> list[Path]:
        """Run-level artifacts: the malicious and newcomer ids (:meth:`Population.artifacts`)."""
        return self.population.artifacts(outdir)

    def evaluate_models(self, model_of: Callable[[int], dict[str, torch.Tensor]], name: str) -> dict[str, float]:
        """``<name>_acc`` (``<name>_rmse``): server-side models, one per client (``model_of(cid)``),
        sent to the clients (counted as evaluation traffic) and tested on their test splits."""
        rnd, task, cids = self.round - 1, self.data.task, self.evaluation_clients()
        arrivals = self.eval_exchange(Phase("eval", rnd), cids, lambda cid: Message.model(model_of(cid)),
                                      self.test_side())
        summary = summarize(self.summary_rows([self.population.mark(arrivals[cid].local) for cid in cids]), task)
        if task == "classification":
            return {f"{name}_acc": summary["test/acc_mean"]} if "test/acc_mean" in summary else {}
        return {f"{name}_rmse": summary["test/rmse_mean"]} if "test/rmse_mean" in summary else {}

    def personal_models(self, cids: list[int] | None = None,
                        receive: Callable[[int, dict[str, torch.Tensor]], None] | None = None
                        ) -> dict[int, dict[str, torch.Tensor]]:
        """The models clients are evaluated with now (an evaluation exchange, counted as such);
        with ``receive``, each is handed over as it is made and none is kept."""
        rnd = self.round - 1
        self.method.begin_eval(rnd, False)
        cids = self.evaluation_clients() if cids is None else cids
        stream = None if receive is None else (lambda arrival: receive(arrival.cid, arrival.local))
        arrivals = self.eval_exchange(Phase("eval", rnd), cids, lambda cid: self.method.eval_message(rnd, cid),
                                      self.personal_side(rnd), stream)
        return {cid: arrivals[cid].local for cid in cids} if receive is None else {}

    def personal_params(self, cid: int) -> dict[str, torch.Tensor]:
        return self.personal_models([cid])[cid]

    def set_hparams(self, hparams: Any) -> None:
        """Change the method's hyperparameters between rounds (both sides; the config follows)."""
        self.method.set_hparams(hparams)
        self.client_role.set_hparams(hparams)
        self.cfg.method.hparams = hparams

    # ---- state ---------------------------------------------------------------------------------
    def lineage_state(self) -> dict:
        """The model lineage without its client states: round, hyperparameters, server state."""
        joined = {"joined": self.newcomers_joined, "result": self.join_result}
        if self.join_trained and self.join_trained != set(self.ctx.newcomers):  # else implied (load_lineage_state)
            joined["trained"] = sorted(self.join_trained)
        state = {"round": self.round, "hparams": to_dict(self.method.hp), "server": self.method.server_state(),
                 "newcomers": joined}
        stages = self.wire.stages.state_dict()
        if stages:  # the server side of the wire's stages, by name (compression: the downlink mirrors)
            state["stages"] = stages
        return state

    def load_lineage_state(self, state: dict) -> None:
        self.round = int(state["round"])
        self.set_hparams(from_dict(type(self.method.hp), state["hparams"], "method"))
        # accelerator tensors follow the run's device; host tensors stay where the method keeps them
        self.method.load_server_state(tree_map(lambda t: t if t.device.type == "cpu" else t.to(self.device),
                                               state["server"]))
        join = state.get("newcomers") or {}
        self.newcomers_joined = bool(join.get("joined", False))
        self.join_result = join.get("result")
        # the newcomers a join step trained: all of them when the join ran a step, unless the state names some
        steps = (self.join_result or {}).get("newcomer/join_steps", 0)
        every = set(self.ctx.newcomers) if self.newcomers_joined and steps else set()
        self.join_trained = {int(c) for c in join["trained"]} if "trained" in join else every
        self.wire.stages.load_state_dict(to_device(state.get("stages", {}), self.device))

    def model_state(self) -> dict:
        """The whole model lineage as plain data, every client's state included (for inspection and
        tests: it costs the whole population; checkpoints and snapshots do not use it)."""
        state = self.lineage_state()
        state["clients"] = self.store.states()
        memories = self.store.memories()
        if memories:  # server-side per-client memories (pfl.federation.store.ClientMemory)
            state["memories"] = memories
        return state

    def snapshot(self) -> dict:
        """A copy of the model state that later rounds cannot change (restore with :meth:`restore`);
        the client states are the store's snapshot (a disk store's is its index)."""
        state = clone(self.lineage_state())
        state["clients"] = self.store.snapshot()
        return state

    def restore(self, snapshot: dict) -> None:
        """Continue from a snapshot's model state; the run's accounting (executed rounds, history,
        communication, time) carries on, so cumulative counters never decrease."""
        self.load_lineage_state(clone({k: v for k, v in snapshot.items() if k != "clients"}))
        self.store.restore(snapshot["clients"])


__all__ = ["DivergedError", "Simulator", "resolve_device"]
