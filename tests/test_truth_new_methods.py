"""FedPer, FedBABU, FedRoD, MOON and FedProto against their papers' rules written out in numpy
(tests/truth.py's manner): a one-hidden-layer classifier (``mlp``, hidden [H]) whose forward pass and
gradients are written by hand here — cross-entropy, balanced softmax, the personal head's loss, the
cosine-similarity contrast and the prototype distance — with full-batch steps, so every local step
is exact. Each test also shows that its truth tells the method from a plausible wrong variant
(FedAvg's shared head, a head trained during federation, plain cross-entropy for the balanced
softmax, swapped positive and negative pairs, the other prototype weighting). Last, every one of
them learns: accuracy rises in a few rounds on the digits."""

import numpy as np
import pytest

from truth import classification_data, config, numpy_params, run_rounds, softmax

LR, K, H = 0.3, 3, 6
BODY, HEAD = ["fc1.weight", "fc1.bias"], ["fc.weight", "fc.bias"]


@pytest.fixture(scope="module")
def blobs():
    return classification_data()


def _sim(data, method, steps=K, **kw):
    from pfl.federation.simulator import Simulator

    cfg = config(method, data.num_clients, steps=steps, lr=LR, source="digits", model="mlp",
                 model__params={"hidden": [H]}, **kw)
    return Simulator(cfg, data=data)


# ---- the classifier by hand ----------------------------------------------------------------------

def hidden(p, X):
    return np.maximum(X @ p["fc1.weight"].T + p["fc1.bias"], 0.0)


def logits(p, X):
    return hidden(p, X) @ p["fc.weight"].T + p["fc.bias"]


def onehot(y, c):
    return np.eye(c)[y]


def backprop(p, X, dz, dh_extra=None):
    """Gradients of a loss whose derivative is ``dz`` w.r.t. the logits (already divided by n) and
    ``dh_extra`` w.r.t. the hidden representation (a term on the representation itself)."""
    h = hidden(p, X)
    dh = dz @ p["fc.weight"] + (0.0 if dh_extra is None else dh_extra)
    dpre = dh * (h > 0)
    return {"fc.weight": dz.T @ h, "fc.bias": dz.sum(0), "fc1.weight": dpre.T @ X, "fc1.bias": dpre.sum(0)}


def ce_dz(z, y):
    return (softmax(z) - onehot(y, z.shape[1])) / len(y)


def step(p, g, names, lr=LR):
    return {k: (v - lr * g[k] if k in names else v) for k, v in p.items()}


def gd(p, X, y, names, steps, lr=LR):
    for _ in range(steps):
        p = step(p, backprop(p, X, ce_dz(logits(p, X), y)), names, lr)
    return p


def average(models, sizes, names):
    w = np.asarray(sizes, dtype=float) / sum(sizes)
    return {k: sum(wi * m[k] for wi, m in zip(w, models)) for k in names}


def assert_params(actual, expected, names=None, tol=1e-5):
    actual = numpy_params(actual)
    for k in names or expected:
        np.testing.assert_allclose(actual[k], expected[k], rtol=1e-4, atol=tol)


def differ(a, b, names, by=1e-3):
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in names) > by


# ---- FedPer ---------------------------------------------------------------------------------------

def test_fedper_joint_steps_on_body_and_own_head_then_the_body_average(blobs):
    data, arrays = blobs
    sim = _sim(data, "fedper")
    glob = numpy_params(sim.method.global_model)
    heads = {i: {k: glob[k] for k in HEAD} for i in range(len(arrays))}
    sizes = [len(y) for _, y in arrays]
    shared_head = {k: glob[k] for k in HEAD}   # the wrong variant: the head averaged too (FedAvg)
    for _ in range(2):
        trained = []
        for i, (X, y) in enumerate(arrays):
            out = gd({**{k: glob[k] for k in BODY}, **heads[i]}, X, y, BODY + HEAD, K)   # all layers at once
            heads[i] = {k: out[k] for k in HEAD}
            trained.append(out)
        shared_head = average(trained, sizes, HEAD)
        glob.update(average(trained, sizes, BODY))
    run_rounds(sim, 2)
    for i in range(len(arrays)):
        assert_params(sim.personal_params(i), {**{k: glob[k] for k in BODY}, **heads[i]})
        assert differ(heads[i], shared_head, HEAD)
    assert sim.method.global_params() is None


# ---- FedBABU --------------------------------------------------------------------------------------

