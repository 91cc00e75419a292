"""Survivors of FedSplit (``local_update``, ``server_bytes``), FedDyn, FedPD (``communicates``,
``local_update``, ``configure``, ``setup``), FedRoD (``local_update``, ``log_prior``, ``configure``),
FedBABU (``local_update``) and FedOpt (``server_moments``, ``aggregate``). The truths: each method's
round written again in numpy (least squares, tests/truth.py, or the small MLP of
test_truth_new_methods.py) with a compressed uplink, so the upload must name the downlink part it
relates to (``base``/``ref``) and, for rand-k, its entries are the ones drawn from the documented key
(run seed, round, client, "compress", "up", part/tensor); the round's ``train/loss`` as the mean over
clients of the mean loss at the iterates of each local step; a composed ``+ala`` first round equal to
the base method's (ALA skips a client with no local model yet, docs/methods/fedala.md); FedPD's
shared coin drawn from ``ctx.rng(round, "fedpd")`` (docs/methods/seminar.md §4.1: skip with
probability p, so a draw equal to p communicates) with the bytes of each round counted by hand;
FedRoD's log prior log(max(count, 1e-12)) for a client missing a class; FedSplit's server memory
N·d values under sampling, 0 otherwise; the Yogi moment update in numpy; the errors' fields and
messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from truth import classification_data, close, config, least_squares, numpy_params, simulator, softmax, vec

LR, K = 0.2, 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(clusters=[0, 1, 2, 3])


def gd_losses(p, i, w, steps, lr, pull=None, shift=None):
    """``steps`` full-batch steps (as truth.LeastSquares.gd) and the mean of f_i at the iterates the
    steps start from (what a client reports as its training loss)."""
    w = np.array(w, dtype=float)
    losses = []
    for _ in range(steps):
        losses.append(p.loss(i, w))
        g = p.grad(i, w)
        if pull is not None:
            g = g + pull[0] * (w - pull[1])
        if shift is not None:
            g = g + shift
        w = w - lr * g
    return w, float(np.mean(losses))


# ---- FedDyn ----------------------------------------------------------------------------------------

def _feddyn_round(p, theta, alpha):
    """FedDyn's first round, every client: g_k = 0, θ_k = K steps on f_k + (α/2)‖θ − θ^t‖²;
    h = −α(1/N)Σ(θ_k − θ^t); θ¹ = mean θ_k − h/α. Returns θ¹ and the mean reported loss."""
    out = [gd_losses(p, i, theta, K, LR, pull=(alpha, theta)) for i in range(p.m)]
    ws = [w for w, _ in out]
    h = -alpha * sum(w - theta for w in ws) / p.m
    return sum(ws) / p.m - h / alpha, float(np.mean([loss for _, loss in out]))


def test_feddyn_upload_is_the_change_to_the_received_model_under_a_compressed_uplink(problem):
    """With the identity uplink the codec sends θ_k − θ^t against the part it was trained from
    (``base``): the round equals FedDyn's by hand, and ``train/loss`` is the clients' mean loss."""
    p, alpha = problem, 0.5
    sim = simulator(p, "feddyn", steps=K, lr=LR, method__alpha=alpha, compression__uplink__name="identity",
                    compression__min_numel=1)
    theta1, loss = _feddyn_round(p, vec(sim.method.global_model), alpha)
    metrics = sim.run_round(evaluate=False)
    assert close(vec(sim.method.global_model), theta1)
    assert metrics["train/loss"] == pytest.approx(loss, rel=1e-5)


def test_feddyn_composed_with_ala_starts_its_first_round_from_the_received_model(problem):
    """ALA skips a client with no local model yet, so feddyn+ala's first round is FedDyn's by hand."""
    p, alpha = problem, 0.5
    sim = simulator(p, "feddyn+ala", steps=K, lr=LR, method__alpha=alpha)
    theta1, _ = _feddyn_round(p, vec(sim.method.global_model), alpha)
    sim.run_round(evaluate=False)
    assert close(vec(sim.method.global_model), theta1)


# ---- the small MLP (as test_truth_new_methods.py) ----------------------------------------------------

H, MLR = 6, 0.3
BODY, HEAD = ["fc1.weight", "fc1.bias"], ["fc.weight", "fc.bias"]


def blobs(**kw):
    """Gaussian class blobs per client (tests/truth.py); ``missing``: {client: class} a client does not hold."""
    return classification_data(**kw)


def mlp_sim(data, method, **kw):
    from pfl.federation.simulator import Simulator

    cfg = config(method, data.num_clients, steps=K, lr=MLR, source="digits", model="mlp",
                 model__params={"hidden": [H]}, **kw)
    return Simulator(cfg, data=data)


def hidden(p, X):
    return np.maximum(X @ p["fc1.weight"].T + p["fc1.bias"], 0.0)


def logits(p, X):
    return hidden(p, X) @ p["fc.weight"].T + p["fc.bias"]


def onehot(y, c):
    return np.eye(c)[y]


def ce(z, y):
    z = z - z.max(1, keepdims=True)
    return float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(len(y)), y]))


def backprop(p, X, dz):
    h = hidden(p, X)
    dpre = (dz @ p["fc.weight"]) * (h > 0)
    return {"fc.weight": dz.T @ h, "fc.bias": dz.sum(0), "fc1.weight": dpre.T @ X, "fc1.bias": dpre.sum(0)}


def step(p, g, names, lr=MLR):
    return {k: (v - lr * g[k] if k in names else v) for k, v in p.items()}


def average(models, sizes, names):
    w = np.asarray(sizes, dtype=float) / sum(sizes)
    return {k: sum(wi * m[k] for wi, m in zip(w, models)) for k in names}


def assert_params(actual, expected, names=None, tol=1e-5):
    actual = numpy_params(actual)
    for k in names or expected:
        np.testing.assert_allclose(actual[k], expected[k], rtol=1e-4, atol=tol)


# ---- FedBABU ---------------------------------------------------------------------------------------

def test_fedbabu_body_upload_under_a_compressed_uplink_and_its_training_loss():
    """FedBABU's round by hand (the body trained with the fixed head, sample-weighted body average)
    with the identity uplink (the body is sent against the part it was trained from), and
    ``train/loss`` the mean over clients of the mean cross-entropy at each step's start."""
    data, arrays = blobs()
    sim = mlp_sim(data, "fedbabu", compression__uplink__name="identity", compression__min_numel=1)
    glob = numpy_params(sim.method.global_model)
    trained, losses = [], []
    for X, y in arrays:
        q, ls = dict(glob), []
        for _ in range(K):
            z = logits(q, X)
            ls.append(ce(z, y))
            q = step(q, backprop(q, X, (softmax(z) - onehot(y, 3)) / len(y)), BODY)
        trained.append(q)
        losses.append(np.mean(ls))
    want = {**glob, **average(trained, [len(y) for _, y in arrays], BODY)}
    metrics = sim.run_round(evaluate=False)
    assert_params(sim.method.global_params(), want)
    assert metrics["train/loss"] == pytest.approx(float(np.mean(losses)), rel=1e-5)


