"""Truths for the behaviours the mutation score found unguarded (docs/verification.md, "Mutation score",
the G rows): each test compares what pfl computed with something written another way — numpy gradient
steps, a closed form, the spec's rule evaluated on recorded inputs — on small least-squares or digits
federations (tests/truth.py), and each names the mutant it was shown to kill.

Only inputs are read from the run (the data, the seeded initial model, what a client uploaded); the
expected values are built here."""

import itertools

import numpy as np
import pytest
import torch

from truth import close, least_squares, mlp_grads, numpy_params, params_of, run_rounds, simulator, softmax, vec

LR, K = 0.2, 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(clusters=[0, 0, 1, 1])


# ---- the engine's client step and evaluation plan (pfl/methods/base.py) ---------------------------

def test_an_explicit_minibatch_replaces_the_clients_training_split(problem):
    """ClientHandle.train(x=, y=) (pFedMe's inner problems) trains on the given rows only: K numpy
    steps on the quadratic of those rows, not of the whole split (kills ClientHandle.train 47)."""
    p = problem
    sim = simulator(p, "fedavg", steps=K, lr=LR)
    client = sim.client(1)
    w0 = np.array([0.3, -0.2, 0.1])
    rows = slice(0, 7)
    X, y = p.X[1][rows], p.y[1][rows]
    got = client.train(params_of(w0, sim.method.global_model), 0, x=torch.tensor(X, dtype=torch.float32),
                       y=torch.tensor(y, dtype=torch.float32), batch_size=0, steps=K, lr=LR).params
    Z = np.hstack([X, np.ones((len(X), 1))])
    w = w0.copy()
    for _ in range(K):
        w = w - LR * (2.0 / len(Z)) * Z.T @ (Z @ w - y)
    assert close(vec(got), w, 1e-5)
    assert not close(w, p.gd(1, w0, K, LR), 1e-3)  # the whole split would give another model


def test_the_global_metrics_evaluate_the_received_global_model(problem):
    """Ditto's ``global/test_loss`` is the mean over clients of the server model's test MSE (numpy),
    not the personal models' (kills Method.eval_plan 17)."""
    p = problem
    sim = simulator(p, "ditto", steps=K, lr=LR, method__lam=0.5)
    run_rounds(sim, 2)
    theta = vec(sim.method.global_params())  # what the evaluation message carries
    row = sim.evaluate()
    expected = np.mean([p.loss(i, theta) for i in range(p.m)])
    personal = np.mean([p.loss(i, vec(sim.personal_params(i))) for i in range(p.m)])
    assert abs(row["global/test_loss"] - expected) <= 1e-5 * max(1.0, expected)
    assert abs(personal - expected) > 1e-3  # the personal models are evaluated elsewhere (test/*)


# ---- composition: the names a config error lists (pfl/methods/__init__.py) ------------------------

def test_an_unknown_base_of_a_composed_name_lists_the_registered_methods():
    """``nosuch+ala``: the error names the field and lists the registered bases (kills _compose 9)."""
    from pfl.methods import METHODS, get_method
    from pfl.schema import ConfigError

    with pytest.raises(ConfigError) as info:
        get_method("nosuch+ala")
    assert info.value.field == "method.name"
    text = str(info.value)
    assert "'nosuch'" in text and all(name in text for name in ("fedavg", "ditto", "fpfc"))
    assert set(METHODS.names()) >= {"fedavg", "ditto", "fpfc"}


# ---- CFL: the split's centres place newcomers and absent members (pfl/methods/cfl.py) --------------

