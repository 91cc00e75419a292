"""The seminar's methods with a real compressor, partial participation and newcomers: each method's
own class in the simulator against the same algorithm computed by hand in numpy on a least-squares
federation (tests/truth.py: full-batch steps, so every local step is exact).

A compressed upload is random, so the test reads what was delivered (a recording stage at the end of
the wire) and checks it against the definition: rand-k keeps at most k entries, each (d/k)× the value
the method should have compressed — a value computed here from the gradients or updates in numpy. So
a wrong rule shared by both sides (compressing Δ instead of Δ − h, moving the shift without α, taking
the wrong gradients) fails, whatever the draws."""

from __future__ import annotations

import numpy as np
import pytest

from truth import Recorder, close, config, least_squares, vec
from pfl.federation.simulator import Simulator
from pfl.schema import ConfigError

LR, K = 0.2, 3
#: rand-k on the 4-entry weight keeps 2 (ω = 1); the 1-entry bias is kept whole (ω = 0)
RANDK = {"name": "randk", "ratio": 0.5}


@pytest.fixture(scope="module")
def problem():
    return least_squares(d=4, sizes=(20, 30, 24, 27, 22), clusters=[0, 1, 2, 3, 0])


def run(problem, method, **kw):
    rec = Recorder()
    sim = Simulator(config(method, problem.m, steps=kw.pop("steps", K), lr=kw.pop("lr", LR), compression__min_numel=1,
                           **kw), data=problem.federated(), stages=[rec])
    return sim, rec


def decoded(msg, part: str) -> np.ndarray:
    """A delivered part's encoded entries as one [weight, bias] vector (what the receiver decodes)."""
    e = msg[part].entries
    return vec({k: (t.decoded if hasattr(t, "decoded") else t) for k, t in e.items()})


def assert_randk_of(got: np.ndarray, v: np.ndarray) -> None:
    """``got`` is rand-k (ratio ½) of ``v``: the weight keeps 2 of its 4 entries, each 2v_i; the bias is v."""
    w, wv = got[:4], v[:4]
    kept = w != 0
    assert kept.sum() <= 2 and np.allclose(w[kept], 2 * wv[kept], rtol=1e-4, atol=1e-6), (got, v)
    assert np.allclose(got[4:], v[4:], rtol=1e-4, atol=1e-6)


def sample_weights(problem, clients) -> np.ndarray:
    n = np.array([problem.n(i) for i in clients], dtype=float)
    return n / n.sum()


# ---- DIANA ---------------------------------------------------------------------------------------------

def test_diana_compresses_the_difference_to_its_shift_and_moves_the_shift_by_alpha(problem):
    """Client i sends C(Δ_i − h_i); both sides set h_i ← h_i + α·C(Δ_i − h_i); the server steps by
    Σ p_i (h_i + C(Δ_i − h_i)). Partial participation: the server keeps every h_i."""
    alpha = 0.3
    sim, rec = run(problem, "diana", per_round=3, compression__uplink=RANDK, method__alpha=alpha,
                   method__shifts="per_client")
    x = vec(sim.method.global_model)
    h = np.zeros((problem.m, problem.dim))
    for rnd in range(4):
        sampled = sim.sample(rnd)
        sim.run_round(evaluate=False)
        step = np.zeros(problem.dim)
        for p_i, i in zip(sample_weights(problem, sampled), sampled):
            delta = problem.gd(i, x, K, LR) - x
            c = decoded(rec.up[rnd, i], "delta")
            assert_randk_of(c, delta - h[i])
            step += p_i * (h[i] + c)
            h[i] = h[i] + alpha * c
        x = x + step
        assert close(vec(sim.method.global_model), x, 1e-4)
    for i in sim.method.h:
        assert close(vec(sim.client_states[i]["h"]), h[i], 1e-4) and close(vec(sim.method.h[i]), h[i], 1e-4)


# ---- ADIANA --------------------------------------------------------------------------------------------

