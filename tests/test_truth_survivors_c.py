"""Survivors of group C (pfl.methods.lag, pfl.methods.marina, pfl.methods.pacfl) against truths written
here: closed forms (LAG's every-skip trajectory, MARINA's coin count), numpy re-computations on a
least-squares federation (tests/truth.py) with the client's own seeded draws as inputs, hand-made
geometries whose angles are known before any SVD (PACFL), UPGMA/single/complete linkage by hand,
and the wire's byte counts from the message definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from truth import Recorder, close, config, least_squares, run_rounds, simulator, vec
from pfl.federation.messages import Message, State
from pfl.federation.simulator import Simulator
from pfl.schema import ConfigError

LR, K = 0.05, 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(d=4, sizes=(20, 30, 24, 27), clusters=[0, 1, 2, 3])


def sample_weights(p, clients=None):
    clients = range(p.m) if clients is None else clients
    n = np.array([p.n(i) for i in clients], dtype=float)
    return n / n.sum()


# ---- LAG ---------------------------------------------------------------------------------------------

def test_lag_threshold_with_no_history_is_zero():
    """thr = Σ_{j=1}^{D} (ξ/D)·m_{t+1−j}: with D = 0 the sum is empty (kills lag_threshold 9, 17, 19)."""
    from pfl.methods.lag import lag_threshold

    assert lag_threshold([0.5, 2.0], xi=0.7, D=0) == 0.0
    assert lag_threshold([0.5, 2.0], xi=0.7, D=0, server_lr=0.5) == 0.0


@pytest.mark.parametrize("eta, weighting", [(2.0, "samples"), (1.0, "uniform"), (0.5, "uniform")])
def test_lag_with_a_huge_xi_every_client_skips_from_its_second_round(problem, eta, weighting):
    """ξ huge: round 0 uploads Δ_i = GD_K(x⁰) − x⁰; from round 1 on every client skips, so the server
    repeats x ← x + η·Σ w_i Δ_i: x^R = x⁰ + R·η·Σ w_i Δ_i, and skip_rate = m(R−1)/(mR) = (R−1)/R."""
    p, R = problem, 4
    sim = simulator(p, "lag", steps=K, lr=LR, method__xi=1e12, method__history=2, method__server_lr=eta,
                    method__weighting=weighting)
    x0 = vec(sim.method.global_model)
    w = sample_weights(p) if weighting == "samples" else np.full(p.m, 1 / p.m)
    step = sum(wi * (p.gd(i, x0, K, LR) - x0) for i, wi in enumerate(w))
    for r in range(1, R + 1):
        sim.run_round(evaluate=False)
        assert close(vec(sim.method.global_model), x0 + r * eta * step, 1e-4)
        assert sim.method.extra_metrics(r)["lag/skip_rate"] == pytest.approx((r - 1) / r)
        up, _ = sim.ledger.per_round[-1]
        if r > 1:
            assert up == p.m * 1   # a SKIP is one header byte (8 bits) per client


def test_lag_skips_an_unchanged_update_at_a_zero_threshold(problem):
    """ξ = 0 (thr = 0) and no local training (0 epochs): Δ_i = 0 every round, so ‖Δ_i − Δ̂_i‖² = 0 ≤ 0
    and from round 1 on every client skips (kills local_update 44)."""
    sim = simulator(problem, "lag", steps=None, lr=LR, federation__local_epochs=0, method__xi=0.0)
    x0 = vec(sim.method.global_model)
    run_rounds(sim, 3)
    assert sim.method.extra_metrics(3)["lag/skip_rate"] == pytest.approx(2 / 3)
    assert close(vec(sim.method.global_model), x0, 1e-6)


def test_lag_threshold_travels_as_one_float32_whatever_the_default_dtype(problem):
    """thr is one float (4 bytes on the wire) even when torch's default dtype is float64 (kills
    broadcast 3, 5)."""
    sim = simulator(problem, "lag", steps=K, lr=LR)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        msg = sim.method.broadcast(0, 0)
    finally:
        torch.set_default_dtype(old)
    assert msg["thr"].nbytes() == 4


def test_lag_server_bytes_is_one_update_per_training_client(problem):
    from pfl.methods.base import ModelSize
    from pfl.methods.lag import LAG

    sim = simulator(problem, "lag", steps=K, lr=LR)
    size = ModelSize(params=5, head=5, features=4, classes=0)
    assert LAG.server_bytes(4, size, sim.cfg) == 4 * 4 * 5


def _randk_masks(rec, part, rounds, clients):
    return {(r, c): tuple(np.flatnonzero(rec.up[r, c][part].entries["fc.weight"].decoded.numpy().ravel()))
            for r in rounds for c in clients}


def test_lag_rand_k_draws_differ_between_clients_and_rounds(problem):
    """The compressor's draws are the client's own, per round: rand-k masks of one round are not all
    the same across clients, nor one client's across rounds (kills local_update 66, 67)."""
    rec = Recorder()
    sim = Simulator(config("lag", problem.m, steps=K, lr=LR, method__xi=0.0, compression__min_numel=1,
                           compression__uplink={"name": "randk", "ratio": 0.5}),
                    data=problem.federated(), stages=[rec])
    run_rounds(sim, 4)
    masks = _randk_masks(rec, "model", range(4), range(problem.m))
    assert all(len(set(masks[r, c] for c in range(problem.m))) > 1 for r in range(4))
    assert all(len(set(masks[r, c] for r in range(4))) > 1 for c in range(problem.m))


