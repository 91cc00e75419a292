"""Methods with one global model, against closed forms on a least-squares federation (tests/truth.py).

Every expected value is computed in numpy from the data: a closed-form optimum or fixed point, or
the paper's update rule written out again. Each test also checks that its truth separates the right
answer from a plausible wrong one (e.g. FedAvg's drifted fixed point from the joint optimum), so a
method that dropped its correction would fail.
"""

import numpy as np
import pytest

from truth import affine_fixed_point, close, least_squares, run_rounds, simulator, vec

LR, K = 0.2, 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(clusters=[0, 1, 2, 3])  # every client its own β: strong drift


def _sample_weights(p, clients=None):
    clients = range(p.m) if clients is None else clients
    n = np.array([p.n(i) for i in clients], dtype=float)
    return n / n.sum()


def _fedavg_map(p, weights, steps=K, lr=LR, pull=0.0):
    return lambda th: sum(w * p.gd(i, th, steps, lr, pull=(pull, th) if pull else None)
                          for i, w in zip(range(p.m), weights))


# ---- FedAvg, FedProx, FedAvg-FT, Local ------------------------------------------------------------

def test_fedavg_one_round_and_fixed_point(problem):
    p = problem
    sim = simulator(p, "fedavg", steps=K, lr=LR, method__server_lr=0.5)
    w0 = vec(sim.method.global_model)
    run_rounds(sim, 1)
    avg = _fedavg_map(p, _sample_weights(p))(w0)
    assert close(vec(sim.method.global_model), w0 + 0.5 * (avg - w0))
    # many rounds: the fixed point of θ ↦ Σ p_i GD_K^i(θ) — which is not the joint optimum (client drift)
    sim = simulator(p, "fedavg", steps=K, lr=LR)
    run_rounds(sim, 80)
    fixed = affine_fixed_point(_fedavg_map(p, _sample_weights(p)), p.dim)
    assert close(vec(sim.method.global_model), fixed, 1e-5)
    assert not close(fixed, p.joint_opt(range(p.m), _sample_weights(p)), 1e-3)


def test_fedavg_uniform_weighting_and_partial_participation(problem):
    p = problem
    sim = simulator(p, "fedavg", steps=K, lr=LR, per_round=2, method__weighting="uniform")
    w0 = vec(sim.method.global_model)
    sampled = sim.sample(0)
    run_rounds(sim, 1)
    expected = sum(p.gd(i, w0, K, LR) for i in sampled) / 2
    assert close(vec(sim.method.global_model), expected)


@pytest.mark.parametrize("mu", [1.0, 2.0])
def test_fedprox_fixed_point_has_the_proximal_pull(problem, mu):
    p = problem
    sim = simulator(p, "fedprox", steps=K, lr=LR, method__mu=mu)
    w0 = vec(sim.method.global_model)
    run_rounds(sim, 1)
    assert close(vec(sim.method.global_model), _fedavg_map(p, _sample_weights(p), pull=mu)(w0))
    run_rounds(sim, 79)
    fixed = affine_fixed_point(_fedavg_map(p, _sample_weights(p), pull=mu), p.dim)
    assert close(vec(sim.method.global_model), fixed, 1e-5)
    assert not close(fixed, affine_fixed_point(_fedavg_map(p, _sample_weights(p)), p.dim), 1e-3)


def test_fedavg_ft_evaluates_the_fine_tuned_global_model(problem):
    p = problem
    sim = simulator(p, "fedavg_ft", steps=K, lr=LR, method__ft_epochs=4)
    run_rounds(sim, 2)
    glob = vec(sim.method.global_model)
    for cid in (0, 3):
        # ft_epochs full-batch epochs = 4 steps on the client's own loss, from the global model
        assert close(vec(sim.personal_params(cid)), p.gd(cid, glob, 4, LR))
    assert not close(vec(sim.personal_params(0)), glob, 1e-3)


def test_local_reaches_each_clients_least_squares_solution(problem):
    p = problem
    sim = simulator(p, "local", steps=K, lr=LR)
    w0 = vec(sim.client_role.init)
    run_rounds(sim, 2)
    assert close(vec(sim.personal_params(1)), p.gd(1, w0, 2 * K, LR))
    run_rounds(sim, 100)
    for cid in range(p.m):
        assert close(vec(sim.personal_params(cid)), p.local_opt(cid), 1e-5)
    assert sim.ledger.up_bytes == 0 and sim.ledger.down_bytes == 0


# ---- FedOpt: the server optimisers of Reddi et al. (and FedAvgM) -----------------------------------

@pytest.mark.parametrize("name, v_init", [("fedadam", "zero"), ("fedadagrad", "zero"), ("fedyogi", "zero"),
                                          ("fedavgm", "zero"), ("fedadam", "tau2"), ("fedyogi", "tau2")])
def test_fedopt_server_rule_over_three_rounds(problem, name, v_init):
    p = problem
    sim = simulator(p, name, steps=K, lr=LR, method__v_init=v_init, method__tau=0.05)
    hp = sim.method.hp
    theta = vec(sim.method.global_model)
    m = np.zeros_like(theta)
    v = np.full_like(theta, hp.tau ** 2 if v_init == "tau2" else 0.0)  # the paper's v₋₁ = τ²
    local_avg = _fedavg_map(p, _sample_weights(p))
    for _ in range(3):
        delta = local_avg(theta) - theta
        if name == "fedavgm":
            m = hp.beta1 * m + delta
            theta = theta + hp.server_lr * m
            continue
        m = hp.beta1 * m + (1 - hp.beta1) * delta
        if name == "fedadam":
            v = hp.beta2 * v + (1 - hp.beta2) * delta ** 2
        elif name == "fedadagrad":
            v = v + delta ** 2
        else:  # Yogi: v − (1 − β2)Δ² sign(v − Δ²)
            v = v - (1 - hp.beta2) * delta ** 2 * np.sign(v - delta ** 2)
        theta = theta + hp.server_lr * m / (np.sqrt(v) + hp.tau)
    run_rounds(sim, 3)
    assert close(vec(sim.method.global_model), theta, 1e-5)