def test_adiana_client_sends_the_two_compressed_gradient_differences(problem):
    """a_i = C(∇f_i(x^k) − h_i), b_i = C(∇f_i(w^k) − h_i), h_i ← h_i + α b_i; the server's y^{k+1} =
    x^k − η(h̄ + mean a_i), z^{k+1} = z^k + (γ/η)(y^{k+1} − x^k) (β = 1, γ = η/(2θ1)), w^1 = y^0 or w^0
    (both x⁰), x^{k+1} = θ1 z + θ2 w + (1 − θ1 − θ2) y."""
    sim, rec = run(problem, "adiana", steps=1, lr=0.1, compression__uplink=RANDK)
    m, eta, alpha = problem.m, sim.method.eta(0), sim.method.alpha
    assert alpha == pytest.approx(1 / 2)                                  # ω = d/k − 1 = 1
    t1, t2 = 0.25, 0.5
    y = z = w = x = vec(sim.method.init)
    h = np.zeros((m, problem.dim))
    for rnd in range(2):
        sim.run_round(evaluate=False)
        a_mean = np.zeros(problem.dim)
        b_mean = np.zeros(problem.dim)
        for i in range(m):
            a, b = decoded(rec.up[rnd, i], "a"), decoded(rec.up[rnd, i], "b")
            assert_randk_of(a, problem.grad(i, x) - h[i])
            assert_randk_of(b, problem.grad(i, w) - h[i])
            h[i] += alpha * b
            a_mean += a / m
            b_mean += b / m
        h_bar_before = h.mean(0) - alpha * b_mean
        y_new = x - eta * (h_bar_before + a_mean)
        z = z + (1 / (2 * t1)) * (y_new - x)
        w = y if sim.method.coin(rnd) else w
        y = y_new
        assert close(vec(sim.method.y), y, 1e-4) and close(vec(sim.method.z), z, 1e-4)
        x = t1 * z + t2 * w + (1 - t1 - t2) * y
    for i in range(m):
        assert close(vec(sim.client_states[i]["h"]), h[i], 1e-4)


def test_adiana_default_eta_counts_the_training_clients_only(problem):
    """η = lr·min{1, N/(32ω(2p(ω+1)+1)²)} with ω = 1, p = 1/(2(1+ω)) = ¼: N/128, N = 4 members when
    one of the 5 clients is a newcomer (not 5/128)."""
    sim, _ = run(problem, "adiana", steps=1, lr=0.1, compression__uplink=RANDK, newcomers__fraction=0.2)
    assert len(sim.ctx.newcomers) == 1 and sim.method.prob == pytest.approx(0.25)
    assert sim.method.eta(0) == pytest.approx(0.1 * 4 / 128)


# ---- MARINA --------------------------------------------------------------------------------------------

def test_marina_with_rand_k_by_hand(problem):
    """x^{k+1} = x^k − γg^k; g^{k+1} = mean ∇f_i(x^{k+1}) on a full round, else g^k + mean
    C(∇f_i(x^{k+1}) − ∇f_i(x^k)); γ = lr/(1 + √((1 − p)ω/(pN))) with N the training clients (a
    newcomer sits out)."""
    p = 0.4
    sim, rec = run(problem, "marina", lr=0.1, compression__uplink=RANDK, method__p=p, newcomers__fraction=0.2)
    members = sim.ctx.members
    assert len(members) == 4
    gamma = 0.1 / (1 + np.sqrt((1 - p) * 1.0 / (p * 4)))
    assert sim.method.step(0) == pytest.approx(gamma)
    x, g = vec(sim.method.init), None
    compressed = 0
    for rnd in range(8):
        sim.run_round(evaluate=False)
        x_new = x if g is None else x - gamma * g
        if sim.method.coin(rnd):
            g = np.mean([problem.grad(i, x_new) for i in members], axis=0)
        else:
            compressed += 1
            diffs = []
            for i in members:
                c = decoded(rec.up[rnd, i], "g")
                assert_randk_of(c, problem.grad(i, x_new) - problem.grad(i, x))
                diffs.append(c)
            g = g + np.mean(diffs, axis=0)
        x = x_new
        assert close(vec(sim.method.x), x, 1e-4) and close(vec(sim.method.g), g, 1e-4)
    assert compressed >= 2


