"""Newcomers: clients held out of training that join the federation after its last round.

The FPFC paper's generalisation experiment (§6.4.2, Table 3; docs/methods/fpfc.md §8): round(m·f) clients
(``newcomers.fraction`` = f, drawn once from the run's seed by :func:`newcomer_clients`) take no
part in training — the simulator samples only the other clients, evaluates only them, and a
method's server sizes its federation by them (``ctx.members``). After the last round
(:meth:`pfl.federation.loop.RoundLoop.run`) :func:`join_newcomers` lets the newcomers join by their
method's rule, through the method's join hooks (:mod:`pfl.methods.base`):

    join_begin(rnd, newcomers)                                  server
    for step in 0, 1, ..., newcomers.rounds − 1 (the fine-tuning rules: finetune_rounds − 1):
        active = join_active(step)        (none: done)          server
        for cid in active:
            join_message(rnd, step, cid) → delivered (join_down) server → newcomer
            join_update(rnd, step, client, msg) → delivered (join_up)  newcomer → server
        join_aggregate(rnd, step, replies)                      server

with ``rnd`` = the round after the last training round + ``step`` (it seeds the generators and sets
the learning rate, which continues its schedule). Each join step is one exchange
(:mod:`pfl.federation.exchange`, phase ``join``): every message is copied, transformed (an
attacker's join uploads are attacked too) and counted, booked apart from training as
``comm/join_up_bytes`` / ``comm/join_down_bytes``; ``compression.*`` acts on training traffic only,
so join messages travel dense. Then every client is evaluated
once more (the newcomers with their method's evaluation message) and the metrics are:

* ``newcomer/acc_mean``, ``newcomer/acc_std`` (``newcomer/rmse_mean`` for regression) — the
  newcomers' personalized models on their own test splits (benign newcomers under an attack);
* ``newcomer/ari`` — clustered methods: the adjusted Rand index of the cluster assignment of all
  clients (trained and newcomers) against the true clusters; ``newcomer/in_true_cluster`` — the share
  of newcomers assigned to the cluster that holds most of the trained clients of their true cluster;
  ``newcomer/clusters`` — the number of clusters after the join;
* ``newcomer/join_steps`` — join steps run; ``newcomer/count``.

Deterministic and resumable: every draw is seeded by (seed, round, client); the result is part of the
model state, so a finished run resumed from its final checkpoint reports it without joining again,
and a run interrupted during the join resumes from its last checkpoint (before the join) and joins
exactly as the uninterrupted run did.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ..clusters import cluster_metrics
from ..config import ExperimentConfig, round_share
from ..evaluation import summarize
from .context import derive_seed
from .wire import Phase


def newcomer_clients(cfg: ExperimentConfig, num_clients: int) -> tuple[int, ...]:
    """The run's newcomers (sorted ids; empty when ``newcomers.fraction`` is 0), drawn once from its seed."""
    count = round_share(num_clients, cfg.newcomers.fraction)
    if count == 0:
        return ()
    rng = np.random.default_rng(derive_seed(cfg.seed, "newcomers"))
    return tuple(sorted(int(i) for i in rng.choice(num_clients, size=count, replace=False)))


def in_true_cluster(assignment: dict[int, int], true: np.ndarray, members: list[int],
                    newcomers: list[int]) -> float:
    """Share of ``newcomers`` whose cluster is the one holding most trained members of their true cluster."""
    hits = []
    for cid in newcomers:
        peers = [assignment[c] for c in members if true[c] == true[cid] and c in assignment]
        if not peers or cid not in assignment:
            hits.append(False)
            continue
        hits.append(assignment[cid] == Counter(peers).most_common(1)[0][0])
    return float(np.mean(hits)) if hits else float("nan")


def join_newcomers(sim) -> dict[str, float]:
    """Let the newcomers join the run of ``sim`` (a :class:`~pfl.federation.simulator.Simulator`;
    see the module docstring); their metrics. Runs once per lineage."""
    newcomers = list(sim.ctx.newcomers)
    if not newcomers:
        return {}
    if sim.join_result is not None:
        return dict(sim.join_result)
    method = sim.method
    start = sim.round
    method.join_begin(start, newcomers)
    steps = 0
    for step in range(sim.cfg.newcomers.rounds):
        active = method.join_active(step)
        if not active:
            break
        sim.join_trained.update(active)
        rnd = start + step
        arrivals = sim.exchange(Phase("join", rnd, step), active,
                                lambda cid: method.join_message(rnd, step, cid), sim.join_side(rnd, step))
        method.join_aggregate(rnd, step, {cid: a.reply for cid, a in arrivals.items() if a.reply is not None})
        steps += 1
    sim.newcomers_joined = True
    sim.evaluate(final=True)  # every client now; the table keeps a newcomer column
    rows = [r for r in sim.last_client_table if r["client"] in set(newcomers) and not r.get("malicious")]
    out = {f"newcomer/{k.split('/', 1)[1]}": v for k, v in summarize(rows, sim.data.task).items()
           if k.startswith("test/")}
    out["newcomer/count"] = float(len(rows))
    out["newcomer/join_steps"] = float(steps)
    assignment = method.cluster_assignment()
    true = sim.ctx.meta.true_clusters
    if assignment is not None:
        present = sorted(assignment)
        found = cluster_metrics([assignment[c] for c in present], None if true is None else true[present])
        out["newcomer/clusters"] = found["cluster/num"]
        if true is not None:
            out["newcomer/ari"] = found["cluster/ari"]
            out["newcomer/in_true_cluster"] = in_true_cluster(assignment, true, sim.ctx.members, newcomers)
    out.update({k: v for k, v in sim.ledger.metrics().items() if k.startswith("comm/join_")})
    sim.join_result = dict(out)
    return out


__all__ = ["in_true_cluster", "join_newcomers", "newcomer_clients"]
