"""FedSLR, FedALA and PerFed-CKT against truths computed in numpy (tests/truth.py).

FedSLR's Phase I is a proximal method whose fixed point is the minimiser of a composite objective,
found here by a second, plain implementation (ISTA); its Phase II is a lasso, solved the same way.
FedALA's learned weights solve a box-constrained quadratic, solved here exactly by enumerating the
active sets. PerFed-CKT's client step and server centroids are written out in numpy on digits.
"""

import dataclasses
import itertools

import numpy as np
import pytest

from truth import close, least_squares, mlp_grads, numpy_params, run_rounds, simulator, softmax, vec

LR, K = 0.2, 3


def ista(grad, prox, x0, step, iters=5000):
    x = np.array(x0, dtype=float)
    for _ in range(iters):
        x = prox(x - step * grad(x), step)
    return x


# ---- FedSLR --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def problem():
    return least_squares(clusters=[0, 0, 1, 1])


def test_fedslr_phase_one_reaches_the_nuclear_norm_regularised_optimum(problem):
    """Fixed point: argmin (1/n)Σ f_i(w) + (ω/2)‖w‖² + λ‖W‖_* — for the 1×d weight the nuclear norm
    is its Euclidean norm (the bias is not thresholded)."""
    p, lam, eta, omega = problem, 0.3, 2.0, 1e-3
    sim = simulator(p, "fedslr", steps=K, lr=LR, method__lam=lam, method__eta=eta, method__weight_decay=omega,
                    method__phase2_epochs=0)
    d = p.dim - 1

    def prox(z, s):
        z = z.copy()
        norm = np.linalg.norm(z[:d])
        z[:d] *= max(0.0, 1 - s * lam / norm)
        return z

    smooth = lambda w: sum(p.grad(i, w) for i in range(p.m)) / p.m + omega * w  # noqa: E731
    optimum = ista(smooth, prox, np.zeros(p.dim), 0.1)
    run_rounds(sim, 100)
    assert close(vec(sim.method.global_model), optimum, 1e-5)
    assert not close(optimum, p.joint_opt(range(p.m)), 1e-2)  # λ matters
    assert sim.method.ranks()["fc.weight"] == (1, 1)


def test_fedslr_phase_two_personal_part_is_the_lasso_solution(problem):
    """Many Phase II epochs: P_i = argmin f_i(w^t + P) + μ‖P‖₁ + (ω₂/2)‖P‖² around the received GKR."""
    p, mu, omega2 = problem, 0.4, 1e-3
    sim = simulator(p, "fedslr", steps=K, lr=LR, method__lam=0.0, method__eta=2.0, method__mu=mu,
                    method__phase2_epochs=400, method__phase2_weight_decay=omega2)
    run_rounds(sim, 1)
    received = vec(sim.method.global_model)  # the GKR the next round sends
    run_rounds(sim, 1)
    soft = lambda z, s: np.sign(z) * np.maximum(np.abs(z) - s * mu, 0.0)  # noqa: E731
    zeros = 0
    for i in range(p.m):
        expected = ista(lambda P, i=i: p.grad(i, received + P) + omega2 * P, soft, np.zeros(p.dim), LR, 3000)
        got = vec(sim.client_states[i]["P"])
        assert close(got, expected, 1e-4)
        zeros += int((np.abs(expected) < 1e-12).sum())
        assert close(vec(sim.personal_params(i)), vec(sim.method.global_model) + got, 1e-5)
    assert zeros > 0  # μ is large enough that the lasso has exact zeros (and so must the method)


# ---- FedALA --------------------------------------------------------------------------------------

def box_qp(H, g0, W_at):
    """argmin_{W ∈ [0,1]^d} ½WᵀHW + (g0 − H·W_at)ᵀW by trying every active set (d small)."""
    d = len(g0)
    best, best_val = None, np.inf
    lin = g0 - H @ W_at
    for pattern in itertools.product((0, 1, 2), repeat=d):
        W = np.array([float(c) if c < 2 else 0.0 for c in pattern])
        free = [k for k, c in enumerate(pattern) if c == 2]
        if free:
            fixed = [k for k in range(d) if k not in free]
            rhs = -(lin[free] + H[np.ix_(free, fixed)] @ W[fixed])
            W[free] = np.linalg.solve(H[np.ix_(free, free)], rhs)
        if (W < -1e-12).any() or (W > 1 + 1e-12).any():
            continue
        val = 0.5 * W @ H @ W + lin @ W
        if val < best_val:
            best, best_val = W, val
    return best


