"""The seminar's compression and communication-skipping methods (DIANA, ADIANA, MARINA, LAG, FedPD,
FedSplit, L2GD) on their own classes against numpy truths on a least-squares federation
(tests/truth.py). Compression is the identity here, so the tests do not depend on any codec: they
check the algorithms' server and client rules and their optima. Issue 25 ("the wire") adds the
compressed cases."""

import numpy as np
import pytest

from truth import affine_fixed_point, close, least_squares, run_rounds, simulator, vec

LR, K = 0.2, 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(clusters=[0, 1, 2, 3])


def _weights(p, uniform=False):
    n = np.ones(p.m) if uniform else np.array([p.n(i) for i in range(p.m)], dtype=float)
    return n / n.sum()


def test_diana_shifts_momentum_and_fixed_point_with_the_identity_compressor(problem):
    """Δ̂_i = h_i + C(Δ_i − h_i) = Δ_i; h_i ← h_i + α(Δ_i − h_i); v ← βv + Σp_iΔ̂_i; x ← x + η_g v."""
    p, alpha, beta, eta_g = problem, 0.5, 0.3, 0.8
    sim = simulator(p, "diana", steps=K, lr=LR, compression__uplink__name="identity", method__alpha=alpha,
                    method__momentum=beta, method__server_lr=eta_g)
    x = vec(sim.method.global_model)
    h = np.zeros((p.m, p.dim))
    v = np.zeros(p.dim)
    for _ in range(3):
        deltas = np.array([p.gd(i, x, K, LR) - x for i in range(p.m)])
        h = h + alpha * (deltas - h)
        v = beta * v + _weights(p) @ deltas
        x = x + eta_g * v
    run_rounds(sim, 3)
    assert close(vec(sim.method.global_model), x)
    assert close(vec(sim.method.h_mean), _weights(p) @ h)
    for i in range(p.m):
        assert close(vec(sim.client_states[i]["h"]), h[i])
    plain = simulator(p, "diana", steps=K, lr=LR, compression__uplink__name="identity")
    run_rounds(plain, 80)
    fixed = affine_fixed_point(lambda th: sum(w * p.gd(i, th, K, LR) for i, w in enumerate(_weights(p))), p.dim)
    assert close(vec(plain.method.global_model), fixed, 1e-5)


def test_adiana_reaches_the_joint_optimum_with_the_identity_compressor(problem):
    p = problem
    sim = simulator(p, "adiana", steps=1, lr=0.1, compression__uplink__name="identity")
    run_rounds(sim, 150)
    assert close(vec(sim.method.y), p.joint_opt(range(p.m)), 1e-5)  # the box's f = (1/N)Σ f_i


def test_marina_with_the_identity_is_gradient_descent_on_the_mean_loss(problem):
    """Exact differences make g^k = ∇f(x^k), so x^{k+1} = x^k − γ∇f(x^k) with γ = lr (ω = 0)."""
    p = problem
    sim = simulator(p, "marina", lr=LR, compression__uplink__name="identity", method__p=0.3)
    grad = lambda x: sum(p.grad(i, x) for i in range(p.m)) / p.m  # noqa: E731
    x = vec(sim.method.x)
    run_rounds(sim, 6)
    for _ in range(5):  # round 0 only collects g⁰
        x = x - LR * grad(x)
    assert close(vec(sim.method.x), x) and close(vec(sim.method.g), grad(x))
    assert 1 <= sim.method.full_rounds < 6
    run_rounds(sim, 100)
    assert close(vec(sim.method.x), p.joint_opt(range(p.m)), 1e-5)


@pytest.mark.parametrize("eta", [1.0, 0.5])
def test_lag_skip_rule_and_stored_updates_by_hand(problem, eta):
    """A client skips when ‖Δ_i − Δ̂_i‖² ≤ (ξ/D)Σ of the last D squared model movements / η_g²; the
    server then reuses its stored Δ̂_i and steps x ← x + η_g(avg − x)."""
    p, xi, D = problem, 0.6, 2
    sim = simulator(p, "lag", steps=K, lr=0.05, method__xi=xi, method__history=D, method__server_lr=eta)
    x = vec(sim.method.global_model)
    stored: dict[int, np.ndarray] = {}
    movements: list[float] = []
    skips = 0
    for _ in range(8):
        thr = xi / D * sum(movements[-D:]) / eta**2
        used = []
        for i in range(p.m):
            delta = p.gd(i, x, K, 0.05) - x
            if i in stored and np.sum((delta - stored[i]) ** 2) <= thr:
                skips += 1
            else:
                stored[i] = delta
            used.append(x + stored[i])
        new = x + eta * (sum(w * u for w, u in zip(_weights(p), used)) - x)
        movements.append(float(np.sum((new - x) ** 2)))
        x = new
    run_rounds(sim, 8)
    assert 0 < skips < 8 * p.m - p.m       # some, not all, later uploads were skipped
    assert sim.method.skips == skips
    assert close(vec(sim.method.global_model), x, 1e-4)