@pytest.mark.parametrize("uplink", [{"name": "topk", "ratio": 0.5}, {"name": "randk", "ratio": 0.5}])
def test_lag_with_a_lossless_downlink_is_lag_without_one(problem, uplink):
    """With a sparsified uplink, LAG (which encodes its own uplink as a change from the model it
    received) gives the same bits with an identity downlink as with no downlink stage at all. (The
    codec once read LAG's encoded change as the client's model there; kills local_update 84, 85 with
    the fix.) Not a general law: an identity downlink rebuilds a client's copy as h + (x − h), which
    can differ from x in the last bit (with a dense uplink the runs differ by ~1e-9 in round 2)."""
    models = []
    for down in ("none", "identity"):
        sim = simulator(problem, "lag", steps=K, lr=LR, method__xi=0.0, compression__min_numel=1,
                        compression__uplink=uplink, compression__downlink__name=down)
        run_rounds(sim, 3)
        models.append(vec(sim.method.global_model))
    assert np.array_equal(models[0], models[1])

# ---- MARINA ------------------------------------------------------------------------------------------

def _subset_grad(p, i, w, idx):
    """∇ of the mean squared error on the samples ``idx`` of client i (float64)."""
    Z, y = p.design(i)[idx], p.y[i][idx]
    return 2.0 / len(idx) * Z.T @ (Z @ w - y)


def _subset_loss(p, i, w, idx):
    r = p.design(i)[idx] @ w - p.y[i][idx]
    return float(np.mean(r * r))


def _draw(sim, i, rnd, n, batch):
    """The client's own minibatch draw of a round (an input here, like the data): ``batch`` of its
    ``n`` samples from its 'grad' generator, the same draw for both gradients of the round."""
    return torch.randperm(n, generator=sim.client(i).generator(rnd, "grad"))[:batch].numpy()


