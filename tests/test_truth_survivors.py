"""Truths for mutants that survived the full mutation run (docs/verification.md, "Mutation score"):
each test holds pfl's answer against something worked out apart from it (Krum's definition in numpy,
a merge rule done by hand, a closed-form gradient step, the documented refusal), and its docstring
names the mutants it was checked to kill.

Only inputs come from the code under test (the data, the seeded initial model); every expected
value is built here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from truth import close, least_squares, params_of, run_rounds, simulator, vec

LR, K = 0.2, 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(clusters=[0, 0, 1, 1])


def numpy_krum(rows: np.ndarray, f: int) -> int:
    """Krum's pick from its definition: the row whose n − f − 2 nearest other rows (at least one)
    are closest in summed squared distance; the first such row on a tie."""
    n = len(rows)
    k = max(1, n - f - 2)
    best, pick = math.inf, -1
    for i in range(n):
        d = sorted(float(np.sum((rows[i] - rows[j]) ** 2)) for j in range(n) if j != i)
        s = sum(d[:k])
        if s < best:
            best, pick = s, i
    return pick


# ---- pfl/aggregation.py ----------------------------------------------------------------------------

def test_empty_inputs_are_refused_with_their_own_messages():
    """Each empty-input refusal says what was missing (kills _stack 2–4, weighted_average 2–4,
    WeightedSum.mean 2–4 and __init__ 11, whose count starting at 1 reaches the wrong refusal)."""
    from pfl.aggregation import WeightedSum, coordinate_median, weighted_average

    with pytest.raises(ValueError, match=r"^robust aggregation needs at least one model$"):
        coordinate_median([])
    with pytest.raises(ValueError, match=r"^weighted_average needs at least one model$"):
        weighted_average([])
    with pytest.raises(ValueError, match=r"^a weighted sum of no models has no mean$"):
        WeightedSum().mean()


def test_weights_that_sum_to_zero_are_refused():
    """A zero total weight has no mean (kills WeightedSum.mean 7–9)."""
    from pfl.aggregation import WeightedSum

    acc = WeightedSum()
    acc.add({"w": torch.ones(2)}, 0.0)
    with pytest.raises(ValueError, match=r"^weights must sum to a positive number$"):
        acc.mean()


def test_a_model_added_without_a_weight_counts_once():
    """add(a) then add(b, 3): the mean is (a + 3b)/4 (kills WeightedSum.add 1, a default weight of 2)."""
    from pfl.aggregation import WeightedSum

    a, b = torch.tensor([1.0, -2.0]), torch.tensor([5.0, 6.0])
    acc = WeightedSum()
    acc.add({"w": a})
    acc.add({"w": b}, 3.0)
    assert np.allclose(acc.mean()["w"].numpy(), (np.array([1.0, -2.0]) + 3 * np.array([5.0, 6.0])) / 4)


def test_an_unknown_aggregator_names_itself_and_the_allowed_ones():
    """(kills aggregate 49–51)"""
    from pfl.aggregation import RobustAggregation, aggregate

    with pytest.raises(ValueError, match=r"^unknown aggregator 'bogus'; allowed: mean, median, trimmed_mean, krum$"):
        aggregate([{"w": torch.zeros(1)}], None, RobustAggregation(aggregator="bogus"))


def test_byzantine_share_bounds():
    """0 and shares inside [0, 1) pass, −1 passes, any other negative share is refused naming the
    field and the allowed range (kills RobustAggregation.validate 2, 3, 7–10)."""
    from pfl.aggregation import RobustAggregation
    from pfl.schema import ConfigError

    for share in (0.0, 0.5, -1.0):
        RobustAggregation(byzantine_share=share).validate("method")
    with pytest.raises(ConfigError) as err:
        RobustAggregation(byzantine_share=-0.5).validate("method")
    assert err.value.field == "method.byzantine_share"
    assert "must be in [0, 1) or -1 (the attack fraction), got -0.5" in str(err.value)


def test_krum_through_aggregate_assumes_no_byzantine_replies_by_default():
    """With byzantine_share = −1 and no attack fraction given, f = 0 and a score sums n − 2 = 3
    squared distances: a spread group of three beats a tight far pair, which f = n would pick
    (kills aggregate 1, default attack fraction 1)."""
    from pfl.aggregation import RobustAggregation, aggregate

    values = np.array([[0.0], [1.0], [2.0], [10.0], [10.01]])
    pick = numpy_krum(values, 0)
    assert pick == 2 and numpy_krum(values, 5) == 3   # the input separates the two readings
    models = [{"w": torch.tensor(v, dtype=torch.float64)} for v in values]
    got = aggregate(models, None, RobustAggregation(aggregator="krum", byzantine_share=-1.0))
    assert float(got["w"]) == values[pick, 0]


def test_krum_measures_large_integer_entries_exactly():
    """Tensors of different dtypes are measured in float64: integer entries 2^24 and 2^24 + 1 stay one
    apart (in float32 they would be equal and make replies 0 and 1 look identical) (kills krum 13)."""
    from pfl.aggregation import krum

    big = 2 ** 24
    rows = np.array([[0.0, big], [0.0, big + 1], [5.0, big], [5.5, big]])
    pick = numpy_krum(rows, 0)
    assert pick == 2
    models = [{"w": torch.tensor([r[0]], dtype=torch.float32), "n": torch.tensor([int(r[1])], dtype=torch.int64)}
              for r in rows]
    _, chosen = krum(models, 0)
    assert chosen == [pick]


def test_krum_of_one_reply_is_that_reply():
    """One reply has one score, 0 (no other reply to measure), and is chosen (kills krum_scores 5, 7
    and 9)."""
    from pfl.aggregation import krum, krum_scores

    assert krum_scores(torch.tensor([[1.0, 2.0]]), 0).tolist() == [0.0]
    model = {"w": torch.tensor([3.0, -1.0])}
    avg, chosen = krum([model], 0)
    assert chosen == [0] and torch.equal(avg["w"], model["w"])


# ---- pfl/clusters.py ---------------------------------------------------------------------------------

def test_relabel_of_nothing_is_an_empty_integer_array():
    """An empty labelling still indexes (kills relabel 3 and 5, which give float64)."""
    from pfl.clusters import relabel

    out = relabel([])
    assert out.dtype.kind == "i" and out.shape == (0,)
    assert np.arange(3)[out].shape == (0,)


def _two_pairs(within_a: float, within_b: float, between: float) -> np.ndarray:
    d = np.full((4, 4), between)
    d[0, 1] = d[1, 0] = within_a
    d[2, 3] = d[3, 2] = within_b
    np.fill_diagonal(d, 0.0)
    return d


def test_silhouette_threshold_averages_the_two_directions_in_double_precision():
    """float32 distances, ‖θ_01‖ = 1 one way and 1 + 2⁻²³ the other: the symmetrised distance is
    1 + 2⁻²⁴ (not a float32), and the best cut, the two pairs, sits halfway between it and 10
    (kills silhouette_threshold 3 and 5, which average in float32 and lose the 2⁻²⁴)."""
    from pfl.clusters import silhouette_threshold

    d = _two_pairs(1.0, 1.0, 10.0).astype(np.float32)
    d[1, 0] = np.nextafter(np.float32(1.0), np.float32(2.0))
    within = (1.0 + float(d[1, 0])) / 2
    assert within == 1.0 + 2.0 ** -24
    assert silhouette_threshold(d) == (within + 10.0) / 2


def test_silhouette_threshold_skips_a_cut_with_no_merge():
    """Merge heights 1 and the next float after 1: their midpoint rounds to 1, where {dist < ν} has
    no edge and every client is alone — not a candidate (2 to m − 1 components); the answer is the
    cut between the pairs and the rest (kills silhouette_threshold 53, which scores m singletons)."""
    from pfl.clusters import silhouette_threshold

    up = float(np.nextafter(1.0, 2.0))
    assert (1.0 + up) / 2 == 1.0
    assert silhouette_threshold(_two_pairs(1.0, up, 10.0)) == (up + 10.0) / 2


def test_silhouette_threshold_needs_a_score_strictly_above_the_minimum():
    """Three clients, d01 = 1, d02 = d12 = 4: the one candidate cut {0, 1} | {2} has silhouette
    ((4 − 1)/4 · 2 + 0)/3 = 1/2 exactly; with min_score = 1/2 nothing scores above it, so None
    (kills silhouette_threshold 64); below it the threshold is (1 + 4)/2."""
    from pfl.clusters import silhouette_threshold

    d = np.array([[0.0, 1.0, 4.0], [1.0, 0.0, 4.0], [4.0, 4.0, 0.0]])
    assert silhouette_threshold(d, min_score=0.5) is None
    assert silhouette_threshold(d, min_score=0.49) == 2.5



def test_silhouette_threshold_refuses_a_nan_distance_as_not_finite():
    """A NaN distance (a diverged model) is refused for what it is, not finite — the symmetrised
    matrix is symmetric by construction, so a refusal that calls it asymmetric would mislead
    (kills silhouette_threshold 27 and 28, which validate the square matrix first)."""
    from pfl.clusters import silhouette_threshold

    d = np.array([[0.0, 1.0, 4.0], [1.0, 0.0, np.nan], [4.0, np.nan, 0.0]])
    with pytest.raises(ValueError, match="finite"):
        silhouette_threshold(d)

# ---- pfl/compression -------------------------------------------------------------------------------

def test_a_biased_compressor_has_no_finite_variance_constant():
    """top-k and sign are biased: ω is infinite, the identity's is 0 (kills Compressor.omega 2)."""
    from pfl.compression.compressors import build

    for spec in ({"name": "topk", "ratio": 0.1}, {"name": "sign"}):
        assert build(spec).omega(100) == math.inf
    assert build({"name": "identity"}).omega(100) == 0.0


