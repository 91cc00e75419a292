"""Personalised methods with a global model next to personal ones, against truths computed in numpy
(tests/truth.py): Ditto's proximal optimum, APFL's three simultaneous updates, Per-FedAvg's MAML
step, pFedMe's Moreau-envelope iterations, FedRep's and LG-FedAvg's partial sharing (the last two on
a one-hidden-layer classifier whose gradients are written out by hand)."""

import numpy as np
import pytest

from truth import (classification_data, close, config, least_squares, mlp_grads, numpy_params, run_rounds,
                   simulator, vec)

LR, K = 0.2, 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(clusters=[0, 1, 2, 3])


def _weights(p, clients):
    n = np.array([p.n(i) for i in clients], dtype=float)
    return n / n.sum()


# ---- Ditto ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("lam", [0.5, 4.0])
def test_ditto_personal_model_is_the_proximal_optimum_around_the_received_global(problem, lam):
    p = problem
    sim = simulator(p, "ditto", steps=K, lr=LR, method__lam=lam, method__personal_epochs=150)
    theta0 = vec(sim.method.global_model)
    run_rounds(sim, 1)
    for cid in range(p.m):
        # argmin_v f_i(v) + (λ/2)‖v − θ⁰‖²: (A_i + λI) v = b_i + λθ⁰ — centred at the *received* θ⁰
        expected = np.linalg.solve(p.A(cid) + lam * np.eye(p.dim), p.b(cid) + lam * theta0)
        personal = vec(sim.personal_params(cid))
        assert close(personal, expected, 1e-5)
        # the truth separates λ from "no pull" (the local optimum) and from "pull to the new global"
        assert not close(personal, p.local_opt(cid), 1e-2)
        new_global = vec(sim.method.global_model)
        assert not close(personal, np.linalg.solve(p.A(cid) + lam * np.eye(p.dim), p.b(cid) + lam * new_global), 1e-2)


def test_ditto_two_rounds_of_partial_participation_by_hand(problem):
    p, lam, epochs, plr = problem, 0.7, 2, 0.1
    sim = simulator(p, "ditto", steps=K, lr=LR, per_round=2, method__lam=lam, method__personal_epochs=epochs,
                    method__personal_lr=plr)
    theta = vec(sim.method.global_model)
    personal = {i: theta.copy() for i in range(p.m)}   # v_k starts at θ⁰
    for rnd in range(2):
        sampled = sim.sample(rnd)
        run_rounds(sim, 1)
        for i in sampled:
            personal[i] = p.gd(i, personal[i], epochs, plr, pull=(lam, theta))
        theta = sum(w * p.gd(i, theta, K, LR) for i, w in zip(sampled, _weights(p, sampled)))
        assert close(vec(sim.method.global_model), theta)
    for i in range(p.m):
        assert close(vec(sim.personal_params(i)), personal[i])


def test_ditto_lambda_zero_personal_model_is_the_local_optimum(problem):
    p = problem
    sim = simulator(p, "ditto", steps=K, lr=LR, method__lam=0.0, method__personal_epochs=150)
    run_rounds(sim, 1)
    for cid in range(p.m):
        assert close(vec(sim.personal_params(cid)), p.local_opt(cid), 1e-5)


# ---- APFL ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mix, adaptive", [("params", True), ("logits", True), ("params", False)])
def test_apfl_simultaneous_updates_of_w_v_and_alpha(problem, mix, adaptive):
    """For a linear model a mixture of outputs is the mixture of parameters, so both modes must give
    the paper's updates: w ← w − η∇f(w), v ← v − ηα∇f(v̄),
    α ← clip(α − η_α⟨v − w, ∇f(v̄)⟩ (+ cα))."""
    p, a0, a_lr, c = problem, 0.4, 0.3, 0.02
    sim = simulator(p, "apfl", steps=K, lr=LR, method__alpha=a0, method__alpha_lr=a_lr, method__alpha_l2=c,
                    method__mix=mix, method__adaptive=adaptive)
    theta = vec(sim.method.global_model)
    v = {i: theta.copy() for i in range(p.m)}
    alpha = {i: a0 for i in range(p.m)}
    for _ in range(2):
        replies = {}
        for i in range(p.m):
            w = theta.copy()
            for _ in range(K):
                vbar = alpha[i] * v[i] + (1 - alpha[i]) * w
                g_w, g_bar = p.grad(i, w), p.grad(i, vbar)
                new_alpha = float(np.clip(alpha[i] - a_lr * (np.dot(v[i] - w, g_bar) + c * alpha[i]), 0, 1))
                new_alpha = new_alpha if adaptive else alpha[i]
                v[i] = v[i] - LR * alpha[i] * g_bar
                w = w - LR * g_w
                alpha[i] = new_alpha
            replies[i] = w
        theta = sum(wt * replies[i] for i, wt in zip(range(p.m), _weights(p, range(p.m))))
    run_rounds(sim, 2)
    assert close(vec(sim.method.global_model), theta)
    for i in range(p.m):
        assert sim.client_states[i]["alpha"].item() == pytest.approx(alpha[i], abs=1e-5)
        assert close(vec(sim.client_states[i]["v"]), v[i])
    assert all((a != a0) == adaptive for a in alpha.values())  # α moved (clipped to [0, 1] for some), or not
    for i in (0, 2):
        personal = alpha[i] * v[i] + (1 - alpha[i]) * theta
        if mix == "params":
            assert close(vec(sim.personal_params(i)), personal)
        else:  # the mixture of the two models' outputs, evaluated through the method's forward
            client = sim.client(i)
            forward = sim.client_role.eval_forward(client)
            out = forward(sim.personal_params(i), client.data.x_test).detach().double().numpy()
            assert close(out, p.design(i) @ personal, 1e-5)


