"""One round of a federated run: sampling, message delivery (copied, transformed, counted), the
server and client sides of the method, evaluation, and the run's complete state.

``Simulator(cfg)`` builds a run; :class:`pfl.federation.loop.RoundLoop` drives its rounds with
callbacks (tracking, checkpoints, Tune reports, progress, divergence). Every random choice is drawn
from a generator seeded by (seed, round, client, purpose), so a run resumed from a checkpoint
continues exactly as the uninterrupted run would have.

Byzantine clients (``attack.*``, :mod:`.attacks`) are an uplink transform; the evaluation summary
is then over the benign clients. Newcomers (``newcomers.*``, :mod:`.newcomers`) are held out of
sampling and evaluation until :meth:`Simulator.join_newcomers` lets them join after the last round.

Two round counters: ``round`` is the model lineage's round (it seeds the generators, drives the
learning-rate schedule and is set back when a pipeline restores an earlier model state, as the λ
path's playoff does); ``executed`` counts the rounds this run has computed and never decreases (the
metrics' ``step``, and what cumulative counters are indexed by).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..config import ExperimentConfig
from ..evaluation import evaluate_plan, summarize
from ..methods import ClientHandle, EvalPlan, Method, get_method
from ..schema import ConfigError, flatten, from_dict, to_dict
from ..training import Params
from .comm import CommLedger
from .context import FederationMeta, RunContext
from .messages import Message
from .state import clone, decode, encode, nbytes, to_device, tree_map

log = logging.getLogger(__name__)

#: an uplink/downlink transform (compression, attacks): (msg, direction, round, client) -> msg.
#: It receives the receiver's copy, so editing it in place cannot reach the sender's state.
Transform = Callable[[Message, str, int, int], Message]

CHECKPOINT_FORMAT = 2
#: config keys a resumed run may change: the round budget, tracking, and settings that do not
#: change what is computed (threads, checkpoint period, where client state is kept)
RESUMABLE_CHANGES = ("federation.rounds", "federation.threads", "federation.checkpoint_every",
                     "federation.client_state_device", "tracking.")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"federation.device={name!r} but CUDA is not available; use cpu or auto")
    return dev


class DivergedError(RuntimeError):
    """Training produced a non-finite loss."""


class CheckpointError(ConfigError):
    """A checkpoint cannot be used for this run (unsafe content, or another experiment's)."""


def simulator_for(cfg):
    """The round driver ``cfg.federation.driver`` names."""
    if cfg.federation.driver == "async":
        from .async_clock import AsyncSimulator

        return AsyncSimulator
    return Simulator


def config_differences(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ between two resolved configs, except :data:`RESUMABLE_CHANGES`.

    A key the saved config lacks counts with its default (a checkpoint written before a setting
    existed, e.g. ``attack.*`` or ``method.aggregator``, ran with what is now its default)."""
    try:
        from ..config import resolve

        saved = resolve(saved).to_dict()
    except ConfigError:
        pass  # not a config this version accepts: compare it as it is
    a, b = flatten(saved), flatten(current)
    out = {}
    for key in sorted(set(a) | set(b)):
        if key.startswith(RESUMABLE_CHANGES) or key in RESUMABLE_CHANGES:
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            out[key] = (a.get(key, "<absent>"), b.get(key, "<absent>"))
    return out


class Simulator:
    def __init__(self, cfg: ExperimentConfig, data=None, transforms: list[Transform] | None = None):
        from ..data import load_federated
        from ..models import build_model

        self.cfg = cfg
        self.start_config = cfg.to_dict()  # what a checkpoint is compared with on resume
        fed = cfg.federation
        if fed.threads:
            torch.set_num_threads(fed.threads)
        self.device = resolve_device(fed.device)
        self.data = (data if data is not None else load_federated(cfg.data, cfg.seed)).to(self.device)
        torch.manual_seed(cfg.seed)  # only model construction; all later draws use derived generators
        model = build_model(cfg.model.name, cfg.model.params, self.data.input_shape,
                            self.data.num_classes).to(self.device)
        from ..models.custom import prepare_model

        model = prepare_model(model, cfg, self.data)  # buffers, output shape, model.head: one-line errors
        from .attacks import malicious_clients
        from .newcomers import newcomer_clients

        m = len(self.data.clients)
        self.ctx = RunContext(cfg=cfg, meta=FederationMeta.of(self.data), model=model, device=self.device,
                              newcomers=newcomer_clients(cfg, m))
        self.malicious: frozenset[int] = frozenset(malicious_clients(cfg, m))
        self._newcomer_ids = frozenset(self.ctx.newcomers)
        self.newcomers_joined = False          # the newcomers have joined (evaluated with everyone)
        self.join_result: dict | None = None   # their metrics, once joined
        method_cls = get_method(cfg.method.name)
        self.method: Method
        self.client_role: Method
        self.method, self.client_role = method_cls.create(cfg.method.hparams, self.ctx)
        from .transforms import build_transforms

        self.transforms = list(transforms or []) + build_transforms(cfg, self.ctx)
        # auto batches only on a GPU: on CPU the batched cohort measured no faster than the loop,
        # for training and evaluation alike (pipelines/bench_cohort.py)
        self.vectorized = fed.cohort == "vectorized" or (
            fed.cohort == "auto" and method_cls.cohort == "vectorized" and self.device.type == "cuda")
        from ..compression import Codec

        self.codec = Codec(cfg.compression, self.ctx, self.method)  # compression.* (a no-op when none)
        self.ledger = CommLedger()
        self.round = 0       # the lineage's next round
        self.executed = 0    # rounds computed by this run
        self.history: list[dict[str, float]] = []
        self.elapsed = 0.0
        self.last_client_table: list[dict] | None = None
        self.client_states: list[dict] = []
        self.state_device = self.device
        first = self._new_client_state(0) if self.num_clients else {}
        self.state_device = self._choose_state_device(first)
        self.client_states = [to_device(first, self.state_device)]
        self.client_states += [self._new_client_state(cid) for cid in range(1, self.num_clients)]

    # ---- clients -------------------------------------------------------------------------------
    @property
    def num_clients(self) -> int:
        return len(self.data.clients)

    def _handle(self, cid: int, state: dict) -> ClientHandle:
        return ClientHandle(cid, self.data.clients[cid], state, self.ctx, self.client_role.client_model(cid))

    def _new_client_state(self, cid: int) -> dict:
        handle = self._handle(cid, {})
        self.client_role.init_client(handle)
        return to_device(handle.state, self.state_device)

    def _choose_state_device(self, sample_state: dict) -> torch.device:
        """``federation.client_state_device``: where per-client state lives between its steps."""
        choice = self.cfg.federation.client_state_device
        if choice == "device" or self.device.type == "cpu":
            return self.device
        if choice == "cpu":
            return torch.device("cpu")
        # auto on an accelerator: every client's state must fit in half the free memory, counting
        # at least one model copy per client (most state is created on a client's first step)
        per_client = max(nbytes(sample_state), sum(p.numel() * p.element_size() for p in self.ctx.model.parameters()))
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else float("inf")
        where = torch.device("cpu") if per_client * self.num_clients > 0.5 * free else self.device
        log.info("client state on %s (%d clients × ~%d bytes; %.0f MB free on %s)", where, self.num_clients,
                 per_client, free / 2**20, self.device)
        return where

    def client(self, cid: int) -> ClientHandle:
        """Client ``cid`` as its own step sees it (for inspection; the stored state itself when it
        lives on the run's device)."""
        return self._handle(cid, to_device(self.client_states[cid], self.device))

    @contextlib.contextmanager
    def _as_client(self, cid: int) -> Iterator[ClientHandle]:
        """Client ``cid`` with its state on the run's device; its new state is kept afterwards."""
        handle = self.client(cid)
        yield handle
        self.client_states[cid] = to_device(handle.state, self.state_device)

    def sample(self, rnd: int) -> list[int]:
        """The clients of round ``rnd``: ``clients_per_round`` of the members (newcomers never)."""
        k = self.cfg.federation.clients_per_round
        members = self.ctx.members
        m = len(members)
        if k == 0 or k >= m:
            return members
        rng = self.ctx.rng(rnd, "sample")
        return sorted(members[int(i)] for i in rng.choice(m, size=k, replace=False))

    def deliver(self, msg: Message | None, direction: str, rnd: int, cid: int) -> Message | None:
        """The receiver's copy of ``msg`` after the transforms, counted by the ledger (a training
        downlink encoded by ``compression.downlink`` first, so its encoded size is what counts)."""
        if msg is None:
            return None
        msg = msg.copy()
        for transform in self.transforms:
            msg = transform(msg, direction, rnd, cid)
        if direction == "down":
            msg = self.codec.encode_down(msg, rnd, cid)
        self.ledger.record(msg, direction)
        return msg

    def client_step(self, rnd: int, cid: int, down: Message | None) -> Message | None:
        """Client ``cid``'s side of round ``rnd``: its delivered reply (None: it sent nothing).

        Compression (:mod:`pfl.compression.codec`) acts here, on each side of the wire: the client
        decodes a compressed downlink with its replicas and encodes its reply as the update of what
        it received (with its error-feedback memory, both in its own state); the reply is delivered
        and counted encoded, and the server reconstructs it from its own record of what it sent
        before ``aggregate`` sees it.
        """
        sent = self.codec.server_view(down, cid) if self.codec.up is not None else None
        with self._as_client(cid) as client:
            reply = self._client_side(rnd, client, down)
        return self._server_receives(rnd, cid, reply, sent)

    def _client_side(self, rnd: int, client: ClientHandle, down: Message | None) -> Message | None:
        codec = self.codec
        down = codec.decode_down(down, client)
        received = None
        if codec.up is not None and down is not None:
            received = {k: v.detach().clone() for k, v in down.tensors().items()}  # the client's own record
        reply = self.client_role.local_update(rnd, client, down)
        return codec.encode_up(reply, rnd, client, received, self.client_role)

    def _server_receives(self, rnd: int, cid: int, reply: Message | None, sent: Params | None) -> Message | None:
        return self.codec.decode_up(self.deliver(reply, "up", rnd, cid), rnd, sent, self.method)

    def as_cohort(self, cids: list[int], step: Callable[[ClientHandle], Any]) -> dict[int, Any]:
        """``step(client)`` for every client of ``cids``, their training and evaluation requests
        batched (``federation.cohort_chunk`` clients at a time); each client's new state is kept."""
        from .cohort import Cohort, chunks

        out: dict[int, Any] = {}
        cohort = Cohort()
        for part in chunks(cids, self.cfg.federation.cohort_chunk):
            handles = [self.client(cid) for cid in part]
            results = cohort.run(handles, [lambda h=h: step(h) for h in handles])
            for cid, handle, result in zip(part, handles, results):
                self.client_states[cid] = to_device(handle.state, self.state_device)
                out[cid] = result
        return out

    # ---- one round -----------------------------------------------------------------------------
    def run_round(self, evaluate: bool | None = None) -> dict[str, float]:
        """Run the next round; returns its metrics (with evaluation metrics on evaluation rounds;
        ``evaluate`` overrides the schedule)."""
        rnd = self.round
        start = time.perf_counter()
        sampled = self.sample(rnd)
        self.method.begin_round(rnd, sampled)
        replies: dict[int, Message] = {}
        losses = []
        if self.vectorized:
            downs = {cid: self.deliver(self.method.broadcast(rnd, cid), "down", rnd, cid) for cid in sampled}
            views = {cid: self.codec.server_view(downs[cid], cid) if self.codec.up is not None else None
                     for cid in sampled}
            raw = self.as_cohort(sampled, lambda c: self._client_side(rnd, c, downs[c.cid]))
            sent = {cid: self._server_receives(rnd, cid, raw[cid], views[cid]) for cid in sampled}
        else:
            sent = {}
            for cid in sampled:
                down = self.deliver(self.method.broadcast(rnd, cid), "down", rnd, cid)
                sent[cid] = self.client_step(rnd, cid, down)
        for cid in sampled:
            reply = sent[cid]
            if reply is not None:
                replies[cid] = reply
                if "train_loss" in reply.info:
                    losses.append(float(reply.info["train_loss"]))
        self.method.aggregate(rnd, replies)
        return self.close_round(rnd, start, losses, self.ctx.lr(rnd), evaluate=evaluate)

    def close_round(self, rnd: int, start: float, losses: list[float], lr: float,
                    extra: dict[str, float] | None = None, evaluate: bool | None = None) -> dict[str, float]:
        """Book the finished round ``rnd``: timing, loss, evaluation when due, communication,
        ``extra``; appended to the history."""
        self.ledger.close_round()
        round_time = time.perf_counter() - start
        self.elapsed += round_time
        self.round += 1
        self.executed += 1
        metrics: dict[str, float] = {"round": float(rnd), "step": float(self.executed),
                                     "time/round_s": round_time, "lr": lr}
        if losses:
            metrics["train/loss"] = float(np.mean(losses))
        if self.is_eval_round(rnd) if evaluate is None else evaluate:
            metrics.update(self.evaluate(final=self.round >= self.cfg.federation.rounds))
        metrics.update(self.ledger.metrics())
        metrics.update(self.codec.metrics())
        metrics.update(extra or {})
        metrics["time/elapsed_s"] = self.elapsed
        self.history.append(metrics)
        return metrics

    def is_eval_round(self, rnd: int) -> bool:
        fed = self.cfg.federation
        return (rnd + 1) % fed.eval_every == 0 or rnd + 1 >= fed.rounds

    # ---- evaluation ----------------------------------------------------------------------------
    def _eval_exchange(self, rnd: int, cid: int, on_client: Callable[[ClientHandle, Any], Any] | None = None):
        """Client ``cid``'s evaluation plan after round ``rnd`` (its evaluation message counted),
        and what ``on_client(client, plan)`` computed with the client's data."""
        msg = self.deliver(self.method.eval_message(rnd, cid), "eval_down", rnd, cid)
        with self._as_client(cid) as client:
            plan = self.client_role.eval_plan(rnd, client, msg)
            result = on_client(client, plan) if on_client else None
        return plan, self.deliver(plan.reply, "eval_up", rnd, cid), result

    def evaluate(self, final: bool = False) -> dict[str, float]:
        """Every client's personalized model (and the global model, and the method's extra models)
        on its own validation and test splits."""
        rnd = self.round - 1
        self.method.begin_eval(rnd, final)
        task, with_global = self.data.task, self.cfg.federation.eval_global
        rows, replies = [], {}
        cids = self.evaluation_clients()  # the members (and the newcomers once they joined)
        if self.vectorized:
            msgs = {cid: self.deliver(self.method.eval_message(rnd, cid), "eval_down", rnd, cid) for cid in cids}

            def plan_and_row(client: ClientHandle):
                plan = self.client_role.eval_plan(rnd, client, msgs[client.cid])
                return plan, evaluate_plan(client, plan, task, with_global)

            done = self.as_cohort(cids, plan_and_row)
            exchanged = [(self.deliver(done[cid][0].reply, "eval_up", rnd, cid), done[cid][1]) for cid in cids]
        else:
            exchanged = [self._eval_exchange(rnd, cid, lambda client, plan: evaluate_plan(client, plan, task,
                                                                                       with_global))[1:]
                         for cid in cids]
        for cid, (reply, row) in zip(cids, exchanged):
            if reply is not None:
                replies[cid] = reply
            rows.append(self._mark(row))
        self.method.eval_aggregate(rnd, replies)
        self.last_client_table = rows
        metrics = summarize(self.summary_rows(rows), task)
        if self.malicious:
            metrics["attack/benign_clients"] = float(len(self.summary_rows(rows)))
        metrics.update(self.method.extra_metrics(rnd, final=final))
        return metrics

    # -- who is evaluated and summarised (attacks, newcomers) --
    def evaluation_clients(self) -> list[int]:
        """The clients evaluated now: the members, and the newcomers once they have joined."""
        return list(range(self.num_clients)) if self.newcomers_joined else self.ctx.members

    def summary_rows(self, rows: list[dict]) -> list[dict]:
        """The rows ``test/*``, ``val/*``, ``global/*`` summarise: benign members (malicious clients
        and newcomers are reported apart)."""
        if not self.malicious and not self.ctx.newcomers:
            return rows
        return [r for r in rows if not r.get("malicious") and not r.get("newcomer")]

    def _mark(self, row: dict) -> dict:
        if self.data.client_ids is not None:  # a natural partition's own ids (file sources)
            row["client_id"] = self.data.client_ids[row["client"]]
        if self.malicious:
            row["malicious"] = int(row["client"] in self.malicious)
        if self.ctx.newcomers:
            row["newcomer"] = int(row["client"] in self._newcomer_ids)
        return row

    def join_newcomers(self) -> dict[str, float]:
        """After the last round: the newcomers join by the method's rule; their ``newcomer/*``
        metrics (empty without newcomers; see :mod:`pfl.federation.newcomers`)."""
        from .newcomers import join_newcomers

        return join_newcomers(self)

    def artifacts(self, outdir: str | Path) -> list[Path]:
        """Run-level artifacts: ``attack_malicious.csv`` (the malicious ids) and
        ``newcomers.csv`` (the newcomer ids) when there are any."""
        out = []
        true = self.ctx.meta.true_clusters
        for name, ids in (("attack_malicious.csv", sorted(self.malicious)),
                          ("newcomers.csv", list(self.ctx.newcomers))):
            if ids:
                path = Path(outdir) / name
                lines = ["client,true_cluster,n_train"] + [
                    f"{c},{-1 if true is None else int(true[c])},{self.ctx.meta.client_sizes[c]}" for c in ids]
                path.write_text("\n".join(lines) + "\n")
                out.append(path)
        return out

    def evaluate_models(self, model_of: Callable[[int], dict[str, torch.Tensor]], name: str) -> dict[str, float]:
        """``<name>_acc`` (``<name>_rmse``): server-side models, one per client (``model_of(cid)``),
        sent to the clients (counted as evaluation traffic) and tested on their test splits."""
        rnd, task, rows = self.round - 1, self.data.task, []
        for cid in self.evaluation_clients():
            msg = self.deliver(Message.of(model_of(cid)), "eval_down", rnd, cid)
            with self._as_client(cid) as client:
                rows.append(self._mark(evaluate_plan(client, EvalPlan(msg.tensors()), task, False)))
        summary = summarize(self.summary_rows(rows), task)
        if task == "classification":
            return {f"{name}_acc": summary["test/acc_mean"]} if "test/acc_mean" in summary else {}
        return {f"{name}_rmse": summary["test/rmse_mean"]} if "test/rmse_mean" in summary else {}

    def personal_models(self, cids: list[int] | None = None) -> dict[int, dict[str, torch.Tensor]]:
        """The models clients are evaluated with now (an evaluation exchange, counted as such)."""
        rnd = self.round - 1
        self.method.begin_eval(rnd, False)
        out = {}
        for cid in self.evaluation_clients() if cids is None else cids:
            plan, _, _ = self._eval_exchange(rnd, cid)
            out[cid] = plan.personal
        return out

    def personal_params(self, cid: int) -> dict[str, torch.Tensor]:
        return self.personal_models([cid])[cid]

    # ---- driving -------------------------------------------------------------------------------
    def run(self, until: int | None = None) -> list[dict[str, float]]:
        """Run to ``until`` (default: federation.rounds) with divergence checks; the history."""
        from .loop import RoundLoop, StopOnDivergence

        result = RoundLoop(self, [StopOnDivergence()]).run(until)
        if result.status == "FAILED":
            raise DivergedError(result.reason)
        return self.history

    def set_hparams(self, hparams: Any) -> None:
        """Change the method's hyperparameters between rounds (both sides; the config follows)."""
        self.method.set_hparams(hparams)
        self.client_role.set_hparams(hparams)
        self.cfg.method.hparams = hparams

    # ---- state ---------------------------------------------------------------------------------
    def model_state(self) -> dict:
        """What a model lineage is: its round, hyperparameters, server state and client states."""
        state = {"round": self.round, "hparams": to_dict(self.method.hp),
                 "server": self.method.server_state(), "clients": self.client_states,
                 "newcomers": {"joined": self.newcomers_joined, "result": self.join_result}}
        codec = self.codec.state_dict()
        if codec:  # the server's downlink mirrors (compression.downlink)
            state["codec"] = codec
        return state

    def load_model_state(self, state: dict) -> None:
        self.round = int(state["round"])
        self.set_hparams(from_dict(type(self.method.hp), state["hparams"], "method"))
        # accelerator tensors follow the run's device; host tensors stay where the method keeps them
        self.method.load_server_state(tree_map(lambda t: t if t.device.type == "cpu" else t.to(self.device),
                                               state["server"]))
        self.client_states = [to_device(s, self.state_device) for s in state["clients"]]
        join = state.get("newcomers") or {}
        self.newcomers_joined = bool(join.get("joined", False))
        self.join_result = join.get("result")
        self.codec.load_state_dict(to_device(state.get("codec", {}), self.device))

    def snapshot(self) -> dict:
        """A copy of the model state that later rounds cannot change (restore with :meth:`restore`)."""
        return clone(self.model_state())

    def restore(self, snapshot: dict) -> None:
        """Continue from a snapshot's model state; the run's accounting (executed rounds, history,
        communication, time) carries on, so cumulative counters never decrease."""
        self.load_model_state(clone(snapshot))

    def state_dict(self) -> dict:
        return {
            "format": CHECKPOINT_FORMAT,
            "config": self.start_config,
            "model": self.model_state(),
            "run": {"executed": self.executed, "elapsed": self.elapsed, "history": self.history,
                    "ledger": self.ledger.state_dict()},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError("--checkpoint", f"checkpoint format {state.get('format')!r} is not "
                                                  f"{CHECKPOINT_FORMAT} (written by another pfl version)")
        differ = config_differences(state["config"], self.start_config)
        if differ:
            listed = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, a, b in
                               ((k, *v) for k, v in differ.items()))
            raise CheckpointError(", ".join(differ), f"the checkpoint belongs to a run with another config "
                                                     f"({listed}); only the round budget and tracking may "
                                                     "change on resume")
        self.load_model_state(state["model"])
        run = state["run"]
        self.executed = int(run["executed"])
        self.elapsed = float(run["elapsed"])
        self.history = list(run["history"])
        self.ledger.load_state_dict(run["ledger"])

    def save(self, path: str | Path, extra: dict | None = None) -> Path:
        """Write the state (and ``extra``, e.g. callbacks' state) atomically to ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        if extra:
            state["extra"] = extra
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(encode(state, "checkpoint"), tmp)
        tmp.replace(path)  # a killed run never leaves a half-written checkpoint
        return path

    def load(self, path: str | Path) -> dict:
        """Continue from the checkpoint at ``path``; returns its ``extra`` part."""
        state = read_checkpoint(path)
        self.load_state_dict(state)
        return state.get("extra", {})


def read_checkpoint(path: str | Path) -> dict:
    """A checkpoint's content; tensors and plain containers only (``weights_only=True``)."""
    path = Path(path)
    try:
        raw = torch.load(path, map_location=None if torch.cuda.is_available() else "cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError("--checkpoint", f"{path} is not a pfl checkpoint that loads safely (tensors "
                                              f"and plain containers only): {first}") from None
    if not isinstance(raw, dict):
        raise CheckpointError("--checkpoint", f"{path} does not hold a pfl checkpoint")
    return decode(raw)


__all__ = ["CheckpointError", "DivergedError", "Simulator", "Transform", "config_differences",
           "read_checkpoint", "resolve_device", "simulator_for"]