def test_the_scaled_form_keeps_the_inner_compressors_name_and_value_count():
    """C/(1 + ω) sends what C sends: rand-k's k = ⌈ratio·d⌉ values, under rand-k's name (kills
    Scaled.__init__ 3 and Scaled.compress 11)."""
    from pfl.compression.base import Scaled
    from pfl.compression.compressors import build

    inner = build({"name": "randk", "ratio": 0.3})
    scaled = Scaled(inner)
    enc = scaled.compress(torch.arange(1.0, 11.0), torch.Generator().manual_seed(0))
    assert enc.values == math.ceil(0.3 * 10) == 3
    assert scaled.name == "randk"


@pytest.mark.parametrize("settings, words", [
    ({"compression__downlink": {"name": "sign", "scaled": False}},
     "sign with scaled=false is neither unbiased nor contractive, so the clients' copies would drift from "
     "the model; use scaled=true"),
    ({"compression__uplink": {"name": "sign", "scaled": False}, "compression__error_feedback": True},
     "error feedback needs a contractive compressor; sign with scaled=false is not (its memory grows): "
     "use scaled=true"),
])
def test_unstable_compression_settings_say_why_and_what_to_set(settings, words):
    """(kills check_method_compression 10, 15, 16, 23, 28, 29)"""
    from helpers import small_config

    from pfl.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        small_config(**settings)
    assert words in str(err.value)