# ---- FedRoD ----------------------------------------------------------------------------------------

def fedrod_round(glob, heads, arrays, classes):
    """One FedRoD round by hand (balanced softmax generic model, personal head on stop(z)); returns
    the averaged generic model and the mean over clients of the mean per-step loss."""
    trained, losses = [], []
    for i, (X, y) in enumerate(arrays):
        p, ph, ls = dict(glob), dict(heads[i]), []
        prior = np.log(np.maximum(np.bincount(y, minlength=classes), 1e-12))
        for _ in range(K):
            h, g = hidden(p, X), logits(p, X)
            personal = g + h @ ph["weight"].T + ph["bias"]
            ls.append(ce(g + prior, y) + ce(personal, y))
            grads = backprop(p, X, (softmax(g + prior) - onehot(y, classes)) / len(y))
            dp = (softmax(personal) - onehot(y, classes)) / len(y)
            ph = {"weight": ph["weight"] - MLR * dp.T @ h, "bias": ph["bias"] - MLR * dp.sum(0)}
            p = step(p, grads, BODY + HEAD)
        heads[i] = ph
        trained.append(p)
        losses.append(np.mean(ls))
    return average(trained, [len(y) for _, y in arrays], BODY + HEAD), float(np.mean(losses))


def _fedrod_expected(sim, arrays):
    glob = numpy_params(sim.method.global_model)
    zero = {"weight": np.zeros_like(glob["fc.weight"]), "bias": np.zeros_like(glob["fc.bias"])}
    heads = {i: dict(zero) for i in range(len(arrays))}
    return fedrod_round(glob, heads, arrays, 3), heads


