"""Clustered methods against truths computed in numpy (tests/truth.py): two clusters of two clients
whose least-squares problems differ, so the right partition is known by construction and each
cluster's model has a closed form (a FedAvg fixed point, or the cluster's joint optimum).

FPFC and FPFC-L1 are checked on the first-order optimality (KKT) conditions of their objective
Σ_i f_i(w_i) + (1/m) Σ_{i<j} P(‖w_i − w_j‖), written out here with the penalty's derivative."""

import numpy as np
import pytest

from truth import (affine_fixed_point, close, components, least_squares, params_of, run_rounds, same_partition,
                   simulator, vec)

LR, K = 0.2, 2
TRUE = [0, 0, 1, 1]


@pytest.fixture(scope="module")
def problem():
    return least_squares(clusters=TRUE)


def _cluster_map(p, members, weights=None, steps=K):
    w = np.full(len(members), 1 / len(members)) if weights is None else weights
    return lambda th: sum(wi * p.gd(i, th, steps, LR) for i, wi in zip(members, w))


# ---- IFCA ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_ifca_clients_pick_the_lowest_loss_model_and_each_model_reaches_its_clusters_fixed_point(problem, weighting):
    p = problem
    sim = simulator(p, "ifca", steps=K, lr=LR, method__k=2, method__weighting=weighting)
    like = sim.method.models[0]
    starts = [np.array([0.0, 0.0, 0.0]), np.array([6.0, 3.0, 0.0])]  # two start points, no optimum in them
    sim.method.models = [params_of(s, like) for s in starts]
    choice = [int(np.argmin([p.loss(i, s) for s in starts])) for i in range(p.m)]
    assert choice == TRUE
    run_rounds(sim, 1)
    def weights(members):
        n = np.array([p.n(i) for i in members], dtype=float)
        return n / n.sum() if weighting == "samples" else None

    for j in (0, 1):
        members = [i for i in range(p.m) if choice[i] == j]
        assert close(vec(sim.method.models[j]), _cluster_map(p, members, weights(members))(starts[j]))
    run_rounds(sim, 30)
    for j in (0, 1):
        members = [i for i in range(p.m) if TRUE[i] == j]
        fixed = affine_fixed_point(_cluster_map(p, members, weights(members)), p.dim)
        assert close(vec(sim.method.models[j]), fixed, 1e-5)
    sim.evaluate()
    assert sim.method.cluster_assignment() == {i: TRUE[i] for i in range(p.m)}


def test_ifca_leaves_a_model_nobody_chose_untouched(problem):
    p = problem
    sim = simulator(p, "ifca", steps=K, lr=LR, method__k=3)
    like = sim.method.models[0]
    starts = [np.array([0.0, 0.0, 0.0]), np.array([6.0, 3.0, 0.0]), np.array([-50.0, 40.0, 9.0])]
    sim.method.models = [params_of(s, like) for s in starts]
    run_rounds(sim, 1)
    assert close(vec(sim.method.models[2]), starts[2], 0.0)


# ---- CFL -----------------------------------------------------------------------------------------