# ---- Per-FedAvg ----------------------------------------------------------------------------------

@pytest.mark.parametrize("variant, tol, budget", [("fo", 1e-5, 0), ("exact", 1e-5, 0), ("hf", 1e-3, 0),
                                                  ("hf", 1e-3, 6), ("fo", 1e-5, 6)])
def test_perfedavg_meta_steps_on_quadratics(problem, variant, tol, budget):
    """Full batches: w ← w − β(I − αA)∇f(w − α∇f(w)) (the Hessian term drops for fo); the personal
    model is one step of size α from the global model. ``budget``: no ``method.steps``, so a client
    takes local_steps // (batches per meta step) meta steps — 3 batches for hf, 2 for fo."""
    p, alpha, beta = problem, 0.1, 0.15
    steps = {0: 2, 6: 6 // (3 if variant == "hf" else 2)}[budget]
    sim = simulator(p, "perfedavg", steps=budget or K, lr=LR, method__variant=variant, method__alpha=alpha,
                    method__beta=beta, method__steps=0 if budget else steps)
    theta0 = vec(sim.method.global_model)

    def meta(hessian):
        replies = []
        for i in range(p.m):
            w = theta0.copy()
            for _ in range(steps):
                g = p.grad(i, w - alpha * p.grad(i, w))
                w = w - beta * (g - alpha * p.A(i) @ g if hessian else g)
            replies.append(w)
        return sum(wt * r for wt, r in zip(_weights(p, range(p.m)), replies))

    theta = meta(variant != "fo")
    run_rounds(sim, 1)
    assert close(vec(sim.method.global_model), theta, tol)
    assert not close(meta(variant == "fo"), theta, 1e-2)  # the Hessian term matters at this α
    for i in (1, 3):
        assert close(vec(sim.personal_params(i)), theta - alpha * p.grad(i, theta), tol)


# ---- pFedMe --------------------------------------------------------------------------------------

@pytest.mark.parametrize("local_iters", [2, 0])
def test_pfedme_inner_and_outer_iterations_and_server_mixing(problem, local_iters):
    """R = local_iters, or (0) the FedAvg budget: local_steps full-batch iterations."""
    p, lam, eta_p, inner, mu, beta = problem, 3.0, 0.05, 5, 1e-3, 0.5
    iters = local_iters or K
    sim = simulator(p, "pfedme", steps=K, lr=LR, method__lam=lam, method__personal_lr=eta_p,
                    method__inner_steps=inner, method__inner_weight_decay=mu, method__beta=beta,
                    method__local_iters=local_iters)
    theta = vec(sim.method.global_model)
    personal = {}
    for _ in range(2):
        ws = []
        for i in range(p.m):
            w, th = theta.copy(), theta.copy()
            for _ in range(iters):
                for _ in range(inner):  # θ ← θ − η_p(∇f(θ) + λ(θ − w) + μθ)
                    th = th - eta_p * (p.grad(i, th) + lam * (th - w) + mu * th)
                w = w - LR * lam * (w - th)
            personal[i] = th
            ws.append(w)
        theta = (1 - beta) * theta + beta * sum(wt * w for wt, w in zip(_weights(p, range(p.m)), ws))
    run_rounds(sim, 2)
    assert close(vec(sim.method.global_model), theta)
    for i in range(p.m):
        assert close(vec(sim.personal_params(i)), personal[i])


def test_pfedme_many_inner_steps_reach_the_moreau_prox_point(problem):
    p, lam = problem, 2.0
    sim = simulator(p, "pfedme", steps=K, lr=LR, method__lam=lam, method__personal_lr=0.15,
                    method__inner_steps=200, method__inner_weight_decay=0.0, method__local_iters=1)
    w0 = vec(sim.method.global_model)
    run_rounds(sim, 1)
    for i in range(p.m):
        prox = np.linalg.solve(p.A(i) + lam * np.eye(p.dim), p.b(i) + lam * w0)  # argmin f_i + (λ/2)‖θ − w⁰‖²
        assert close(vec(sim.personal_params(i)), prox, 1e-5)


# ---- FedRep and LG-FedAvg on a one-hidden-layer classifier -------------------------------------------

@pytest.fixture(scope="module")
def blobs():
    return classification_data()


def _classifier_sim(data, method, **kw):
    from pfl.federation.simulator import Simulator

    cfg = config(method, data.num_clients, steps=K, lr=0.3, source="digits", model="mlp",
                 model__params={"hidden": [5]}, **kw)
    return Simulator(cfg, data=data)


def _gd(p, X, y, names, steps, lr):
    p = dict(p)
    for _ in range(steps):
        g = mlp_grads(p, X, y)
        p = {k: (v - lr * g[k] if k in names else v) for k, v in p.items()}
    return p


def _avg(models, sizes, names):
    w = np.asarray(sizes, dtype=float) / sum(sizes)
    return {k: sum(wi * m[k] for wi, m in zip(w, models)) for k in names}


BODY, HEAD = ["fc1.weight", "fc1.bias"], ["fc.weight", "fc.bias"]


@pytest.mark.parametrize("body_epochs, eta_g", [(0, 1.0), (2, 0.5)])
def test_fedrep_head_then_body_and_the_body_average(blobs, body_epochs, eta_g):
    data, arrays = blobs
    sim = _classifier_sim(data, "fedrep", method__head_epochs=2, method__body_epochs=body_epochs,
                          method__server_lr=eta_g)
    glob = numpy_params(sim.method.global_model)
    heads = {i: {k: glob[k] for k in HEAD} for i in range(len(arrays))}   # own heads start at θ⁰
    sizes = [len(y) for _, y in arrays]
    for _ in range(2):
        bodies = []
        for i, (X, y) in enumerate(arrays):
            start = {**{k: glob[k] for k in BODY}, **heads[i]}
            after_head = _gd(start, X, y, HEAD, 2, 0.3)        # head epochs, body frozen
            after_body = _gd(after_head, X, y, BODY, body_epochs or K, 0.3)   # then body steps, head frozen
            heads[i] = {k: after_body[k] for k in HEAD}
            bodies.append(after_body)
        avg = _avg(bodies, sizes, BODY)
        glob.update({k: glob[k] + eta_g * (avg[k] - glob[k]) for k in BODY})
    run_rounds(sim, 2)
    for i in range(len(arrays)):
        personal = numpy_params(sim.personal_params(i))
        for k in BODY + HEAD:
            expected = glob[k] if k in BODY else heads[i][k]
            np.testing.assert_allclose(personal[k], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("warmup", [0, 1])
def test_lgfedavg_local_bodies_and_the_head_average(blobs, warmup):
    data, arrays = blobs
    sim = _classifier_sim(data, "lgfedavg", method__warmup_rounds=warmup)
    glob = numpy_params(sim.method.global_model)
    bodies = {i: {k: glob[k] for k in BODY} for i in range(len(arrays))}
    sizes = [len(y) for _, y in arrays]
    for rnd in range(3):
        trained = []
        for i, (X, y) in enumerate(arrays):
            # warm-up: FedAvg on the whole model; the first round after it starts from the server's whole model
            start = dict(glob) if warmup and rnd <= warmup else {**bodies[i], **{k: glob[k] for k in HEAD}}
            out = _gd(start, X, y, BODY + HEAD, K, 0.3)
            bodies[i] = {k: out[k] for k in BODY}
            trained.append(out)
        glob.update(_avg(trained, sizes, BODY + HEAD if rnd < warmup else HEAD))
    run_rounds(sim, 3)
    for i in range(len(arrays)):
        personal = numpy_params(sim.personal_params(i))
        for k in BODY + HEAD:
            expected = bodies[i][k] if k in BODY else glob[k]
            np.testing.assert_allclose(personal[k], expected, rtol=1e-4, atol=1e-5)
