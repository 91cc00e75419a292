"""Evaluations beyond the default (the ``evaluation`` config section); the defaults add nothing, so a
run that sets none of them computes and reports exactly what it did before.

* ``evaluation.when: [before, after]`` (fluke's pre-/post-fit): in every training round each sampled
  client evaluates, on its test split, the model it starts from (``before``: its personal model
  given the training downlink's ``model`` part — FedAvg: the received global model; Ditto, Local:
  its own model before training) and the model its local update produced (``after``: its personal
  model given its reply's ``model`` part — FedAvg: the model it trained; Ditto: its personal model
  after the personal task). Both are :meth:`Method.fit_model`, which a method may override (a reply
  of updates only, SCAFFOLD's or FedNova's, has no ``after`` model by default). Metrics:
  ``fit/before/test_acc_mean``, ``fit/after/test_acc_mean``, ``fit/<when>/test_loss_mean`` (a
  regression source: ``fit/<when>/test_rmse_mean``) over the round's sampled clients, and
  ``fit/clients``. They are part of the round (its time included).
* ``evaluation.local_model``: the ``after`` model is kept in the client's state
  (:data:`LOCAL_KEY`) and evaluated at every evaluation round on the client's test split as
  ``local/test_acc`` (``local/test_rmse``), over the clients that have trained.
* ``evaluation.server_test``: the global model on one pooled test set, the union of the evaluated
  clients' test splits (every client's at the final evaluation): ``server/test_acc``,
  ``server/test_loss`` (``server/test_rmse``). Not new data: it is the clients' own test samples,
  each weighing the same, where ``global/test_acc`` is a mean over clients. pfl sets no data aside
  before partitioning (that would change every partition and its cache key).
* ``evaluation.trained_apart``: ``test/trained/*`` — ``test/*`` over the clients that have taken
  part in at least one training round (a round's sample, :meth:`Population.sample`, for every round
  of the model's lineage so far; a pooled reference row: every member) — and ``test/trained/clients``,
  their count.
* ``evaluation.untrained_model``: what a client that never trained (in a training round, or a
  newcomer in a join step) is evaluated with —
  ``personal`` (its personal model as the method builds it: for Ditto an untrained model),
  ``global`` (the global model it receives, when the method has one) or ``method``:
  :attr:`Method.untrained_model`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..evaluation import summarize
from .wire import ClientSide

if TYPE_CHECKING:
    from ..methods.base import ClientHandle, EvalPlan

#: the client-state key of the last locally trained model (``evaluation.local_model``)
LOCAL_KEY = "eval/local_model"
#: its evaluation's name (``local/test_acc``)
LOCAL_NAME = "local/test"


def fit_side(sim, rnd: int, side: ClientSide) -> ClientSide:
    """The training client side with the ``evaluation.when`` / ``local_model`` evaluations around
    the local update; ``side`` itself when neither is asked for."""
    ev = sim.cfg.evaluation
    if not ev.when and not ev.local_model:
        return side
    role = sim.client_role

    def run(client: "ClientHandle", msg):
        row: dict = {"client": client.cid, "n_test": client.data.n_test}
        fwd = role.eval_forward(client)
        if "before" in ev.when:
            _test(row, "before", client, role.fit_model(rnd, client, msg, "before"), fwd)
        reply, _ = side(client, msg)
        trained = role.fit_model(rnd, client, reply, "after")
        if "after" in ev.when:
            _test(row, "after", client, trained, fwd)
        if ev.local_model and trained is not None:
            client.state[LOCAL_KEY] = {k: v.detach().clone() for k, v in trained.items()}
        return reply, row
    return run


def _test(row: dict, when: str, client: "ClientHandle", params, fwd) -> None:
    if params is None:
        return
    d = client.data
    res = client.evaluate(params, d.x_test, d.y_test, forward=fwd)
    row[f"{when}_loss"], row[f"{when}_acc"] = res.loss, res.acc


def fit_metrics(sim, rows: Sequence[dict]) -> dict[str, float]:
    """``fit/*`` of one round from its sampled clients' rows (none when ``evaluation.when`` is empty)."""
    when = sim.cfg.evaluation.when
    if not when or not rows:
        return {}
    out = {"fit/clients": float(len(rows))}
    for w in when:
        loss = np.array([r.get(f"{w}_loss", np.nan) for r in rows], dtype=float)
        if not np.isfinite(loss).any():
            continue
        if sim.data.task == "classification":
            acc = np.array([r.get(f"{w}_acc", np.nan) for r in rows], dtype=float)
            out[f"fit/{w}/test_acc_mean"] = float(np.nanmean(acc))
        else:
            out[f"fit/{w}/test_rmse_mean"] = float(np.nanmean(np.sqrt(loss)))
        out[f"fit/{w}/test_loss_mean"] = float(np.nanmean(loss))
    return out


def trained_clients(sim) -> set[int]:
    """The clients that took part in a training round of the model's lineage (rounds 0 … round − 1),
    from the seeded samples; cached on the simulator, recomputed after a restore to an earlier round."""
    if type(sim.method).pooled:  # a reference row trains on every member's data from the first round
        return set(sim.ctx.members)
    upto, seen = getattr(sim, "_trained_cache", (0, set()))
    if upto > sim.round:
        upto, seen = 0, set()
    for r in range(upto, sim.round):
        seen.update(sim.sample(r))
    sim._trained_cache = (sim.round, seen)
    return seen


def untrained_rule(sim) -> str:
    rule = sim.cfg.evaluation.untrained_model
    return type(sim.method).untrained_model if rule == "method" else rule


def adjust_plan(sim, client: "ClientHandle", plan: "EvalPlan", joined: frozenset[int] = frozenset()) -> "EvalPlan":
    """A client's evaluation plan with the untrained rule and the local model applied; ``joined``:
    the newcomers a join step trained (not untrained, though no training round sampled them)."""
    ev = sim.cfg.evaluation
    trained = client.cid in joined or client.cid in trained_clients(sim)
    if plan.global_model is not None and untrained_rule(sim) == "global" and not trained:
        plan = dataclasses.replace(plan, personal=plan.global_model, forward=None)
    if ev.local_model and LOCAL_KEY in client.state:
        plan = dataclasses.replace(plan, extra={**plan.extra, LOCAL_NAME: client.state[LOCAL_KEY]})
    return plan


def eval_metrics(sim, rows: list[dict]) -> dict[str, float]:
    """``server/*`` and ``test/trained/*`` from an evaluation's summarised rows."""
    ev, task = sim.cfg.evaluation, sim.data.task
    out: dict[str, float] = {}
    if ev.server_test:
        glob = [r for r in rows if "global_test_loss" in r and r["n_test"] > 0]
        n = np.array([r["n_test"] for r in glob], dtype=float)
        if glob and n.sum() > 0:
            loss = float(np.sum(n * np.array([r["global_test_loss"] for r in glob])) / n.sum())
            out["server/test_loss"] = loss
            if task == "classification":
                out["server/test_acc"] = float(np.sum(n * np.array([r["global_test_acc"] for r in glob])) / n.sum())
            else:
                out["server/test_rmse"] = float(np.sqrt(loss))
    if ev.trained_apart:
        done = trained_clients(sim)
        trained = [r for r in rows if r["client"] in done]
        if len(trained) == len(rows):   # every evaluated client trained: test/* says it already
            return out
        out["test/trained/clients"] = float(len(trained))
        out.update({f"test/trained/{k[5:]}": v for k, v in summarize(trained, task).items() if k.startswith("test/")})
    return out


__all__ = ["LOCAL_KEY", "LOCAL_NAME", "adjust_plan", "eval_metrics", "fit_metrics", "fit_side", "trained_clients",
           "untrained_rule"]