def test_newcomer_bytes_are_reported_under_their_own_names():
    """(kills CommLedger.metrics 36)"""
    from pfl.federation.comm import CommLedger

    out = CommLedger(join_up_bytes=5, join_down_bytes=7).metrics()
    assert out["comm/join_up_bytes"] == 5.0 and out["comm/join_down_bytes"] == 7.0


# ---- the methods -----------------------------------------------------------------------------------

def test_apfl_mixes_running_statistics_without_a_gradient_to_alpha():
    """BatchNorm statistics are mixed with α held constant: no gradient reaches α through them,
    while a parameter's mix has dα = v − w (kills mixed_params 2)."""
    from pfl.methods.apfl import mixed_params

    alpha = torch.tensor(0.25, requires_grad=True)
    v = {"w": torch.tensor([2.0]), "s": torch.tensor([4.0])}
    w = {"w": torch.tensor([1.0]), "s": torch.tensor([0.0])}
    out = mixed_params(v, w, alpha, frozenset({"s"}))
    assert float(out["s"]) == 1.0 and not out["s"].requires_grad
    (grad,) = torch.autograd.grad(out["w"].sum(), alpha)
    assert float(grad) == 1.0


def test_cfl_bipartition_is_complete_linkage():
    """Update directions at angles 0, 0.1, 0.21, 0.33 rad (cosine distance grows with the angle gap):
    complete linkage joins 0–1 (gap 0.1), then 2–3 (0.12 < the 0.21 from 0 to 2), so the halves are
    {0, 1} | {2, 3}; single linkage would chain 2 onto {0, 1} (gap 0.11) (kills bipartition 33)."""
    from pfl.methods.cfl import bipartition

    angles = torch.tensor([0.0, 0.1, 0.21, 0.33], dtype=torch.float64)
    updates = torch.stack([angles.cos(), angles.sin()], dim=1) * torch.tensor([[1.0], [2.0], [0.5], [3.0]],
                                                                              dtype=torch.float64)
    assert bipartition(updates).tolist() == [0, 0, 1, 1]