def test_cfl_splits_when_the_mean_update_is_small_and_reaches_the_cluster_optima(problem):
    p, eps1, eps2 = problem, 0.05, 1.0
    sim = simulator(p, "cfl", steps=K, lr=LR, method__eps1=eps1, method__eps2=eps2, method__start_round=3,
                    method__min_size=2)
    theta = vec(sim.method.models[0])
    split_round = None
    for rnd in range(40):
        deltas = [p.gd(i, theta, K, LR) - theta for i in range(p.m)]
        mean_norm = np.linalg.norm(np.mean(deltas, 0))
        max_norm = max(np.linalg.norm(d) for d in deltas)
        run_rounds(sim, 1)
        if rnd >= 3 and mean_norm < eps1 and max_norm > eps2:
            split_round = rnd
            models = [theta + np.mean([deltas[i] for i in range(p.m) if TRUE[i] == c], 0) for c in (0, 1)]
            break
        theta = theta + np.mean(deltas, 0)
        assert len(sim.method.clusters) == 1 and close(vec(sim.method.models[0]), theta)
        assert sim.method.stats["cfl/mean_norm"] == pytest.approx(mean_norm, rel=1e-4)
    assert split_round is not None and split_round > 3
    assert sorted(map(sorted, sim.method.clusters)) == [[0, 1], [2, 3]]
    by_members = {tuple(sorted(c)): vec(m) for c, m in zip(sim.method.clusters, sim.method.models)}
    assert close(by_members[(0, 1)], models[0]) and close(by_members[(2, 3)], models[1])
    run_rounds(sim, 60)
    assert len(sim.method.clusters) == 2  # clusters of min_size clients are not split again
    for c, members in ((0, (0, 1)), (1, (2, 3))):
        fixed = affine_fixed_point(_cluster_map(p, list(members)), p.dim)
        got = {tuple(sorted(cl)): vec(m) for cl, m in zip(sim.method.clusters, sim.method.models)}[members]
        assert close(got, fixed, 1e-5)


# ---- PACFL ---------------------------------------------------------------------------------------

def _subspace_problem():
    """Cluster 0's inputs lie in span(e1, e2), cluster 1's in span(e3, e4) of R^4: principal angles
    0° within a cluster and 90° across, known before any SVD."""
    rs = np.random.RandomState(3)
    X, Y = [], []
    for i, c in enumerate(TRUE):
        n = 20 + 3 * i
        x = np.zeros((n, 4))
        x[:, 2 * c:2 * c + 2] = rs.normal(size=(n, 2))
        X.append(x)
        Y.append(x @ np.array([1.0, -2.0, 3.0, 0.5]) + 0.2 * rs.normal(size=n))
    return least_squares(sizes=[len(y) for y in Y], d=4, clusters=TRUE).__class__(X, Y, np.array(TRUE))


@pytest.mark.parametrize("angle", ["principal", "reference"])
def test_pacfl_angles_partition_and_per_cluster_fedavg(angle):
    p = _subspace_problem()
    sim = simulator(p, "pacfl", steps=K, lr=LR, method__n_basis=2, method__angle=angle, method__beta=60.0)
    theta0 = vec(sim.client_role.init)
    run_rounds(sim, 1)  # the one-shot round: bases only, no training
    prox = sim.method.prox.double().numpy()
    across = np.array([[TRUE[i] != TRUE[j] for j in range(4)] for i in range(4)])
    np.testing.assert_allclose(prox[across], 90.0, atol=1e-3)
    if angle == "principal":
        np.testing.assert_allclose(prox[~across], 0.0, atol=0.1)  # the same plane (arccos near 1 is coarse)
    else:  # the smallest angle between two orthonormal bases of one plane is at most 45°
        assert (prox[~across] <= 45.0 + 1e-3).all()
    assert same_partition([sim.method.labels[i] for i in range(4)], TRUE)
    models = {c: theta0.copy() for c in (0, 1)}
    for _ in range(3):
        for c in (0, 1):
            members = [i for i in range(4) if TRUE[i] == c]
            n = np.array([p.n(i) for i in members], dtype=float)
            models[c] = _cluster_map(p, members, n / n.sum())(models[c])
    run_rounds(sim, 3)
    for i in range(4):
        assert close(vec(sim.method.models[sim.method.labels[i]]), models[TRUE[i]])


# ---- FPFC and FPFC-L1: stationarity of the fusion-penalised objective --------------------------------

def scad_derivative(t, lam, a):
    """P'_λ(t) of plain SCAD (ξ = 0) for t > 0 (docs/methods/fpfc.md §1)."""
    return lam if t <= lam else (a * lam - t) / (a - 1) if t <= a * lam else 0.0


