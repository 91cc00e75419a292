"""The seminar's other methods (docs/methods/seminar.md §4, tests §5): FedPD, FedSplit, L2GD — their
math on small quadratic problems against known optima and direct computation, and their runs in the
simulator (skipped rounds, shared coins, which model is evaluated). Each method's class against the
algorithm by hand with a real compressor, sampling and newcomers: tests/test_truth_compressed.py."""

import math

import numpy as np
import pytest
import torch

from helpers import models_equal, small_config
from pfl.callbacks.divergence import run_rounds
from pfl.federation.simulator import Simulator
from pfl.methods.fedsplit import fedsplit_reflect, prox_pull
from pfl.methods.l2gd import l2gd_average, l2gd_counts
from pfl.schema import ConfigError
from pfl.training import local_sgd

torch.set_default_dtype(torch.float32)


# ---- FedPD --------------------------------------------------------------------------------------

def test_fedpd_one_shared_coin_and_no_bytes_on_skipped_rounds():
    sim = Simulator(small_config(method__name="fedpd", method__p=0.5, federation__rounds=8,
                                 federation__clients_per_round=0))
    run_rounds(sim)
    coins = [sim.method.communicates(r) for r in range(8)]
    assert any(coins) and not all(coins)
    ups = [up for up, _ in sim.ledger.per_round]
    downs = [down for _, down in sim.ledger.per_round]
    d_bytes = sum(4 * t.numel() for t in sim.method.x0.values())
    assert ups == [sim.num_clients * d_bytes if c else 0 for c in coins]
    assert downs == [0] + [sim.num_clients * d_bytes if c else 0 for c in coins[:-1]]
    assert sim.method.comm_rounds == sum(coins)
    st = sim.client_states[0]
    assert models_equal(st["x0"], {k: st["x"][k] + 0.1 * st["lam"][k] for k in st["x"]}, atol=1e-6)
    assert "fedpd/local_acc" in sim.history[-1] and "global/test_acc" in sim.history[-1]


def test_fedpd_needs_every_client():
    with pytest.raises(ConfigError) as err:
        Simulator(small_config(method__name="fedpd"))
    assert err.value.field == "federation.clients_per_round"


# ---- FedSplit -----------------------------------------------------------------------------------

def test_fedsplit_single_client_contraction():
    a, s = 2.0, 0.3
    prox = lambda v: {"v": v["v"] / (1 + s * a)}  # noqa: E731
    xbar = {"v": torch.tensor(1.0, dtype=torch.float64)}
    z = dict(xbar)
    for _ in range(3):
        z = fedsplit_reflect(z, xbar, prox)
        new = z["v"]
        assert float(new) == pytest.approx(float(xbar["v"]) * (1 - s * a) / (1 + s * a))
        xbar = {"v": new}


def test_fedsplit_converges_to_the_minimiser_with_exact_proxes():
    g = torch.Generator().manual_seed(0)
    A, c = [], []
    for _ in range(3):
        m = torch.randn(5, 5, generator=g, dtype=torch.float64)
        A.append(m @ m.T + 0.5 * torch.eye(5, dtype=torch.float64))
        c.append(torch.randn(5, generator=g, dtype=torch.float64))
    x_star = torch.linalg.solve(sum(A), sum(a @ ci for a, ci in zip(A, c)))
    eig = torch.linalg.eigvalsh(torch.stack(A))
    s = 1 / math.sqrt(float(eig.min()) * float(eig.max()))
    xbar = {"v": torch.zeros(5, dtype=torch.float64)}
    z = [dict(xbar) for _ in range(3)]
    for _ in range(200):
        z = [fedsplit_reflect(z[j], xbar, lambda v, j=j: {"v": torch.linalg.solve(
            torch.eye(5, dtype=torch.float64) + s * A[j], v["v"] + s * A[j] @ c[j])}) for j in range(3)]
        xbar = {"v": sum(zj["v"] for zj in z) / 3}
    assert (xbar["v"] - x_star).norm() < 1e-8


def test_fedsplit_sgd_prox_matches_the_exact_prox():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(50, 4, generator=g)
    y = X @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(50, generator=g)
    model = torch.nn.Linear(4, 1, bias=False)
    v = {"weight": torch.randn(1, 4, generator=g)}
    s = 0.5
    out = local_sgd(model, {"weight": torch.zeros(1, 4)}, X, y, lr=0.05, steps=3000, batch_size=0,
                    task="regression", grad_hook=prox_pull(v, s)).params["weight"]
    # argmin (1/n)‖Xu − y‖² + ‖u − v‖²/(2s)
    exact = torch.linalg.solve(2 / 50 * X.T @ X + torch.eye(4) / s, 2 / 50 * X.T @ y + v["weight"][0] / s)
    assert torch.allclose(out[0], exact, atol=1e-4)