@pytest.mark.parametrize("part, ft", [("full", 2), ("head", 3), ("full", 0)])
def test_fedbabu_body_only_federation_with_the_random_head_then_fine_tuning(blobs, part, ft):
    data, arrays = blobs
    sim = _sim(data, "fedbabu", method__finetune_epochs=ft, method__finetune_part=part, federation__eval_every=1)
    glob = numpy_params(sim.method.global_model)
    head0 = {k: glob[k].copy() for k in HEAD}
    sizes = [len(y) for _, y in arrays]
    for _ in range(2):
        glob.update(average([gd(glob, X, y, BODY, K) for X, y in arrays], sizes, BODY))
    wrong = numpy_params(sim.method.global_model)   # the head trained in federation too (FedAvg)
    for _ in range(2):
        wrong = average([gd(wrong, X, y, BODY + HEAD, K) for X, y in arrays], sizes, BODY + HEAD)
    run_rounds(sim, 2)
    assert_params(sim.method.global_params(), {**glob, **head0})   # the head never moved
    assert differ(glob, wrong, BODY)
    for i, (X, y) in enumerate(arrays):
        client = sim.client(i)
        plan = sim.client_role.eval_plan(1, client, sim.method.eval_message(1, i))
        names = {"full": BODY + HEAD, "head": HEAD}[part]
        assert_params(plan.global_model, glob)
        assert_params(plan.personal, gd(glob, X, y, names, ft))   # ft full-batch epochs
        if ft:
            assert differ(numpy_params(plan.personal), glob, names)


# ---- FedRoD ---------------------------------------------------------------------------------------

def fedrod_round(glob, heads, arrays, classes, bsm, steps=K):
    """One FedRoD round by hand: simultaneous steps of (body, generic head) on the balanced softmax
    and of the personal head on CE(stop(g) + h_k(stop(z))); returns the averaged generic model."""
    trained = []
    for i, (X, y) in enumerate(arrays):
        p, ph = dict(glob), dict(heads[i])
        prior = np.log(np.maximum(np.bincount(y, minlength=classes), 1e-12)) if bsm else np.zeros(classes)
        for _ in range(steps):
            h, g = hidden(p, X), logits(p, X)
            grads = backprop(p, X, (softmax(g + prior) - onehot(y, classes)) / len(y))
            dp = (softmax(g + h @ ph["weight"].T + ph["bias"]) - onehot(y, classes)) / len(y)
            ph = {"weight": ph["weight"] - LR * dp.T @ h, "bias": ph["bias"] - LR * dp.sum(0)}
            p = step(p, grads, BODY + HEAD)
        heads[i] = ph
        trained.append(p)
    return average(trained, [len(y) for _, y in arrays], BODY + HEAD)


@pytest.mark.parametrize("loss", ["bsm", "ce"])
def test_fedrod_balanced_softmax_generic_model_and_personal_heads(blobs, loss):
    data, arrays = blobs
    classes = data.num_classes
    sim = _sim(data, "fedrod", method__generic_loss=loss)
    glob = numpy_params(sim.method.global_model)
    zero = {"weight": np.zeros_like(glob["fc.weight"]), "bias": np.zeros_like(glob["fc.bias"])}
    heads = {i: dict(zero) for i in range(len(arrays))}
    other = {i: dict(zero) for i in range(len(arrays))}
    start = dict(glob)
    for _ in range(2):
        glob = fedrod_round(glob, heads, arrays, classes, loss == "bsm")
    wrong = start
    for _ in range(2):  # the other generic loss: balanced softmax against plain cross-entropy
        wrong = fedrod_round(wrong, other, arrays, classes, loss != "bsm")
    run_rounds(sim, 2)
    assert_params(sim.method.global_params(), glob)
    assert differ(glob, wrong, BODY + HEAD)
    for i, (X, y) in enumerate(arrays):
        assert_params(sim.client_states[i]["personal_head"], heads[i])
        client = sim.client(i)
        personal = sim.personal_params(i)
        out = sim.client_role.eval_forward(client)(personal, client.data.x_test).detach().double().numpy()
        expected = logits(glob, X) + hidden(glob, X) @ heads[i]["weight"].T + heads[i]["bias"]
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


# ---- MOON -----------------------------------------------------------------------------------------