def test_cfl_split_centres_are_the_mean_unit_updates_of_each_side():
    """Centre of a side = mean of its participants' unit-normalised updates (numpy), whatever their
    norms; a member without a fresh update joins the side whose centre is closest in direction to its
    last update, one without any the larger side (kills split_with_centres 10, 23)."""
    from pfl.methods.cfl import split_with_centres

    rs = np.random.RandomState(0)
    e1, e2 = np.array([1.0, 0.2, 0.0]), np.array([-0.1, 1.0, 0.3])
    raw = np.stack([5.0 * e1, 0.5 * e1, 2.0 * e2, 0.3 * e2, 1.5 * e2]) + 0.05 * rs.normal(size=(5, 3))
    participants = [10, 11, 12, 13, 14]
    last = {20: torch.tensor(0.1 * e1 + 0.02), 21: torch.tensor(3.0 * e2)}
    left, right, centre = split_with_centres([10, 11, 12, 13, 14, 20, 21, 22], participants,
                                             torch.tensor(raw), last)
    assert (left, right) == ([10, 11, 20], [12, 13, 14, 21, 22])  # 22: no update yet → the larger side
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    expected = np.stack([unit[:2].mean(0), unit[2:].mean(0)])
    np.testing.assert_allclose(centre.double().numpy(), expected, rtol=1e-6, atol=1e-9)
    scaled = raw / np.linalg.norm(raw)  # one norm for all rows: other directions
    assert not np.allclose(np.stack([scaled[:2].mean(0), scaled[2:].mean(0)]), expected, atol=1e-3)


# ---- DIANA / FedSLR / PACFL ------------------------------------------------------------------------

def test_diana_mean_shifts_are_refused_under_partial_participation(problem):
    """``shifts: mean`` keeps one server shift h̄ = mean of all clients' shifts, which only full
    participation keeps right: refused with clients_per_round < members, accepted with all (kills
    Diana.configure 8)."""
    from pfl.schema import ConfigError

    with pytest.raises(ConfigError) as info:
        simulator(problem, "diana", steps=K, lr=LR, per_round=2, method__shifts="mean")
    assert info.value.field == "method.shifts"
    simulator(problem, "diana", steps=K, lr=LR, per_round=0, method__shifts="mean")


def test_fedslr_per_client_duals_under_partial_participation_reach_the_optimum_of_the_members():
    """server: algo2 (every γ_i kept), 2 of the 5 members per round and one newcomer held out: the
    fixed point is still argmin (1/n)Σ_{members} f_i + (ω/2)‖w‖² + λ‖W‖_* (ISTA here), the newcomer's
    data outside it (kills FedSLR.aggregate 24)."""
    p = least_squares(sizes=(20, 30, 24, 27, 22, 25), clusters=[0, 0, 0, 1, 1, 1])
    lam, eta, omega = 0.3, 2.0, 1e-3
    sim = simulator(p, "fedslr", steps=K, lr=LR, per_round=2, method__lam=lam, method__eta=eta,
                    method__weight_decay=omega, method__phase2_epochs=0, method__server="algo2",
                    newcomers__fraction=0.17)
    members = list(sim.ctx.members)
    assert len(members) == 5
    d = p.dim - 1

    def prox(z, s):
        z = z.copy()
        z[:d] *= max(0.0, 1 - s * lam / np.linalg.norm(z[:d]))
        return z

    w = np.zeros(p.dim)
    for _ in range(5000):
        w = prox(w - 0.1 * (sum(p.grad(i, w) for i in members) / len(members) + omega * w), 0.1)
    run_rounds(sim, 300)
    assert close(vec(sim.method.global_model), w, 1e-4)
    everyone = p.joint_opt(range(p.m))
    assert not close(w, everyone, 1e-2)


def test_fedslr_copy_init_starts_the_personal_part_at_the_initial_matrices(problem):
    """p_init: copy_init — P⁰ = (initial weight matrix, zero bias); one Phase II epoch (full batch) is
    then one proximal-gradient step P¹ = soft(P⁰ − ℓ(∇f_i(θ⁰ + P⁰) + ω₂P⁰), ℓμ) (kills _p_init 8)."""
    p, mu, omega2 = problem, 0.05, 1e-3
    sim = simulator(p, "fedslr", steps=K, lr=LR, method__lam=0.0, method__mu=mu, method__phase2_epochs=1,
                    method__phase2_weight_decay=omega2, method__p_init="copy_init")
    theta0 = vec(sim.method.global_model)
    d = p.dim - 1
    P0 = np.concatenate([theta0[:d], np.zeros(1)])
    assert np.abs(P0[:d]).min() > 0
    run_rounds(sim, 1)

    def step(i, P):
        z = P - LR * (p.grad(i, theta0 + P) + omega2 * P)
        return np.sign(z) * np.maximum(np.abs(z) - LR * mu, 0.0)

    for i in range(p.m):
        got = vec(sim.client_states[i]["P"])
        assert close(got, step(i, P0), 1e-5)
        assert not close(got, step(i, np.zeros(p.dim)), 1e-3)