def test_marina_compressed_rounds_take_both_gradients_on_one_fresh_minibatch(problem):
    """c_k = 0 (p tiny): g^{k+1} = g^k + Σ w_i (∇f_i^B(x^{k+1}) − ∇f_i^B(x^k)) with B the client's
    minibatch of the round, the same for both gradients; round 0 is the full gradient; weights by
    training-set size; train/loss is the mean over clients of f_i^B(x^{k+1}) (kills _grad 8, 15, 16,
    18–23, local_update 19, 20, 34, 35, 43, 52, 78, 79)."""
    p, batch, lr = problem, 4, 0.1
    sim = simulator(p, "marina", lr=lr, federation__batch_size=batch, compression__uplink__name="identity",
                    method__p=1e-9, method__weighting="samples")
    w = sample_weights(p)
    x = vec(sim.method.x)
    full = [np.arange(p.n(i)) for i in range(p.m)]
    g = sum(wi * _subset_grad(p, i, x, full[i]) for i, wi in enumerate(w))
    metrics = sim.run_round(evaluate=False)
    assert metrics["train/loss"] == pytest.approx(np.mean([p.loss(i, x) for i in range(p.m)]), rel=1e-5)
    assert close(vec(sim.method.g), g, 1e-5)
    for rnd in range(1, 5):
        x_new = x - lr * g
        idx = [_draw(sim, i, rnd, p.n(i), batch) for i in range(p.m)]
        g = g + sum(wi * (_subset_grad(p, i, x_new, idx[i]) - _subset_grad(p, i, x, idx[i])) for i, wi in enumerate(w))
        loss = np.mean([_subset_loss(p, i, x_new, idx[i]) for i in range(p.m)])
        x = x_new
        metrics = sim.run_round(evaluate=False)
        assert metrics["train/loss"] == pytest.approx(loss, rel=1e-5)
        assert close(vec(sim.method.x), x, 1e-5) and close(vec(sim.method.g), g, 1e-4)
    assert sim.method.extra_metrics(5)["marina/full_rounds"] == 1.0


def test_marina_full_rounds_use_sync_batch_samples_drawn_per_round(problem):
    """p = 1, sync_batch = 3: every round g^k = mean_i ∇f_i^{B_k}(x^k) on a fresh 3-sample draw
    (kills _grad 15, local_update 25)."""
    p, lr, b = problem, 0.1, 3
    sim = simulator(p, "marina", lr=lr, compression__uplink__name="identity", method__p=1.0, method__sync_batch=b)
    x, g = vec(sim.method.x), None
    for rnd in range(4):
        if g is not None:
            x = x - lr * g
        g = np.mean([_subset_grad(p, i, x, _draw(sim, i, rnd, p.n(i), b)) for i in range(p.m)], axis=0)
        sim.run_round(evaluate=False)
        assert close(vec(sim.method.g), g, 1e-4) and close(vec(sim.method.x), x, 1e-5)
    assert sim.method.extra_metrics(4)["marina/full_rounds"] == 4.0


def test_marina_coin_is_the_rounds_public_draw_below_p(problem):
    """c_0 = 1; c_k = 1 iff u_k < p with u_k the round's public draw (an input: the run's 'marina'
    stream of round k); u_k = p exactly is c_k = 0 (P(c = 1) = p for u uniform on [0, 1)). The
    full-round count after round r is 1 + #{1 ≤ k ≤ r: u_k < p} (kills coin 4–6, 8–11, aggregate 24, setup 4)."""
    R = 12
    sim = simulator(problem, "marina", lr=0.1, compression__uplink__name="identity", method__p=0.5)
    u = [sim.ctx.rng(k, "marina").random() for k in range(R)]
    for r in range(R):
        sim.run_round(evaluate=False)
        expected = 1 + sum(uk < 0.5 for uk in u[1:r + 1])
        assert sim.method.extra_metrics(r)["marina/full_rounds"] == float(expected), r
    assert 1 < expected < R
    edge = simulator(problem, "marina", lr=0.1, compression__uplink__name="identity", method__p=u[1])
    run_rounds(edge, 2)
    assert edge.method.extra_metrics(2)["marina/full_rounds"] == 1.0


