"""Truth tests for survivors of ``pfl.methods.ala.adaptive_local_aggregation`` (FedALA's ALA step).

The expected W and θ̂ are recomputed in numpy for a single linear layer with softmax cross-entropy:
θ̂ = θ_local + (θ_global − θ_local) ⊙ W, ∂L/∂W = ∂L/∂θ̂ ⊙ (θ_global − θ_local) with
∂L/∂logits = (softmax − onehot)/B, then W ← clip(W − η ∂L/∂W, 0, 1) per batch (batch size 1 included),
through a user ``forward`` (here one that doubles the logits), with the docstring's "local may lack
names" rule, and the skip contract (no passes: empty loss list, zero time) and a time_s bounded by
the wall time of the call.
"""
import time

import numpy as np
import torch

import pfl.methods.ala as ala


def _setup(seed=0, n=6, d=4, c=3):
    rng = np.random.default_rng(seed)
    g = {"weight": rng.normal(size=(c, d)), "bias": rng.normal(size=c)}
    l = {"weight": rng.normal(size=(c, d)), "bias": rng.normal(size=c)}
    x = rng.normal(size=(n, d))
    y = rng.integers(0, c, size=n)
    model = torch.nn.Linear(d, c).double()
    t = lambda p: {k: torch.tensor(v) for k, v in p.items()}
    return model, g, l, x, y, t


def _np_ala(g, l, x, y, bs, eta, scale=1.0):
    w = {k: np.ones_like(v) for k, v in g.items()}
    loss = None
    for s in range(0, len(y), bs):
        xb, yb = x[s:s + bs], y[s:s + bs]
        th = {k: l[k] + (g[k] - l[k]) * w[k] for k in g}
        z = scale * (xb @ th["weight"].T + th["bias"])
        z = z - z.max(1, keepdims=True)
        pr = np.exp(z) / np.exp(z).sum(1, keepdims=True)
        loss = float(-np.log(pr[np.arange(len(yb)), yb]).mean())
        oh = np.eye(g["bias"].size)[yb]
        dz = scale * (pr - oh) / len(yb)
        gth = {"weight": dz.T @ xb, "bias": dz.sum(0)}
        w = {k: np.clip(w[k] - eta * gth[k] * (g[k] - l[k]), 0.0, 1.0) for k in g}
    th = {k: l[k] + (g[k] - l[k]) * w[k] for k in g}
    return w, th, loss


def _run(model, g, l, x, y, **kw):
    args = dict(weights=None, start_phase=False, eta=0.7, batch_size=1, threshold=0.1, window=3,
                max_epochs=5)
    args.update(kw)
    return ala.adaptive_local_aggregation(model, g, l, ["weight", "bias"], torch.tensor(x),
                                          torch.tensor(y), **args)


def test_ala_with_batch_size_one_steps_per_sample_like_numpy():
    model, g, l, x, y, t = _setup()
    res = _run(model, t(g), t(l), x, y, batch_size=1)
    w, th, loss = _np_ala(g, l, x, y, 1, 0.7)
    for k in g:
        np.testing.assert_allclose(res.weights[k].numpy(), w[k], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(res.params[k].numpy(), th[k], rtol=1e-9, atol=1e-12)
    assert res.passes == 1 and abs(res.losses[0] - loss) < 1e-9


def test_ala_uses_the_given_forward_for_the_weight_gradient():
    model, g, l, x, y, t = _setup(1)
    fwd = lambda p, xb: 2.0 * (xb @ p["weight"].T + p["bias"])
    res = _run(model, t(g), t(l), x, y, batch_size=3, forward=fwd)
    w, th, loss = _np_ala(g, l, x, y, 3, 0.7, scale=2.0)
    for k in g:
        np.testing.assert_allclose(res.weights[k].numpy(), w[k], rtol=1e-9, atol=1e-12)
    assert abs(res.losses[0] - loss) < 1e-9


def test_names_missing_from_local_are_taken_from_global():
    model, g, l, x, y, t = _setup(2)
    loc = t(l)
    del loc["bias"]
    res = _run(model, t(g), loc, x, y, batch_size=2)
    l2 = dict(l, bias=g["bias"])
    w, th, _ = _np_ala(g, l2, x, y, 2, 0.7)
    for k in g:
        np.testing.assert_allclose(res.params[k].numpy(), th[k], rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(res.params["bias"].numpy(), g["bias"])


def test_skipped_ala_does_no_pass_no_loss_and_takes_no_time():
    model, g, l, x, y, t = _setup(3)
    for local in (None, t(g)):
        res = _run(model, t(g), local, x, y)
        assert res.skipped and res.passes == 0
        assert res.losses == [] and res.time_s == 0.0


def test_time_s_is_within_the_wall_time_of_the_call():
    model, g, l, x, y, t = _setup(4)
    t0 = time.perf_counter()
    res = _run(model, t(g), t(l), x, y)
    wall = time.perf_counter() - t0
    assert 0.0 <= res.time_s <= wall


def test_empty_sample_leaves_weights_at_one_and_records_a_nan_loss():
    model, g, l, x, y, t = _setup(5)
    res = _run(model, t(g), t(l), x[:0], y[:0])
    assert res.passes == 1 and len(res.losses) == 1 and np.isnan(res.losses[0])
    for k in g:
        np.testing.assert_array_equal(res.weights[k].numpy(), np.ones_like(g[k]))