def test_fedpd_reaches_the_joint_optimum(problem):
    p = problem
    sim = simulator(p, "fedpd", steps=K, lr=LR, method__eta=0.5)
    run_rounds(sim, 120)
    assert close(vec(sim.method.x0), p.joint_opt(range(p.m)), 1e-5)  # min Σ f_i, unlike FedAvg
    fedavg = affine_fixed_point(lambda th: sum(p.gd(i, th, K, LR) for i in range(p.m)) / p.m, p.dim)
    assert not close(fedavg, p.joint_opt(range(p.m)), 1e-3)


def test_fedsplit_one_round_by_hand(problem):
    """v = 2x̄ − z, z½ = prox_{s f}(v) = (A + I/s)⁻¹(b + v/s) (many accurate steps), z ← z + 2(z½ − x̄)."""
    p, s = problem, 0.5
    sim = simulator(p, "fedsplit", steps=25, lr=LR, method__s=s)
    xbar = vec(sim.method.xbar)
    z = [xbar.copy() for _ in range(p.m)]
    for _ in range(2):
        halves = [np.linalg.solve(p.A(i) + np.eye(p.dim) / s, p.b(i) + (2 * xbar - z[i]) / s) for i in range(p.m)]
        z = [z[i] + 2 * (halves[i] - xbar) for i in range(p.m)]
        xbar = sum(z) / p.m
    run_rounds(sim, 2)
    assert close(vec(sim.method.xbar), xbar, 1e-4)
    assert close(vec(sim.client_states[1]["z"]), z[1], 1e-4)


def test_fedpd_one_round_by_hand(problem):
    """K steps on f_i + ⟨λ_i, x − x₀⟩ + ‖x − x₀‖²/(2η) from x_i; λ_i += (x_i − x₀)/η; x₀ = mean(x_i + ηλ_i)."""
    p, eta = problem, 0.5
    sim = simulator(p, "fedpd", steps=K, lr=LR, method__eta=eta)
    x0 = vec(sim.method.x0)
    x = [x0.copy() for _ in range(p.m)]
    lam = [np.zeros(p.dim) for _ in range(p.m)]
    for _ in range(2):
        x = [p.gd(i, x[i], K, LR, pull=(1 / eta, x0), shift=lam[i]) for i in range(p.m)]
        lam = [lam[i] + (x[i] - x0) / eta for i in range(p.m)]
        x0 = sum(x[i] + eta * lam[i] for i in range(p.m)) / p.m
    run_rounds(sim, 2)
    assert close(vec(sim.method.x0), x0)
    assert close(vec(sim.client_states[2]["lam"]), lam[2])


def test_fedsplit_with_accurate_proximal_steps_reaches_the_joint_optimum(problem):
    p = problem
    sim = simulator(p, "fedsplit", steps=20, lr=LR, method__s=0.5)
    run_rounds(sim, 30)
    assert close(vec(sim.method.xbar), p.joint_opt(range(p.m)), 1e-4)


def test_l2gd_two_rounds_of_local_and_averaging_steps_by_hand(problem):
    """B_t local steps (lr β), then x̄ = mean x_i and A_t averaging steps x̄ + (1 − γ)^A (x_i − x̄),
    γ = λβ(1 − p)/p; the counts are the shared geometric coins of the round."""
    p, lam, prob = problem, 0.5, 0.3
    sim = simulator(p, "l2gd", lr=LR, method__lam=lam, method__p=prob)
    gamma = lam * LR * (1 - prob) / prob
    x = np.array([vec(sim.method.init)] * p.m)
    counts = []
    for rnd in range(2):
        rng = sim.ctx.rng(rnd, "l2gd")
        B, A = int(rng.geometric(prob)), int(rng.geometric(1 - prob))
        counts.append((B, A))
        x = np.array([p.gd(i, x[i], B, LR) for i in range(p.m)])
        xbar = x.mean(0)
        run_rounds(sim, 1)
        assert close(vec(sim.method.xbar), xbar)
        x = xbar + (1 - gamma) ** A * (x - xbar)   # applied at the start of the next round
    for i in range(p.m):
        assert close(vec(sim.personal_params(i)), x[i])
    assert sim.method.local_steps == sum(b for b, _ in counts)