# ---- SCAFFOLD and FedDyn: drift corrections that reach the joint optimum ----------------------------

def test_scaffold_reaches_the_joint_optimum_where_fedavg_drifts(problem):
    p = problem
    sim = simulator(p, "scaffold", steps=K, lr=LR)
    run_rounds(sim, 100)
    x_star = p.joint_opt(range(p.m))  # (1/N) Σ f_i: SCAFFOLD's mean is unweighted
    assert close(vec(sim.method.global_model), x_star, 1e-5)
    assert not close(affine_fixed_point(_fedavg_map(p, np.full(p.m, 1 / p.m)), p.dim), x_star, 1e-3)


@pytest.mark.parametrize("steps", [1, 3])
def test_scaffold_one_round_with_partial_participation_by_hand(problem, steps):
    p, eta_g, K = problem, 0.7, steps
    sim = simulator(p, "scaffold", steps=K, lr=LR, per_round=2, method__server_lr=eta_g)
    theta = vec(sim.method.global_model)
    sampled = sim.sample(0)
    run_rounds(sim, 1)
    # c = c_k = 0 in round 0: plain GD; c_k⁺ = (θ − y_K)/(Kη); θ += η_g mean Δy; c += (|S|/N) mean Δc
    ys = {i: p.gd(i, theta, K, LR) for i in sampled}
    cs = {i: (theta - ys[i]) / (K * LR) for i in sampled}
    assert close(vec(sim.method.global_model), theta + eta_g * sum(ys[i] - theta for i in sampled) / 2)
    assert close(vec(sim.method.c), (2 / p.m) * sum(cs.values()) / 2)
    for i in sampled:
        assert close(vec(sim.client_states[i]["c"]), cs[i])
    # round 1: the corrected steps y ← y − η(∇f_i(y) + c − c_i)
    theta1, c = vec(sim.method.global_model), vec(sim.method.c)
    sampled1 = sim.sample(1)
    run_rounds(sim, 1)
    step = {i: p.gd(i, theta1, K, LR, shift=c - cs.get(i, np.zeros_like(c))) for i in sampled1}
    assert close(vec(sim.method.global_model), theta1 + eta_g * sum(step[i] - theta1 for i in sampled1) / 2)


def test_feddyn_reaches_the_joint_optimum(problem):
    p, alpha = problem, 0.5
    sim = simulator(p, "feddyn", steps=K, lr=LR, method__alpha=alpha)
    run_rounds(sim, 100)
    x_star = p.joint_opt(range(p.m))
    assert close(vec(sim.method.global_model), x_star, 1e-4)


def test_feddyn_one_round_with_partial_participation_by_hand(problem):
    p, alpha = problem, 0.5
    sim = simulator(p, "feddyn", steps=K, lr=LR, per_round=2, method__alpha=alpha)
    theta = vec(sim.method.global_model)
    sampled = sim.sample(0)
    run_rounds(sim, 1)
    # g_k = 0 at first: minimise f_k(w) + (α/2)‖w − θ‖²; g_k ← −α(θ_k − θ); h ← h − α(1/N)Σ(θ_k − θ)
    ws = {i: p.gd(i, theta, K, LR, pull=(alpha, theta)) for i in sampled}
    h = -alpha * sum(ws[i] - theta for i in sampled) / p.m
    assert close(vec(sim.method.h), h)
    assert close(vec(sim.method.global_model), sum(ws.values()) / 2 - h / alpha)
    for i in sampled:
        assert close(vec(sim.client_states[i]["g"]), -alpha * (ws[i] - theta))
    # round 1: the local objective gains −⟨g_k, w⟩ (a shift of −g_k in the gradient)
    theta1 = vec(sim.method.global_model)
    g = {i: vec(sim.client_states[i]["g"]) if "g" in sim.client_states[i] else np.zeros(p.dim) for i in range(p.m)}
    sampled1 = sim.sample(1)
    run_rounds(sim, 1)
    ws1 = {i: p.gd(i, theta1, K, LR, pull=(alpha, theta1), shift=-g[i]) for i in sampled1}
    h1 = h - alpha * sum(ws1[i] - theta1 for i in sampled1) / p.m
    assert close(vec(sim.method.global_model), sum(ws1.values()) / 2 - h1 / alpha)


def test_feddyn_clips_the_corrected_gradient(problem):
    """max_grad_norm: every step's ∇f_k + α(w − θ) − g_k is scaled to global norm ≤ c."""
    p, alpha, c = problem, 0.5, 0.8
    sim = simulator(p, "feddyn", steps=K, lr=LR, method__alpha=alpha, method__max_grad_norm=c)
    theta = vec(sim.method.global_model)
    run_rounds(sim, 1)
    ws, clipped = [], 0
    for i in range(p.m):
        w = theta.copy()
        for _ in range(K):
            g = p.grad(i, w) + alpha * (w - theta)
            norm = np.linalg.norm(g)
            clipped += norm > c
            w = w - LR * (g * min(1.0, c / norm))
        ws.append(w)
    assert clipped > 0  # the clip is active in this example
    h = -alpha * sum(w - theta for w in ws) / p.m
    assert close(vec(sim.method.global_model), sum(ws) / p.m - h / alpha)