def test_fedrod_generic_upload_under_a_compressed_uplink_and_its_training_loss():
    data, arrays = blobs()
    sim = mlp_sim(data, "fedrod", compression__uplink__name="identity", compression__min_numel=1)
    (glob, loss), heads = _fedrod_expected(sim, arrays)
    metrics = sim.run_round(evaluate=False)
    assert_params(sim.method.global_params(), glob)
    assert_params(sim.client_states[1]["personal_head"], heads[1])
    assert metrics["train/loss"] == pytest.approx(loss, rel=1e-5)


def test_fedrod_composed_with_ala_starts_its_first_round_from_the_received_model():
    data, arrays = blobs()
    sim = mlp_sim(data, "fedrod+ala")
    (glob, _), heads = _fedrod_expected(sim, arrays)
    sim.run_round(evaluate=False)
    assert_params(sim.method.global_params(), glob)
    assert_params(sim.client_states[2]["personal_head"], heads[2])


def test_fedrod_log_prior_of_a_class_the_client_lacks_is_the_log_of_1e_minus_12():
    """Client 0 holds no sample of the last class: its log prior is log(max(count, 1e-12)) over all
    ``num_classes`` classes (about −27.6 for the missing one)."""
    data, arrays = blobs(missing={0: 2})
    sim = mlp_sim(data, "fedrod")
    counts = np.bincount(arrays[0][1], minlength=3)
    assert counts[2] == 0
    got = sim.method.log_prior(sim.client(0))
    assert got.dtype == torch.float32 and got.shape == (3,)
    want = np.log(np.maximum(counts, 1e-12).astype(np.float32))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    assert float(got[2]) == pytest.approx(-27.631, abs=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("loss", ["ce", "bsm"])
def test_fedrod_log_prior_lives_on_the_labels_device(loss):
    """The prior is added to the logits on the client's device: it is made where the labels are."""
    from types import SimpleNamespace

    data, arrays = blobs()
    sim = mlp_sim(data, "fedrod", method__generic_loss=loss)
    y = torch.tensor(arrays[1][1], device="cuda")
    got = sim.method.log_prior(SimpleNamespace(data=SimpleNamespace(y_train=y)))
    assert got.device == y.device and got.shape == (3,)
    want = np.zeros(3) if loss == "ce" else np.log(np.bincount(arrays[1][1], minlength=3))
    np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-6)


def test_fedrod_on_a_regression_task_names_the_method_field():
    from pfl.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        simulator(least_squares(), "fedrod")
    assert err.value.field == "method.name"
    assert err.value.message.startswith("fedrod needs a classification task")


# ---- FedOpt ----------------------------------------------------------------------------------------

def test_yogi_keeps_v_where_the_change_and_v_are_both_zero():
    """v ← v − (1 − β2)Δ² sign(v − Δ²): a coordinate with Δ = 0 and v = 0 keeps v = 0 (sign(0) = 0)."""
    from pfl.methods.fedopt import server_moments

    beta1, beta2 = 0.9, 0.99
    m0, v0 = np.array([0.0, 0.2, 0.0], dtype=np.float32), np.array([0.0, 0.5, 0.01], dtype=np.float32)
    delta = np.array([0.0, 0.3, 0.4], dtype=np.float32)
    m, v = server_moments(torch.tensor(m0), torch.tensor(v0), torch.tensor(delta), "yogi", beta1, beta2)
    sq = delta * delta
    np.testing.assert_allclose(m.numpy(), beta1 * m0 + (1 - beta1) * delta, rtol=1e-6)
    np.testing.assert_allclose(v.numpy(), v0 - (1 - beta2) * sq * np.sign(v0 - sq), rtol=1e-6)
    assert float(v[0]) == 0.0


