"""Survivors of APFL's local update (the uplink's ``base`` tag, the start hook's client), the
fine-tuned newcomers' evaluation plan (``FineTuneNewcomers.eval_plan``: the global model it reports)
and ``Method.personal_params``'s error (triage list R). Truths: APFL's w follows plain gradient
steps on f_k (the mixture's term sees w detached), so with a top-k uplink the server's model is the
sample-weighted mean of θ + top-k(w_k − θ), written in numpy from the least-squares problem; with
``+ala`` the first round is the same (ALA's documented skip rule: no local model yet); a
Per-FedAvg newcomer's ``global/*`` row is the final global model's mean squared error on its own
test split (numpy), and LG-FedAvg, whose shared head is no global model, reports none for its
newcomers (its module docstring); a method without ``personal_params`` names itself and the hook."""

from __future__ import annotations

import numpy as np
import pytest

from truth import close, least_squares, simulator, vec

K, LR = 3, 0.05


# ---- APFL ----------------------------------------------------------------------------------------

def _topk(v: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros_like(v)
    keep = np.argsort(-np.abs(v), kind="stable")[:k]
    out[keep] = v[keep]
    return out


def test_apfl_with_a_top_k_uplink_averages_the_start_plus_the_top_k_of_each_clients_w_change():
    """The reply is a model trained from the downlink's ``model`` part: sent as top-k of w − θ,
    rebuilt on θ; weight (4 entries, k = 2) and bias (1 entry, k = 1) compressed separately."""
    p = least_squares(d=4)
    sim = simulator(p, "apfl", steps=K, lr=LR, method__alpha=0.3,
                    compression__uplink={"name": "topk", "ratio": 0.5}, compression__min_numel=1)
    theta = vec(sim.method.global_params())
    sim.run_round(evaluate=False)
    got = vec(sim.method.global_params())
    d = p.dim - 1
    sent = []
    for i in range(p.m):
        change = p.gd(i, theta, K, LR) - theta
        sent.append(theta + np.concatenate([_topk(change[:d], 2), change[d:]]))
    n = np.array([p.n(i) for i in range(p.m)], dtype=float)
    expected = np.tensordot(n / n.sum(), np.stack(sent), axes=1)
    assert close(got, expected)
    assert np.count_nonzero(sent[0][:d] - theta[:d]) == 2  # top-k really dropped entries


def test_apfl_with_ala_first_round_trains_w_from_the_received_model():
    """ALA is skipped while a client has no local model: round 0 of ``apfl+ala`` is FedAvg's step of
    the w-models, Σ n_k w_k / Σ n_k with w_k = K gradient steps on f_k from θ."""
    p = least_squares()
    sim = simulator(p, "apfl+ala", steps=K, lr=LR)
    theta = vec(sim.method.global_params())
    sim.run_round(evaluate=False)
    n = np.array([p.n(i) for i in range(p.m)], dtype=float)
    expected = np.tensordot(n / n.sum(), np.stack([p.gd(i, theta, K, LR) for i in range(p.m)]), axes=1)
    assert close(vec(sim.method.global_params()), expected)


# ---- fine-tuned newcomers: the global model of their evaluation ---------------------------------------

def _joined(method):
    from pfl.federation.loop import RoundLoop

    p = least_squares(sizes=(20, 30, 24, 27, 22, 25))
    sim = simulator(p, method, steps=K, lr=LR, rounds=2, newcomers__fraction=0.17,
                    newcomers__finetune_rounds=1)
    for _ in range(2):
        sim.run_round(evaluate=False)
    final = vec(sim.method.global_model)
    RoundLoop(sim, []).run()
    (n,) = sim.ctx.newcomers
    row = next(r for r in sim.last_client_table if r["client"] == n)
    return p, sim, n, final, row


def test_a_fine_tuned_perfedavg_newcomer_reports_the_final_global_models_loss_as_global():
    p, sim, n, final, row = _joined("perfedavg")
    assert np.isclose(row["global_test_loss"], p.loss(n, final), rtol=1e-5)
    assert np.isclose(row["global_val_loss"], p.loss(n, final), rtol=1e-5)
    # and its personal row is the fine-tuned model (K plain steps from the final global model)
    assert np.isclose(row["test_loss"], p.loss(n, p.gd(n, final, K, LR)), rtol=1e-5)
    assert not np.isclose(row["test_loss"], row["global_test_loss"], rtol=1e-3)


def test_a_fine_tuned_lgfedavg_newcomer_reports_no_global_model():
    """LG-FedAvg's evaluation message is its shared head, not a global model: no ``global_*``."""
    p, sim, n, final, row = _joined("lgfedavg")
    assert not [k for k in row if k.startswith("global_")]
    assert np.isclose(row["test_loss"], p.loss(n, p.gd(n, final, K, LR)), rtol=1e-5)


# ---- Method.personal_params ----------------------------------------------------------------------

def test_personal_params_without_a_received_model_names_the_method_and_the_hook():
    sim = simulator(least_squares(), "fedavg")
    client = sim.client(0)
    with pytest.raises(NotImplementedError, match=r"^fedavg must define personal_params$"):
        sim.method.personal_params(0, client, None)
