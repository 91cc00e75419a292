"""The round loop: sampling, message delivery (counted), evaluation, checkpoints.

``Simulator(cfg).run()`` trains one federated experiment. Every random choice is drawn from a
generator seeded by (seed, round, client, purpose), so a run resumed from a checkpoint continues
exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from ..config import ExperimentConfig
from ..evaluation import evaluate_clients
from ..methods import ClientHandle, Method, get_method
from .comm import CommLedger
from .context import RunContext
from .messages import Message

log = logging.getLogger(__name__)

#: an uplink/downlink transform (compression, attacks): (msg, direction, round, client) -> msg
Transform = Callable[[Message, str, int, int], Message]


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


def simulator_for(cfg):
    """The round driver ``cfg.federation.driver`` names."""
    if cfg.federation.driver == "async":
        from .async_clock import AsyncSimulator

        return AsyncSimulator
    return Simulator


class Simulator:
    def __init__(self, cfg: ExperimentConfig, data=None, transforms: list[Transform] | None = None):
        from ..data import load_federated
        from ..models import build_model

        self.cfg = cfg
        fed = cfg.federation
        if fed.threads:
            torch.set_num_threads(fed.threads)
        self.device = resolve_device(fed.device)
        self.data = (data if data is not None else load_federated(cfg.data, cfg.seed)).to(self.device)
        torch.manual_seed(cfg.seed)  # only model construction; all later draws use derived generators
        model = build_model(cfg.model.name, cfg.model.params, self.data.input_shape,
                            self.data.num_classes).to(self.device)
        self.ctx = RunContext(cfg=cfg, data=self.data, model=model, device=self.device)
        method_cls = get_method(cfg.method.name)
        self.method: Method = method_cls(cfg.method.hparams, self.ctx)
        self.transforms = list(transforms or [])
        self.ledger = CommLedger()
        self.round = 0  # next round to run
        self.history: list[dict[str, float]] = []
        self.elapsed = 0.0
        self.method.setup()
        self.client_states: list[dict] = [{} for _ in self.data.clients]
        for cid in range(len(self.data.clients)):
            self.method.init_client(self.client(cid))

    # ------------------------------------------------------------------------------------------
    @property
    def num_clients(self) -> int:
        return len(self.data.clients)

    def client(self, cid: int) -> ClientHandle:
        return ClientHandle(cid, self.data.clients[cid], self.client_states[cid], self.ctx)

    def sample(self, rnd: int) -> list[int]:
        k = self.cfg.federation.clients_per_round
        m = self.num_clients
        if k == 0 or k >= m:
            return list(range(m))
        rng = self.ctx.rng(rnd, "sample")
        return sorted(int(i) for i in rng.choice(m, size=k, replace=False))

    def deliver(self, msg: Message | None, direction: str, rnd: int, cid: int) -> Message | None:
        if msg is None:
            return None
        for transform in self.transforms:
            msg = transform(msg, direction, rnd, cid)
        self.ledger.record(msg, direction)
        return msg

    # ------------------------------------------------------------------------------------------
    def run_round(self) -> dict[str, float]:
        """Run the next round; returns its metrics (evaluation metrics on eval rounds)."""
        rnd = self.round
        start = time.perf_counter()
        sampled = self.sample(rnd)
        self.method.begin_round(rnd, sampled)
        downs = {cid: self.deliver(self.method.broadcast(rnd, cid), "down", rnd, cid) for cid in sampled}
        replies: dict[int, Message] = {}
        losses = []
        for cid in sampled:
            reply = self.method.local_update(rnd, self.client(cid), downs[cid])
            reply = self.deliver(reply, "up", rnd, cid)
            if reply is not None:
                replies[cid] = reply
                if "train_loss" in reply.info:
                    losses.append(float(reply.info["train_loss"]))
        self.method.aggregate(rnd, replies)
        return self.close_round(rnd, start, losses, self.ctx.lr(rnd))

    def close_round(self, rnd: int, start: float, losses: list[float], lr: float,
                    extra: dict[str, float] | None = None) -> dict[str, float]:
        """Book the finished round ``rnd``: timing, loss (a non-finite one ends the run),
        communication, evaluation on eval rounds, ``extra``; appended to the history."""
        self.ledger.close_round()
        round_time = time.perf_counter() - start
        self.elapsed += round_time
        self.round += 1
        metrics: dict[str, float] = {"round": float(rnd), "time/round_s": round_time, "lr": lr}
        if losses:
            train_loss = float(np.mean(losses))
            metrics["train/loss"] = train_loss
            if not math.isfinite(train_loss):
                raise DivergedError(f"round {rnd}: training loss is {train_loss}")
        metrics.update(self.ledger.metrics())
        if self.is_eval_round(rnd):
            metrics.update(self.evaluate(final=self.round >= self.cfg.federation.rounds))
        metrics.update(extra or {})
        metrics["time/elapsed_s"] = self.elapsed
        self.history.append(metrics)
        return metrics

    def is_eval_round(self, rnd: int) -> bool:
        fed = self.cfg.federation
        return (rnd + 1) % fed.eval_every == 0 or rnd + 1 >= fed.rounds

    def evaluate(self, final: bool = False) -> dict[str, float]:
        result = evaluate_clients(self.method, [self.client(c) for c in range(self.num_clients)],
                                  self.data.task, eval_global=self.cfg.federation.eval_global)
        self.last_client_table = result.table
        metrics = dict(result.metrics)
        metrics.update(self.method.extra_metrics(self.round - 1, final=final))
        for key, value in metrics.items():
            if key.endswith("loss_mean") and not math.isfinite(value):
                raise DivergedError(f"round {self.round - 1}: {key} is {value}")
        return metrics

    def rounds(self, until: int | None = None) -> Iterator[dict[str, float]]:
        """Yield each remaining round's metrics up to ``until`` (default: federation.rounds)."""
        end = self.cfg.federation.rounds if until is None else until
        while self.round < end:
            yield self.run_round()

    def run(self, until: int | None = None) -> list[dict[str, float]]:
        for _ in self.rounds(until):
            pass
        return self.history

    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "round": self.round,
            "elapsed": self.elapsed,
            "history": self.history,
            "ledger": self.ledger.state_dict(),
            "method": self.method.server_state(),
            "clients": self.client_states,
            "config": self.cfg.to_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.round = state["round"]
        self.elapsed = state["elapsed"]
        self.history = list(state["history"])
        self.ledger.load_state_dict(state["ledger"])
        self.method.load_server_state(state["method"])
        self.client_states[:] = state["clients"]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(self.state_dict(), tmp)
        tmp.replace(path)  # atomic: a killed run never leaves a half-written checkpoint
        return path

    def load(self, path: str | Path) -> None:
        state = torch.load(Path(path), map_location=self.device, weights_only=False)
        self.load_state_dict(state)
