"""Survivors of FedAvg's server side (``streaming``, ``receive``, ``reply_average``) and FPFC's initial
cluster labels, against truths computed here: the server with the mean keeps no reply's tensors
(each reply is folded into a running sum as it arrives, as ``FedAvg.streams_replies`` and
:class:`pfl.aggregation.WeightedSum` document) and still ends at the sample-weighted mean written in
numpy; the uniform mean of replies near the float32 limit is their plain mean (no doubled weights
overflowing); a non-streaming member of the family (FedBN) with ``weighting: uniform`` averages its
clients' K-step GD models unweighted; Krum's f is round(attack.fraction·n) by default, the pick
recomputed in numpy from the clients' GD models (and shown to differ from f = 0's); FPFC asked for
its clusters before any round or evaluation answers one cluster (θ = 0: every pair below ν)."""

import numpy as np

from truth import close, least_squares, params_of, run_rounds, simulator, vec

LR, K = 0.2, 3


def _problem():
    return least_squares(sizes=(20, 30, 24, 27, 22), clusters=[0, 0, 1, 1, 2])


# ---- FPFC: the clusters before anything happened (setup 68) ------------------------------------

def test_fpfc_cluster_assignment_before_any_round_or_evaluation_is_one_cluster():
    """θ = 0 after setup: every pair is below ν, so the connected components are one cluster
    (kills FPFC.setup 68, whose cached labels start as "" instead of "none yet")."""
    p = _problem()
    sim = simulator(p, "fpfc", steps=K, lr=LR, method__nu=0.5)
    got = sim.method.cluster_assignment()
    assert sorted(got) == list(range(p.m))
    assert set(got.values()) == {0}


# ---- FedAvg's streaming mean (streaming 10, 12, 15, 16, 19) --------------------------------------

def test_fedavg_with_the_mean_hands_aggregate_the_control_data_only_and_ends_at_the_weighted_mean():
    """With the mean, FedAvg folds each reply into a running sum as it arrives: ``aggregate`` gets
    every client's control data (its n, its training loss) but none of its tensors, and the global
    model is still Σ n_i GD_K^i(θ⁰) / Σ n_i (numpy). A robust rule needs the replies themselves."""
    p = _problem()
    sim = simulator(p, "fedavg", steps=K, lr=LR)
    seen = []
    aggregate = sim.method.aggregate

    def recording(rnd, replies):
        seen.append({c: (len(r.parts), r.info.get("n"), "train_loss" in r.info) for c, r in replies.items()})
        return aggregate(rnd, replies)

    sim.method.aggregate = recording
    w0 = vec(sim.method.global_model)
    run_rounds(sim, 1)
    assert seen == [{i: (0, p.n(i), True) for i in range(p.m)}]
    n = np.array([p.n(i) for i in range(p.m)], dtype=float)
    expected = sum(n[i] * p.gd(i, w0, K, LR) for i in range(p.m)) / n.sum()
    assert close(vec(sim.method.global_model), expected)

    median = simulator(p, "fedavg", steps=K, lr=LR, method__aggregator="median")
    kept = []
    aggregate_m = median.method.aggregate
    median.method.aggregate = lambda rnd, replies: (kept.append({c: len(r.parts) for c, r in replies.items()}),
                                                    aggregate_m(rnd, replies))[1]
    run_rounds(median, 1)
    assert kept and all(v > 0 for v in kept[0].values())


# ---- the uniform running mean near the float32 limit (receive 27) ---------------------------------

def test_fedavg_uniform_mean_of_replies_near_the_float32_limit_is_their_plain_mean():
    """weighting = uniform: the mean of two replies a, b is (a + b)/2, finite whenever a + b is
    (here 1.5e38 + 1.0e38 < 3.4e38, the float32 limit: e.g. a same-value attack's huge constant); a
    weight of 2 per reply would overflow the running sum (kills FedAvg.receive 27)."""
    from pfl.federation.messages import Message

    p = _problem()
    sim = simulator(p, "fedavg", steps=K, lr=LR, method__weighting="uniform")
    m = sim.method
    like = m.global_model
    values = {0: 1.5e38, 1: 1.0e38}
    replies = {}
    for cid, v in values.items():
        model = params_of(np.full(p.dim, v), like)
        replies[cid] = m.receive(0, cid, Message.model(model, base="model", train_loss=0.0, n=p.n(cid)))
    m.aggregate(0, replies)
    got = vec(m.global_model)
    assert np.all(np.isfinite(got))
    assert close(got, np.full(p.dim, (values[0] + values[1]) / 2.0), 1e-6)


# ---- the kept replies' plain mean (reply_average 18) ---------------------------------------------

def test_fedbn_uniform_weighting_averages_the_clients_models_unweighted():
    """FedBN (FedAvg over the non-BatchNorm entries: all of a linear model) overrides ``aggregate``,
    so it keeps its replies and averages them at the end; with ``weighting: uniform`` one round is
    the plain mean of the clients' K-step GD models, not their sample-weighted mean."""
    p = _problem()
    sim = simulator(p, "fedbn", steps=K, lr=LR, method__weighting="uniform")
    w0 = vec(sim.method.global_model)
    run_rounds(sim, 1)
    models = [p.gd(i, w0, K, LR) for i in range(p.m)]
    plain = sum(models) / p.m
    n = np.array([p.n(i) for i in range(p.m)], dtype=float)
    weighted = sum(ni * w for ni, w in zip(n, models)) / n.sum()
    assert not close(plain, weighted, 1e-4)
    assert close(vec(sim.method.global_model), plain)


# ---- Krum's f from the attack fraction (reply_average 28, 33) -------------------------------------

def _krum_pick(models, f):
    """Index of the model with the smallest sum of squared distances to its n − f − 2 nearest others."""
    n = len(models)
    k = max(1, min(n - f - 2, n - 1))
    scores = []
    for i in range(n):
        d = sorted(float(np.sum((models[i] - models[j]) ** 2)) for j in range(n) if j != i)
        scores.append(sum(d[:k]))
    return min(range(n), key=lambda i: (scores[i], i))


def test_fedavg_krum_takes_f_from_the_attack_fraction_by_default():
    """``byzantine_share: -1`` (the default): f = round(attack.fraction · n) = round(0.2 · 5) = 1, so
    each score sums the n − f − 2 = 2 nearest squared distances; the global model is the picked
    client's K-step GD model (no client is malicious with ``attack.kind: none``). The pick differs from
    f = 0's (3 neighbours), so a server that ignored the fraction would pick another client."""
    p = _problem()
    sim = simulator(p, "fedavg", steps=K, lr=LR, method__aggregator="krum", attack__kind="none",
                    attack__fraction=0.2)
    w0 = vec(sim.method.global_model)
    run_rounds(sim, 1)
    models = [p.gd(i, w0, K, LR) for i in range(p.m)]
    pick = _krum_pick(models, 1)
    assert pick != _krum_pick(models, 0)
    assert close(vec(sim.method.global_model), models[pick])
