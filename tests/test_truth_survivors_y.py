"""Truths for the survivors of list Y (issue 42): FPFC's ``begin_round``, ``prox``, ``distances``,
``cluster_assignment`` and ``round_metrics``. The simulated clock is checked by a hand count (speed 1,
no latency: each round lasts c·local_steps·max n_i of its sampled devices; an empty round lasts 0) and,
with latency on, against the delay model's τ of each (round, device) — fresh draws each round, as the
clock's docstring says. ζ_i with newcomers held out is recomputed in numpy as the members' average
(1/|M|) Σ_{j∈M} (w_j + θ_ij − v_ij/ρ), and on ``meta`` tensors every index is built on the server's
device. The proximal maps are checked by brute force on a fine grid against their definition
argmin_θ P(|θ|) + (ρ/2)(θ − δ)² (SCAD with a ≠ 3.7; the group lasso with ρ ≠ 1). ``distances`` with
newcomers: +inf for pairs that do not exist, 0 on the diagonal, ‖θ_ij‖ elsewhere; the assignment
before any evaluation: connected components of {‖θ_ij‖ < ν} by a union–find written here; the primal
residual and scale over the members' pairs i < j from their definitions."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from truth import CudaDeviceRules, components, least_squares, run_rounds, same_partition, simulator


def _newcomers(**kw):
    """Six devices, newcomers 0 and 2 held out of training, after two rounds (ρ = 1.5)."""
    p = least_squares(sizes=(20, 30, 24, 27, 22, 25), clusters=[0, 0, 0, 1, 1, 1])
    settings = dict(steps=2, lr=0.2, newcomers__fraction=0.34, method__lam=0.5, method__xi=0.0, method__rho=1.5)
    settings.update(kw)
    sim = simulator(p, "fpfc", **settings)
    run_rounds(sim, 2)
    assert sorted(sim.ctx.newcomers) == [0, 2]
    return sim


# ---- the simulated clock ------------------------------------------------------------------------------

def test_fpfc_sim_clock_adds_the_slowest_devices_work_of_every_round():
    """Speed 1 (σ = 0), no latency, c = 0.5, 3 full-batch steps, every device every round: a round lasts
    0.5·3·max n_i = 45, three rounds 135; an empty round adds nothing (kills begin_round 1, 2, 3, 5, 7, 12)."""
    p = least_squares(sizes=(20, 30, 24, 27))
    sim = simulator(p, "fpfc", steps=3, method__clock_c=0.5, method__clock_speed_sigma=0.0,
                    method__clock_latency=0.0)
    meth = sim.method
    per_round = 0.5 * 3 * max(p.n(i) for i in range(p.m))
    for k in range(1, 4):
        run_rounds(sim, 1)
        assert meth.sim_clock == pytest.approx(k * per_round, rel=1e-12)
    meth.begin_round(sim.round, [])
    assert meth.sim_clock == pytest.approx(3 * per_round, rel=1e-12)
    metrics = sim.evaluate()
    assert metrics["time/sim_clock"] == pytest.approx(3 * per_round, rel=1e-12)


def test_fpfc_sim_clock_draws_a_fresh_latency_for_every_round():
    """No compute time (c = 0): a round lasts the largest of its devices' latencies, drawn per (round,
    device); the clock is the sum over the rounds of max_i τ(round, i), and the rounds differ (kills
    begin_round 8)."""
    p = least_squares(sizes=(20, 30, 24, 27))
    sim = simulator(p, "fpfc", steps=1, method__clock_c=0.0, method__clock_speed_sigma=0.0,
                    method__clock_latency=0.3)
    meth = sim.method
    rounds, lengths = [], []
    for _ in range(3):
        rounds.append(sim.round)
        before = meth.sim_clock
        run_rounds(sim, 1)
        lengths.append(meth.sim_clock - before)
    expected = [max(meth.delays.tau(k, i) for i in range(p.m)) for k in rounds]
    assert lengths == pytest.approx(expected, rel=1e-12)
    assert len({round(x, 12) for x in lengths}) == 3


# ---- ζ_i with newcomers held out ----------------------------------------------------------------------

def test_fpfc_zeta_with_newcomers_is_the_members_average():
    """Newcomers 0 and 2 are not in the federation: ζ_i = (1/4) Σ_{j∈M} (w_j + θ_ij − v_ij/ρ) over the
    four members, ρ = 1.5 (kills begin_round 22, 23, 25, 39, 45)."""
    sim = _newcomers()
    meth = sim.method
    members = [1, 3, 4, 5]
    W, theta, v = (t.double().numpy() for t in (meth.W, meth.theta, meth.v))
    assert np.any(theta != 0.0) and np.any(v != 0.0)
    sampled = [1, 4, 5]
    meth.begin_round(sim.round, sampled)
    for i in sampled:
        expected = np.mean([W[j] + theta[i, j] - v[i, j] / 1.5 for j in members], axis=0)
        got = np.concatenate([t.detach().double().numpy().ravel()
                              for t in meth.broadcast(sim.round, i).tensors("zeta").values()])
        assert np.allclose(got, expected, rtol=1e-5, atol=1e-6), i


def test_fpfc_zeta_with_newcomers_is_computed_on_the_servers_device():
    """W, θ, v held on ``meta``: the sampled rows and the members' columns are indexed there (kills
    begin_round 18, 21, 29, 32)."""
    sim = _newcomers()
    meth = sim.method
    meth.W, meth.theta, meth.v = (t.to("meta") for t in (meth.W, meth.theta, meth.v))
    with CudaDeviceRules():
        meth.begin_round(sim.round, [1, 3])
    zeta = meth.broadcast(sim.round, 3).tensors("zeta")
    assert set(zeta) == set(meth.clustered) and all(t.device.type == "meta" for t in zeta.values())


# ---- the proximal maps --------------------------------------------------------------------------------

def _grid_prox(delta: float, penalty, rho: float) -> float:
    """argmin over θ of penalty(|θ|) + (ρ/2)(θ − δ)² on a grid of step 1e-5 around δ."""
    grid = np.linspace(-3.0, 3.0, 600_001)
    objective = penalty(np.abs(grid)) + 0.5 * rho * (grid - delta) ** 2
    return float(grid[np.argmin(objective)])


def _scad(t: np.ndarray, lam: float, a: float) -> np.ndarray:
    """Fan & Li's SCAD: λt, then (2aλt − t² − λ²)/(2(a−1)), then (a+1)λ²/2."""
    return np.where(t <= lam, lam * t,
                    np.where(t <= a * lam, (2 * a * lam * t - t ** 2 - lam ** 2) / (2 * (a - 1)),
                             (a + 1) * lam ** 2 / 2))