def test_marina_refuses_a_biased_compressor():
    """Its estimator and step assume E C(v) = v (the step uses ω): top-k, sign, unscaled rand-k are refused."""
    for spec in ({"name": "topk", "ratio": 0.1}, {"name": "sign"}, {"name": "randk", "ratio": 0.1, "scale": False}):
        with pytest.raises(ConfigError) as err:
            config("marina", 4, compression__uplink=spec)
        assert err.value.field == "compression.uplink.name"


# ---- FedPD ---------------------------------------------------------------------------------------------

def _fedpd_by_hand(problem, init, rounds, eta, communicates, compress=lambda v: v):
    """(server x_0, per-client x, λ, x_{0,i}) after ``rounds`` rounds of FedPD, in numpy."""
    m, d = problem.m, problem.dim
    x = np.zeros((m, d)) + init
    lam = np.zeros((m, d))
    x0 = x.copy()
    held = x.copy()
    server = x[0].copy()
    pending = False
    for rnd in range(rounds):
        if pending:
            x0[:] = server
            held[:] = server
        for i in range(m):
            w = x[i].copy()
            for _ in range(K):      # ∇ of f_i + ⟨λ_i, w − x_{0,i}⟩ + ‖w − x_{0,i}‖²/(2η): ∇f_i + λ_i + (w − x_{0,i})/η
                w = w - LR * (problem.grad(i, w) + lam[i] + (w - x0[i]) / eta)
            x[i] = w
            lam[i] = lam[i] + (x[i] - x0[i]) / eta
            x0[i] = x[i] + eta * lam[i]
        pending = communicates(rnd)
        if pending:     # the upload: the change from the x_0 each client last received
            server = server + np.mean([compress(x0[i] - held[i]) for i in range(m)], axis=0)
    return server, x, lam, x0


def test_fedpd_local_steps_dual_and_schedule_by_hand(problem):
    """The sign of λ and the 1/η of the pull, the dual step λ ← λ + (x − x_0)/η, x_{0,i}⁺ = x_i + ηλ_i,
    and skipped rounds that keep x_{0,i}⁺ (schedule: every 3)."""
    eta = 0.5
    sim, _ = run(problem, "fedpd", method__eta=eta, method__schedule="every", method__every=3)
    for _ in range(7):
        sim.run_round(evaluate=False)
    server, x, lam, x0 = _fedpd_by_hand(problem, vec(sim.method.init), 7, eta, sim.method.communicates)
    assert [sim.method.communicates(r) for r in range(7)] == [False, False, True, False, False, True, False]
    assert close(vec(sim.method.x0), server, 1e-4)
    for i in range(problem.m):
        st = sim.client_states[i]
        assert close(vec(st["x"]), x[i], 1e-4) and close(vec(st["lam"]), lam[i], 1e-4)
        assert close(vec(st["x0"]), x0[i], 1e-4)


def test_fedpd_uploads_its_change_so_top_k_keeps_the_largest_change_not_the_largest_weights(problem):
    """Issue 25, problem 3: after skipped rounds FedPD's upload is x_{0,i}⁺ − x_0 (what the client last
    received), an Update; with top-k ½ the server adds the mean of the kept changes. Compressing the
    weights themselves would keep the largest weights instead."""
    eta = 0.5

    def topk(v):
        out = v.copy()
        w = out[:4]
        w[np.argsort(-np.abs(w))[2:]] = 0
        return out

    sim, rec = run(problem, "fedpd", method__eta=eta, method__schedule="every", method__every=3,
                   compression__uplink={"name": "topk", "ratio": 0.5})
    for _ in range(6):
        sim.run_round(evaluate=False)
    server, *_ = _fedpd_by_hand(problem, vec(sim.method.init), 6, eta, sim.method.communicates, compress=topk)
    assert close(vec(sim.method.x0), server, 1e-4)
    assert set(rec.up) == {(2, i) for i in range(problem.m)} | {(5, i) for i in range(problem.m)}
    assert all(list(msg) == ["dx0"] and msg["dx0"].kind == "update" for msg in rec.up.values())