def test_marina_default_p_is_the_bits_ratio(problem):
    """p = 0: bits(Q)/(32d); the identity sends 32 bits a value, so p = 1, ω = 0 and γ = lr (kills
    configure 15)."""
    sim = simulator(problem, "marina", lr=0.1, compression__uplink__name="identity")
    m = sim.method.extra_metrics(0)
    assert m["marina/p"] == 1.0 and m["marina/omega"] == 0.0 and m["marina/gamma"] == pytest.approx(0.1)


def test_marina_refuses_partial_participation_naming_itself_and_why(problem):
    """The error names the field, the method and the reason (kills configure 2, 3, 7–10)."""
    with pytest.raises(ConfigError) as err:
        simulator(problem, "marina", lr=0.1, per_round=2)
    assert err.value.field == "federation.clients_per_round"
    text = str(err.value)
    assert "marina needs every client in every round" in text
    assert ("every client keeps its copy of x and the coin's full rounds need every gradient") in text


def test_marina_rand_k_draws_differ_between_clients_and_rounds(problem):
    """Compressed rounds (p tiny): the rand-k masks are the client's own per round (kills local_update
    70, 71)."""
    rec = Recorder()
    sim = Simulator(config("marina", problem.m, lr=0.1, compression__min_numel=1, method__p=1e-9,
                           compression__uplink={"name": "randk", "ratio": 0.5}),
                    data=problem.federated(), stages=[rec])
    run_rounds(sim, 5)
    masks = _randk_masks(rec, "g", range(1, 5), range(problem.m))
    assert all(len(set(masks[r, c] for c in range(problem.m))) > 1 for r in range(1, 5))
    assert all(len(set(masks[r, c] for r in range(1, 5))) > 1 for c in range(problem.m))


# ---- PACFL: the clustering of a distance matrix --------------------------------------------------------

def test_pacfl_cluster_by_threshold_of_one_client_is_one_integer_label():
    """Kills cluster_by_threshold 5–9: one client is cluster 0, as an integer label like every other size."""
    from pfl.methods.pacfl import cluster_by_threshold

    got = cluster_by_threshold(np.zeros((1, 1)), 3.5)
    assert got.shape == (1,) and got.dtype.kind == "i" and got.tolist() == [0]
    two = cluster_by_threshold(np.array([[0.0, 1.0], [1.0, 0.0]]), 3.5)
    assert two.dtype.kind == got.dtype.kind and two.tolist() == [0, 0]


def test_pacfl_cluster_by_threshold_merges_distances_below_one_degree():
    """Distances in [0, 1) are distances too: 0.2° ≤ β = 0.5° merges, 0.7° does not (kills 41)."""
    from pfl.methods.pacfl import cluster_by_threshold

    assert cluster_by_threshold(np.array([[0.0, 0.2], [0.2, 0.0]]), 0.5).tolist() == [0, 0]
    assert cluster_by_threshold(np.array([[0.0, 0.7], [0.7, 0.0]]), 0.5).tolist() == [0, 1]


@pytest.mark.parametrize("linkage, expected", [("single", [0, 0, 0]), ("average", [0, 0, 1]),
                                               ("weighted", [0, 0, 1]), ("complete", [0, 0, 1])])
def test_pacfl_cluster_by_threshold_uses_the_linkage_asked_for(linkage, expected):
    """d01 = 18, d12 = 20, d02 = 40, β = 25: after {0, 1} (18) the distance to 2 is min = 20 (single),
    (40 + 20)/2 = 30 (average, weighted), max = 40 (complete) (kills 31)."""
    from pfl.methods.pacfl import cluster_by_threshold

    d = np.array([[0.0, 18.0, 40.0], [18.0, 0.0, 20.0], [40.0, 20.0, 0.0]])
    assert cluster_by_threshold(d, 25.0, linkage).tolist() == expected


# ---- PACFL: bases and angles -----------------------------------------------------------------------------

