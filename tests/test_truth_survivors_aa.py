"""Truths for the survivors of pfl/methods/fpfc_admm.py in list aa (issue 42): ``_pair_update_cols``,
``pair_update``, ``glued_clusters``, ``theta_gap`` and ``FPFCJoin.join_aggregate``. The pair updates
are held against the ADMM step written out in numpy over the pairs (θ_ij = prox(w_i − w_j + v_ij/ρ),
v_ij += ρ(w_i − w_j − θ_ij), mirrored antisymmetrically; ``once`` from the old duals, the official
loop row after row), with ρ ≠ 1 and non-zero duals, an empty set of rows or partners (nothing
changes) and the refusal of an unknown mode; the glued-cluster count against a loop over the cluster
pairs at the boundaries the docstring states (‖θ‖ < λ strictly, "two devices or more", "more than
half"); ``theta_gap`` on all-singleton true clusters (no pair inside a cluster, no within key); a
newcomer's join against its upload read by name, its sample count, θ = v = 0 after a ``fused`` start
and the group soft-threshold of its first upload with ``join_start: upload``. CUDA's rules for index
and value tensors are enforced on ``meta`` (a machine without an accelerator) for the index tensors
and the sample counts the server must build on its own device.

Only inputs come from the code under test; every expected value is built here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from truth import CudaDeviceRules, components, least_squares, params_of, run_rounds, same_partition, simulator


# ---- the pair math, written out in numpy ---------------------------------------------------------------

def _gst_torch(kappa):
    """Group soft-threshold, an odd prox (the group lasso's), written here."""
    def prox(delta):
        norm = torch.linalg.vector_norm(delta, dim=-1, keepdim=True)
        return torch.clamp(1.0 - kappa / norm, min=0.0) * delta
    return prox


def _gst_np(delta, kappa):
    norm = np.linalg.norm(delta)
    return np.zeros_like(delta) if norm <= kappa else (1.0 - kappa / norm) * delta


def _state(m=5, p=3, seed=0):
    """W and antisymmetric θ, v (zero diagonals), float64."""
    rs = np.random.RandomState(seed)
    W = rs.normal(0.0, 1.0, (m, p))
    theta, v = np.zeros((m, m, p)), np.zeros((m, m, p))
    for i in range(m):
        for j in range(i + 1, m):
            theta[i, j] = rs.normal(0.0, 1.0, p)
            v[i, j] = rs.normal(0.0, 1.0, p)
            theta[j, i], v[j, i] = -theta[i, j], -v[i, j]
    return W, theta, v


def _torch(*arrays):
    return [torch.tensor(a, dtype=torch.float64) for a in arrays]


def _expected(W, theta, v, rows, cols, kappa, rho, sequential):
    """The ADMM pair step over the pairs (i ∈ rows, j ∈ cols), loop by loop."""
    theta, v = theta.copy(), v.copy()
    duals = v if sequential else v.copy()  # sequential: a pair reads the duals the earlier pairs wrote
    for i in rows:
        for j in cols:
            d = W[i] - W[j]
            t = _gst_np(d + duals[i, j] / rho, kappa)
            nv = duals[i, j] + rho * (d - t)
            theta[i, j], v[i, j], theta[j, i], v[j, i] = t, nv, -t, -nv
    return theta, v


def _run(W, theta, v, rows, cols, kappa, rho, **mode):
    from pfl.methods.fpfc_admm import pair_update

    tW, tt, tv = _torch(W, theta, v)
    pair_update(tW, tt, tv, rows, _gst_torch(kappa), rho, cols=cols, **mode)
    assert np.array_equal(tW.numpy(), W)
    return tt.numpy(), tv.numpy()


def test_pair_update_by_default_updates_the_pairs_to_the_partners_once_from_the_old_duals():
    """Rows {0, 2}, partners {0, 1, 2, 3} (device 4 not a partner: its pairs stay), ρ = 2, non-zero
    duals, the default mode: every pair (i, j) from the duals before the call, written antisymmetrically;
    the pair (0, 2), with both ends in the rows, updated once (kills pair_update 1, 2 and
    _pair_update_cols 15, 17–19, 37, 45, 53)."""
    W, theta, v = _state()
    rows, cols, kappa, rho = [0, 2], [0, 1, 2, 3], 0.3, 2.0
    got_theta, got_v = _run(W, theta, v, rows, cols, kappa, rho)
    want_theta, want_v = _expected(W, theta, v, rows, cols, kappa, rho, sequential=False)
    assert np.allclose(got_theta, want_theta, rtol=1e-12, atol=1e-12)
    assert np.allclose(got_v, want_v, rtol=1e-12, atol=1e-12)
    assert np.array_equal(got_theta[:, 4], theta[:, 4]) and np.array_equal(got_v[4], v[4])


def test_pair_update_official_sequential_with_partners_walks_the_rows_in_order():
    """``official_sequential`` with partners: row 2 sees the dual of the pair (0, 2) that row 0 wrote,
    as the official loop does (kills _pair_update_cols 4, 5, 16, 17)."""
    W, theta, v = _state(seed=1)
    rows, cols, kappa, rho = [0, 2], [0, 1, 2, 3], 0.3, 2.0
    got_theta, got_v = _run(W, theta, v, rows, cols, kappa, rho, mode="official_sequential")
    want_theta, want_v = _expected(W, theta, v, rows, cols, kappa, rho, sequential=True)
    assert np.allclose(got_theta, want_theta, rtol=1e-12, atol=1e-12)
    assert np.allclose(got_v, want_v, rtol=1e-12, atol=1e-12)
    once_theta, _ = _expected(W, theta, v, rows, cols, kappa, rho, sequential=False)
    assert not np.allclose(once_theta[2, 0], want_theta[2, 0])      # the two modes do differ here


@pytest.mark.parametrize("rho", [2.0, 1.0])
def test_pair_update_over_all_devices_divides_the_dual_by_rho(rho):
    """No partner list (all m devices), the default mode, ρ = 2 and ρ = 1 (kills pair_update 1, 2, 51)."""
    W, theta, v = _state(seed=2)
    rows, cols, kappa = [1, 3], list(range(5)), 0.3
    got_theta, got_v = _run(W, theta, v, rows, None, kappa, rho)
    want_theta, want_v = _expected(W, theta, v, rows, cols, kappa, rho, sequential=False)
    assert np.allclose(got_theta, want_theta, rtol=1e-12, atol=1e-12)
    assert np.allclose(got_v, want_v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows, cols, mode", [([], None, "once"), ([], [0, 1, 3], "once"),
                                              ([1], [], "once"), ([1], [], "official_sequential")])