def test_fedala_start_phase_learns_the_box_optimal_mix_and_training_starts_there():
    """θ̂ = θ_i + (θ − θ_i)⊙W with W = argmin_{[0,1]^d} f_i(θ̂(W)) (p = all, s = 100 %, full batch)."""
    p = least_squares(clusters=[0, 1, 2, 3], seed=3)
    sim = simulator(p, "fedala", steps=K, lr=LR, method__p=0, method__s=100.0, method__threshold=1e-8,
                    method__window=10, method__ala_max_epochs=4000)
    run_rounds(sim, 1)  # no local model yet: ALA is skipped, every client trains from θ⁰
    theta = vec(sim.method.global_model)
    starts, mixes = {}, []
    for i in range(p.m):
        local = vec(sim.client_states[i]["ala"]["local"])
        D = theta - local
        H = np.diag(D) @ p.A(i) @ np.diag(D)
        g_at_local = np.diag(D) @ p.grad(i, local)        # gradient in W at W = 0
        W = box_qp(H, g_at_local, np.zeros(p.dim))
        starts[i] = local + D * W
        mixes.extend(W)
        # the learning rate of W must be below 2/L of this quadratic; ALA's own loop is then a projected GD
        sim.set_hparams(dataclasses.replace(sim.method.hp, eta=1.0 / np.linalg.eigvalsh(H).max()))
        assert close(vec(sim.personal_params(i)), starts[i], 1e-4)
    assert any(0 < w < 1 for w in mixes) and any(w in (0.0, 1.0) for w in mixes)  # inner and boundary optima
    # round 1 trains from θ̂ (the evaluation-time ALA is reused) and FedAvg averages the results
    n = np.array([p.n(i) for i in range(p.m)], dtype=float)
    expected = sum(w * p.gd(i, starts[i], K, LR) for i, w in zip(range(p.m), n / n.sum()))
    run_rounds(sim, 1)
    assert close(vec(sim.method.global_model), expected, 1e-4)


# ---- PerFed-CKT ----------------------------------------------------------------------------------

def _ckt_sim(lam, temperature):
    from pfl.resolver import load
    from pfl.federation.simulator import Simulator

    cfg = load(None, {"method.name": "perfed_ckt", "method.architectures": ["softmax_regression"],
                      "method.k": 2, "method.lam": lam, "method.temperature": temperature,
                      "method.public_size": 40, "model.name": "softmax_regression", "data.source": "digits",
                      "data.num_clients": 4, "data.max_samples": 400, "data.partition.kind": "dirichlet",
                      "data.partition.alpha": 0.3, "federation.batch_size": 0, "federation.local_steps": K,
                      "federation.lr": 0.5, "federation.clients_per_round": 0, "federation.eval_every": 1000,
                      "tracking.enabled": False, "data.cache": False})
    return Simulator(cfg)


def test_perfed_ckt_round_of_distillation_towards_the_cluster_centroid():
    lam, T, lr = 0.7, 2.0, 0.5
    sim = _ckt_sim(lam, T)
    x_pub = sim.method.public.x.double().numpy()
    data = [(c.x_train.double().numpy(), c.y_train.numpy()) for c in sim.data.clients]
    params = {i: numpy_params(sim.client_states[i]["params"]) for i in range(4)}

    def train(i, target):
        prm = dict(params[i])
        X, y = data[i]
        for _ in range(K):
            if target is not None:  # λ·T²·KL(softmax(μ/T) ‖ softmax(s/T)), mean over the public rows
                s = x_pub @ prm["fc.weight"].T + prm["fc.bias"]
                dz = lam * T * (softmax(s / T) - softmax(target / T)) / len(x_pub)
            g = mlp_grads(prm, X, y, None)
            if target is not None:
                g = {"fc.weight": g["fc.weight"] + dz.T @ x_pub, "fc.bias": g["fc.bias"] + dz.sum(0)}
            prm = {k: prm[k] - lr * g[k] for k in prm}
        params[i] = prm
        return x_pub @ prm["fc.weight"].T + prm["fc.bias"]

    logits = {i: train(i, None) for i in range(4)}   # round 0: no centroid yet, plain cross-entropy
    run_rounds(sim, 1)
    for i in range(4):
        np.testing.assert_allclose(sim.method.logits[i].double().numpy(), logits[i], rtol=1e-4, atol=1e-4)
    # k-means with K = 2 on four points: the partition with the least within-cluster sum of squares
    flat = {i: logits[i].ravel() for i in range(4)}
    def sse(groups):  # noqa: E306
        return sum(sum(np.sum((flat[i] - np.mean([flat[j] for j in g], 0)) ** 2) for i in g) for g in groups)
    splits = [(list(a), [i for i in range(4) if i not in a]) for r in (1, 2) for a in itertools.combinations(range(4), r)]
    best = min(splits, key=sse)
    labels = sim.method.assign.tolist()
    assert sorted(sorted(i for i in range(4) if labels[i] == c) for c in set(labels)) == sorted(map(sorted, best))
    centroid = {i: np.mean([logits[j] for j in range(4) if labels[j] == labels[i]], 0) for i in range(4)}
    new_logits = {i: train(i, centroid[i]) for i in range(4)}  # round 1: CE + λ·ρ towards the centroid
    run_rounds(sim, 1)
    for i in range(4):
        got = numpy_params(sim.personal_params(i))
        for k in got:
            np.testing.assert_allclose(got[k], params[i][k], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(sim.method.logits[i].double().numpy(), new_logits[i], rtol=1e-4, atol=1e-4)