def test_pacfl_data_basis_is_the_float64_top_subspace_of_ill_conditioned_data():
    """Samples = a large common vector plus tiny spread: the 2nd and 3rd left singular vectors are
    lost in float32; the basis spans numpy's float64 top-3 subspace to 1e-5 (kills data_basis 2)."""
    from pfl.methods.pacfl import data_basis

    rs = np.random.RandomState(0)
    c = np.ones(5) / np.sqrt(5)
    x = 1e3 * c[None, :] + rs.normal(size=(30, 5)) * np.array([1, 0.5, 0.25, 0.01, 0.005]) * 1e-2
    xt = torch.tensor(x, dtype=torch.float32)
    ref = np.linalg.svd(xt.double().numpy().T, full_matrices=False)[0][:, :3]
    got = data_basis(xt, None, 3).double().numpy()
    assert got.shape == (5, 3)
    assert np.abs(ref @ ref.T - got @ got.T).max() < 1e-5


def test_pacfl_data_basis_keeps_a_label_with_one_sample():
    """Per label, the top min(p, n) left singular vectors: label 0 (one sample 3e1) gives ±e1, label 1
    (2e3 and e2) gives ±e3 then ±e2, label 2 (one sample −2e4) gives ±e4 (kills data_basis 17)."""
    from pfl.methods.pacfl import data_basis

    x = torch.tensor([[3.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 2.0, 0], [0, 0, 0, -2.0]])
    got = data_basis(x, torch.tensor([0, 1, 1, 2]), 2).double().numpy()
    expected = np.array([[1.0, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 1]])
    np.testing.assert_allclose(np.abs(got), expected, atol=1e-6)


def test_pacfl_orthonormal_basis_of_a_zero_stack_is_empty_and_of_three_columns_is_orthonormal():
    """The column space of 0 is {0}: no direction survives (kills orthonormal 8); three independent
    columns give three orthonormal ones spanning them (kills orthonormal 10)."""
    from pfl.methods.pacfl import orthonormal

    assert torch.count_nonzero(orthonormal(torch.zeros(1, 4, 2, dtype=torch.float64))) == 0
    a = torch.tensor([[[1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]], dtype=torch.float64)
    q = orthonormal(a)[0].numpy()
    np.testing.assert_allclose(q.T @ q, np.eye(3), atol=1e-12)
    P = q @ q.T
    np.testing.assert_allclose(P @ a[0].numpy(), a[0].numpy(), atol=1e-12)


def _unit(deg, dim=3, j=1):
    """cos θ·e1 + sin θ·e_j as a one-column basis."""
    v = torch.zeros(dim, 1)
    v[0, 0], v[j, 0] = math.cos(math.radians(deg)), math.sin(math.radians(deg))
    return v


def _plane_bases():
    """[e1, e2] and [(e1 + e2)/√2, (e1 − e2)/√2]: one plane, so the principal angle is 0°, while the
    largest |u·v| between basis vectors is 1/√2: the reference angle is 45°."""
    s = 1 / math.sqrt(2)
    return (torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]),
            torch.tensor([[s, s], [s, -s], [0.0, 0.0]]))


def test_pacfl_proximity_reference_is_the_default_and_differs_from_principal():
    """Kills proximity 1, 2, 18, 19."""
    from pfl.methods.pacfl import proximity

    a, b = _plane_bases()
    assert float(proximity([a], [b])[0, 0]) == pytest.approx(45.0, abs=1e-4)
    assert float(proximity([a], [b], "reference")[0, 0]) == pytest.approx(45.0, abs=1e-4)
    assert float(proximity([a], [b], "principal")[0, 0]) == pytest.approx(0.0, abs=0.1)


# ---- PACFL: the server's re-clustering -------------------------------------------------------------------

def _pacfl(problem, **kw):
    return simulator(problem, "pacfl", steps=K, lr=LR, **kw)


def _basis_reply(basis, n):
    return Message.of({"basis": State({"basis": basis})}, n=n)


