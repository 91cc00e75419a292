"""Truths for the survivors of list V (issue 42): FPFC's ``aggregate``, ``_train`` and ``begin_eval``.
The server's rows and body are recomputed in numpy from the data and the seeded start: a device's
upload after one step on the minibatch of its ``train`` client stream; an upload under top-k uplink
compression as ζ_i + topk(w_i − ζ_i) (the model is sent as its change to the ζ it received); the
shared body under an fp16 uplink within fp16's rounding of the change from the uncompressed twin run
(the body is sent as its change to the received body); the body as the plain mean of the bodies
uploaded (recorded off the wire) with exactly the shared layers, or the Krum choice (f = round(share·n)
with the run's attack fraction) written here; ``train/loss`` as the mean of the clients' full-batch
MSE at the start; a reply without ``n`` weighted 1 in the read-out, as a device never seen; pairs to
newcomers left at θ = v = 0 during training (docstring); the read-out at the final evaluation as
the n_i-weighted mean of the components of {‖θ_ij‖ < ν}, a pair at exactly ν not linked."""

from __future__ import annotations

import numpy as np
import torch

from truth import Recorder, close, least_squares, params_of, run_rounds, simulator, vec

LR, K = 0.2, 3


# ---- the upload: the train stream, the change to ζ, the loss ---------------------------------------

def test_fpfc_upload_is_one_step_on_the_minibatch_of_the_train_stream():
    """One local step of b = 5 samples drawn from the client stream ``train`` of the round; the pull
    ρ(w − ζ) is zero at the common start (kills _train 1, 2)."""
    p, lr, b = least_squares(sizes=(20, 30, 24, 27)), 0.1, 5
    sim = simulator(p, "fpfc", steps=1, lr=lr, federation__batch_size=b)
    w0 = vec(sim.method.init)
    rnd = sim.round
    run_rounds(sim, 1)
    for i in range(p.m):
        Z, y = p.design(i), p.y[i]
        idx = torch.randperm(len(y), generator=sim.ctx.generator(rnd, i, "train")).numpy()[:b]
        w = w0 - lr * 2.0 / b * Z[idx].T @ (Z[idx] @ w0 - y[idx])
        assert close(sim.method.W[i].double().numpy(), w, 1e-5), i


def test_fpfc_compressed_upload_is_the_change_to_the_received_zeta():
    """Top-k (ratio 1/2 per tensor: the larger of the two weights, and the bias) on the uplink: the
    server holds ζ_i + topk(w_i − ζ_i), ζ_i = the start in round 0 and w_i K pulled full-batch steps
    (kills _train 47, 49, 50, 51)."""
    p, rho = least_squares(), 1.0
    sim = simulator(p, "fpfc", steps=K, lr=LR, compression__uplink={"name": "topk", "ratio": 0.5},
                    compression__min_numel=1)
    w0 = vec(sim.method.init)

    def topk(delta):
        out = delta.copy()
        weight = out[:2]
        weight[np.argmin(np.abs(weight))] = 0.0
        return out

    run_rounds(sim, 1)
    for i in range(p.m):
        w = p.gd(i, w0, K, LR, pull=(rho, w0))
        assert abs(w[0] - w0[0]) != abs(w[1] - w0[1])
        assert close(sim.method.W[i].double().numpy(), w0 + topk(w - w0), 1e-5), i


def test_fpfc_train_loss_is_the_mean_of_the_clients_loss_at_the_start():
    """One full-batch step: each client's loss is its MSE at the start, ``train/loss`` their mean
    (kills _train 66)."""
    p = least_squares()
    sim = simulator(p, "fpfc", steps=1, lr=LR)
    w0 = vec(sim.method.init)
    metrics = sim.run_round(evaluate=False)
    expected = np.mean([np.mean((p.design(i) @ w0 - p.y[i]) ** 2) for i in range(p.m)])
    assert abs(metrics["train/loss"] - expected) <= 1e-5 * max(1.0, expected)


# ---- the shared body -----------------------------------------------------------------------------------

