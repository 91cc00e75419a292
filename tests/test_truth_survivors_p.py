"""Survivors of DIANA and ADIANA (triage list P): DIANA's server memory, metrics, refusal message,
its start point under ALA and its compression streams; ADIANA's client step (the w it holds, the
minibatch both gradients share, weight decay, the training loss it reports, the two upload streams),
its default η, its downlink and its refusals. Truths: the spec's hand count of the server's shifts
(N·d values of ``itemsize`` bytes, none when only h̄ is kept); α = 1/(1+ω) with rand-k's ω = d/k − 1;
ADIANA with the identity compressor and a coin that always lands heads written out in numpy
(x = θ1 z + θ2 w + (1 − θ1 − θ2) y, a_i = ∇f_i(x) − h_i, b_i = ∇f_i(w) − h_i, y, z, h̄ updates, w⁺ = y,
η = lr without compression), the downlink's bytes counted from d fp32 values per model sent, the
closed form η = lr·min{1, N/(32ω(2p(ω+1)+1)²)}, the same minibatch (``federation.batch_size``) for
both gradients, and independent compressor draws per round and per client (rand-k's kept entries
are not the same for every client of a round, nor for every round of a client); the w-coin heads
iff the round's shared uniform draw is below p (probability p exactly)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from truth import Recorder, close, config, least_squares, simulator, vec
from pfl.federation.simulator import Simulator
from pfl.schema import ConfigError

LR, K = 0.2, 3
RANDK = {"name": "randk", "ratio": 0.5}   # rand-k on the 4-entry weight keeps 2 (ω = 1); the bias whole


@pytest.fixture(scope="module")
def problem():
    return least_squares()


@pytest.fixture(scope="module")
def problem4():
    return least_squares(d=4, sizes=(20, 30, 24, 27, 22), clusters=[0, 1, 2, 3, 0])


def _run(problem, method, **kw):
    rec = Recorder()
    sim = Simulator(config(method, problem.m, steps=kw.pop("steps", K), lr=kw.pop("lr", LR), compression__min_numel=1,
                           **kw), data=problem.federated(), stages=[rec])
    return sim, rec


def _decoded(msg, part: str) -> np.ndarray:
    e = msg[part].entries
    return vec({k: (t.decoded if hasattr(t, "decoded") else t) for k, t in e.items()})


# ---- DIANA: server memory, metrics, refusal ----------------------------------------------------------

@pytest.mark.parametrize("shifts, per_round, newcomers, held", [
    ("per_client", 0, 0.0, True), ("per_client", 2, 0.0, True), ("per_client", 0, 0.2, True),
    ("mean", 0, 0.0, False), ("auto", 0, 0.0, False), ("auto", 4, 0.2, False), ("auto", 2, 0.0, True),
    ("auto", 3, 0.2, True)])
def test_diana_server_bytes_count_every_shift_only_when_the_server_keeps_them_per_client(shifts, per_round, newcomers,
                                                                                         held):
    """The server keeps a copy of every training client's h_i (N·d values of ``itemsize`` bytes) with
    per-client shifts (``per_client``, or ``auto`` under client sampling), nothing beyond the model
    with only h̄ (``mean``, or ``auto`` with every training client in every round)."""
    from pfl.methods.base import ModelSize
    from pfl.methods.diana import Diana

    m, params = 5, 7
    cfg = config("diana", m, per_round=per_round, method__shifts=shifts, newcomers__fraction=newcomers)
    members = m - (1 if newcomers else 0)
    want = 4 * members * params if held else 0
    assert Diana.server_bytes(m, ModelSize(params=params, head=2), cfg) == want
    assert Diana.server_bytes(m, ModelSize(params=params, head=2, itemsize=8), cfg) == 2 * want


def test_diana_server_bytes_match_the_shifts_a_run_holds(problem):
    """After rounds that reached every client, the server holds N per-client shifts of d values."""
    from pfl.methods.base import ModelSize
    from pfl.methods.diana import Diana

    sim = simulator(problem, "diana", steps=1, lr=LR, per_round=2, compression__uplink__name="identity")
    for _ in range(6):
        sim.run_round(evaluate=False)
    held = sum(t.numel() * t.element_size() for h in sim.method.h.values() for t in h.values())
    assert len(sim.method.h) == problem.m
    assert Diana.server_bytes(problem.m, ModelSize(params=problem.dim, head=problem.dim), sim.cfg) == held


def test_diana_reports_alpha_and_omega_of_rand_k(problem4):
    """Rand-k keeping 2 of the 4 weights: ω = d/k − 1 = 1, so α = 1/(1 + ω) = ½."""
    sim, _ = _run(problem4, "diana", compression__uplink=RANDK)
    got = sim.method.extra_metrics(0)
    assert set(got) == {"diana/alpha", "diana/omega"}
    assert got["diana/omega"] == 1.0 and got["diana/alpha"] == 0.5


def test_diana_mean_shifts_refusal_says_why_and_what_to_use(problem):
    with pytest.raises(ConfigError) as info:
        simulator(problem, "diana", steps=K, lr=LR, per_round=2, method__shifts="mean")
    assert info.value.field == "method.shifts"
    assert info.value.message == ("shifts=mean needs every client in every round "
                                  "(federation.clients_per_round=0); use per_client or auto")


def test_diana_with_ala_starts_its_first_round_from_the_received_model(problem):
    """ALA has no local model before a client's first round: DIANA+ALA's first round is DIANA's, with
    the identity compressor x¹ = x⁰ + Σ p_i (GD_K(x⁰) − x⁰)."""
    sim = simulator(problem, "diana+ala", steps=K, lr=LR, compression__uplink__name="identity")
    x = vec(sim.method.global_model)
    n = np.array([problem.n(i) for i in range(problem.m)], dtype=float)
    want = x + sum(w * (problem.gd(i, x, K, LR) - x) for i, w in enumerate(n / n.sum()))
    sim.run_round(evaluate=False)
    assert close(vec(sim.method.global_model), want)


def _kept(msg, part):
    return tuple(_decoded(msg, part)[:4] != 0)


def test_diana_compressor_draws_differ_between_clients_and_between_rounds(problem4):
    """Each upload draws its own rand-k: in a round the clients do not all keep the same weights, and
    a client does not keep the same weights in every round."""
    sim, rec = _run(problem4, "diana", compression__uplink=RANDK, method__alpha=0.3)
    rounds = 4
    for _ in range(rounds):
        sim.run_round(evaluate=False)
    m = problem4.m
    for rnd in range(rounds):
        assert len({_kept(rec.up[rnd, i], "delta") for i in range(m)}) > 1
    for i in range(m):
        assert len({_kept(rec.up[rnd, i], "delta") for rnd in range(rounds)}) > 1


# ---- ADIANA: the client step and the server recursion by hand -----------------------------------------

def test_adiana_clients_use_the_w_the_server_sends_and_report_the_loss_at_x(problem):
    """Identity compressor (ω = 0: η = lr, α = 1) and p = 1, so w^{k+1} = y^k every round and is sent
    with x^{k+1}: a_i = ∇f_i(x^k) − h_i, b_i = ∇f_i(w^k) − h_i, h_i ← h_i + b_i; y^{k+1} = x^k − η(h̄ +
    mean a), z^{k+1} = z^k + (1/(2θ1))(y^{k+1} − x^k); the round's training loss is mean f_i(x^k); the
    downlink carries d fp32 values per client for x, and as many again for w after a heads round."""
    p = problem
    lr = 0.1
    sim, rec = _run(p, "adiana", steps=1, lr=lr, compression__uplink__name="identity", method__prob=1.0)
    t1, t2, eta = 0.25, 0.5, lr
    y = z = w = vec(sim.method.init)
    h = np.zeros((p.m, p.dim))
    for rnd in range(4):
        x = t1 * z + t2 * w + (1 - t1 - t2) * y
        metrics = sim.run_round(evaluate=False)
        assert metrics["train/loss"] == pytest.approx(np.mean([p.loss(i, x) for i in range(p.m)]), rel=1e-5)
        sent = 1 if rnd == 0 else 2                     # w^0 = x^0 is never sent; w changes every round
        assert metrics["comm/round_down_bytes"] == sent * 4 * p.dim * p.m
        a = np.array([p.grad(i, x) for i in range(p.m)]) - h
        b = np.array([p.grad(i, w) for i in range(p.m)]) - h
        for i in range(p.m):
            assert close(_decoded(rec.up[rnd, i], "a"), a[i], 1e-4)
            assert close(_decoded(rec.up[rnd, i], "b"), b[i], 1e-4)
        y_new = x - eta * (h.mean(0) + a.mean(0))
        h = h + b
        z = z + (1 / (2 * t1)) * (y_new - x)
        w, y = y, y_new
        assert close(vec(sim.method.y), y, 1e-4) and close(vec(sim.method.z), z, 1e-4)
        assert close(vec(sim.method.w), w, 1e-4)


def test_adiana_takes_both_gradients_on_the_same_minibatch_of_batch_size(problem):
    """``federation.batch_size`` B < n: a_i and b_i are gradients on one minibatch of B samples (with
    x⁰ = w⁰ and the identity compressor, a_i = b_i in round 0), drawn from the client's round stream
    ("grad"), not the full-batch gradient."""
    p = problem
    sim, rec = _run(p, "adiana", steps=1, lr=0.1, compression__uplink__name="identity", federation__batch_size=5,
                    method__theta1=0.5, method__theta2=0.5)
    x = vec(sim.method.init)
    sim.run_round(evaluate=False)
    for i in range(p.m):
        a, b = _decoded(rec.up[0, i], "a"), _decoded(rec.up[0, i], "b")
        assert np.array_equal(a, b)
        idx = torch.randperm(p.n(i), generator=sim.client(i).generator(0, "grad"))[:5].numpy()
        Z = p.design(i)[idx]
        want = 2.0 / 5 * Z.T @ (Z @ x - p.y[i][idx])
        assert close(a, want, 1e-5)
        assert not close(a, p.grad(i, x), 1e-2)


def test_adiana_gradients_include_the_weight_decay(problem):
    """``federation.weight_decay`` λ: the oracle is ∇f_i + λ·x, so a_i = ∇f_i(x⁰) + λx⁰ in round 0."""
    p, lam = problem, 0.3
    sim, rec = _run(p, "adiana", steps=1, lr=0.1, compression__uplink__name="identity", federation__weight_decay=lam,
                    method__theta1=0.5, method__theta2=0.5)
    x = vec(sim.method.init)
    sim.run_round(evaluate=False)
    for i in range(p.m):
        assert close(_decoded(rec.up[0, i], "a"), p.grad(i, x) + lam * x, 1e-5)
        assert close(_decoded(rec.up[0, i], "b"), p.grad(i, x) + lam * x, 1e-5)


def test_adiana_compressor_draws_differ_between_clients_rounds_and_uploads(problem4):
    """a_i and b_i are independent rand-k draws of each client in each round."""
    sim, rec = _run(problem4, "adiana", steps=1, lr=0.1, compression__uplink=RANDK)
    rounds, m = 4, problem4.m
    for _ in range(rounds):
        sim.run_round(evaluate=False)
    for part in ("a", "b"):
        for rnd in range(rounds):
            assert len({_kept(rec.up[rnd, i], part) for i in range(m)}) > 1, (part, rnd)
        for i in range(m):
            assert len({_kept(rec.up[rnd, i], part) for rnd in range(rounds)}) > 1, (part, i)
    assert any(_kept(rec.up[rnd, i], "a") != _kept(rec.up[rnd, i], "b") for rnd in range(rounds) for i in range(m))


# ---- ADIANA: η and the refusals ---------------------------------------------------------------------

def _eta(lr, n, omega, p):
    return lr * (1.0 if omega == 0 else min(1.0, n / (32 * omega * (2 * p * (omega + 1) + 1) ** 2)))


@pytest.mark.parametrize("uplink, omega, prob", [
    ({"name": "identity"}, 0.0, 0.0),                                   # η = lr
    ({"name": "randk", "ratio": 0.25}, 3.0, 0.0),                      # ω = 4/1 − 1, p = 1/8
    ({"name": "randk", "ratio": 0.25}, 3.0, 0.5),                      # 2p(ω+1)+1 = 5
    ({"name": "natural"}, 1 / 8, 0.01),                                 # N/(32ω(…)²) > 1: η = lr
])
def test_adiana_default_eta_is_the_papers_step_with_the_client_lr(problem4, uplink, omega, prob):
    sim, _ = _run(problem4, "adiana", steps=1, lr=0.1, compression__uplink=uplink, method__prob=prob)
    p = prob or 1 / (2 * (1 + omega))
    assert sim.method.omega == pytest.approx(omega, rel=1e-12)
    assert sim.method.eta(0) == pytest.approx(_eta(0.1, problem4.m, omega, p), rel=1e-12)
    if uplink["name"] in ("identity", "natural"):
        assert sim.method.eta(0) == pytest.approx(0.1, rel=1e-12)


def test_adiana_refuses_theta1_zero_naming_it(problem):
    with pytest.raises(ConfigError) as info:
        simulator(problem, "adiana", steps=1, lr=0.1, method__theta1=0.0, method__theta2=0.5)
    assert info.value.field == "method.theta1"
    assert info.value.message == "θ1 must be > 0 (γ = η/(2θ1))"


def test_adiana_refuses_client_sampling_saying_why(problem):
    with pytest.raises(ConfigError) as info:
        simulator(problem, "adiana", steps=1, lr=0.1, per_round=2)
    assert info.value.field == "federation.clients_per_round"
    assert info.value.message == ("adiana needs every client in every round (the server keeps only the mean "
                                  f"shift h̄); set 0 (all) or at least the {problem.m} training clients, got 2")


def test_adiana_coin_is_heads_exactly_when_the_shared_draw_is_below_p(problem):
    """The w-coin is Bernoulli(p) from the round's shared uniform draw u on the 2⁻⁵³ grid: heads iff
    u < p, which has probability p exactly for p on the grid (u ≤ p would add 2⁻⁵³). With p = u the
    round is tails, with the next float above u heads (w^{1} = y^{0} then, and is sent)."""
    base = simulator(problem, "adiana", steps=1, lr=0.1, method__prob=0.5)
    u = float(base.ctx.rng(0, "adiana").random())
    for prob, heads in ((u, False), (float(np.nextafter(u, 1.0)), True)):
        sim = simulator(problem, "adiana", steps=1, lr=0.1, method__prob=prob)
        assert sim.method.coin(0) is heads
        sim.run_round(evaluate=False)
        assert sim.method.w_changed is heads