# ---- FedSplit and L2GD: partial participation and newcomers ---------------------------------------------

def test_fedsplit_stale_average_over_the_training_clients(problem):
    """Two of the four training clients per round (one newcomer waits): each sampled client reflects
    z_j ← z_j + 2(prox(2x̄ − z_j) − x̄), the prox by K steps with the pull (u − v)/s from x̄; x̄ is the mean
    of the latest z_j of the four members (x⁰ for one never sampled)."""
    s = 0.5
    sim, _ = run(problem, "fedsplit", steps=10, per_round=2, method__s=s, newcomers__fraction=0.2)
    members = sim.ctx.members
    assert len(members) == 4
    init = vec(sim.method.init)
    z = {i: init.copy() for i in members}
    xbar = init.copy()
    for rnd in range(4):
        sampled = sim.sample(rnd)
        assert set(sampled) <= set(members)
        sim.run_round(evaluate=False)
        for i in sampled:
            v = 2 * xbar - z[i]
            half = problem.gd(i, xbar, 10, LR, pull=(1 / s, v))
            z[i] = z[i] + 2 * (half - xbar)
        xbar = np.mean([z[i] for i in members], axis=0)
        assert close(vec(sim.method.xbar), xbar, 1e-4)


def test_l2gd_with_lambda_sampling_and_a_newcomer_by_hand(problem):
    """λ > 0, two of four members per round: a sampled client applies the last round's averaging
    x̄ + (1 − γ)^A (x_i − x̄) (A = 0 in round 0, where x̄ = x⁰), takes its B_t local steps and uploads;
    x̄ is the mean of the members' latest x_i."""
    lam, prob = 0.5, 0.3
    sim, _ = run(problem, "l2gd", per_round=2, method__lam=lam, method__p=prob, newcomers__fraction=0.2)
    gamma = lam * LR * (1 - prob) / prob
    members = sim.ctx.members
    init = vec(sim.method.init)
    x = {i: init.copy() for i in range(problem.m)}
    server = {i: init.copy() for i in members}
    xbar, steps_before = init.copy(), 0
    for rnd in range(4):
        sampled = sim.sample(rnd)
        sim.run_round(evaluate=False)
        b, a = (lambda r: (int(r.geometric(prob)), int(r.geometric(1 - prob))))(sim.ctx.rng(rnd, "l2gd"))
        for i in sampled:
            x[i] = xbar + (1 - gamma) ** steps_before * (x[i] - xbar)
            x[i] = problem.gd(i, x[i], b, LR)
            server[i] = x[i]
        xbar, steps_before = np.mean([server[i] for i in members], axis=0), a
        assert close(vec(sim.method.xbar), xbar, 1e-4)
    for i in members:
        assert close(vec(sim.client_states[i]["x"]), x[i], 1e-4)
    assert close(vec(sim.client_states[sim.ctx.newcomers[0]]["x"]), init)   # never trained


def test_every_training_client_in_every_round_is_full_participation_with_newcomers(problem):
    """Issue 25, problem 4: with 1 newcomer among 5 clients, 4 clients per round is everyone who trains —
    ADIANA (which needs every client) accepts it and DIANA keeps only the mean shift."""
    sim, _ = run(problem, "adiana", steps=1, lr=0.1, per_round=4, newcomers__fraction=0.2)
    assert len(sim.ctx.members) == 4
    diana, _ = run(problem, "diana", per_round=4, newcomers__fraction=0.2, compression__uplink=RANDK)
    assert not diana.method.per_client
    with pytest.raises(ConfigError, match="federation.clients_per_round"):
        run(problem, "adiana", steps=1, lr=0.1, per_round=3, newcomers__fraction=0.2)
