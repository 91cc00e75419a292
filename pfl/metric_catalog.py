"""The metric catalog: every metric name a run of a config can report.

Sweeps check a search space's metric against it before Ray starts, and a test checks every metric
each method logs against it, so a renamed or undeclared metric fails early. Names with ``*`` match
any tail (a method's ``metric_names`` such as ``ala/*``).
"""

from __future__ import annotations

import fnmatch
from typing import Sequence

from .data import source_spec
from .federation.comm import CommLedger
from .methods import get_method

#: time/data_load_s: loading the data (a file's parse or the cache's read included), once per process
RUN_METRICS = ("train/loss", "lr", "time/round_s", "time/elapsed_s", "time/data_load_s")
EVAL_METRICS = {
    "classification": ("val/loss_mean", "test/loss_mean", "val/acc_mean", "val/acc_se", "test/acc_mean", "test/acc_std",
                       "test/acc_p10", "test/acc_worst", "test/acc_weighted", "global/test_acc",
                       "global/val_acc", "global/test_loss"),
    "regression": ("val/loss_mean", "test/loss_mean", "val/rmse_mean", "val/rmse_se", "test/rmse_mean", "test/rmse_std",
                   "test/rmse_p10", "test/rmse_worst", "global/test_rmse", "global/test_loss"),
}
ASYNC_METRICS = ("time/sim_clock", "async/arrivals")
#: under an attack (pfl/federation/attacks.py) and with newcomers (pfl/federation/newcomers.py)
ATTACK_METRICS = ("attack/benign_clients", "attack/diverged")
NEWCOMER_METRICS = ("newcomer/*", "comm/join_up_bytes", "comm/join_down_bytes")
#: with federation.workers > 1 (pfl/federation/workers.py): bytes to and from the workers, workers restarted
WORKER_METRICS = ("workers/sent_bytes", "workers/received_bytes", "workers/restarts", "workers/nodes")


def reported_metrics(cfg) -> tuple[str, ...]:
    """Every metric name a run of ``cfg`` can report (``*`` matches any tail): the loop's own, the
    ledger's, the evaluation's for the task, and the method's :attr:`metric_names`."""
    task = source_spec(cfg.data.source).task
    names = [*RUN_METRICS, *CommLedger().metrics(), *EVAL_METRICS[task], *get_method(cfg.method.name).metric_names]
    if cfg.federation.driver == "async":
        names += ASYNC_METRICS
    if cfg.attack.kind != "none":
        names += ATTACK_METRICS
    if cfg.newcomers.fraction > 0:
        names += NEWCOMER_METRICS
    if cfg.federation.workers > 1:
        names += WORKER_METRICS
    if cfg.federation.eval_clients:
        names.append("eval/clients")  # how many clients an evaluation covered (the sample, or everyone at the end)
    if cfg.federation.cohort != "sequential":
        names.append("cohort/sequential_clients")  # clients a batched cohort ran alone (pfl.federation.cohort)
    names += evaluation_metrics(cfg.evaluation, task)
    if any(spec.name in ("fp16", "bf16") for spec in (cfg.compression.uplink, cfg.compression.downlink)):
        names.append("comm/fp16_flushed")  # pfl.compression.codec: non-zeros a half-precision encoding lost
    return tuple(dict.fromkeys(names))


def evaluation_metrics(ev, task: str) -> list[str]:
    """What the ``evaluation`` section adds (pfl/federation/eval_modes.py); nothing by default."""
    score = "acc" if task == "classification" else "rmse"
    names = []
    for when in ev.when:  # fluke's pre-/post-fit: the round's sampled clients around their local update
        names += [f"fit/{when}/test_{score}_mean", f"fit/{when}/test_loss_mean"]
    if ev.when:
        names.append("fit/clients")
    if ev.local_model:  # each client's last locally trained model
        names.append(f"local/test_{score}")
    if ev.server_test:  # the global model on the union of the clients' test splits
        names += [f"server/test_{score}", "server/test_loss"]
    if ev.trained_apart:  # test/* over the clients that trained, and their count
        names += ["test/trained/clients"]
        names += [f"test/trained/{m[5:]}" for m in EVAL_METRICS[task] if m.startswith("test/")]
    return names


def metric_known(name: str, catalog: Sequence[str]) -> bool:
    """Whether ``name`` is in ``catalog`` (exactly, or by a pattern with ``*``)."""
    return any(name == pattern or ("*" in pattern and fnmatch.fnmatchcase(name, pattern)) for pattern in catalog)


__all__ = ["evaluation_metrics", "reported_metrics", "metric_known"]