def _mlp(rec=None, **kw):
    from pfl.federation.simulator import Simulator
    from truth import classification_data, config

    data, _ = classification_data(sizes=(12, 15, 10, 14))
    cfg = config("fpfc", data.num_clients, steps=2, lr=0.1, source="digits", model="mlp",
                 model__params={"hidden": [6]}, method__shared_layers="body", **kw)
    return Simulator(cfg, data=data, stages=[rec] if rec is not None else [])


def _np(params, names):
    return {k: params[k].detach().double().cpu().numpy() for k in names}


def test_fpfc_body_is_the_mean_of_the_uploaded_bodies_over_the_shared_layers():
    """The body after each round holds exactly the shared layers, each the plain mean of the bodies
    uploaded that round (recorded off the wire); the next round runs on it (kills aggregate 66, 71)."""
    rec = Recorder()
    sim = _mlp(rec, rounds=2)
    meth = sim.method
    for rnd in range(2):
        run_rounds(sim, 1)
        assert list(meth.body) == meth.shared and meth.shared and meth.clustered
        ups = [rec.up[rnd, c] for c in range(4)]
        for k in meth.shared:
            expected = np.mean([u.params("body")[k].double().numpy() for u in ups], axis=0)
            assert np.allclose(meth.body[k].double().numpy(), expected, atol=1e-6), (rnd, k)