def test_pacfl_a_client_without_a_basis_is_a_cluster_of_its_own(problem):
    """Before the one-shot round nobody has uploaded a basis: every member is its own cluster; after
    it (2 of 4 sampled) the two without a basis get fresh ids after the found clusters (kills
    PACFL.cluster_assignment 10)."""
    sim = simulator(problem, "pacfl", steps=K, lr=LR, per_round=2, method__n_basis=2, method__beta=60.0)
    assert sim.method.cluster_assignment() == {0: 0, 1: 1, 2: 2, 3: 3}
    run_rounds(sim, 1)
    found = sim.method.cluster_assignment()
    with_basis = sorted(sim.method.labels)
    assert len(with_basis) == 2
    rest = [c for c in range(4) if c not in with_basis]
    assert [found[c] for c in with_basis] == [sim.method.labels[c] for c in with_basis]
    n_models = len(sim.method.models)
    assert sorted(found[c] for c in rest) == [n_models, n_models + 1]


# ---- FPFC's newcomer stopping rule (pfl/methods/fpfc_admm.py) --------------------------------------

def test_fpfc_newcomer_stops_at_its_first_settled_upload():
    """newcomers.tol: the newcomer-only rounds end after the first step s ≥ 1 whose upload moved by
    ‖w_s − w_{s−1}‖ ≤ tol·‖w_{s−1}‖, evaluated here on the recorded uploads (kills FPFCJoin.join_aggregate
    71, 73, 77, 79)."""
    from pfl.federation.loop import RoundLoop

    p = least_squares(sizes=(20, 30, 24, 27, 22, 25), clusters=[0, 0, 0, 1, 1, 1])
    tol, cap = 2e-2, 60
    sim = simulator(p, "fpfc", steps=2, lr=0.2, rounds=10, newcomers__fraction=0.17, method__lam=1.0,
                    method__xi=0.0, newcomers__rounds=cap, newcomers__tol=tol)
    run_rounds(sim, 10)
    n = sim.ctx.newcomers[0]
    uploads, original = [], sim.method.join_aggregate

    def recording(rnd, step, replies):
        uploads.append(vec(replies[n].tensors("w")))
        original(rnd, step, replies)

    sim.method.join_aggregate = recording
    RoundLoop(sim, []).run()
    moved = [np.linalg.norm(uploads[s] - uploads[s - 1]) / np.linalg.norm(uploads[s - 1])
             for s in range(1, len(uploads))]
    first = next(s for s in range(1, cap) if s > len(moved) or moved[s - 1] <= tol)
    assert len(uploads) == first + 1 < cap
    assert first > 2  # the rule, not the first step, ended it


# ---- PerFed-CKT: clustering space and the all-centroids downlink (pfl/methods/perfed_ckt.py) -------

def _ckt(lam, temperature, **method):
    from pfl.federation.simulator import Simulator
    from pfl.resolver import load

    cfg = load(None, {"method.name": "perfed_ckt", "method.architectures": ["softmax_regression"],
                      "method.k": 2, "method.lam": lam, "method.temperature": temperature,
                      "method.public_size": 40, "model.name": "softmax_regression", "data.source": "digits",
                      "data.num_clients": 4, "data.max_samples": 400, "data.partition.kind": "dirichlet",
                      "data.partition.alpha": 0.3, "federation.batch_size": 0, "federation.local_steps": K,
                      "federation.lr": 0.5, "federation.clients_per_round": 0, "federation.eval_every": 1000,
                      "tracking.enabled": False, "data.cache": False,
                      **{f"method.{k}": v for k, v in method.items()}})
    return Simulator(cfg)


