"""The seminar's compressed methods (docs/methods/seminar.md §3, tests §5): DIANA, ADIANA, MARINA, LAG —
their math on small quadratic problems against known optima and direct computation, and their runs
in the simulator (bytes, shared coins, shifts). Each method's class against the algorithm by hand
with a real compressor, sampling and newcomers: tests/test_truth_compressed.py."""

import math

import numpy as np
import pytest
import torch

from helpers import client_gradients, models_equal, small_config
from pfl.callbacks.divergence import run_rounds
from pfl.compression import build, decode_update, encode_update, resolve_spec
from pfl.federation.simulator import Simulator
from pfl.methods.diana import adiana_parameters, adiana_step, adiana_x, reply_weights, weighted_sum
from pfl.methods.lag import lag_threshold
from pfl.schema import ConfigError

torch.set_default_dtype(torch.float32)


def comp(name, **params):
    return build(resolve_spec({"name": name, **params}, "compression.uplink"))


def _uniform(n):
    return {c: 1.0 / n for c in range(n)}


# ---- DIANA --------------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.3, 1.0])
def test_diana_with_the_identity_compressor_is_fedavg(alpha):
    fedavg = Simulator(small_config(federation__rounds=3))
    run_rounds(fedavg)
    diana = Simulator(small_config(method__name="diana", method__alpha=alpha, federation__rounds=3,
                                   compression__uplink__name="identity"))
    run_rounds(diana)
    # Δ̂ = h + (Δ − h) and x + mean Δ̂ vs mean(x + Δ): FedAvg up to float rounding
    assert models_equal(diana.method.global_model, fedavg.method.global_model, atol=1e-5)
    assert diana.history[-1]["comm/up_bytes"] == fedavg.history[-1]["comm/up_bytes"]


def test_diana_server_shifts_match_the_clients():
    partial = Simulator(small_config(method__name="diana", federation__rounds=5, compression__uplink__name="qsgd",
                                     compression__uplink__s=1))
    run_rounds(partial)
    assert partial.method.per_client and partial.method.h
    for cid, h in partial.method.h.items():
        assert models_equal(h, partial.client_states[cid]["h"])          # bit for bit
    full = Simulator(small_config(method__name="diana", federation__rounds=5, federation__clients_per_round=0,
                                  compression__uplink__name="qsgd", compression__uplink__s=1))
    run_rounds(full)
    n = {c: float(full.client(c).n_train) for c in range(full.num_clients)}
    weights = {c: v / sum(n.values()) for c, v in n.items()}
    mean_h = weighted_sum({c: full.client_states[c]["h"] for c in n}, weights)
    assert models_equal(full.method.h_mean, mean_h, atol=1e-6)
    assert full.history[-1]["diana/alpha"] == pytest.approx(1 / (1 + full.method.omega))


def test_diana_default_alpha_comes_from_omega():
    sim = Simulator(small_config(method__name="diana", compression__uplink__name="randk",
                                 compression__uplink__ratio=0.1))
    # the largest compressed tensor decides: ω = d/k − 1
    d = max(t.numel() for t in sim.method.global_model.values())
    assert sim.method.omega == pytest.approx(d / math.ceil(0.1 * d) - 1)
    assert sim.method.alpha == pytest.approx(1 / (1 + sim.method.omega))


# ---- ADIANA -------------------------------------------------------------------------------------