def test_fpfc_krum_body_is_the_upload_with_the_lowest_krum_score():
    """aggregator: krum with byzantine_share −1 takes f from the run's attack fraction (0.25 of 4
    replies, no attack kind: nobody rewrites): f = round(0.25·4) = 1, each body scored by the sum of
    its n − f − 2 = 1 smallest squared distances to the others, ties by position; the body is the
    lowest-scored upload's body (here a mutually-nearest pair ties, and f = 0 would pick another
    upload; kills aggregate 67, 72)."""
    rec, fraction = Recorder(), 0.25
    sim = _mlp(rec, method__aggregator="krum", attack__fraction=fraction)
    run_rounds(sim, 1)
    meth = sim.method
    bodies = [_np(rec.up[0, c].params("body"), meth.shared) for c in range(4)]
    flat = np.stack([np.concatenate([b[k].ravel() for k in meth.shared]) for b in bodies])
    d2 = ((flat[:, None, :] - flat[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(d2, np.inf)

    def choice(f):
        scores = np.sort(d2, axis=1)[:, :max(1, 4 - f - 2)].sum(1)
        return int(np.argmin(scores))  # the first of equal minima: ties by position

    best = choice(int(fraction * 4 + 0.5))
    assert best != choice(0)
    for k in meth.shared:
        assert np.allclose(meth.body[k].double().numpy(), bodies[best][k], atol=1e-6), k


def test_fpfc_fp16_uplink_sends_the_head_and_body_as_changes():
    """fp16 on the uplink: the server's head rows and body differ from the uncompressed twin run's by at
    most fp16's relative rounding (2⁻¹¹) of the change to what the devices received — the head sent as
    its change to ζ_i (the start in round 0), the body as its change to the received body (kills
    _train 47, 49, 50, 51, 56, 58, 59, 60)."""
    rec = Recorder()
    plain = _mlp(rec)
    run_rounds(plain, 1)
    packed = _mlp(compression__uplink={"name": "fp16"}, compression__min_numel=1)
    run_rounds(packed, 1)
    a, b = plain.method, packed.method
    init_head = np.concatenate([a.init[k].double().numpy().ravel() for k in a.clustered])
    for i in range(4):
        change = np.abs(a.W[i].double().numpy() - init_head)
        err = np.abs(b.W[i].double().numpy() - a.W[i].double().numpy())
        assert np.all(err <= 2.0 ** -11 * change + 1e-7), i
    for k in a.shared:
        changes = [np.abs(rec.up[0, c].params("body")[k].double().numpy() - a.init[k].double().numpy())
                   for c in range(4)]
        bound = 2.0 ** -11 * np.mean(changes, axis=0) + 1e-7
        assert np.all(np.abs(b.body[k].double().numpy() - a.body[k].double().numpy()) <= bound), k


# ---- the server's bookkeeping ------------------------------------------------------------------------

def test_fpfc_a_reply_without_a_sample_count_weighs_one_in_the_readout():
    """A reply without ``n`` counts with weight 1 in the read-out, as a device never seen: devices 0
    (no n), 1 (n = 5), 2 and 3 (never replied: the start) in one component average to
    (w_0 + 5 w_1 + 2 w_start)/8 (kills aggregate 35, 37, 40)."""
    from pfl.federation.messages import Message, Model

    p = least_squares(sizes=(20, 30, 24, 27))
    sim = simulator(p, "fpfc")
    meth = sim.method
    w0, w1, start = np.array([1.0, -2.0, 0.5]), np.array([3.0, 0.25, -1.0]), vec(meth.init)
    replies = {0: Message.of({"w": Model(params_of(w0, meth.init))}),
               1: Message.of({"w": Model(params_of(w1, meth.init))}, n=5)}
    meth.aggregate(0, replies)
    got = meth.readout_models(np.zeros(4, dtype=int)).double().numpy()
    expected = (w0 + 5 * w1 + 2 * start) / 8
    for cid in range(4):
        assert close(got[cid], expected, 1e-6), cid


def test_fpfc_training_rounds_leave_the_pairs_to_newcomers_at_zero():
    """Newcomers (0 and 2) are not in the federation during training: every pair touching them keeps
    θ = v = 0, and the members' pairs moved (kills aggregate 48, 56)."""
    p = least_squares(sizes=(20, 30, 24, 27, 22, 25), clusters=[0, 0, 0, 1, 1, 1])
    sim = simulator(p, "fpfc", steps=2, lr=0.2, newcomers__fraction=0.34, method__lam=0.5, method__xi=0.0)
    run_rounds(sim, 2)
    meth = sim.method
    new = sorted(sim.ctx.newcomers)
    assert new == [0, 2]
    members = [c for c in range(6) if c not in new]
    for t in (meth.theta, meth.v):
        arr = t.double().numpy()
        assert np.all(arr[new] == 0.0) and np.all(arr[:, new] == 0.0)
    theta = meth.theta.double().numpy()
    assert np.any(theta[np.ix_(members, members)] != 0.0)


# ---- the read-out at the final evaluation ------------------------------------------------------------

def test_fpfc_final_readout_links_pairs_strictly_below_nu():
    """ν = 0.5: ‖θ_01‖ = 0.25 and ‖θ_34‖ = 0.49 link, ‖θ_12‖ = 0.5 exactly does not, other pairs at
    2.0: components {0, 1}, {2}, {3, 4}; at the final evaluation (readout_every_eval off) each device's
    read-out is its component's n_i-weighted mean upload; at a non-final one there is none (kills
    begin_eval 2, 4, 7)."""
    p = least_squares(sizes=(20, 30, 24, 27, 18), clusters=[0, 0, 0, 1, 1])
    sim = simulator(p, "fpfc", steps=K, lr=LR, method__nu=0.5)
    run_rounds(sim, 1)
    meth = sim.method
    m, dim = 5, meth.theta.shape[2]
    s = np.full((m, m), 2.0)
    np.fill_diagonal(s, 0.0)
    for (i, j), value in {(0, 1): 0.25, (1, 2): 0.5, (3, 4): 0.49}.items():
        s[i, j] = s[j, i] = value
    theta = np.zeros((m, m, dim))
    theta[:, :, 0] = np.triu(s) - np.triu(s).T
    meth.theta.copy_(torch.tensor(theta, dtype=meth.theta.dtype))
    assert not meth.hp.readout_every_eval
    meth.begin_eval(1, final=False)
    assert meth.eval_message(1, 0) is None
    meth.begin_eval(1, final=True)
    W = meth.W.double().numpy()
    n = np.array([p.n(i) for i in range(m)], dtype=float)
    for group in ([0, 1], [2], [3, 4]):
        expected = (n[group, None] * W[group]).sum(0) / n[group].sum()
        for cid in group:
            got = vec(meth.eval_message(1, cid).params("readout"))
            assert close(got, expected, 1e-6), cid
    assert not np.allclose(W[1], W[2])