def _best_bipartition(points):
    """The two-way partition of 4 points with the least within-cluster sum of squares (k-means' optimum)."""
    def sse(groups):
        return sum(sum(np.sum((points[i] - np.mean([points[j] for j in g], 0)) ** 2) for i in g) for g in groups)
    splits = [(list(a), [i for i in range(4) if i not in a]) for r in (1, 2) for a in itertools.combinations(range(4), r)]
    return sorted(map(sorted, min(splits, key=sse)))


def test_perfed_ckt_clusters_in_probability_space_and_clients_pick_the_nearest_centroid():
    """cluster_space: probs (T = 1) — k-means on softmax(z/T) finds another partition than on the raw
    logits here; downlink: all_centroids — each client distils towards the logit centroid nearest to
    its own public probabilities; the round is then CE + λT²KL steps written out in numpy (kills
    recluster 33, _target 39, 44, local_update 5)."""
    lam, T, lr = 0.7, 1.0, 0.5
    sim = _ckt(lam, T, cluster_space="probs", downlink="all_centroids")
    x_pub = sim.method.public.x.double().numpy()
    data = [(c.x_train.double().numpy(), c.y_train.numpy()) for c in sim.data.clients]
    params = {i: numpy_params(sim.client_states[i]["params"]) for i in range(4)}

    def train(i, target):
        prm = dict(params[i])
        X, y = data[i]
        for _ in range(K):
            g = mlp_grads(prm, X, y, None)
            if target is not None:
                s = x_pub @ prm["fc.weight"].T + prm["fc.bias"]
                dz = lam * T * (softmax(s / T) - softmax(target / T)) / len(x_pub)
                g = {"fc.weight": g["fc.weight"] + dz.T @ x_pub, "fc.bias": g["fc.bias"] + dz.sum(0)}
            prm = {k: prm[k] - lr * g[k] for k in prm}
        params[i] = prm
        return x_pub @ prm["fc.weight"].T + prm["fc.bias"]

    logits = {i: train(i, None) for i in range(4)}
    run_rounds(sim, 1)
    probs = {i: softmax(logits[i] / T).ravel() for i in range(4)}
    partition = _best_bipartition(probs)
    assert partition != _best_bipartition({i: logits[i].ravel() for i in range(4)})  # the space matters here
    labels = sim.method.assign.tolist()
    assert sorted(sorted(i for i in range(4) if labels[i] == c) for c in set(labels)) == partition
    centroids = [np.mean([logits[j] for j in g], 0) for g in partition]
    targets = {i: centroids[int(np.argmin([np.sum((softmax(c / T) - softmax(logits[i] / T)) ** 2)
                                           for c in centroids]))] for i in range(4)}
    for i in range(4):
        train(i, targets[i])
    run_rounds(sim, 1)
    for i in range(4):
        got = numpy_params(sim.personal_params(i))
        for k in got:
            np.testing.assert_allclose(got[k], params[i][k], rtol=1e-4, atol=1e-5)


def test_the_public_set_of_a_per_device_source_is_drawn_from_the_devices_own_samples():
    """same_heldout on a per-device source (fpfc_synthetic, every sample some device's): every public
    row is a row of some client's data, and the overlap counts all of them (kills build_public_set 20)."""
    from pfl.federation.simulator import Simulator
    from pfl.resolver import load

    cfg = load(None, {"method.name": "perfed_ckt", "method.architectures": ["softmax_regression"],
                      "method.public_size": 30, "model.name": "softmax_regression",
                      "data.source": "fpfc_synthetic", "data.num_clients": 6, "federation.batch_size": 0,
                      "federation.local_steps": 1, "tracking.enabled": False, "data.cache": False})
    sim = Simulator(cfg)
    pub = sim.method.public.x.double().numpy()
    held = np.concatenate([np.concatenate([c.x_train.double().numpy(), c.x_val.double().numpy(),
                                           c.x_test.double().numpy()]) for c in sim.data.clients])
    dist = ((pub[:, None, :] - held[None, :, :]) ** 2).sum(-1).min(1)
    assert len(pub) == 30 and dist.max() < 1e-10
    assert sim.method.public.overlap == 30
