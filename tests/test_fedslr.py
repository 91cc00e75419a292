"""FedSLR: the low-rank helpers (reshape, SVT factors, factorized messages), the L1 prox, the two
server algorithms, rank/communication vs λ, learning, config errors, resume and the search space."""

from pathlib import Path

import pytest
import torch

from helpers import small_config, straight_and_resumed
from pfl import lowrank
from pfl.callbacks.divergence import run_rounds
from pfl.federation.messages import LowRank, Message
from pfl.federation.simulator import Simulator
from pfl.prox import soft_threshold
from pfl.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def fedslr_config(**overrides):
    base = dict(method__name="fedslr", federation__rounds=3, federation__eval_every=3)
    base.update(overrides)
    return small_config(**base)


# ---- low-rank helpers -------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(6, 4, 5, 5), (3, 2, 3, 2), (8, 5, 1, 1)])
def test_conv_reshape_round_trip_and_layout(shape):
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(shape, generator=gen)
    out, cin, kh, kw = shape
    m = lowrank.to_matrix(t)
    assert m.shape == (out * kh, cin * kw) == lowrank.matrix_shape(shape)
    # rows indexed by (o, a), columns by (c, b): m[o·kh + a, c·kw + b] = t[o, c, a, b]
    for o, c, a, b in [(0, 0, 0, 0), (out - 1, cin - 1, kh - 1, kw - 1), (out // 2, cin // 2, kh // 2, kw - 1)]:
        assert m[o * kh + a, c * kw + b] == t[o, c, a, b]
    torch.testing.assert_close(lowrank.from_matrix(m, shape), t, rtol=0, atol=0)
    lin = torch.randn(7, 3, generator=gen)
    assert torch.equal(lowrank.to_matrix(lin), lin)


def test_threshold_matches_closed_form_and_factor_pair():
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(4, 3, 5, 5, generator=gen, dtype=torch.float64)
    m = lowrank.to_matrix(t)
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    tau = float(s[2] + s[3]) / 2  # keeps exactly 3 singular values
    out, layer = lowrank.threshold(t, tau)
    closed = u @ torch.diag(torch.clamp(s - tau, min=0)) @ vh
    torch.testing.assert_close(lowrank.to_matrix(out), closed)
    assert layer.rank == int((s > tau).sum()) == 3 and layer.max_rank == 15
    assert layer.left.shape == (20, 3) and layer.right.shape == (3, 15)
    torch.testing.assert_close(layer.left @ layer.right, closed)
    torch.testing.assert_close(layer.kept, s[:3] - tau)
    # balanced factors: AᵀA = B Bᵀ = diag(σ − τ)
    torch.testing.assert_close(layer.left.T @ layer.left, torch.diag(s[:3] - tau))
    torch.testing.assert_close(layer.right @ layer.right.T, torch.diag(s[:3] - tau))


def test_l1_prox_is_soft_threshold_and_minimises():
    v = torch.linspace(-2, 2, 41, dtype=torch.float64)
    kappa = 0.3
    x = soft_threshold(v, kappa)
    direct = torch.where(v > kappa, v - kappa, torch.where(v < -kappa, v + kappa, torch.zeros_like(v)))
    torch.testing.assert_close(x, direct)
    grid = torch.linspace(-3, 3, 60001, dtype=torch.float64)
    for vi, xi in zip(v[::5], x[::5]):
        objective = kappa * grid.abs() + 0.5 * (grid - vi) ** 2
        assert abs(float(grid[objective.argmin()]) - float(xi)) < 2e-4


def test_factorized_message_bytes_and_dense_fallback():
    gen = torch.Generator().manual_seed(2)
    rows_cols = {"low": (30, 20), "high": (6, 5), "zero": (12, 9)}
    params, layers = {}, {}
    for name, (rows, cols) in rows_cols.items():
        base = torch.randn(rows, cols, generator=gen)
        s = torch.linalg.svdvals(base)
        tau = {"low": float(s[1] + s[2]) / 2, "high": float(s[-1]) / 2, "zero": float(s[0]) + 1}[name]
        params[name], layers[name] = lowrank.threshold(base, tau)
    params["bias"] = torch.randn(5, generator=gen)
    msg = Message.model(lowrank.encode(params, layers))
    entries = msg["model"].entries
    assert isinstance(entries["low"], LowRank) and layers["low"].rank == 2
    assert entries["low"].nbytes() == (30 + 20) * 2 * 4
    # rank 5 of a 6×5 matrix: factors (6+5)·5 = 55 > 30 dense values, so the dense tensor goes
    assert isinstance(entries["high"], torch.Tensor) and entries["high"].shape == (6, 5)
    assert isinstance(entries["zero"], LowRank) and layers["zero"].rank == 0 and entries["zero"].nbytes() == 0
    assert msg.nbytes() == (50 * 2 + 30 + 0 + 5) * 4
    decoded = lowrank.decode(msg)
    for name, value in params.items():
        torch.testing.assert_close(decoded[name], value, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(decoded["zero"]) == 0


# ---- the method --------------------------------------------------------------------------------

@pytest.mark.parametrize("lam, rounds, rtol", [(0.0, 3, 1e-6), (1e-3, 2, 1e-5)])
def test_algorithm2_and_3_give_the_same_iterates(lam, rounds, rtol):
    """algo2 keeps every γ_i, algo3 their running mean: the server iterates must agree.

    (With λ > 0 the float32 SVD's rounding is amplified by later rounds, hence fewer rounds.)"""
    models = {}
    for algo in ("algo2", "algo3"):
        sim = Simulator(fedslr_config(method__server=algo, method__lam=lam, federation__rounds=rounds))
        run_rounds(sim)
        models[algo] = sim.method.global_model
        if algo == "algo2":
            assert sim.method.gamma_mean is None and sim.method.gamma_all["fc1.weight"].shape[0] == 10
        else:
            assert sim.method.gamma_all is None
    for name, a in models["algo2"].items():
        b = models["algo3"][name]
        assert float((a - b).norm() / a.norm()) < rtol, name


def test_server_mirrors_client_duals():
    """Algorithm 2's server copy of γ_i equals the client's own γ_i (no extra traffic needed)."""
    sim = Simulator(fedslr_config(method__server="algo2", method__lam=1e-3, federation__rounds=2))
    run_rounds(sim)
    seen = [c for c in range(sim.num_clients) if "gamma" in sim.client_states[c]]
    assert seen
    for cid in seen:
        for name, g in sim.client_states[cid]["gamma"].items():
            torch.testing.assert_close(sim.method.gamma_all[name][cid], g, rtol=1e-5, atol=1e-7)
    unseen = [c for c in range(sim.num_clients) if c not in seen]
    for cid in unseen:
        assert all(float(sim.method.gamma_all[n][cid].abs().max()) == 0 for n in sim.method.gamma_all)


def test_large_lambda_lowers_rank_and_downlink_bytes():
    results = {}
    for lam in (0.0, 3e-2):
        sim = Simulator(fedslr_config(method__lam=lam, federation__rounds=4, federation__eval_every=4))
        final = run_rounds(sim)[-1]
        results[lam] = (final, [down for _, down in sim.ledger.per_round])
    dense, sparse = results[0.0], results[3e-2]
    full = dense[0]["model/rank_mean"]
    assert dense[0]["model/params"] == sum(p.numel() for p in Simulator(fedslr_config()).method.global_model.values())
    assert sparse[0]["model/rank_mean"] < 0.8 * full
    assert sparse[0]["model/params"] < dense[0]["model/params"]
    # round 0 sends the dense initial model in both runs; later rounds the thresholded GKR
    assert sparse[1][0] == dense[1][0]
    assert sparse[1][-1] < 0.8 * dense[1][-1]
    assert len(set(dense[1])) == 1
    assert sparse[0]["comm/down_bytes"] == sum(sparse[1])


def test_model_params_count_matches_the_message():
    sim = Simulator(fedslr_config(method__lam=3e-2, federation__rounds=3))
    run_rounds(sim)
    msg = sim.method.broadcast(sim.round, 0)
    assert msg.num_params() == sim.method.gkr_params()
    assert msg.nbytes() == 4 * sim.method.gkr_params()
    assert any(isinstance(e, LowRank) for e in msg["model"].entries.values())


def test_mixed_model_beats_gkr_on_personalized_accuracy():
    cfg = fedslr_config(data__partition__alpha=0.1, federation__rounds=6, federation__eval_every=6,
                        federation__lr=0.05)
    final = run_rounds(Simulator(cfg))[-1]
    assert final["test/acc_mean"] > 0.3, final  # chance: 0.1
    assert final["test/acc_mean"] > final["global/test_acc"] + 0.1, final
    assert 0.0 < final["model/sparsity"] < 1.0
    assert final["model/mixed_params"] > final["model/params"]


def test_larger_mu_gives_sparser_personal_part():
    sparsity = {}
    for mu in (0.0, 0.05):
        cfg = fedslr_config(method__mu=mu, federation__rounds=2, federation__eval_every=2)
        sparsity[mu] = run_rounds(Simulator(cfg))[-1]["model/sparsity"]
    # μ = 0 leaves only never-updated entries at zero (constant-zero pixels, dead units)
    assert sparsity[0.05] > sparsity[0.0] + 0.2


def test_resume_continues_identically(tmp_path):
    cfg = fedslr_config(method__lam=1e-3, federation__rounds=4, federation__eval_every=4)
    full, again = straight_and_resumed(cfg, tmp_path)
    for name, value in full.method.global_model.items():
        torch.testing.assert_close(again.method.global_model[name], value, rtol=0, atol=0)
    assert full.ledger.down_bytes == again.ledger.down_bytes


@pytest.mark.parametrize("override, field", [
    ({"method__lam": -1.0}, "method.lam"),
    ({"method__eta": 0.0}, "method.eta"),
    ({"method__mu": -0.1}, "method.mu"),
    ({"method__server": "algo4"}, "method.server"),
    ({"method__p_init": "random"}, "method.p_init"),
    ({"method__phase2_epochs": -1}, "method.phase2_epochs"),
    ({"method__weight_decay": -1e-3}, "method.weight_decay"),
])
def test_bad_hyperparameters_name_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        fedslr_config(**override)
    assert info.value.field == field


def test_unknown_lowrank_exclude_is_a_config_error_and_exclusion_works():
    with pytest.raises(ConfigError) as info:
        Simulator(fedslr_config(method__lowrank_exclude=["fc9.weight"]))
    assert info.value.field == "method.lowrank_exclude" and "fc1.weight" in str(info.value)
    with pytest.raises(ConfigError):
        Simulator(fedslr_config(method__lowrank_exclude=["fc1.bias"]))
    sim = Simulator(fedslr_config(method__lam=1e-2, method__lowrank_exclude=["fc2.weight"], federation__rounds=2))
    final = run_rounds(sim)[-1]
    assert "model/rank/fc2.weight" not in final and "model/rank/fc1.weight" in final
    assert isinstance(sim.method.broadcast(2, 0)["model"].entries["fc2.weight"], torch.Tensor)


def test_search_space_loads_and_validates():
    from pfl.tune.space import base_config, check_space, load_space

    space = load_space(ROOT / "search_spaces" / "fedslr.yaml")
    assert set(space.distributions) == {"method.lam", "method.mu", "method.eta"}
    assert space.distributions["method.lam"].values == [1e-5, 5e-5, 1e-4, 5e-4, 1e-3]
    assert space.distributions["method.eta"].values == [2.0, 10.0, 20.0, 100.0]
    check_space(space, base_config(space))
    check_space(space, base_config(space, smoke=True))


def test_lambda_zero_phase_one_is_feddyn():
    """λ = 0, no weight decay: the GKR iterates are FedDyn's with α = 1/η (the spec's check)."""
    common = dict(federation__rounds=3, federation__eval_every=3, federation__weight_decay=0.0)
    slr = Simulator(fedslr_config(method__lam=0.0, method__eta=5.0, method__weight_decay=0.0,
                                  method__phase2_epochs=0, **common))
    run_rounds(slr)
    dyn = Simulator(small_config(method__name="feddyn", method__alpha=0.2, **common))
    run_rounds(dyn)
    for name, a in dyn.method.global_model.items():
        b = slr.method.global_model[name]
        assert float((a - b).norm() / a.norm()) < 1e-5, name