def cosine_and_grad(z, a):
    """Row-wise cosine similarity of z and a and its gradient with respect to z; 0 and 0 where a row is
    zero (a ReLU representation can be; torch's similarity is 0 there, and no gradient passes a
    representation whose units are all off)."""
    nz, na = np.linalg.norm(z, axis=1, keepdims=True), np.linalg.norm(a, axis=1, keepdims=True)
    ok = (nz > 0) & (na > 0)
    nz, na = np.where(ok, nz, 1.0), np.where(ok, na, 1.0)
    s = np.where(ok, (z * a).sum(1, keepdims=True) / (nz * na), 0.0)
    return s[:, 0], np.where(ok, a / (nz * na) - s * z / nz ** 2, 0.0)


def moon_grads(p, glob, prev, X, y, mu, tau, swap=False):
    z, zg, zp = hidden(p, X), hidden(glob, X), hidden(prev, X)
    if swap:  # the wrong variant: the previous model as the positive, the global one as the negative
        zg, zp = zp, zg
    sg, dsg = cosine_and_grad(z, zg)
    sp, dsp = cosine_and_grad(z, zp)
    w = softmax(np.stack([sg, sp], 1) / tau)     # ℓ = logsumexp(s_g/τ, s_p/τ) − s_g/τ
    dz = mu / len(y) * (((w[:, :1] - 1) * dsg + w[:, 1:] * dsp) / tau)
    return backprop(p, X, ce_dz(logits(p, X), y), dz)


def moon(glob, arrays, rounds, mu, tau, swap=False):
    prev = {i: dict(glob) for i in range(len(arrays))}
    for _ in range(rounds):
        trained = []
        for i, (X, y) in enumerate(arrays):
            p = dict(glob)
            for _ in range(K):
                p = step(p, moon_grads(p, glob, prev[i], X, y, mu, tau, swap), BODY + HEAD)
            prev[i] = p
            trained.append(p)
        glob = average(trained, [len(y) for _, y in arrays], BODY + HEAD)
    return glob


def test_moon_contrastive_term_on_the_representation_over_three_rounds(blobs):
    data, arrays = blobs
    mu, tau = 2.0, 0.5
    sim = _sim(data, "moon", method__mu=mu, method__tau=tau)
    start = numpy_params(sim.method.global_model)
    expected = moon(start, arrays, 3, mu, tau)
    run_rounds(sim, 3)
    assert_params(sim.method.global_params(), expected)
    assert differ(expected, moon(start, arrays, 3, mu, tau, swap=True), BODY + HEAD, 1e-4)
    assert differ(expected, moon(start, arrays, 3, 0.0, tau), BODY + HEAD, 1e-4)   # FedAvg


# ---- FedProto -------------------------------------------------------------------------------------

def fedproto(start, arrays, classes, rounds, lam, weighting, schedule=None):
    """Rounds of FedProto by hand (``schedule``: each round's sampled clients; default all)."""
    models = {i: dict(start) for i in range(len(arrays))}
    protos, known = np.zeros((classes, H)), np.zeros(classes, dtype=bool)
    for rnd in range(rounds):
        uploads = []
        for i, (X, y) in enumerate(arrays):
            if schedule is not None and i not in schedule[rnd]:
                continue
            p = models[i]
            for _ in range(K):
                h = hidden(p, X)
                dh = lam * known[y][:, None] * 2.0 * (h - protos[y]) / (H * len(y))   # λ·mean_d (z − P̄_y)²
                p = step(p, backprop(p, X, ce_dz(logits(p, X), y), dh), BODY + HEAD)
            models[i] = p
            h, counts = hidden(p, X), np.bincount(y, minlength=classes)
            uploads.append(({c: h[y == c].mean(0) for c in range(classes) if counts[c]}, counts))
        for c in range(classes):
            held = [(local[c], counts[c]) for local, counts in uploads if c in local]
            if held:
                w = np.array([n if weighting == "samples" else 1.0 for _, n in held], dtype=float)
                protos[c] = sum(wi * v for wi, (v, _) in zip(w, held)) / w.sum()
                known[c] = True
    return models, protos


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_fedproto_prototype_regularised_local_models_and_the_prototype_average(blobs, weighting):
    data, arrays = blobs
    classes, lam = data.num_classes, 3.0
    sim = _sim(data, "fedproto", method__lam=lam, method__proto_weighting=weighting)
    start = numpy_params(sim.client_role.init)
    models, protos = fedproto(start, arrays, classes, 3, lam, weighting)
    run_rounds(sim, 3)
    np.testing.assert_allclose(sim.method.protos.double().numpy(), protos, rtol=1e-4, atol=1e-5)
    for i in range(len(arrays)):
        assert_params(sim.personal_params(i), models[i])
    other = "samples" if weighting == "uniform" else "uniform"
    models_other, protos_other = fedproto(start, arrays, classes, 3, lam, other)
    assert np.abs(protos - protos_other).max() > 1e-3
    assert any(differ(models[i], models_other[i], BODY + HEAD, 1e-4) for i in models)
    local, _ = fedproto(start, arrays, classes, 3, 0.0, weighting)   # λ = 0: Local training
    assert any(differ(models[i], local[i], BODY + HEAD) for i in models)