def test_pair_update_of_no_rows_or_no_partners_touches_no_pair(rows, cols, mode):
    """θ, v of every pair touching the rows and a partner: with no rows or no partners, none (kills
    pair_update 27, 30 and _pair_update_cols 9, 12, 22, 25)."""
    W, theta, v = _state(seed=3)
    got_theta, got_v = _run(W, theta, v, rows, cols, 0.3, 2.0, mode=mode)
    assert np.array_equal(got_theta, theta) and np.array_equal(got_v, v)


@pytest.mark.parametrize("cols", [None, [0, 1, 2]])
def test_pair_update_refuses_an_unknown_mode_naming_it_and_the_allowed_ones(cols):
    """(kills pair_update 119 and _pair_update_cols 6)"""
    from pfl.methods.fpfc_admm import pair_update

    W, theta, v = _torch(*_state(m=3))
    with pytest.raises(ValueError) as err:
        pair_update(W, theta, v, [0], _gst_torch(0.1), 1.0, mode="twice", cols=cols)
    assert "'twice'" in str(err.value) and "once, official_sequential" in str(err.value)


# ---- CUDA's device rules, enforced on ``meta`` ------------------------------------------------------

def test_pair_update_over_all_devices_indexes_on_the_devices_of_w():
    """(kills pair_update 28, 31)"""
    from pfl.methods.fpfc_admm import pair_update

    W = torch.zeros(4, 3, device="meta")
    theta, v = torch.zeros(4, 4, 3, device="meta"), torch.zeros(4, 4, 3, device="meta")
    with CudaDeviceRules():
        pair_update(W, theta, v, [0, 2], lambda d: 0.5 * d, 2.0)
    assert theta.device.type == "meta" and v.device.type == "meta"


# ---- glued_clusters and theta_gap ---------------------------------------------------------------------

def _glued_by_hand(dist, labels, lam):
    """Cluster pairs (both of two devices or more) with more than half their device pairs below λ."""
    labels = [int(x) for x in labels]
    members = {k: [i for i, x in enumerate(labels) if x == k] for k in set(labels)}
    count = 0
    for a in members:
        for b in members:
            if a < b and len(members[a]) >= 2 and len(members[b]) >= 2:
                pairs = [(i, j) for i in members[a] for j in members[b]]
                close = sum(1 for i, j in pairs if dist[i][j] < lam)
                count += 2 * close > len(pairs)
    return count