def test_fedsplit_client_state_persists():
    sim = Simulator(small_config(method__name="fedsplit", federation__rounds=1, federation__clients_per_round=0))
    run_rounds(sim)
    z0 = sim.client_states[0]["z"]
    assert not models_equal(z0, sim.method.xbar, atol=1e-6)
    assert models_equal(sim.method.xbar, {k: sum(s["z"][k] for s in sim.client_states) / sim.num_clients
                                           for k in z0}, atol=1e-6)


# ---- L2GD ---------------------------------------------------------------------------------------

def test_l2gd_averaging_closed_form():
    g = torch.Generator().manual_seed(0)
    xs = [{"v": torch.randn(6, generator=g, dtype=torch.float64)} for _ in range(4)]
    xbar = {"v": sum(x["v"] for x in xs) / 4}
    gamma, steps = 0.3, 5
    stepped = [dict(x) for x in xs]
    for _ in range(steps):
        mean = sum(x["v"] for x in stepped) / 4
        stepped = [{"v": (1 - gamma) * x["v"] + gamma * mean} for x in stepped]
    closed = [l2gd_average(x, xbar, gamma, steps) for x in xs]
    for a, b in zip(stepped, closed):
        assert torch.allclose(a["v"], b["v"], atol=1e-12)
    assert torch.allclose(sum(x["v"] for x in closed) / 4, xbar["v"], atol=1e-12)      # x̄ unchanged
    assert all(torch.allclose(l2gd_average(x, xbar, 1.0, 1)["v"], xbar["v"]) for x in xs)
    assert l2gd_average(xs[0], xbar, 0.0, 7) is xs[0]


def test_l2gd_with_lambda_0_is_local_sgd_bit_for_bit():
    cfg = small_config(method__name="l2gd", method__lam=0.0, method__p=0.3, federation__rounds=3,
                       federation__clients_per_round=0)
    sim = Simulator(cfg)
    run_rounds(sim)
    for cid in (0, 3):
        client = sim.client(cid)
        x = {k: v.clone() for k, v in sim.method.init.items()}
        for rnd in range(3):
            steps, _ = sim.method.counts(rnd)
            x = client.train(x, rnd, steps=steps).params
        assert models_equal(sim.client_states[cid]["x"], x)


def test_l2gd_rejects_an_averaging_weight_above_1():
    with pytest.raises(ConfigError) as err:
        Simulator(small_config(method__name="l2gd", method__lam=1.0, method__p=1e-6, federation__lr=0.01))
    assert err.value.field == "method.lam" and "γ" in str(err.value)


def test_l2gd_run_lengths_are_geometric_with_the_coins_means():
    """A round's B local steps and A averaging steps: geometric on {1, 2, …} with means 1/p, 1/(1 − p)."""
    p = 0.3
    counts = [l2gd_counts(np.random.default_rng(s), p) for s in range(20_000)]
    assert np.mean([b for b, _ in counts]) == pytest.approx(1 / p, rel=0.03)
    assert np.mean([a for _, a in counts]) == pytest.approx(1 / (1 - p), rel=0.03)


def test_l2gd_round_bytes_and_personal_models():
    sim = Simulator(small_config(method__name="l2gd", method__lam=0.5, method__p=0.3, federation__rounds=3,
                                 federation__clients_per_round=0))
    run_rounds(sim)
    d_bytes = sum(4 * t.numel() for t in sim.method.xbar.values())
    # d up and d down per client per round; round 0's downlink is x⁰ (the base of the uploaded models)
    assert sim.ledger.per_round == [(10 * d_bytes, 10 * d_bytes)] * 3
    personal = sim.personal_models([2])[2]
    gamma = sim.method.gamma(2)
    expected = l2gd_average(sim.client_states[2]["x"], sim.method.xbar, gamma, sim.method.counts(2)[1])
    assert models_equal(personal, expected)
    assert not models_equal(personal, sim.method.xbar, atol=1e-6)          # personal, not the mean
    last = sim.history[-1]
    assert last["l2gd/iterations"] == sum(sum(sim.method.counts(r)) for r in range(3))
    assert "global/test_acc" in last and last["test/acc_mean"] != last["global/test_acc"]
