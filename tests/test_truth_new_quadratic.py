"""FedAMP and FedNova on least-squares federations (tests/truth.py), against their papers' rules in
numpy: FedAMP's attention weights, cloud models and proximal local solves over rounds of partial
participation; FedNova's normalised averaging with minibatches of unequal counts (so local steps
differ), heavy-ball momentum and a proximal local solver, and the closed forms of ‖a‖₁. Each test
shows that its truth separates the method from a plausible wrong variant."""

import numpy as np
import pytest
import torch

from truth import close, least_squares, run_rounds, simulator, vec

LR, K = 0.1, 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(sizes=(20, 30, 24, 27, 13), clusters=[0, 0, 1, 1, 0])


# ---- FedAMP ---------------------------------------------------------------------------------------

def fedamp(p, theta0, schedule, alpha, lam, sigma, squared=True, pull=None):
    """Rounds of FedAMP by hand; ``schedule`` lists each round's sampled clients. Returns the server's
    stored models and the clients' personal models."""
    stored, personal = {}, {}
    pull = lam / alpha if pull is None else pull
    for sampled in schedule:
        clouds = {}
        for k in sampled:
            own = stored.get(k, theta0)
            xi = {}
            for j, w_j in stored.items():
                if j != k:
                    dist = np.sum((own - w_j) ** 2) if squared else np.linalg.norm(own - w_j)
                    xi[j] = alpha * np.exp(-dist / sigma) / sigma
            clouds[k] = (1 - sum(xi.values())) * own + sum(x * stored[j] for j, x in xi.items())
        for k in sampled:   # the server answers every sampled client from the same stored models
            personal[k] = p.gd(k, clouds[k], K, LR, pull=(pull, clouds[k]))
            stored[k] = personal[k]
    return stored, personal


def test_fedamp_attention_cloud_models_and_proximal_steps_under_sampling(problem):
    p, alpha, lam, sigma = problem, 0.3, 0.6, 20.0
    sim = simulator(p, "fedamp", steps=K, lr=LR, per_round=3, method__alpha=alpha, method__lam=lam,
                    method__sigma=sigma)
    theta0 = vec(sim.client_role.init)
    schedule = [sorted(sim.sample(r)) for r in range(4)]
    assert len(set().union(*schedule)) == p.m   # everybody reported by the end
    stored, personal = fedamp(p, theta0, schedule, alpha, lam, sigma)
    run_rounds(sim, 4)
    for j, w in stored.items():
        assert close(sim.method.models[j].double().numpy(), w)
    for i in range(p.m):
        assert close(vec(sim.personal_params(i)), personal[i])
    # the attention matters here, and so do the squared distance and the pull's λ/α
    for wrong in (dict(alpha=1e-9, pull=lam / alpha), dict(squared=False), dict(pull=lam)):
        kw = {**dict(alpha=alpha, lam=lam, sigma=sigma), **wrong}
        _, other = fedamp(p, theta0, schedule, **kw)
        assert max(np.abs(other[i] - personal[i]).max() for i in range(p.m)) > 1e-3, wrong


def test_fedamp_self_weight_is_one_minus_the_attention_to_others(problem):
    p, alpha, sigma = problem, 0.2, 50.0
    sim = simulator(p, "fedamp", steps=K, lr=LR, method__alpha=alpha, method__lam=0.2, method__sigma=sigma,
                    federation__eval_every=1)
    run_rounds(sim, 1)
    W = {j: w.double().numpy() for j, w in sim.method.models.items()}
    expected = np.mean([1 - sum(alpha * np.exp(-np.sum((W[k] - W[j]) ** 2) / sigma) / sigma for j in W if j != k)
                        for k in W])
    sim.method.begin_round(1, list(range(p.m)))
    assert sim.method.extra_metrics(1)["fedamp/self_weight"] == pytest.approx(expected, rel=1e-5)


# ---- FedNova --------------------------------------------------------------------------------------

def test_update_weight_matches_the_papers_closed_forms():
    from pfl.methods.fednova import update_weight

    for tau in (1, 2, 7):
        assert update_weight(tau, 0.1) == pytest.approx(tau)
        rho = 0.6
        momentum_form = (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)
        assert update_weight(tau, 0.1, momentum=rho) == pytest.approx(momentum_form)
        eta, mu = 0.1, 2.0
        assert update_weight(tau, eta, mu=mu) == pytest.approx((1 - (1 - eta * mu) ** tau) / (eta * mu))
    assert update_weight(5, 0.1, momentum=0.6) != pytest.approx(5.0)   # momentum is not plain SGD


def minibatch_sgd(p, i, w, perms, batch, lr, rho, mu):
    """Client i's local SGD by hand on the given epochs' orders, with heavy-ball momentum ρ and a pull
    μ(w − start); returns the model and the number of steps."""
    Z, y = p.design(i), p.y[i]
    start, w, buf, steps = w.copy(), w.copy(), None, 0
    for perm in perms:
        for s in range(0, len(y), batch):
            rows = perm[s:s + batch]
            g = 2.0 / len(rows) * Z[rows].T @ (Z[rows] @ w - y[rows]) + mu * (w - start)
            buf = g if buf is None else rho * buf + g
            w = w - lr * buf
            steps += 1
    return w, steps


def a_norm(tau, lr, rho, mu):
    if mu:
        return (1 - (1 - lr * mu) ** tau) / (lr * mu)
    return (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho) if rho else float(tau)


@pytest.mark.parametrize("rho, mu, eta_g", [(0.0, 0.0, 1.0), (0.5, 0.0, 0.7), (0.0, 0.8, 1.0)])
def test_fednova_normalised_average_with_unequal_local_steps(problem, rho, mu, eta_g):
    p, batch = problem, 8
    sim = simulator(p, "fednova", lr=LR, steps=0, federation__local_steps=None, federation__local_epochs=1,
                    federation__batch_size=batch, federation__momentum=rho, method__mu=mu, method__server_lr=eta_g)
    x = vec(sim.method.global_model)
    for rnd in range(2):
        ys, taus, n = {}, {}, {}
        for i in range(p.m):
            gen = sim.client(i).generator(rnd)   # the minibatch order is an input: the client's own draw
            perms = [torch.randperm(p.n(i), generator=gen).numpy()]
            ys[i], taus[i] = minibatch_sgd(p, i, x, perms, batch, LR, rho, mu)
            n[i] = p.n(i)
        assert len(set(taus.values())) > 1   # unequal local steps: where FedNova and FedAvg part
        weights = np.array([n[i] for i in range(p.m)], dtype=float) / sum(n.values())
        a = {i: a_norm(taus[i], LR, rho, mu) for i in range(p.m)}
        tau_eff = sum(w * a[i] for w, i in zip(weights, range(p.m)))
        d = sum(w * (x - ys[i]) / a[i] for w, i in zip(weights, range(p.m)))
        fedavg = x + eta_g * (sum(w * ys[i] for w, i in zip(weights, range(p.m))) - x)
        x = x - eta_g * tau_eff * d
        assert np.abs(x - fedavg).max() > 1e-4   # the normalisation changes the step
        run_rounds(sim, 1)
        assert close(vec(sim.method.global_model), x)
        assert sim.method.tau_eff == pytest.approx(tau_eff)
    if rho or mu:   # normalising by the steps alone (the plain-SGD rule) is wrong here
        plain = sum(w * taus[i] for w, i in zip(weights, range(p.m)))
        assert abs(plain - tau_eff) > 0.1