def _dist(between, m=5, far=9.0):
    """Clusters {0, 1}, {2, 3}, {4}; the four pairs between the first two at the given distances."""
    d = np.full((m, m), far)
    np.fill_diagonal(d, 0.0)
    d[0, 1] = d[1, 0] = d[2, 3] = d[3, 2] = 0.01
    for (i, j), x in zip([(0, 2), (0, 3), (1, 2), (1, 3)], between):
        d[i, j] = d[j, i] = x
    d[4, 0] = d[0, 4] = 0.1        # a singleton close to a cluster never glues
    return d


@pytest.mark.parametrize("between, glued", [
    ([0.1, 0.2, 0.3, 9.0], 1),       # three of the four pairs below λ: glued (clusters of two count)
    ([0.1, 0.2, 9.0, 9.0], 0),       # exactly half: not more than half
    ([0.5, 0.5, 0.5, 9.0], 0),       # at λ: not below it
    ([0.5, 0.1, 0.2, 0.3], 1),       # three below, one at λ
])
def test_glued_clusters_counts_cluster_pairs_with_more_than_half_their_pairs_below_lambda(between, glued):
    """λ = 0.5 (kills glued_clusters 14, 26, 27, 35)."""
    from pfl.methods.fpfc_admm import glued_clusters

    lam, labels = 0.5, np.array([0, 0, 1, 1, 2])
    d = _dist(between)
    assert _glued_by_hand(d, labels, lam) == glued
    assert glued_clusters(torch.tensor(d), labels, lam) == float(glued)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_glued_clusters_takes_labels_of_any_integer_type(dtype):
    """Read-out labels as int32 (numpy's default int on some platforms) or int64 (kills
    glued_clusters 4, 7)."""
    from pfl.methods.fpfc_admm import glued_clusters

    d = _dist([0.1, 0.2, 0.3, 9.0])
    assert glued_clusters(torch.tensor(d), np.array([0, 0, 1, 1, 2], dtype=dtype), 0.5) == 1.0


def test_theta_gap_of_singleton_true_clusters_has_no_within_pair():
    """Every true cluster one device: no pair inside a cluster, so no ``theta_max_within``; the smallest
    between is the smallest off-diagonal distance (kills theta_gap 10)."""
    from pfl.methods.fpfc_admm import theta_gap

    d = np.array([[0.0, 0.4, 0.7], [0.4, 0.0, 0.2], [0.7, 0.2, 0.0]])
    assert theta_gap(d, np.array([0, 1, 2])) == {"fpfc/theta_min_between": 0.2}


# ---- the newcomers' join ----------------------------------------------------------------------------------

def _fpfc_newcomers(**kw):
    """Six devices, two of them newcomers (0 and 2), after one training round."""
    p = least_squares(sizes=(20, 30, 24, 27, 22, 25), clusters=[0, 0, 0, 1, 1, 1])
    settings = dict(steps=2, lr=0.2, newcomers__fraction=0.34, method__lam=0.5, method__xi=0.0,
                    newcomers__tol=0.5)
    settings.update(kw)
    sim = simulator(p, "fpfc", **settings)
    run_rounds(sim, 1)
    assert sorted(sim.ctx.newcomers) == [0, 2]
    return sim


def _reply(w, n, like, reverse=False, device=None):
    from pfl.federation.messages import Message, Model

    params = params_of(np.asarray(w, dtype=float), like)
    if reverse:
        params = dict(reversed(list(params.items())))
    if device is not None:
        params = {k: t.to(device) for k, t in params.items()}
    body = {"extra.bias": torch.zeros(1, device=device)}
    return Message.of({"w": Model(params), "body": Model(body)}, n=n)


def test_fpfc_join_stores_each_newcomers_upload_by_name_and_its_sample_count():
    """Replies with the clustered layers in another order than the model's and a body part besides:
    W's row is [weight, bias] of the upload, n_seen the reply's n (kills FPFCJoin.join_aggregate 15,
    17, 18, 29, 33, 34)."""
    sim = _fpfc_newcomers()
    meth = sim.method
    meth.join_begin(1, [0, 2])
    uploads = {0: [0.5, -1.0, 2.0], 2: [3.0, 0.25, -0.75]}
    meth.join_aggregate(1, 0, {c: _reply(w, 7 + 4 * c, meth.init, reverse=True) for c, w in uploads.items()})
    for c, w in uploads.items():
        assert np.array_equal(meth.W[c].double().numpy(), np.asarray(w))
        assert float(meth.n_seen[c]) == 7 + 4 * c