def _cfl_replies(meth, vectors):
    from pfl.federation.messages import Message, Update
    from pfl.models.functional import unflatten_params

    names = list(meth.models[0])
    return {cid: Message.of({"delta": Update(unflatten_params(v.clone(), meth.models[0], names))}, n=5)
            for cid, v in vectors.items()}


def _cfl(**kw):
    from helpers import clustered

    from pfl.federation.simulator import Simulator

    return Simulator(clustered("label_swap", 2, 8, method__name="cfl", method__start_round=0, method__eps1=10.0,
                               method__eps2=0.5, federation__rounds=1, **kw)).method


def test_cfl_splits_a_cluster_with_exactly_two_replies():
    """Split when the cluster has more than min_size members and at least two replies: two opposite
    updates from an 8-client cluster with min_size 1 split it, 0 and 1 on different sides (kills
    CFL.aggregate 63, which wants three replies)."""
    meth = _cfl(method__min_size=1)
    dim = sum(v.numel() for v in meth.models[0].values())
    u = torch.randn(dim, generator=torch.Generator().manual_seed(0))
    meth.aggregate(0, _cfl_replies(meth, {0: u, 1: -u}))
    assert len(meth.clusters) == 2
    side = {c: i for i, group in enumerate(meth.clusters) for c in group}
    assert side[0] != side[1]


def test_cfl_ids_after_a_partition_set_from_outside_are_fresh():
    """A partition set from outside gets ids after every id used so far, and a split in the same
    round gives its two sides ids after those: no id is used twice (kills CFL.aggregate 14, which
    moves the next id back and hands out the root's 0 again)."""
    meth = _cfl(method__min_size=2)
    used = set(meth.cluster_ids) | {meth.next_id - 1}
    meth.clusters = [[0, 1, 2, 3], [4, 5, 6, 7]]
    meth.models = [meth.models[0], {k: v.clone() for k, v in meth.models[0].items()}]
    dim = sum(v.numel() for v in meth.models[0].values())
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(dim, generator=gen)
    noise = lambda: 0.05 * torch.randn(dim, generator=gen)  # noqa: E731
    meth.aggregate(0, _cfl_replies(meth, {c: (u if c < 2 else -u) + noise() for c in range(4)}))
    assert sorted(map(sorted, meth.clusters)) == [[0, 1], [2, 3], [4, 5, 6, 7]]
    ids = list(meth.cluster_ids) + list(meth.tree)
    assert len(set(meth.cluster_ids)) == 3 and min(ids) > max(used)


def test_fedpd_with_no_replies_in_a_communication_round_keeps_x0():
    """A round that communicates but got no replies has nothing to average: x₀ stays, nothing is
    pending (kills FedPD.aggregate 2, which then averages an empty list)."""
    sim = simulator(least_squares(), "fedpd", steps=K, lr=LR, method__schedule="every", method__every=1)
    meth = sim.method
    assert meth.communicates(0)
    before = vec(meth.x0)
    meth.aggregate(0, {})
    assert not meth.pending and np.array_equal(vec(meth.x0), before)