def fusion_residual(p, W, derivative, lam, fused_tol=1e-4):
    """Largest violation of the first-order conditions of Σ f_i(w_i) + (1/m)Σ_{i<j} P(‖w_i − w_j‖).

    Devices closer than ``fused_tol`` form a fused group; across groups the penalty is smooth (force
    P'(t)/m along the unit difference); inside a group each pair may carry any force of norm ≤ λ/m,
    so the group's forces must cancel in sum and each device's leftover must fit in that ball."""
    m = len(W)
    group = list(range(m))
    for i in range(m):
        for j in range(i):
            if np.linalg.norm(W[i] - W[j]) < fused_tol:
                group[i] = group[j]
    worst = 0.0
    for g in set(group):
        members = [i for i in range(m) if group[i] == g]
        rows = []
        for i in members:
            r = p.grad(i, W[i])
            for j in range(m):
                if group[j] != g:
                    d = W[i] - W[j]
                    t = np.linalg.norm(d)
                    r = r + derivative(t) / m * d / t
            rows.append(r)
        worst = max(worst, float(np.abs(np.sum(rows, 0)).max()))
        for r in rows:  # what the in-group pair forces must absorb
            worst = max(worst, float(np.linalg.norm(r)) - lam / m * (len(members) - 1))
    return worst, len(set(group))


@pytest.mark.parametrize("lam, groups, per_round", [(1.0, 2, 0), (0.5, 4, 0), (1.0, 2, 2)])
def test_fpfc_scad_reaches_a_stationary_point_and_fuses_the_clusters(problem, lam, groups, per_round):
    """λ = 1: each cluster fuses (its joint optimum needs a pair force 0.18 ≤ λ/m = 0.25) and the
    clusters, farther apart than aλ, exert no force; λ = 0.5 (force 0.125 < 0.18, 0.13) fuses neither.
    ``per_round`` 2: half the devices each round (the server updates only their pairs) reach it too."""
    p, a = problem, 3.7
    sim = simulator(p, "fpfc", steps=5, lr=LR, per_round=per_round, method__lam=lam, method__xi=0.0, method__a=a)
    run_rounds(sim, 60 if not per_round else 200)
    W = sim.method.W.double().numpy()
    residual, found = fusion_residual(p, W, lambda t: scad_derivative(t, lam, a), lam)
    assert residual < 1e-4 and found == groups
    if groups == 2:
        for i in range(p.m):
            members = [j for j in range(p.m) if TRUE[j] == TRUE[i]]
            assert close(W[i], p.joint_opt(members), 1e-5)


@pytest.mark.parametrize("lam", [0.3, 1.5])
def test_fpfc_l1_reaches_the_group_lasso_optimum(problem, lam):
    """Convex: the KKT conditions identify the optimum; every pair, far or near, pulls with λ/m."""
    p = problem
    sim = simulator(p, "fpfc_l1", steps=5, lr=LR, method__lam=lam)
    run_rounds(sim, 80)
    W = sim.method.W.double().numpy()
    residual, found = fusion_residual(p, W, lambda t: lam, lam)
    assert residual < 1e-4
    assert found == (4 if lam < 1 else 2)
    # the pull of the far cluster moves the fused model off its cluster's joint optimum
    if lam > 1:
        assert not close(W[0], p.joint_opt([0, 1]), 1e-2)


def test_fpfc_cluster_assignment_is_the_partition_of_now_after_rounds_without_an_evaluation(problem):
    """``Method.cluster_assignment``: the clusters of now. An evaluation at the start (θ = 0: every pair
    below ν, one cluster) must not be what FPFC answers after training rounds have moved θ; the truth
    is the connected components of {‖θ_ij‖ < ν} found here by a search over the numpy pair norms."""
    p = problem
    sim = simulator(p, "fpfc", steps=5, lr=LR, method__lam=0.05, method__nu=0.5)
    sim.evaluate()
    assert set(sim.method.cluster_assignment().values()) == {0}
    run_rounds(sim, 15)
    theta = sim.method.theta.double().numpy()
    labels = components(np.linalg.norm(theta, axis=2) < 0.5)
    assert labels.max() > 0, "the rounds must split the federation for this test to tell the answers apart"
    got = sim.method.cluster_assignment()
    assert same_partition([got[i] for i in range(p.m)], labels)