def test_fpfc_join_with_a_fused_start_leaves_the_newcomers_pairs_at_zero_after_the_first_upload():
    """``join_start: fused`` (the default): the first upload (step 0) moves no pair; θ = v = 0 on every
    pair of the newcomers (kills FPFCJoin.join_aggregate 37, 39)."""
    sim = _fpfc_newcomers()
    meth = sim.method
    assert meth.hp.join_start == "fused"
    meth.join_begin(1, [0, 2])
    meth.join_aggregate(1, 0, {c: _reply([1.0 + c, -2.0, 0.5], 10, meth.init) for c in (0, 2)})
    for c in (0, 2):
        assert float(meth.theta[c].abs().sum()) == 0.0 and float(meth.v[c].abs().sum()) == 0.0
        assert float(meth.theta[:, c].abs().sum()) == 0.0 and float(meth.v[:, c].abs().sum()) == 0.0


def test_fpfc_join_with_an_upload_start_computes_the_pairs_from_the_first_upload():
    """``join_start: upload`` with the group lasso (κ = λ/ρ = 0.25): after the first upload θ_cj =
    gst(w_c − w_j, κ) and v_cj = ρ(w_c − w_j − θ_cj) for every member j (its pairs started at 0),
    mirrored; the pair of the two newcomers stays 0 (kills FPFCJoin.join_aggregate 40, 41)."""
    rho = 2.0
    sim = _fpfc_newcomers(method__join_start="upload", method__penalty="l1", method__rho=rho)
    meth = sim.method
    members = sorted(sim.ctx.members)
    W_before = meth.W.double().numpy().copy()
    meth.join_begin(1, [0, 2])
    uploads = {0: [1.0, -2.0, 0.5], 2: [4.0, 1.0, -1.0]}
    meth.join_aggregate(1, 0, {c: _reply(w, 10, meth.init) for c, w in uploads.items()})
    theta, v = meth.theta.double().numpy(), meth.v.double().numpy()
    for c, w in uploads.items():
        for j in members:
            d = np.asarray(w) - W_before[j]
            t = _gst_np(d, 0.5 / rho)
            assert np.allclose(theta[c, j], t, atol=1e-6) and np.allclose(theta[j, c], -t, atol=1e-6)
            assert np.allclose(v[c, j], rho * (d - t), atol=1e-5) and np.allclose(v[j, c], -rho * (d - t), atol=1e-5)
        assert np.any(theta[c, members] != 0.0)
    assert not theta[0, 2].any() and not v[0, 2].any()


def test_fpfc_join_records_the_sample_counts_on_the_servers_device():
    """The server's state on ``meta``: the sample counts are built there, not on the CPU (kills
    FPFCJoin.join_aggregate 24, 27)."""
    sim = _fpfc_newcomers()
    meth = sim.method
    meth.join_begin(1, [0, 2])
    meth.W, meth.theta, meth.v, meth.n_seen = (t.to("meta") for t in (meth.W, meth.theta, meth.v, meth.n_seen))
    replies = {c: _reply([1.0, -2.0, 0.5], 10, meth.init, device="meta") for c in (0, 2)}
    with CudaDeviceRules():
        meth.join_aggregate(1, 0, replies)
    assert meth.n_seen.device.type == "meta" and meth.W.device.type == "meta"


def test_fpfc_cluster_assignment_after_a_join_step_is_the_partition_of_now():
    """``Method.cluster_assignment`` answers the clusters of now: after an evaluation, a join step that
    moves the newcomers' pairs (``join_start: upload``; newcomer 0 uploads device 3's model, so its
    pair to device 3 is 0, below ν, newcomer 2 uploads a far model) must be seen without another
    evaluation (at which newcomer 0, not yet joined, was a cluster of its own).
    The truth: the components of {‖θ_ij‖ < ν} over the pair norms θ holds after the step, found here
    by a search in numpy (pairs with a device that has not joined do not exist)."""
    sim = _fpfc_newcomers(method__join_start="upload", method__penalty="l1", method__rho=2.0, method__nu=0.3)
    meth = sim.method
    sim.evaluate()
    members = sorted(sim.ctx.members)
    w3 = meth.W[3].double().numpy().copy()
    meth.join_begin(1, [0, 2])
    meth.join_aggregate(1, 0, {0: _reply(w3, 10, meth.init), 2: _reply(w3 + 50.0, 10, meth.init)})
    norms = np.linalg.norm(meth.theta.double().numpy(), axis=2)
    joined = set(members) | {0, 2}
    m = norms.shape[0]
    exists = np.array([[i in joined and j in joined and not (i in (0, 2) and j in (0, 2)) for j in range(m)]
                       for i in range(m)])
    label = components(exists & (norms < 0.3))
    got = meth.cluster_assignment()
    want = {c: label[c] for c in got}
    assert same_partition(got, want)
    assert want[0] == want[3] and want[2] != want[3]  # newcomer 0 joined device 3's cluster