def test_pacfl_server_proximity_uses_the_configured_angle(problem):
    """angle = reference: two bases of one plane are 45° apart in the server's matrix (kills _add_bases 9)."""
    sim = _pacfl(problem, method__angle="reference", method__beta=10.0)
    a, b = _plane_bases()
    sim.method.aggregate(0, {0: _basis_reply(a, 20), 1: _basis_reply(b, 30)})
    assert float(sim.method.prox[0, 1]) == pytest.approx(45.0, abs=1e-4)
    assert sim.method.labels[0] != sim.method.labels[1]


def test_pacfl_single_linkage_chains_and_clients_without_a_basis_follow_the_found_clusters(problem):
    """Bases at 0°, 18°, 40° in one plane, β = 25, single linkage: one cluster (18 then min(40, 20) =
    20); client 3 (no basis yet) is cluster 1, the next id (kills _add_bases 27, 33)."""
    sim = _pacfl(problem, method__linkage="single", method__beta=25.0)
    sim.method.aggregate(0, {0: _basis_reply(_unit(0), 20), 1: _basis_reply(_unit(18), 30),
                             2: _basis_reply(_unit(40), 24)})
    assert sim.method.cluster_assignment() == {0: 0, 1: 0, 2: 0, 3: 1}
    assert len(sim.method.models) == 1


def test_pacfl_new_bases_keep_a_cluster_model_or_average_the_members_previous_ones(problem):
    """Single linkage, β = 35. Clients 0 (0°) and 1 (60°) are two clusters with models A and B. Client 2
    (10°) joins 0's cluster, which keeps A (1 stays with B). Client 3 (30°) then chains all four into
    one cluster that starts from Σ n_i θ_{c(i)} / Σ n_i over the members that had one:
    (10·A + 30·B + 5·A)/45 (kills _add_bases 42, 46–54, aggregate 3)."""
    sim = _pacfl(problem, method__linkage="single", method__beta=35.0)
    m = sim.method
    m.aggregate(0, {0: _basis_reply(_unit(0), 10), 1: _basis_reply(_unit(60), 30)})
    assert m.labels[0] != m.labels[1]
    A = {k: torch.full_like(v, 1.0) for k, v in m.init.items()}
    B = {k: torch.full_like(v, 4.0) for k, v in m.init.items()}
    m.models[m.labels[0]], m.models[m.labels[1]] = A, B
    m.aggregate(1, {2: _basis_reply(_unit(10), 5)})
    assert m.labels[0] == m.labels[2] != m.labels[1]
    for k in A:
        assert torch.equal(m.models[m.labels[0]][k], A[k]) and torch.equal(m.models[m.labels[1]][k], B[k])
    m.aggregate(2, {3: _basis_reply(_unit(30), 7)})
    assert len(m.models) == 1 and set(m.labels.values()) == {0}
    for k in A:
        np.testing.assert_allclose(m.models[0][k].numpy(), np.full(A[k].shape, (10 * 1.0 + 30 * 4.0 + 5 * 1.0) / 45),
                                   rtol=1e-6)


def _subspace_problem():
    """Clusters {0, 1} in span(e1, e2) and {2, 3} in span(e3, e4) of R^4 (0° within, 90° across)."""
    rs = np.random.RandomState(3)
    X, Y = [], []
    for i, c in enumerate([0, 0, 1, 1]):
        n = 20 + 5 * i
        x = np.zeros((n, 4))
        x[:, 2 * c:2 * c + 2] = rs.normal(size=(n, 2))
        X.append(x)
        Y.append(x @ np.array([1.0, -2.0, 3.0, 0.5]) + 0.2 * rs.normal(size=n))
    p = least_squares(sizes=[len(y) for y in Y], d=4, clusters=[0, 0, 1, 1])
    return p.__class__(X, Y, np.array([0, 0, 1, 1]))