def test_an_unknown_server_rule_names_itself_and_the_allowed_rules():
    from pfl.methods.fedopt import server_moments

    z = torch.zeros(2)
    with pytest.raises(ValueError) as err:
        server_moments(z, z, z, "rmsprop", 0.9, 0.99)
    assert str(err.value) == "unknown FedOpt rule 'rmsprop'; allowed: adam, adagrad, yogi, momentum"


def test_fedadam_with_the_coordinate_median_of_five_clients():
    """aggregator median (not streamed: every reply is kept): Δ = median_k θ_k − θ over five clients
    (an odd count: the middle value), then Adam's moments."""
    p = least_squares(sizes=(20, 30, 24, 27, 22), clusters=[0, 1, 2, 3, 0])
    sim = simulator(p, "fedadam", steps=K, lr=LR, method__aggregator="median", method__tau=0.05)
    hp = sim.method.hp
    theta = vec(sim.method.global_model)
    delta = np.median(np.array([p.gd(i, theta, K, LR) for i in range(p.m)]), axis=0) - theta
    m = (1 - hp.beta1) * delta
    v = (1 - hp.beta2) * delta ** 2
    sim.run_round(evaluate=False)
    assert close(vec(sim.method.global_model), theta + hp.server_lr * m / (np.sqrt(v) + hp.tau))


# ---- FedPD -----------------------------------------------------------------------------------------

def _coin(sim, rnd):
    """The documented public coin: u from ctx.rng(round, "fedpd") (seeded by (run seed, round, "fedpd"))."""
    from pfl.federation.context import derive_seed

    return float(np.random.default_rng(derive_seed(sim.ctx.seed, rnd, "fedpd")).random())


def test_fedpd_bernoulli_coin_schedule_bytes_and_training_loss(problem):
    """p = 0.5 over 8 rounds: a round communicates iff its coin u ≥ p; then every client uploads d
    floats and the next round starts with d floats down to each (round 0: nothing down); the model,
    the count and ``train/loss`` (communicating rounds only) follow FedPD in numpy."""
    p, eta, prob, rounds = problem, 0.5, 0.5, 8
    sim = simulator(p, "fedpd", steps=K, lr=LR, method__eta=eta, method__p=prob)
    comm = [_coin(sim, r) >= prob for r in range(rounds)]
    assert 0 < sum(comm) < rounds
    x0 = vec(sim.method.x0)
    x = [x0.copy() for _ in range(p.m)]
    x0i = [x0.copy() for _ in range(p.m)]
    lam = [np.zeros(p.dim) for _ in range(p.m)]
    bytes_ = 4 * p.dim * p.m
    for r in range(rounds):
        out = [gd_losses(p, i, x[i], K, LR, pull=(1 / eta, x0i[i]), shift=lam[i]) for i in range(p.m)]
        x = [w for w, _ in out]
        lam = [lam[i] + (x[i] - x0i[i]) / eta for i in range(p.m)]
        plus = [x[i] + eta * lam[i] for i in range(p.m)]
        if comm[r]:
            x0 = sum(plus) / p.m
            x0i = [x0.copy() for _ in range(p.m)]
        else:
            x0i = plus
        metrics = sim.run_round(evaluate=False)
        assert metrics["comm/round_up_bytes"] == (bytes_ if comm[r] else 0), r
        assert metrics["comm/round_down_bytes"] == (bytes_ if r and comm[r - 1] else 0), r
        if comm[r]:
            assert metrics["train/loss"] == pytest.approx(float(np.mean([ls for _, ls in out])), rel=1e-5), r
        else:
            assert "train/loss" not in metrics, r
        assert close(vec(sim.method.x0), x0), r
    assert sim.method.comm_rounds == sum(comm)