def _quadratics(n=4, dim=10, low=1.0, high=100.0, seed=0):
    """n quadratics ½xᵀA_i x − b_iᵀx (float64) whose mean Hessian has spectrum [low, high]."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    mean = q @ torch.diag(torch.linspace(low, high, dim, dtype=torch.float64)) @ q.T
    noise = [0.3 * (lambda m: (m + m.T) / 2)(torch.randn(dim, dim, generator=g, dtype=torch.float64))
             for _ in range(n - 1)]
    noise.append(-sum(noise))
    A = [mean + e for e in noise]
    b = [torch.randn(dim, generator=g, dtype=torch.float64) for _ in range(n)]
    x_star = torch.linalg.solve(mean, sum(b) / n)
    return A, b, x_star


def _adiana_run(A, b, iters, eta, theta1, theta2, beta, gamma, alpha, prob, compress=None, seed=0):
    n, dim = len(A), A[0].shape[0]
    rng = np.random.default_rng(seed)
    grad = lambda i, x: A[i] @ x["v"] - b[i]  # noqa: E731
    C = compress or (lambda v: v)
    y = {"v": torch.zeros(dim, dtype=torch.float64)}
    z, w = dict(y), dict(y)
    h_i = [torch.zeros(dim, dtype=torch.float64) for _ in range(n)]
    h = {"v": torch.zeros(dim, dtype=torch.float64)}
    trace = []
    for _ in range(iters):
        x = adiana_x(y, z, w, theta1, theta2)
        a = [C(grad(i, x) - h_i[i]) for i in range(n)]
        bb = [C(grad(i, w) - h_i[i]) for i in range(n)]
        h_i = [h_i[i] + alpha * bb[i] for i in range(n)]
        trace.append((x, w, [hi.clone() for hi in h_i], {"v": h["v"] + sum(a) / n}))
        y, z, w, h = adiana_step(x, y, z, w, h, {"v": sum(a) / n}, {"v": sum(bb) / n}, eta=eta, gamma=gamma,
                                 beta=beta, alpha=alpha, coin=bool(rng.random() < prob))
    return y["v"], trace


def test_adiana_accelerates_on_an_ill_conditioned_quadratic():
    A, b, x_star = _quadratics()
    L, mu = 100.0, 1.0
    eta, prob = 1 / (2 * L), 1.0                                # ω = 0 ⇒ p = 1, η = 1/(2L)
    theta1 = min(0.25, math.sqrt(eta * mu / prob))
    assert theta1 == pytest.approx(0.0707, abs=1e-4)
    beta, gamma = adiana_parameters(eta, theta1, mu)
    y, _ = _adiana_run(A, b, 1000, eta, theta1, 0.5, beta, gamma, 1.0, prob)
    assert (y - x_star).norm() < 1e-10
    x = torch.zeros(10, dtype=torch.float64)
    for _ in range(1000):
        x = x - eta * sum(A[i] @ x - b[i] for i in range(4)) / 4
    assert (x - x_star).norm() > 1e-4                            # plain GD is still far


def test_adiana_parameters_are_validated():
    with pytest.raises(ConfigError) as err:
        small_config(method__name="adiana", method__theta1=0.6, method__theta2=0.5,
                     federation__clients_per_round=0)
    assert err.value.field == "method.theta2"
    with pytest.raises(ConfigError) as err:
        small_config(method__name="adiana", method__prob=1.5)
    assert err.value.field == "method.prob"
    with pytest.raises(ConfigError) as err:
        Simulator(small_config(method__name="adiana"))          # 5 of 10 clients per round
    assert err.value.field == "federation.clients_per_round"


def test_adiana_uploads_two_compressed_messages():
    cfg = small_config(method__name="adiana", federation__rounds=2, federation__clients_per_round=0,
                       compression__uplink__name="qsgd", compression__uplink__s=3)
    sim = Simulator(cfg)
    run_rounds(sim)
    c = build(cfg.compression.uplink)
    one = sum(4 * t.numel() if t.numel() < 256 else math.ceil(c.bits(t.numel()) / 8)
              for t in sim.method.y.values())
    assert sim.ledger.per_round[0][0] == sim.num_clients * 2 * one
    assert math.isfinite(sim.history[-1]["test/acc_mean"])


# ---- MARINA -------------------------------------------------------------------------------------

def test_marina_with_p_1_is_distributed_gradient_descent():
    sim = Simulator(small_config(method__name="marina", method__p=1.0, federation__rounds=3,
                                 federation__clients_per_round=0, method__weighting="uniform"))
    x = {k: v.clone() for k, v in sim.method.init.items()}
    g = None
    for rnd in range(3):
        if g is not None:
            x = {k: x[k] - sim.ctx.lr(rnd) * g[k] for k in x}
        g = weighted_sum(client_gradients(sim, x), _uniform(sim.num_clients))
    run_rounds(sim)
    assert models_equal(sim.method.x, x, atol=1e-7) and models_equal(sim.method.g, g, atol=1e-7)


def test_marina_with_the_identity_tracks_the_full_gradient():
    sim = Simulator(small_config(method__name="marina", method__p=0.3, federation__rounds=6, federation__batch_size=0,
                                 federation__clients_per_round=0, compression__uplink__name="identity"))
    run_rounds(sim)
    assert sim.method.full_rounds < 6                                      # some compressed rounds ran
    full = weighted_sum(client_gradients(sim, sim.method.x), _uniform(sim.num_clients))
    assert models_equal(sim.method.g, full, atol=1e-6)


def test_marina_uplink_bits_follow_the_coins():
    cfg = small_config(method__name="marina", method__p=0.5, federation__rounds=6, federation__clients_per_round=0,
                       compression__uplink__name="randk", compression__uplink__ratio=0.05)
    sim = Simulator(cfg)
    run_rounds(sim)
    c = build(cfg.compression.uplink)
    shapes = [t.numel() for t in sim.method.x.values()]
    dense = sum(4 * d for d in shapes)
    packed = sum(4 * d if d < 256 else math.ceil(c.bits(d) / 8) for d in shapes)
    coins = [sim.method.coin(r) for r in range(6)]
    assert coins[0] and not all(coins)
    assert [up for up, _ in sim.ledger.per_round] == [sim.num_clients * (dense if c_ else packed) for c_ in coins]
    assert sim.method.prob == 0.5


def test_marina_default_p_equalises_traffic():
    sim = Simulator(small_config(method__name="marina", federation__clients_per_round=0,
                                 compression__uplink__name="randk", compression__uplink__ratio=0.1))
    assert 0.1 <= sim.method.prob <= 0.13                                   # k/d + index and dense biases
    p, w = sim.method.prob, sim.method.omega
    d = max(t.numel() for t in sim.method.x.values())
    assert w == pytest.approx(d / math.ceil(0.1 * d) - 1)                   # ω of the largest tensor
    expected = 0.1 / (1 + math.sqrt((1 - p) * w / (p * sim.num_clients)))   # γ = lr/(1 + √((1−p)ω/(pN)))
    assert sim.method.step(0) == pytest.approx(expected) and expected < 0.05


# ---- LAG ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("per_round", [5, 0])
def test_lag_with_xi_0_is_fedavg_bit_for_bit(per_round):
    fedavg = Simulator(small_config(federation__rounds=3, federation__clients_per_round=per_round))
    run_rounds(fedavg)
    lag = Simulator(small_config(method__name="lag", method__xi=0.0, federation__rounds=3,
                                 federation__clients_per_round=per_round))
    run_rounds(lag)
    assert models_equal(lag.method.global_model, fedavg.method.global_model)
    assert lag.method.skips == 0


def test_lag_with_a_huge_xi_skips_every_later_upload():
    sim = Simulator(small_config(method__name="lag", method__xi=1e9, federation__rounds=4,
                                 federation__clients_per_round=0))
    models = [{k: v.clone() for k, v in sim.method.global_model.items()}]
    for _ in range(4):
        sim.run_round()
        models.append({k: v.clone() for k, v in sim.method.global_model.items()})
    ups = [up for up, _ in sim.ledger.per_round]
    assert ups[0] > 1000 and ups[1:] == [sim.num_clients * 1] * 3       # SKIP: one byte (8 bits) each
    steps = [{k: b[k] - a[k] for k in a} for a, b in zip(models, models[1:])]
    for later in steps[2:]:
        assert models_equal(later, steps[1], atol=1e-6)
    assert sim.history[-1]["lag/skip_rate"] == pytest.approx(3 / 4)


def test_lag_threshold_by_hand():
    x0, x1, x2 = torch.zeros(3), torch.tensor([1.0, 0.0, 2.0]), torch.tensor([1.0, 1.0, 1.0])
    m = [float(((x1 - x0) ** 2).sum()), float(((x2 - x1) ** 2).sum())]   # 5, 2
    assert lag_threshold(m, xi=1.0, D=2) == pytest.approx(0.5 * 5 + 0.5 * 2)
    assert lag_threshold(m, xi=1.0, D=2, server_lr=0.5) == pytest.approx(3.5 / 0.25)
    assert lag_threshold(m[:1], xi=1.0, D=2) == pytest.approx(2.5)          # a missing term counts 0
    assert lag_threshold([], xi=1.0, D=10) == 0.0


def test_diana_reply_weights_sum_to_one():
    from pfl.federation.messages import Message

    w = reply_weights({1: Message({}, {"n": 3}), 4: Message({}, {"n": 1})}, "samples")
    assert w == {1: 0.75, 4: 0.25}
    assert reply_weights({1: Message({}, {"n": 3}), 4: Message({}, {"n": 1})}, "uniform") == {1: 0.5, 4: 0.5}


def test_decode_update_is_the_inverse_of_encode_update_for_identity():
    t = {"w": torch.randn(300), "b": torch.randn(3)}
    ref = {"w": torch.randn(300), "b": torch.randn(3)}
    entries, values = encode_update(comp("identity"), t, ref, lambda n: None, min_numel=256)
    assert type(entries["b"]) is torch.Tensor and torch.equal(entries["b"], t["b"])
    dec = decode_update(entries, ref)
    assert torch.allclose(dec["w"], t["w"], atol=1e-6) and torch.equal(values["w"], dec["w"])