def _mean_train_loss(p, i, w, steps, lr):
    """Mean of the full-batch losses at the start of each local step."""
    out = []
    for _ in range(steps):
        out.append(p.loss(i, w))
        w = w - lr * p.grad(i, w)
    return float(np.mean(out))


@pytest.mark.parametrize("extra", [{}, {"compression__uplink__name": "identity", "compression__min_numel": 1}])
def test_pacfl_uniform_weighting_and_the_train_loss_and_a_lossless_uplink(extra):
    """weighting = uniform: each cluster's model is the plain mean of its members' K-step GD models;
    train/loss is the mean of the clients' mean step losses; with a lossless uplink (identity) the
    models travel as changes of the model they were trained from, and nothing changes (kills aggregate
    22, local_update 33, 37, 38, 40, 41)."""
    p, lr = _subspace_problem(), 0.1
    sim = simulator(p, "pacfl", steps=K, lr=lr, method__n_basis=2, method__angle="principal", method__beta=30.0,
                    method__weighting="uniform", **extra)
    theta0 = vec(sim.method.init)
    run_rounds(sim, 1)
    assert sim.method.cluster_assignment() == {0: 0, 1: 0, 2: 1, 3: 1}
    metrics = sim.run_round(evaluate=False)
    for c, members in ((0, [0, 1]), (1, [2, 3])):
        expected = np.mean([p.gd(i, theta0, K, lr) for i in members], axis=0)
        assert close(vec(sim.method.models[c]), expected, 1e-5)
    loss = np.mean([_mean_train_loss(p, i, theta0, K, lr) for i in range(4)])
    assert metrics["train/loss"] == pytest.approx(loss, rel=1e-5)


def test_pacfl_a_classification_basis_has_the_top_vector_of_every_label():
    """Classification: one SVD per label (n_basis = 1 → one column per label, the top left singular
    vector of that label's samples), not one of all samples (kills local_update 5, 6, 9, 10, 13)."""
    from truth import classification_data

    data, arrays = classification_data(sizes=(12, 15, 10), d=4, classes=3)
    cfg = config("pacfl", 3, steps=1, lr=0.1, source="digits", model="mlp", model__params={"hidden": [4]},
                 method__n_basis=1)
    sim = Simulator(cfg, data=data)
    run_rounds(sim, 1)
    for i, (x, y) in enumerate(arrays):
        got = sim.method.bases[i].double().numpy()
        assert got.shape == (4, 3)
        for c in range(3):
            top = np.linalg.svd(x[y == c].T, full_matrices=False)[0][:, 0]
            assert abs(float(top @ got[:, c])) == pytest.approx(1.0, abs=1e-5)


def test_pacfl_basis_reply_carries_the_sample_count_and_clients_without_a_basis_use_theta0(problem):
    """The basis upload reports n_i (the merge weights) (kills local_update 19); before its basis a
    client is evaluated with θ⁰ (kills eval_message 3, personal_params 1)."""
    sim = _pacfl(problem)
    m = sim.method
    reply = m.local_update(0, sim.client(1), Message.of({}, send_basis=True))
    assert reply.info["n"] == problem.n(1)
    assert m.eval_message(0, 2) is None
    assert m.personal_params(0, sim.client(2), None) is m.init


def test_pacfl_clients_with_basis_metric_and_the_ari_of_members_only():
    """pacfl/clients_with_basis counts the bases received; cluster/ari is over the training members
    only (a newcomer is not in it): the found partition is the true one, ARI 1 (kills extra_metrics 6,
    9, 12–14)."""
    p = _subspace_problem()
    p = p.__class__(p.X + [p.X[0] * 1.5], p.y + [p.y[0]], np.array([0, 0, 1, 1, 0]))
    sim = simulator(p, "pacfl", steps=K, lr=0.1, method__n_basis=2, method__angle="principal", method__beta=30.0,
                    newcomers__fraction=0.2)
    assert len(sim.ctx.newcomers) == 1
    before = sim.method.extra_metrics(0)
    assert before["pacfl/clients_with_basis"] == 0.0
    run_rounds(sim, 1)
    after = sim.method.extra_metrics(1)
    assert after["pacfl/clients_with_basis"] == 4.0
    assert after["cluster/num"] == 2.0 and after["cluster/ari"] == pytest.approx(1.0)


