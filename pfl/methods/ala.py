"""Adaptive Local Aggregation (ALA), FedALA, and ALA as a plug-in to other methods.

FedALA (Zhang et al., AAAI 2023) replaces the client's "overwrite the local model with the global
one" by an element-wise, learned mix: on receiving θ the client starts from

    θ̂ = θ_i + (θ − θ_i) ⊙ W_i          on the top-p layers (W_i ∈ [0, 1], one weight per scalar),
    θ̂ = θ                              on the lower layers (overwritten),

where θ_i is the client's own model (the one it trained the last time it took part) and W_i is
learned on a random s% of its training data by SGD with step η, clipped to [0, 1] after every step.
Because θ̂ is linear in W, ∂L/∂W = ∂L/∂θ̂ ⊙ (θ − θ_i): we get it by autograd through θ̂(W) with
``torch.func.functional_call`` (the lower layers are constants, so backward stops at the lowest upper
tensor). The first time ALA really runs for a client ("start phase") W is trained until the
population std of the last K pass losses is below δ; afterwards one pass per reception. W, the
start-phase flag and the local model persist in ``client.state["ala"]``; nothing about ALA is sent,
so communication equals the host method's.

Registered names: ``fedala`` (= FedAvg + ALA) and, through the plug-in ``ala``, ``<base>+ala`` for
any base method with a start hook (``fedavg+ala``, ``fedprox+ala``, ``fedavg_ft+ala``, ``ditto+ala``,
``fedrep+ala`` when those are registered). The hook ALA replaces:

* ``start_params(client, received)`` (FedAvg family, FedRep): ALA(global = the received tensors,
  local = the client's copy of those tensors from its last training). Only the received part takes
  part, so for FedRep p counts layers of the shared body.
* ``personal_start(client, received)`` (Ditto): ALA(global = received, local = whatever the base
  hook returns, i.e. the personal model v_i); the global-copy training is untouched.

Decisions where the spec is silent or leaves a choice (see docs/methods/fedala.md):

* p counts layer units of ``pfl.models.layer_groups`` (``p_unit=units``, default) or parameter tensors
  from the top (``p_unit=tensors``, the reference code's ``layer_idx``); p = 0 means all, as in the code.
* δ defaults to 0.1 (the current reference code; the paper used 0.01); ``ala_max_epochs`` (100) caps
  the start phase even below K + 1 passes.
* The ALA sample is a contiguous window of the stored sample order at a random offset
  (``ala_sample=window``, as the code) or a fresh random subset (``subset``); at least one sample.
  Batches of ``federation.batch_size`` in order, last partial batch kept.
* Skip rule: ALA is skipped (the received tensors are used as they are, no state changes) when the
  client has no local model yet or its local model equals the received one exactly.
* ALA runs only on sampled clients (they are the ones that receive θ); the reference code's
  "run ALA on every client every round" would need a downlink to non-sampled clients and is not offered.
* Evaluation (FedAvg family whose base evaluates the global model): the personalized model is the
  ALA-initialised model for the current global model (``eval_model=ala``, the paper's metric: the code
  evaluates right after ALA), or the client's last trained model (``eval_model=local``). The ALA done
  for evaluation uses the next round's seed and is cached in the client state; if the client is sampled
  next round and receives the same global model it reuses it, so results do not depend on
  ``eval_every`` and no work is done twice. Methods with their own personal model (Ditto, FedRep,
  FedAvg-FT) keep their evaluation.
* FedProx + ALA: the proximal anchor stays the received global model.
* The zoo models have no buffers, BatchNorm or dropout, so the model's train/eval mode does not
  affect the ALA loss (no ``ala_mode`` option).
* ALA cost: each reply's ``info`` carries the client's ALA seconds and passes (control data); the
  server logs ``ala/time_s`` (sum over the round's clients), ``ala/time_s_mean`` (per client),
  ``ala/time_total_s``, ``ala/time_at_eval_total_s`` (the part of it computed during the previous
  evaluation and reused, hence not inside ``time/round_s``), ``ala/passes`` (the round's passes), ``ala/start_passes`` (cumulative
  start-phase passes), ``ala/start_clients`` (clients that finished their start phase).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import time
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch.func import functional_call

from ..federation.messages import Message, Model
from ..federation.state import checkpointable
from ..models import layer_groups
from ..schema import hp
from ..training import Params, loss_fn
from . import register, register_plugin
from .base import ClientHandle, Method
from .fedavg import FedAvg

STATE_KEY = "ala"


@dataclass
class ALAHparams:
    """Adaptive local aggregation (FedALA): how the received global model is mixed into the local one."""
    p: int = hp(1, "ALA acts on the top p layer units (or tensors, see p_unit); lower layers are "
                   "overwritten by the global model; 0 = all", low=0)
    p_unit: str = hp("units", "what p counts: layer units of the model's layer groups, or parameter "
                              "tensors (the reference code's layer_idx: p=1 unit ⇔ 2 tensors)",
                     choices=("units", "tensors"))
    s: float = hp(80.0, "percent of the client's training data used to learn the ALA weights",
                  low=0.0, high=100.0, low_open=True)
    eta: float = hp(1.0, "learning rate η of the ALA weights", low=0.0, low_open=True)
    threshold: float = hp(0.1, "start phase ends when the std of the last `window` pass losses is below "
                               "this δ (paper 0.01, current code 0.1)", low=0.0, low_open=True)
    window: int = hp(10, "K: number of recent pass losses whose std is compared with threshold", low=1)
    ala_max_epochs: int = hp(100, "cap on the passes of the start phase", low=1)
    ala_sample: str = hp("window", "the s% sample: a contiguous window at a random offset (the code) "
                                   "or a random subset (the paper's wording)", choices=("window", "subset"))
    eval_model: str = hp("ala", "personalized model evaluated (FedAvg family): the ALA-initialised "
                                "model for the current global model, or the last locally trained one",
                         choices=("ala", "local"))


# ---- the ALA math (pure functions on tensors) ----------------------------------------------------

def upper_names(model: torch.nn.Module, names: Sequence[str], p: int, unit: str = "units") -> list[str]:
    """The names (among ``names``) that ALA mixes: the top ``p`` units or tensors; p <= 0: all.

    Units come from :func:`pfl.models.layer_groups`, restricted to ``names`` (a method that receives
    only part of the model counts layers of that part).
    """
    present = set(names)
    if unit == "tensors":
        ordered = [n for n, _ in model.named_parameters() if n in present]
        ordered += [n for n in names if n not in set(ordered)]
        return ordered if p <= 0 else ordered[-p:]
    units = [[n for n in u if n in present] for u in layer_groups(model).units]
    units = [u for u in units if u]
    chosen = units if p <= 0 or p >= len(units) else units[-p:]
    return [n for u in chosen for n in u]


def ala_mix(glob: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor],
            weights: Mapping[str, torch.Tensor]) -> Params:
    """θ̂: ``local + (glob − local) ⊙ W`` on the names in ``weights``, ``glob`` everywhere else."""
    out = dict(glob)
    for k, w in weights.items():
        out[k] = local[k] + (glob[k] - local[k]) * w
    return out


def ala_weight_grad(model: torch.nn.Module, glob: Mapping[str, torch.Tensor],
                    local: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor],
                    x: torch.Tensor, y: torch.Tensor, task: str = "classification",
                    forward: Callable[[Params, torch.Tensor], torch.Tensor] | None = None,
                    ) -> tuple[Params, float]:
    """∂L/∂W of the mean loss of θ̂(W) on (x, y), by autograd through θ̂; returns (grads, loss)."""
    w = {k: v.detach().requires_grad_(True) for k, v in weights.items()}
    params = {k: v.detach() for k, v in glob.items()}
    for k, wk in w.items():
        params[k] = local[k].detach() + (glob[k].detach() - local[k].detach()) * wk
    fwd = forward or (lambda p, xb: functional_call(model, p, (xb,)))
    loss = loss_fn(task)(fwd(params, x), y)
    names = list(w)
    grads = torch.autograd.grad(loss, [w[k] for k in names])
    return dict(zip(names, grads)), float(loss.detach())


def ala_step(weights: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], eta: float) -> Params:
    """One projected step: ``clip_[0,1](W − η ∂L/∂W)``."""
    return {k: (w - eta * grads[k]).clamp_(0.0, 1.0) for k, w in weights.items()}


def ala_sample_indices(n: int, s: float, mode: str, generator: torch.Generator) -> torch.Tensor:
    """Indices of the s% ALA sample of a client with ``n`` training samples (at least one)."""
    m = min(n, max(1, int(math.floor(s / 100.0 * n))))
    if mode == "subset":
        return torch.randperm(n, generator=generator)[:m]
    offset = int(torch.randint(0, n - m + 1, (1,), generator=generator))
    return torch.arange(offset, offset + m)


@checkpointable
@dataclass
class ALAResult:
    params: Params          # the initialised local model θ̂ (all received names)
    weights: Params | None  # W after learning (None: skipped)
    start_phase: bool       # the flag after this call
    passes: int             # passes over the ALA sample
    losses: list[float]     # last-batch loss of each pass
    time_s: float
    skipped: bool = False
    started: bool = False   # this call ran the start phase


def identical(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def adaptive_local_aggregation(
    model: torch.nn.Module, glob: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor] | None,
    upper: Sequence[str], x: torch.Tensor, y: torch.Tensor, *, weights: Mapping[str, torch.Tensor] | None,
    start_phase: bool, eta: float, batch_size: int, threshold: float, window: int, max_epochs: int,
    task: str = "classification", forward: Callable[[Params, torch.Tensor], torch.Tensor] | None = None,
) -> ALAResult:
    """Run ALA once: learn W on (x, y) (the ALA sample, batched in order) and return θ̂.

    ``local`` may lack names (never trained there): they are taken from ``glob``, i.e. overwritten.
    Inputs are not modified.
    """
    t0 = time.perf_counter()
    glob = {k: v.detach() for k, v in glob.items()}
    if local is None:
        return ALAResult(dict(glob), None, start_phase, 0, [], 0.0, skipped=True)
    local = {k: (local[k].detach() if k in local else glob[k]) for k in glob}
    if identical(glob, local):
        return ALAResult(dict(glob), None, start_phase, 0, [], 0.0, skipped=True)
    upper = [k for k in upper if k in glob]
    w = ({k: torch.ones_like(glob[k]) for k in upper} if weights is None
         else {k: weights[k].detach().clone() for k in upper})
    n = len(y)
    bs = n if batch_size <= 0 else batch_size
    losses: list[float] = []
    started = start_phase
    while True:
        loss = float("nan")
        for start in range(0, n, bs):
            grads, loss = ala_weight_grad(model, glob, local, w, x[start:start + bs], y[start:start + bs],
                                          task, forward)
            with torch.no_grad():
                w = ala_step(w, grads, eta)
        losses.append(loss)
        if not start_phase:
            break
        # population std of the last K pass losses, over more than K passes (as the reference code)
        if len(losses) > window and float(np.std(losses[-window:])) < threshold:
            break
        if len(losses) >= max_epochs:
            break
    with torch.no_grad():
        params = ala_mix(glob, local, w)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return ALAResult(params, w, False, len(losses), losses, time.perf_counter() - t0, started=started)


@functools.lru_cache(maxsize=64)
def _upper_names_cached(model: torch.nn.Module, names: tuple[str, ...], p: int, unit: str) -> list[str]:
    return upper_names(model, names, p, unit)


def params_digest(params: Mapping[str, torch.Tensor]) -> str:
    """A content hash of a parameter dict (the client recognises a model it has already seen)."""
    h = hashlib.blake2b(digest_size=16)
    for k in sorted(params):
        h.update(k.encode())
        h.update(params[k].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---- the plug-in ---------------------------------------------------------------------------------

class _ALACore:
    """What every ALA composition shares: running ALA for a client and the server-side cost log."""

    hp: Any
    ctx: Any

    def setup(self) -> None:
        super().setup()  # type: ignore[misc]
        self.ala_stats = {"next_round": 0, "time_s": 0.0, "time_s_mean": 0.0, "time_total_s": 0.0,
                          "time_at_eval_total_s": 0.0, "passes": 0, "start_passes": 0, "start_clients": 0}

    def _ala_state(self, client: ClientHandle) -> dict:
        st = client.state.get(STATE_KEY)
        if st is None:
            st = client.state[STATE_KEY] = {"weights": None, "start_phase": True, "local": None,
                                            "pending": None, "round": 0, "report": None}
        return st

    def _ala_upper(self, client: ClientHandle, names: Sequence[str]) -> list[str]:
        return _upper_names_cached(client.model, tuple(names), self.hp.p, self.hp.p_unit)

    def _ala_compute(self, client: ClientHandle, rnd: int, glob: Params, local: Params | None) -> ALAResult:
        st = self._ala_state(client)
        hp_ = self.hp
        d = client.data
        idx = ala_sample_indices(len(d.y_train), hp_.s, hp_.ala_sample, client.generator(rnd, "ala"))
        idx = idx.to(d.y_train.device)
        return adaptive_local_aggregation(
            client.model, glob, local, self._ala_upper(client, list(glob)), d.x_train[idx], d.y_train[idx],
            weights=st["weights"], start_phase=st["start_phase"], eta=hp_.eta,
            batch_size=self.ctx.cfg.federation.batch_size, threshold=hp_.threshold, window=hp_.window,
            max_epochs=hp_.ala_max_epochs, task=self.ctx.meta.task)

    def _ala_apply(self, client: ClientHandle, received: Params, local: Params | None) -> Params:
        """ALA for the round in progress, reusing an evaluation-time result for the same model."""
        st = self._ala_state(client)
        rnd = st["round"]
        pending, st["pending"] = st["pending"], None
        cached = (pending is not None and pending["round"] == rnd
                  and pending["digest"] == params_digest(received))
        res = pending["result"] if cached else self._ala_compute(client, rnd, received, local)
        if not res.skipped:
            st["weights"] = res.weights
            st["start_phase"] = res.start_phase
        st["report"] = {"ala_time_s": res.time_s, "ala_passes": res.passes,
                        "ala_start": int(res.started and not res.skipped), "ala_cached": int(cached)}
        return res.params

    def local_update(self, rnd: int, client: ClientHandle, msg: Message | None) -> Message | None:
        st = self._ala_state(client)
        st["round"] = rnd
        st["report"] = None
        reply = super().local_update(rnd, client, msg)  # type: ignore[misc]
        self._ala_after_training(client, msg, reply)
        if reply is not None and st["report"] is not None:
            reply.info.update(st["report"])
        return reply

    def _ala_after_training(self, client: ClientHandle, msg: Message | None, reply: Message | None) -> None:
        pass

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        infos = [r.info for r in replies.values() if "ala_time_s" in r.info]
        times = [float(i["ala_time_s"]) for i in infos]
        stats = self.ala_stats
        stats["time_s"] = float(sum(times))
        stats["time_s_mean"] = float(np.mean(times)) if times else 0.0
        stats["time_total_s"] += stats["time_s"]
        stats["time_at_eval_total_s"] += float(sum(float(i["ala_time_s"]) for i in infos if i.get("ala_cached")))
        stats["passes"] = int(sum(int(i["ala_passes"]) for i in infos))
        stats["start_passes"] += int(sum(int(i["ala_passes"]) for i in infos if i.get("ala_start")))
        stats["start_clients"] += int(sum(int(i.get("ala_start", 0)) for i in infos))
        stats["next_round"] = rnd + 1
        super().aggregate(rnd, replies)  # type: ignore[misc]

    def extra_metrics(self, rnd: int, final: bool = False) -> dict[str, float]:
        out = dict(super().extra_metrics(rnd, final))  # type: ignore[misc]
        out.update({f"ala/{k}": float(v) for k, v in self.ala_stats.items() if k != "next_round"})
        return out


class ALAStartMixin(_ALACore):
    """ALA in place of ``start_params`` (FedAvg family, FedRep): the client keeps its trained copy."""

    def start_params(self, client: ClientHandle, received: Params) -> Params:
        base_start = super().start_params(client, received)  # type: ignore[misc]
        mixed = self._ala_apply(client, received, self._ala_state(client)["local"])
        if base_start is received:
            return mixed
        # a base that completes the start point (FedRep adds its local head): ALA replaces only
        # the received names in it
        return {**base_start, **mixed}

    def _ala_after_training(self, client: ClientHandle, msg: Message | None, reply: Message | None) -> None:
        # The client's local model for next time: what it trained now, for the names it received. Read
        # from its training, not its reply: SCAFFOLD, FedNova and DIANA send changes or gradients, and
        # LAG sends nothing in a round it skips (it trained all the same).
        if msg is None or client.trained is None:
            return
        names = [k for p in msg.parts.values() if isinstance(p, Model) for k in p.entries]
        kept = {k: client.trained[k].detach() for k in names if k in client.trained}
        if kept:
            self._ala_state(client)["local"] = kept

    def personal_params(self, rnd: int, client: ClientHandle, received: Params | None) -> Params:
        if type(self)._ala_base_personal is not Method.personal_params:
            return super().personal_params(rnd, client, received)  # type: ignore[misc]
        glob = received  # the global model the evaluation message carried
        st = client.state.get(STATE_KEY)
        if not st or st["local"] is None:
            return glob
        if self.hp.eval_model == "local":
            return {**glob, **st["local"]}
        rnd = rnd + 1  # ALA for the next round's reception, whose seed it uses (and which reuses it)
        digest = params_digest(glob)
        pending = st["pending"]
        if pending is None or pending["round"] != rnd or pending["digest"] != digest:
            res = self._ala_compute(client, rnd, glob, st["local"])
            pending = st["pending"] = {"round": rnd, "digest": digest, "result": res}
        return pending["result"].params


class ALAPersonalMixin(_ALACore):
    """ALA in place of ``personal_start`` (Ditto): global = received, local = the personal model."""

    def personal_start(self, client: ClientHandle, received: Params) -> Params:
        local = super().personal_start(client, received)  # type: ignore[misc]
        if local is received:
            return local
        return self._ala_apply(client, received, local)


def _merged_hparams(base_hp: type) -> type:
    base_fields = {f.name for f in dataclasses.fields(base_hp)} if dataclasses.is_dataclass(base_hp) else set()
    clash = base_fields & {f.name for f in dataclasses.fields(ALAHparams)}
    if clash:
        raise ValueError(f"{base_hp.__name__} already has fields {sorted(clash)}; ALA cannot be merged")
    hints = typing.get_type_hints(ALAHparams)
    fields = [(f.name, hints[f.name], dataclasses.field(default=f.default, metadata=f.metadata))
              for f in dataclasses.fields(ALAHparams)]
    bases = (base_hp,) if dataclasses.is_dataclass(base_hp) else ()
    cls = dataclasses.make_dataclass(f"{base_hp.__name__}ALA", fields, bases=bases)
    cls.__module__ = __name__
    cls.__doc__ = f"{(base_hp.__doc__ or '').strip()} + {ALAHparams.__doc__}"
    return cls


def compose(base: type[Method]) -> type[Method]:
    """``base`` with adaptive local aggregation at its start hook and merged hyperparameters."""
    if hasattr(base, "personal_start"):
        mixin: type = ALAPersonalMixin
    elif hasattr(base, "start_params"):
        mixin = ALAStartMixin
    else:
        from ..schema import ConfigError

        raise ConfigError("method.name", f"ALA needs a method with a start_params or personal_start "
                                         f"hook; {base.name!r} has neither")
    attrs = {
        "__module__": __name__,
        "name": f"{base.name}+ala",
        "Hparams": _merged_hparams(base.Hparams),
        "description": f"{base.description or base.name} + adaptive local aggregation (FedALA)",
        "_ala_base_personal": base.personal_params,
        "metric_names": tuple(base.metric_names) + ("ala/*",),
    }
    return type(f"{base.__name__}ALA", (mixin, base), attrs)


register_plugin("ala", compose)


@register
class FedALA(compose(FedAvg)):  # type: ignore[misc]
    name = "fedala"
    description = "FedALA: FedAvg with adaptive local aggregation (Zhang et al. 2023)"


__all__ = ["ALAHparams", "ALAResult", "FedALA", "adaptive_local_aggregation", "ala_mix", "ala_sample_indices",
           "ala_step", "ala_weight_grad", "compose", "params_digest", "upper_names"]