def test_fedproto_a_class_no_sampled_client_holds_keeps_its_prototype(blobs):
    """Clients 0–2 lack class 2, so a round that samples two of them reports no class-2 prototype:
    the server keeps the one it had (and the clients keep being pulled to it)."""
    from pfl.data.federated import ClientData, FederatedData

    data, arrays = blobs
    clients, kept = [], []
    for i, (c, (X, y)) in enumerate(zip(data.clients, arrays)):
        rows = np.arange(len(y)) if i == 3 else np.flatnonzero(y != 2)
        x_t, y_t = c.x_train[rows], c.y_train[rows]
        clients.append(ClientData(x_t, y_t, x_t.clone(), y_t.clone(), x_t.clone(), y_t.clone(), cluster=c.cluster))
        kept.append((X[rows], y[rows]))
    lacking = FederatedData(clients=clients, num_classes=data.num_classes, input_shape=data.input_shape,
                            task=data.task, source=data.source, true_clusters=data.true_clusters,
                            partition_hash="truth-lacking", partition_kind="natural")
    sim = _sim(lacking, "fedproto", per_round=2, method__lam=3.0, seed=1)
    schedule = [sorted(sim.sample(r)) for r in range(5)]
    first = next(r for r, s in enumerate(schedule) if 3 in s)
    assert any(3 not in s for s in schedule[first + 1:])   # class 2 seen, then a round without it
    start = numpy_params(sim.client_role.init)
    models, protos = fedproto(start, kept, data.num_classes, 5, 3.0, "uniform", schedule)
    run_rounds(sim, 5)
    np.testing.assert_allclose(sim.method.protos.double().numpy(), protos, rtol=1e-4, atol=1e-5)
    assert bool(sim.method.known.all())
    for i in range(len(kept)):
        assert_params(sim.personal_params(i), models[i])


# ---- they learn -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fedper", "fedbabu", "fedrod", "moon", "fedproto", "fedamp", "fednova"])
def test_accuracy_rises_in_a_few_rounds(name):
    from helpers import method_config
    from pfl.callbacks.divergence import run_rounds as run_all
    from pfl.federation.simulator import Simulator

    own = {"method__finetune_epochs": 1} if name == "fedbabu" else {}
    sim = Simulator(method_config(name, federation__rounds=8, federation__eval_every=1, federation__local_epochs=2,
                                  federation__clients_per_round=0, model__name="mlp", model__params__hidden=[32],
                                  **own))
    history = run_all(sim)
    first, last = history[0]["test/acc_mean"], history[-1]["test/acc_mean"]
    assert last > max(first + 0.1, 0.45), (name, first, last)   # chance is 0.1


# ---- their settings are checked -------------------------------------------------------------------

@pytest.mark.parametrize("key, value, words", [
    ("method.finetune_part", "tail", ["method.finetune_part", "full", "head", "body"]),
    ("method.generic_loss", "focal", ["method.generic_loss", "bsm", "ce"]),
    ("method.proto_weighting", "median", ["method.proto_weighting", "uniform", "samples"]),
    ("method.tau", 0.0, ["method.tau"]),
    ("method.sigma", -1.0, ["method.sigma"]),
    ("method.mu", -0.1, ["method.mu"]),
])
def test_bad_settings_name_the_field_and_the_allowed_values(key, value, words):
    from pfl.resolver import load
    from pfl.schema import ConfigError

    method = {"method.finetune_part": "fedbabu", "method.generic_loss": "fedrod", "method.proto_weighting": "fedproto",
              "method.tau": "moon", "method.sigma": "fedamp", "method.mu": "fednova"}[key]
    with pytest.raises(ConfigError) as info:
        load(None, {"method.name": method, key: value, "tracking.enabled": False})
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("name", ["fedrod", "moon", "fedproto"])
def test_class_based_methods_refuse_a_regression_task(name):
    from pfl.schema import ConfigError
    from truth import least_squares, simulator

    with pytest.raises(ConfigError, match="classification"):
        simulator(least_squares(), name)