def test_fpfc_scad_prox_uses_the_configured_shape_parameter():
    """a = 2.5, λ = 0.5, ρ = 1, ξ = 0: δ in the linear, the concave (1 < δ ≤ aλ = 1.25) and the flat
    region past aλ but below 3.7λ, where a = 3.7 would still shrink (kills prox 22)."""
    p = least_squares(sizes=(20, 30, 24, 27))
    lam, rho, a = 0.5, 1.0, 2.5
    sim = simulator(p, "fpfc", method__lam=lam, method__rho=rho, method__a=a, method__xi=0.0)
    deltas = [0.3, 0.8, 1.1, 1.2, 1.5, -1.7]
    got = sim.method.prox()(torch.tensor(deltas, dtype=torch.float64).unsqueeze(1)).squeeze(1).numpy()
    expected = [_grid_prox(d, lambda t: _scad(t, lam, a), rho) for d in deltas]
    assert np.allclose(got, expected, atol=2e-5), (got, expected)


def test_fpfc_l1_prox_thresholds_by_lambda_over_rho():
    """Group lasso λ = 0.4, ρ = 2: argmin λ|θ| + (ρ/2)(θ − δ)² is δ shrunk by λ/ρ = 0.2 (kills prox 6)."""
    p = least_squares(sizes=(20, 30, 24, 27))
    lam, rho = 0.4, 2.0
    sim = simulator(p, "fpfc_l1", method__lam=lam, method__rho=rho)
    deltas = [0.1, 0.3, -0.5, 0.9, 1.4]
    got = sim.method.prox()(torch.tensor(deltas, dtype=torch.float64).unsqueeze(1)).squeeze(1).numpy()
    expected = [_grid_prox(d, lambda t: lam * t, rho) for d in deltas]
    assert np.allclose(got, expected, atol=2e-5), (got, expected)