def test_fedslr_copy_init_personal_model_of_a_client_that_never_trained():
    """p_init: copy_init — a client without P yet is evaluated with received + P⁰, P⁰ = (initial
    weight matrix, zero bias) (kills FedSLR.personal_params 9)."""
    p = least_squares()
    sim = simulator(p, "fedslr", steps=K, lr=LR, method__p_init="copy_init")
    theta0 = vec(sim.method.global_model)
    d = p.dim - 1
    P0 = np.concatenate([theta0[:d], np.zeros(1)])
    received = np.array([0.3, -1.2, 2.5])
    got = sim.method.personal_params(0, sim._handle(1, {}), params_of(received, sim.method.global_model))
    assert close(vec(got), received + P0, 1e-6)


def test_marina_weighted_by_samples_is_gradient_descent_on_the_sample_weighted_loss():
    """weighting = samples: with exact differences g = Σ n_i ∇f_i / Σ n_i, so x⁺ = x − γ g (kills
    Marina.aggregate 19, which always weights uniformly)."""
    p = least_squares(sizes=(10, 40, 15, 60))
    n = np.array([p.n(i) for i in range(p.m)], dtype=float)
    sim = simulator(p, "marina", lr=LR, compression__uplink__name="identity", method__p=0.3,
                    method__weighting="samples")
    grad = lambda x: sum(n[i] * p.grad(i, x) for i in range(p.m)) / n.sum()  # noqa: E731
    x = vec(sim.method.x)
    run_rounds(sim, 4)
    for _ in range(3):  # round 0 only collects g⁰
        x = x - LR * grad(x)
    assert close(vec(sim.method.x), x, 1e-5)


def test_pacfl_merged_clusters_average_their_models_by_sample_count():
    """Two clusters whose clients turn out to share a subspace merge when a third basis arrives: the
    merged cluster's model is the n-weighted mean of what its clients held, (10·A + 30·B)/40 (kills
    PACFL._add_bases 52, which averages them uniformly)."""
    p = least_squares()
    sim = simulator(p, "pacfl", steps=K, lr=LR, per_round=2, method__n_basis=1)
    meth = sim.method
    basis = torch.tensor([[1.0], [0.0]])
    like = meth.init
    A, B = np.array([1.0, 2.0, 3.0]), np.array([-3.0, 0.5, 7.0])
    meth.bases = {0: basis, 1: basis}
    meth.prox[:2, :2] = 0.0
    meth.labels, meth.models, meth.n = {0: 0, 1: 1}, [params_of(A, like), params_of(B, like)], {0: 10, 1: 30}
    meth._add_bases({2: basis})
    assert meth.labels == {0: 0, 1: 0, 2: 0} and len(meth.models) == 1
    assert close(vec(meth.models[0]), (10 * A + 30 * B) / 40, 1e-6)


def test_scaffold_with_ala_first_round_is_plain_gradient_descent_from_the_received_model():
    """SCAFFOLD's first round: c = c_i = 0 and (ALA having no local model yet) training starts at
    θ⁰, so θ¹ = θ⁰ + η·mean_i(GD_K(θ⁰) − θ⁰) (kills Scaffold.local_update 28, which hands ALA no
    client)."""
    p = least_squares()
    sim = simulator(p, "scaffold+ala", steps=K, lr=LR)
    theta0 = vec(sim.method.global_model)
    run_rounds(sim, 1)
    eta = sim.method.hp.server_lr
    want = theta0 + eta * np.mean([p.gd(i, theta0, K, LR) - theta0 for i in range(p.m)], axis=0)
    assert close(vec(sim.method.global_model), want, 1e-5)


def test_scaffold_reports_the_clients_training_loss():
    """One full-batch step per client: each client's training loss is f_i(θ⁰), the round's is their
    mean (kills Scaffold.local_update 57, which drops it)."""
    p = least_squares()
    sim = simulator(p, "scaffold", steps=1, lr=LR)
    theta0 = vec(sim.method.global_model)
    sim.run_round(evaluate=False)
    assert sim.history[-1]["train/loss"] == pytest.approx(np.mean([p.loss(i, theta0) for i in range(p.m)]), rel=1e-5)
