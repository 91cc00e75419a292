"""Personalized evaluation (every client's model on its own splits) and clustering metrics.

Metric names (stable, logged to MLflow with ``step=round``):

* ``val/acc_mean``, ``val/loss_mean`` — personalized models on each client's validation split;
  ``val/acc_se`` the binomial standard error of ``val/acc_mean`` (regression: ``val/rmse_se``);
* ``test/acc_mean``, ``test/acc_std``, ``test/acc_p10``, ``test/acc_worst``, ``test/acc_weighted``
  (sample-weighted), ``test/loss_mean``; regression reports ``*/rmse_mean`` instead of accuracy;
* ``global/test_acc``, ``global/test_loss``, ``global/val_acc`` — the global model (when the method
  has one) on every client's split, averaged over clients;
* ``<name>_acc`` (``<name>_rmse``) — a method's extra evaluation models, e.g. ``fpfc/readout_acc``.

Evaluation runs on each client's side (:func:`evaluate_plan`, with the models its
:class:`~pfl.methods.base.EvalPlan` names); :func:`summarize` turns the rows into the metrics.
The ``evaluation`` config section's further evaluations (before/after local training, each client's
local model, a pooled test set, the trained clients apart) are :mod:`pfl.federation.eval_modes`'.
Every metric a run can report is listed by :mod:`pfl.metric_catalog`; clustering metrics
(``cluster/num``, ``cluster/ari``) are :mod:`pfl.clusters`'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from .methods.base import ClientHandle, EvalPlan


def _summary(prefix: str, values: np.ndarray, full: bool = False) -> dict[str, float]:
    values = values[np.isfinite(values)] if values.size else values
    if values.size == 0:
        return {}
    out = {f"{prefix}_mean": float(values.mean())}
    if full:
        out[f"{prefix}_std"] = float(values.std())
        out[f"{prefix}_p10"] = float(np.percentile(values, 10))
        out[f"{prefix}_worst"] = float(values.min())
    return out


def _standard_error(name: str, values: np.ndarray, n: np.ndarray, binomial: bool) -> dict[str, float]:
    """The standard error of the mean over clients of ``values`` (clients with a split only).

    Accuracy (``binomial``): each client's accuracy a_i is a proportion over its n_i samples, so
    var(mean) = Σ_i a_i(1 − a_i)/n_i / k² — the noise of the validation samples, which is what a
    choice between two models on the same split must see past. A regression score has no such
    form; its clients' spread over √k stands in.
    """
    ok = np.isfinite(values) & (n > 0)
    k = int(ok.sum())
    if k == 0:
        return {}
    if binomial:
        a, m = values[ok], n[ok]
        return {name: float(np.sqrt(np.sum(a * (1 - a) / m)) / k)}
    return {name: float(values[ok].std(ddof=1) / np.sqrt(k)) if k > 1 else float("nan")}


def evaluate_plan(client: "ClientHandle", plan: "EvalPlan", task: str, eval_global: bool = True) -> dict[str, float]:
    """One client's row: its personalized model (and the global and extra models of ``plan``) on
    its own validation and test splits. Runs client-side: only this client's data is read."""
    d = client.data
    params, fwd = plan.personal, plan.forward
    val = client.evaluate(params, d.x_val, d.y_val, forward=fwd)
    test = client.evaluate(params, d.x_test, d.y_test, forward=fwd)
    row = {"client": client.cid, "n_train": len(d.y_train), "n_val": val.n, "n_test": test.n,
           "cluster": -1 if d.cluster is None else int(d.cluster),
           "val_loss": val.loss, "val_acc": val.acc, "test_loss": test.loss, "test_acc": test.acc}
    glob = plan.global_model if eval_global else None
    if glob is not None:
        if glob is params and fwd is None:  # the same model: reuse instead of evaluating twice
            gval, gtest = val, test
        else:
            gval = client.evaluate(glob, d.x_val, d.y_val)
            gtest = client.evaluate(glob, d.x_test, d.y_test)
        row.update(global_val_acc=gval.acc, global_test_acc=gtest.acc,
                   global_test_loss=gtest.loss, global_val_loss=gval.loss)
    for name, extra in plan.extra.items():
        res = client.evaluate(extra, d.x_test, d.y_test)
        row[f"{name}:test_loss"] = res.loss
        row[f"{name}:test_acc"] = res.acc
    return row


def summarize(rows: Sequence[dict], task: str) -> dict[str, float]:
    """The logged metrics (see the module docstring) from every client's row."""
    def col(key: str) -> np.ndarray:
        return np.array([r.get(key, np.nan) for r in rows], dtype=float)

    def mean(values: np.ndarray) -> float:  # nan (not a warning) when no client has that split
        finite = values[np.isfinite(values)]
        return float(finite.mean()) if finite.size else float("nan")

    n_test = col("n_test")
    has_global = any("global_test_loss" in r for r in rows)
    metrics: dict[str, float] = {}
    metrics.update(_summary("val/loss", col("val_loss")))
    metrics.update(_summary("test/loss", col("test_loss")))
    if task == "classification":
        metrics.update(_summary("val/acc", col("val_acc")))
        metrics.update(_standard_error("val/acc_se", col("val_acc"), col("n_val"), binomial=True))
        metrics.update(_summary("test/acc", col("test_acc"), full=True))
        if n_test.sum() > 0:
            metrics["test/acc_weighted"] = float(np.nansum(col("test_acc") * n_test) / n_test.sum())
        if has_global:
            metrics["global/test_acc"] = mean(col("global_test_acc"))
            metrics["global/val_acc"] = mean(col("global_val_acc"))
    else:
        metrics.update(_summary("val/rmse", np.sqrt(col("val_loss"))))
        metrics.update(_standard_error("val/rmse_se", np.sqrt(col("val_loss")), col("n_val"), binomial=False))
        metrics.update(_summary("test/rmse", np.sqrt(col("test_loss")), full=True))
        if has_global:
            metrics["global/test_rmse"] = mean(np.sqrt(col("global_test_loss")))
    if has_global:
        metrics["global/test_loss"] = mean(col("global_test_loss"))
    extras = dict.fromkeys(k.split(":")[0] for r in rows for k in r if ":" in k)
    for name in extras:
        if task == "classification":
            metrics[f"{name}_acc"] = mean(col(f"{name}:test_acc"))
        else:
            metrics[f"{name}_rmse"] = mean(np.sqrt(col(f"{name}:test_loss")))
    return metrics


__all__ = ["evaluate_plan", "summarize"]