# ---- distances, clusters, residuals with newcomers ----------------------------------------------------

def test_fpfc_distances_with_newcomers_are_infinite_for_pairs_that_do_not_exist():
    """Before the join, every pair touching newcomer 0 or 2 does not exist (+inf), a device's distance to
    itself is 0, the members' pairs are ‖θ_ij‖ (kills distances 3, 10, 15)."""
    sim = _newcomers()
    meth = sim.method
    theta = meth.theta.double().numpy()
    dist = meth.distances().double().numpy()
    for i in range(6):
        for j in range(6):
            if i == j:
                expected = 0.0
            elif i in (0, 2) or j in (0, 2):
                expected = math.inf
            else:
                expected = float(np.sqrt(np.sum(theta[i, j] ** 2)))
            assert dist[i, j] == pytest.approx(expected, rel=1e-6), (i, j)


def test_fpfc_assignment_before_any_evaluation_is_the_components_below_nu():
    """No evaluation yet: the members' assignment is the connected components of {‖θ_ij‖ < ν} over the
    members; ν is set between two of the pair norms so that the partition is neither one cluster nor
    singletons (kills cluster_assignment 2, 4)."""
    sim = _newcomers()
    meth = sim.method
    members = [1, 3, 4, 5]
    theta = meth.theta.double().numpy()
    norms = np.sqrt(np.sum(theta ** 2, axis=-1))[np.ix_(members, members)]
    pairs = sorted(norms[np.triu_indices(4, 1)])
    nu = 0.5 * (pairs[0] + pairs[1])
    meth.hp = dataclasses.replace(meth.hp, nu=float(nu))
    assert meth._labels is None
    assignment = meth.cluster_assignment()
    assert sorted(assignment) == members
    expected = components(norms < nu)
    assert same_partition([assignment[c] for c in members], expected)
    assert 1 < len(set(expected)) < 4


def test_fpfc_residuals_with_newcomers_are_over_the_members_pairs():
    """With newcomers held out the round's primal residual is (Σ_{i<j∈M} ‖w_i − w_j − θ_ij‖²)^½ and its
    scale max(|M|·Σ_{i∈M} ‖w_i − w̄_M‖², ½Σ_{i,j∈M} ‖θ_ij‖²)^½ over the four members (kills
    round_metrics 7, 13)."""
    sim = _newcomers()
    metrics = sim.run_round(evaluate=False)
    meth = sim.method
    members = [1, 3, 4, 5]
    W, theta = meth.W.double().numpy(), meth.theta.double().numpy()
    primal = sum(np.sum((W[i] - W[j] - theta[i, j]) ** 2) for a, i in enumerate(members) for j in members[a + 1:])
    Wm = W[members]
    spread = len(members) * np.sum((Wm - Wm.mean(0)) ** 2)
    theta_sq = 0.5 * np.sum(theta[np.ix_(members, members)] ** 2)
    assert metrics["fpfc/primal_residual"] == pytest.approx(math.sqrt(primal), rel=1e-4)
    assert metrics["fpfc/primal_scale"] == pytest.approx(math.sqrt(max(spread, theta_sq)), rel=1e-4)