def test_pacfl_server_bytes_count_one_basis_block_per_label():
    """Classification: min(n_basis, features) columns per label, C labels (kills server_bytes 2)."""
    from pfl.methods.base import ModelSize
    from pfl.methods.pacfl import PACFL

    cfg = config("pacfl", 4, method__n_basis=2)
    size = ModelSize(params=20, head=20, features=6, classes=3)
    assert PACFL.server_bytes(4, size, cfg) == 4 * 4 * 4 + 4 * 4 * 6 * (2 * 3)


# ---- PACFL: newcomers ------------------------------------------------------------------------------------

def _state(sim, bases, labels, nmodels):
    m = sim.method
    m.bases = dict(bases)
    m.labels = dict(labels)
    m.models = [{k: torch.full_like(v, float(c)) for k, v in m.init.items()} for c in range(nmodels)]


@pytest.mark.parametrize("linkage, expected", [("single", 0), ("average", 2), ("weighted", 2), ("complete", 1)])
def test_pacfl_newcomer_joins_by_the_configured_linkage(problem, linkage, expected):
    """Newcomer e1; members at angles (to it) {5°, 85°} in cluster 0, {33°} in cluster 1 and
    {20°, 40°} in cluster 2: min 5 / 33 / 20 (single → 0), mean 45 / 33 / 30 (average → 2),
    max 85 / 33 / 40 (complete → 1); a one-member cluster counts (kills join_aggregate 34, 37, 41–44)."""
    sim = _pacfl(problem, method__linkage=linkage)
    bases = {10: _unit(5, 8, 1), 11: _unit(85, 8, 2), 12: _unit(33, 8, 3), 13: _unit(20, 8, 4),
             14: _unit(40, 8, 5)}
    _state(sim, bases, {10: 0, 11: 0, 12: 1, 13: 2, 14: 2}, 3)
    sim.method.join_aggregate(5, 0, {20: _basis_reply(_unit(0, 8, 1), 9)})
    assert sim.method.labels[20] == expected


@pytest.mark.parametrize("angle, expected", [("principal", 0), ("reference", 1)])
def test_pacfl_newcomer_uses_the_configured_angle(problem, angle, expected):
    """Newcomer v = (e1 + e2)/√2. Cluster 0: basis [e1, e2] (principal 0°, reference 45°); cluster 1:
    cos 30°·v + sin 30°·e3 (30° both) (kills join_aggregate 20, 23)."""
    sim = _pacfl(problem, method__angle=angle)
    s = 1 / math.sqrt(2)
    v = torch.tensor([[s], [s], [0.0]])
    w = math.cos(math.radians(30)) * v + math.sin(math.radians(30)) * torch.tensor([[0.0], [0.0], [1.0]])
    _state(sim, {0: torch.eye(3)[:, :2], 1: w}, {0: 0, 1: 1}, 2)
    sim.method.join_aggregate(5, 0, {7: _basis_reply(v, 9)})
    assert sim.method.labels[7] == expected


def test_pacfl_newcomer_tie_goes_to_the_first_cluster(problem):
    """Two clusters at the same angle (30°, bit for bit: the same cosine with e1): the lower cluster
    index wins, like argmin (kills join_aggregate 46)."""
    sim = _pacfl(problem)
    _state(sim, {0: _unit(30, 4, 1), 1: _unit(30, 4, 2)}, {0: 0, 1: 1}, 2)
    sim.method.join_aggregate(5, 0, {7: _basis_reply(_unit(0, 4, 1), 9)})
    assert sim.method.labels[7] == 0
