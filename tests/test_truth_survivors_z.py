"""Truths for the survivors of list Z (issue 42): FPFC's evaluation (``begin_eval``, ``eval_message``,
``eval_plan``, ``extra_metrics``) and ``readout_models``. A final evaluation of a least-squares
federation whose pair norms ‖θ_ij‖ are set by hand: the uploads are K pulled full-batch steps from the
common start (ζ = the start in round 0), recomputed in numpy; ``test/rmse_mean`` is the mean over the
devices of √MSE of their own w_i, ``fpfc/readout_rmse`` of the n_i-weighted mean of the uploads of
their component of {‖θ_ij‖ < ν} (a pair at exactly ν not linked); ``cluster/num`` and ``cluster/ari``
of that partition counted by hand (it is the true one: ARI 1), ``fpfc/nu`` and ``fpfc/lambda`` the
hyperparameters, ``fpfc/glued_clusters`` the pairs of clusters with more than half of their device
pairs below λ (counted by hand), ``time/sim_clock`` c·K·max n_i at speed 1 without latency. With a
shared body (an MLP, numpy forward): every device is evaluated with the body average (the current one,
or with ``stale_body`` the one of the last round it took part in, from the bodies recorded off the
wire) joined with its own head, and its read-out with the same body. ``readout_models`` accepts labels
of any integer dtype (numpy's default int is int32 on Windows with numpy 1.x)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from truth import Recorder, least_squares, mlp_forward, run_rounds, set_pair_norms, simulator, softmax, vec

LR, K, NU, LAM = 0.2, 3, 0.5, 0.8
SIZES, TRUE = (20, 30, 24, 27, 18), [0, 0, 0, 1, 1]
# ‖θ_ij‖ by hand: {0, 1, 2} linked below ν, {3, 4} linked, (2, 3) exactly at ν (not linked); between the
# two clusters 4 of the 6 pairs below λ = 0.8 (0.5, 0.6, 0.6, 0.6), the others at 2.0
NORMS = {(0, 1): 0.25, (1, 2): 0.3, (3, 4): 0.49, (2, 3): 0.5, (0, 3): 0.6, (1, 3): 0.6, (0, 4): 0.6}


def _linear(**kw):
    """One round of K pulled full-batch steps from the start, then the hand-set θ; the uploads in numpy."""
    p = least_squares(sizes=SIZES, clusters=TRUE)
    sim = simulator(p, "fpfc", steps=K, lr=LR, method__nu=NU, method__lam=LAM, method__clock_c=1.0,
                    method__clock_speed_sigma=0.0, method__clock_latency=0.0, **kw)
    w0 = vec(sim.method.init)
    run_rounds(sim, 1)
    W = np.array([p.gd(i, w0, K, LR, pull=(1.0, w0)) for i in range(p.m)])
    assert np.allclose(sim.method.W.double().numpy(), W, atol=1e-5)
    set_pair_norms(sim.method, NORMS)
    return sim, p, W


def _rmse(p, i, w):
    return np.sqrt(p.loss(i, w))


def test_fpfc_final_evaluation_reports_personal_and_readout_rmse():
    """test/rmse_mean with each device's own w_i; fpfc/readout_rmse with its component's n_i-weighted
    mean upload, components {0, 1, 2}, {3, 4} (kills eval_plan 11, 13, 15–17, 19, 21, 22, 26)."""
    sim, p, W = _linear()
    metrics = sim.evaluate(final=True)
    n = np.array([p.n(i) for i in range(p.m)], dtype=float)
    personal = np.mean([_rmse(p, i, W[i]) for i in range(p.m)])
    readout = []
    for group in ([0, 1, 2], [3, 4]):
        r = (n[group, None] * W[group]).sum(0) / n[group].sum()
        readout += [_rmse(p, i, r) for i in group]
    assert metrics["test/rmse_mean"] == pytest.approx(personal, rel=1e-5)
    assert metrics["fpfc/readout_rmse"] == pytest.approx(np.mean(readout), rel=1e-5)
    assert abs(metrics["fpfc/readout_rmse"] - metrics["test/rmse_mean"]) > 1e-3


def test_fpfc_cluster_metrics_read_out_pairs_strictly_below_nu():
    """cluster/num 2 and ARI 1 against the true clusters: the pair (2, 3) at exactly ν does not link
    (with ≤ everything is one cluster: 1 and ARI 0) (kills extra_metrics 7, 10, 13, 17)."""
    sim, _, _ = _linear()
    metrics = sim.evaluate(final=True)
    assert metrics["cluster/num"] == 2.0
    assert metrics["cluster/ari"] == 1.0


def test_fpfc_metrics_report_nu_lambda_glued_clusters_and_the_clock():
    """fpfc/nu = ν, fpfc/lambda = λ as set; fpfc/glued_clusters 1 (4 of the 6 pairs between the two
    clusters below λ); time/sim_clock after one round at speed 1, c = 1, no latency: K·max n_i (kills
    extra_metrics 19–24, 26–28, 36–39)."""
    sim, p, _ = _linear()
    metrics = sim.evaluate(final=True)
    assert metrics["fpfc/nu"] == NU and metrics["fpfc/lambda"] == LAM
    assert metrics["fpfc/glued_clusters"] == 1.0
    assert metrics["time/sim_clock"] == pytest.approx(K * max(SIZES), rel=1e-12)


def test_fpfc_glued_clusters_count_none_at_half_or_fewer_close_pairs():
    """Only (2, 3) below λ between the clusters (1 of 6): not glued (a constant count would pass the
    test above)."""
    sim, _, _ = _linear()
    set_pair_norms(sim.method, {k: v for k, v in NORMS.items() if v < 0.55})
    metrics = sim.evaluate(final=True)
    assert metrics["cluster/num"] == 2.0 and metrics["fpfc/glued_clusters"] == 0.0


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_fpfc_readout_models_accept_labels_of_any_integer_dtype(dtype):
    """readout_models(labels) for int32 (numpy's default int on Windows, numpy 1.x) and int64 labels:
    each device's row is its component's n_i-weighted mean upload (kills readout_models 3, 6)."""
    sim, p, W = _linear()
    n = np.array([p.n(i) for i in range(p.m)], dtype=float)
    labels = np.array([0, 1, 0, 2, 1], dtype=dtype)
    got = sim.method.readout_models(labels).double().numpy()
    for cid in range(p.m):
        group = labels == labels[cid]
        expected = (n[group, None] * W[group]).sum(0) / n[group].sum()
        assert np.allclose(got[cid], expected, atol=1e-5), cid


# ---- the shared body ---------------------------------------------------------------------------------

def _mlp_sim(stale):
    from pfl.federation.simulator import Simulator
    from truth import classification_data, config

    data, arrays = classification_data(sizes=(12, 15, 10, 14))
    rec = Recorder()
    cfg = config("fpfc", data.num_clients, steps=2, lr=0.3, rounds=3, per_round=2, source="digits", model="mlp",
                 model__params={"hidden": [6]}, method__shared_layers="body", method__stale_body=stale)
    return Simulator(cfg, data=data, stages=[rec]), rec, arrays


@pytest.mark.parametrize("stale", [False, True])
def test_fpfc_devices_are_evaluated_with_the_body_and_their_own_head(stale):
    """shared_layers: body, 2 of 4 devices a round, 3 rounds: test/loss_mean is the mean cross-entropy
    of each device's last uploaded head (the start's when it never trained) joined with the body
    average of the last round (stale_body: of the last round the device took part in, the start's
    body when none); fpfc/readout_acc the accuracy of its component's n-weighted head with the same
    body, components {0, 1}, {2, 3} (kills eval_message 2, 4–8, eval_plan 3, 5–7)."""
    sim, rec, arrays = _mlp_sim(stale)
    run_rounds(sim, 3)
    meth = sim.method
    head, body = meth.clustered, meth.shared
    assert head and body
    init = {k: v.double().numpy() for k, v in meth.init.items()}
    last_body = {cid: {k: init[k] for k in body} for cid in range(4)}
    heads = {cid: {k: init[k] for k in head} for cid in range(4)}
    n = {cid: 1.0 for cid in range(4)}
    mean = last_body[0]
    for rnd in range(3):
        cids = sorted(c for r, c in rec.up if r == rnd)
        ups = {c: rec.up[rnd, c] for c in cids}
        mean = {k: np.mean([ups[c].params("body")[k].double().numpy() for c in cids], axis=0) for k in body}
        for c in cids:
            last_body[c] = mean
            heads[c] = {k: t.double().numpy() for k, t in ups[c].params("w").items()}
            n[c] = float(ups[c].info["n"])
    bodies = last_body if stale else {cid: mean for cid in range(4)}
    # the devices' bodies differ with stale_body (else it would not be tested)
    assert not stale or any(not np.allclose(bodies[0][k], bodies[c][k]) for c in range(1, 4) for k in body)
    norms = {(0, 1): 0.0, (2, 3): 0.0}
    m = 4
    s = np.full((m, m), 2.0)
    np.fill_diagonal(s, 0.0)
    for (i, j), value in norms.items():
        s[i, j] = s[j, i] = value
    theta = np.zeros(tuple(meth.theta.shape))
    theta[:, :, 0] = np.triu(s) - np.triu(s).T
    meth.theta.copy_(torch.tensor(theta, dtype=meth.theta.dtype))
    metrics = sim.evaluate(final=True)

    losses, accs = [], []
    for cid in range(4):
        x, y = arrays[cid]
        z, _ = mlp_forward({**bodies[cid], **heads[cid]}, x)
        losses.append(-np.mean(np.log(softmax(z)[np.arange(len(y)), y])))
        group = [c for c in range(4) if c // 2 == cid // 2]
        r = {k: sum(n[c] * heads[c][k] for c in group) / sum(n[c] for c in group) for k in head}
        z, _ = mlp_forward({**bodies[cid], **r}, x)
        accs.append(np.mean(z.argmax(1) == y))
    assert metrics["test/loss_mean"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert metrics["fpfc/readout_acc"] == pytest.approx(np.mean(accs), abs=1e-12)