def test_fedpd_communicates_when_the_coin_equals_p():
    """Skip with probability p: skip iff u < p (for p on numpy's grid of draws this is exactly p, and
    p = 0 never skips), so a round whose draw u equals p communicates."""
    p = least_squares()
    probe = simulator(p, "fedpd", steps=1, lr=LR)
    u = _coin(probe, 0)
    sim = simulator(p, "fedpd", steps=1, lr=LR, method__p=u)
    assert sim.method.communicates(0)
    sim.run_round(evaluate=False)
    assert sim.method.comm_rounds == 1


def test_fedpd_under_client_sampling_names_the_field_and_its_reason():
    from pfl.schema import ConfigError

    p = least_squares()
    with pytest.raises(ConfigError) as err:
        simulator(p, "fedpd", per_round=2)
    assert err.value.field == "federation.clients_per_round"
    assert err.value.message.startswith("fedpd needs every client in every round (one shared coin and an average "
                                        "over all clients); set 0 (all) or at least the 4 training clients, got 2")


# ---- FedSplit --------------------------------------------------------------------------------------

def test_fedsplit_rand_k_upload_draws_the_key_of_its_z_part_and_reports_the_prox_loss():
    """Rand-k 50 % on the uplink (d = 4 weights, k = 2, scaled by d/k = 2; the bias k = 1 of 1): z_j is
    sent as its change to x̄ (``ref``), entries Ω drawn by torch.randperm on the generator keyed
    (seed, round, client, "compress", "up", "z/<tensor>"); the server reconstructs x̄ + C(z_j − x̄) and
    averages. ``train/loss``: the mean over clients of the prox solve's mean f_j."""
    from pfl.federation.context import derive_seed

    p, s = least_squares(d=4, clusters=[0, 1, 2, 3]), 0.5
    sim = simulator(p, "fedsplit", steps=K, lr=LR, method__s=s, compression__uplink__name="randk",
                    compression__uplink__ratio=0.5, compression__min_numel=1)
    xbar = vec(sim.method.xbar)
    got, losses = [], []
    for j in range(p.m):
        half, loss = gd_losses(p, j, xbar, K, LR, pull=(1 / s, 2 * xbar - xbar))  # z_j = x̄ = x⁰ at first
        losses.append(loss)
        change = 2 * (half - xbar)   # z_j − x̄
        g = torch.Generator()
        g.manual_seed(derive_seed(sim.ctx.seed, 0, j, "compress", "up", "z/fc.weight"))
        idx = torch.randperm(4, generator=g)[:2].numpy()
        sent = np.zeros(5)
        sent[idx] = 2.0 * change[idx]
        sent[4] = change[4]
        got.append(xbar + sent)
    metrics = sim.run_round(evaluate=False)
    assert close(vec(sim.method.xbar), sum(got) / p.m)
    assert metrics["train/loss"] == pytest.approx(float(np.mean(losses)), rel=1e-5)


@pytest.mark.parametrize("per_round, newcomers, want", [(0, 0.0, 0), (10, 0.0, 0), (8, 0.2, 0),
                                                        (3, 0.0, 4 * 10 * 1000), (3, 0.2, 4 * 8 * 1000)])
def test_fedsplit_server_keeps_every_training_clients_z_only_under_sampling(per_round, newcomers, want):
    """Server memory: N·d values of ``itemsize`` bytes (N = the training clients, newcomers excluded)
    when clients are sampled; nothing with every training client in every round."""
    from pfl.methods.base import ModelSize
    from pfl.methods.fedsplit import FedSplit

    cfg = config("fedsplit", 10, per_round=per_round, newcomers__fraction=newcomers)
    assert FedSplit.server_bytes(10, ModelSize(params=1000, head=10, itemsize=4), cfg) == want
