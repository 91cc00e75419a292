"""The newcomer rules (docs/methods/fpfc.md §8) against truths computed in numpy (tests/truth.py).

Six clients in two clusters of three; one of them (drawn from the seed) is held out of training and
joins afterwards. The expected model of a newcomer is computed from the final server state and the
newcomer's data by the rule written out here (gradient steps in numpy, the loss minimum, the cluster
known by construction), never with the method's or the engine's training code."""

import numpy as np
import pytest

from truth import close, least_squares, run_rounds, simulator, vec

LR, K, ROUNDS = 0.2, 2, 3
TRUE = [0, 0, 0, 1, 1, 1]


@pytest.fixture(scope="module")
def problem():
    return least_squares(sizes=(20, 30, 24, 27, 22, 25), clusters=TRUE)


def _joined(p, method, rounds=ROUNDS, **kw):
    """A run with one newcomer that has trained ``rounds`` rounds and let the newcomer join."""
    from pfl.federation.loop import RoundLoop

    sim = simulator(p, method, steps=K, lr=LR, rounds=rounds, newcomers__fraction=0.17, **kw)
    assert len(sim.ctx.newcomers) == 1
    run_rounds(sim, rounds)
    before = {k: v.clone() for k, v in sim.method.global_params().items()} if sim.method.global_params() else None
    RoundLoop(sim, []).run()  # nothing left to train: the newcomer joins
    assert sim.newcomers_joined
    return sim, sim.ctx.newcomers[0], before


def test_default_rule_is_the_final_global_model(problem):
    sim, n, final = _joined(problem, "fedavg")
    assert close(vec(sim.personal_params(n)), vec(final), 0.0)
    assert sim.ledger.join_up_bytes == 0


@pytest.mark.parametrize("method", ["lgfedavg", "perfedavg"])
def test_fine_tune_rule_trains_the_final_global_model(problem, method):
    p, steps = problem, 2
    sim, n, _ = _joined(p, method, newcomers__finetune_rounds=steps)
    glob = vec(sim.method.global_model)  # (for the linear model LG-FedAvg's shared head is the whole model)
    expected = p.gd(n, glob, steps * K, LR)  # finetune_rounds local updates of K full-batch steps
    assert close(vec(sim.personal_params(n)), expected)
    assert not close(expected, glob, 1e-3)
    assert sim.ledger.join_down_bytes == 4 * p.dim and sim.ledger.join_up_bytes == 0  # the model, once


def test_fedavg_ft_newcomer_fine_tunes_for_ft_epochs(problem):
    p = problem
    sim, n, final = _joined(p, "fedavg_ft", method__ft_epochs=3)
    assert close(vec(sim.personal_params(n)), p.gd(n, vec(final), 3, LR))


def test_local_newcomer_trains_alone_from_the_common_start(problem):
    p = problem
    sim, n, _ = _joined(p, "local", newcomers__rounds=4)
    init = vec(sim.client_role.init)
    assert close(vec(sim.personal_params(n)), p.gd(n, init, 4 * K, LR))
    assert sim.ledger.join_up_bytes == sim.ledger.join_down_bytes == 0


def test_ditto_newcomer_runs_the_personal_task_around_the_final_global_model(problem):
    p, lam, epochs = problem, 0.8, 3
    sim, n, final = _joined(p, "ditto", method__lam=lam, method__personal_epochs=epochs,
                            newcomers__finetune_rounds=2)
    g = vec(final)
    assert close(vec(sim.personal_params(n)), p.gd(n, g, 2 * epochs, LR, pull=(lam, g)))
    assert sim.ledger.join_down_bytes == 4 * p.dim and sim.ledger.join_up_bytes == 0  # the model, once


def test_ifca_newcomer_picks_the_model_with_the_lowest_training_loss(problem):
    from truth import params_of

    p = problem
    sim = simulator(p, "ifca", steps=K, lr=LR, rounds=ROUNDS, newcomers__fraction=0.17, method__k=2)
    like = sim.method.models[0]
    sim.method.models = [params_of(np.zeros(p.dim), like), params_of(np.array([6.0, 3.0, 0.0]), like)]
    from pfl.federation.loop import RoundLoop

    RoundLoop(sim, []).run()
    n = sim.ctx.newcomers[0]
    losses = [p.loss(n, vec(m)) for m in sim.method.models]
    assert sim.method.cluster_assignment()[n] == int(np.argmin(losses))
    assert close(vec(sim.personal_params(n)), vec(sim.method.models[int(np.argmin(losses))]), 0.0)
    assert int(np.argmin(losses)) == TRUE[n]


def _cluster_of(found, n):
    """The members assigned with newcomer ``n``."""
    return sorted(c for c, lab in found.items() if lab == found[n] and c != n)


def test_cfl_newcomer_descends_the_split_tree_to_its_true_cluster(problem):
    sim, n, _ = _joined(problem, "cfl", rounds=12, method__eps1=0.5, method__eps2=0.5, method__start_round=2,
                        method__min_size=3)
    assert len(sim.method.clusters) == 2
    assert _cluster_of(sim.method.cluster_assignment(), n) == [c for c in range(6) if TRUE[c] == TRUE[n] and c != n]
    assert sim.join_result["newcomer/join_steps"] == 1


def test_pacfl_newcomer_joins_the_cluster_of_its_subspace():
    rs = np.random.RandomState(5)
    X, Y = [], []
    for c in TRUE:  # cluster 0 in span(e1, e2), cluster 1 in span(e3, e4): 0° within, 90° across
        x = np.zeros((25, 4))
        x[:, 2 * c:2 * c + 2] = rs.normal(size=(25, 2))
        X.append(x)
        Y.append(x @ np.array([1.0, -2.0, 3.0, 0.5]) + 0.2 * rs.normal(size=25))
    p = least_squares(sizes=(25,) * 6, d=4, clusters=TRUE).__class__(X, Y, np.array(TRUE))
    sim, n, _ = _joined(p, "pacfl", method__n_basis=2, method__angle="principal", method__beta=30.0)
    assert _cluster_of(sim.method.cluster_assignment(), n) == [c for c in range(6) if TRUE[c] == TRUE[n] and c != n]
    assert sim.ledger.join_up_bytes == 4 * 2 * 4  # one 4×2 float32 basis
    assert close(vec(sim.personal_params(n)), vec(sim.method.models[sim.method.labels[n]]), 0.0)


def test_fpfc_newcomer_reaches_stationarity_against_the_frozen_federation(problem):
    """Newcomer-only ADMM: min_w f_n(w) + (1/(|members|+1)) Σ_j P(‖w − w_j‖) with the members fixed
    (first-order conditions with the penalty's derivative; fused pairs may carry any force ≤ λ/m)."""
    p, lam, a = problem, 1.0, 3.7
    sim, n, _ = _joined(p, "fpfc", rounds=40, method__lam=lam, method__xi=0.0, newcomers__rounds=80,
                        newcomers__tol=0.0)
    W = sim.method.W.double().numpy()
    members = list(sim.ctx.members)
    m_eff = len(members) + 1
    r = p.grad(n, W[n])
    fused = 0
    for j in members:
        d = W[n] - W[j]
        t = np.linalg.norm(d)
        if t < 1e-4:
            fused += 1
            continue
        deriv = lam if t <= lam else (a * lam - t) / (a - 1) if t <= a * lam else 0.0
        r = r + deriv / m_eff * d / t
    assert np.linalg.norm(r) <= lam / m_eff * fused + 1e-4
    assert not close(W[n], p.local_opt(n), 1e-3)  # the federation did pull it
