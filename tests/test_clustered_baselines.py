"""Clustered-FL baselines: IFCA, CFL, PACFL (math on hand-made inputs, comm bytes, clustering, learning)."""

import csv
import math

import numpy as np
import pytest
import torch

from helpers import clustered, small_config, straight_and_resumed
from pfl.callbacks.divergence import run_rounds
from pfl.federation.messages import Message, Model, Scalars, Update
from pfl.federation.simulator import Simulator
from pfl.methods.cfl import bipartition, split_members
from pfl.methods.pacfl import cluster_by_threshold, data_basis, proximity
from pfl.models.functional import flatten_params, unflatten_params
from pfl.resolver import with_overrides
from pfl.schema import ConfigError

D_SOFTMAX = 64 * 10 + 10  # softmax regression on 8x8 digits


def final_acc(sim):
    return run_rounds(sim)[-1]["test/acc_mean"]


@pytest.fixture(scope="module")
def fedavg_label_swap():
    return final_acc(Simulator(clustered("label_swap", 2, 10, method__name="fedavg", federation__rounds=3)))


# ---- IFCA ------------------------------------------------------------------------------------------

def test_ifca_recovers_clusters_beats_fedavg_and_measures_bytes(fedavg_label_swap, tmp_path):
    rounds, m, k = 3, 10, 2
    sim = Simulator(clustered("label_swap", 2, m, method__name="ifca", method__k=k, federation__rounds=rounds))
    history = run_rounds(sim)
    last = history[-1]
    assert last["cluster/ari"] >= 0.9 and last["cluster/num"] == 2
    assert last["test/acc_mean"] > fedavg_label_swap + 0.05
    # down: all K models to every sampled client; up: one model + a one-byte cluster index
    assert sim.ledger.down_bytes == rounds * m * k * D_SOFTMAX * 4
    assert sim.ledger.up_bytes == rounds * m * (D_SOFTMAX * 4 + 1)
    path = sim.method.artifacts(str(tmp_path))[0]
    rows = list(csv.DictReader(open(path)))
    assert len(rows) == m and set(rows[0]) == {"client", "true_cluster", "found_cluster", "n_train"}
    assert [int(r["true_cluster"]) for r in rows] == list(sim.data.true_clusters)


def test_ifca_averages_per_chosen_cluster_and_leaves_unchosen_untouched():
    sim = Simulator(clustered("label_swap", 2, 4, method__name="ifca", method__k=3, federation__rounds=1))
    method = sim.method
    before = [dict(m) for m in method.models]
    gen = torch.Generator().manual_seed(1)
    models = [{k: torch.randn(v.shape, generator=gen) for k, v in before[0].items()} for _ in range(3)]
    choice = [0, 2, 0]
    replies = {cid: Message.of({"model": Model(models[cid], base=f"cluster{choice[cid]}"),
                                "choice": Scalars({"cluster": torch.tensor([choice[cid]], dtype=torch.uint8)})},
                               n=10 + cid)
               for cid in range(3)}
    method.aggregate(0, replies)
    for name in before[0]:
        assert torch.allclose(method.models[0][name], (models[0][name] + models[2][name]) / 2)
        assert torch.equal(method.models[2][name], models[1][name])
        assert torch.equal(method.models[1][name], before[1][name])


def test_ifca_independent_init_differs_shared_collapses():
    indep = Simulator(clustered("label_swap", 2, 4, method__name="ifca", method__k=2, federation__rounds=1)).method
    shared = Simulator(clustered("label_swap", 2, 4, method__name="ifca", method__k=2, method__init="shared",
                                 federation__rounds=1)).method
    assert not torch.equal(flatten_params(indep.models[0]), flatten_params(indep.models[1]))
    assert all(torch.equal(shared.models[0][n], shared.models[1][n]) for n in shared.models[0])


# ---- CFL -------------------------------------------------------------------------------------------

def _opposite_updates(n_a, n_b, dim=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(dim, generator=gen)
    a = v + 0.1 * torch.randn(n_a, dim, generator=gen)
    b = -v + 0.1 * torch.randn(n_b, dim, generator=gen)
    return a, b, v


def test_cfl_bipartition_separates_opposite_updates_and_maps_back_to_client_ids():
    a, b, v = _opposite_updates(3, 2)
    # participants of a cluster that is a non-trivial subset of the clients, interleaved
    participants = [12, 3, 15, 7, 40]
    updates = torch.stack([a[0], b[0], a[1], b[1], a[2]])
    labels = bipartition(updates)
    assert list(labels) == [0, 1, 0, 1, 0]
    last = {9: -v, 21: v}  # absent members: placed by their last update
    members = [3, 7, 9, 12, 15, 21, 33, 40]  # 33 never heard from -> the larger side
    left, right = split_members(members, participants, updates, last)
    assert left == [12, 15, 21, 33, 40] and right == [3, 7, 9]


def test_cfl_split_step_on_a_subset_cluster():
    sim = Simulator(clustered("label_swap", 2, 8, method__name="cfl", method__start_round=0, method__eps1=10.0,
                              method__eps2=0.5, method__min_size=2, federation__rounds=1))
    method = sim.method
    method.clusters = [[0, 1], [2, 3, 4, 5, 6, 7]]
    method.models = [method.models[0], {k: v + 1.0 for k, v in method.models[0].items()}]
    names = list(method.models[0])
    dim = sum(v.numel() for v in method.models[0].values())
    a, b, _ = _opposite_updates(3, 3, dim=dim)
    flat = {2: a[0], 4: a[1], 6: a[2], 3: b[0], 5: b[1], 7: b[2]}
    replies = {cid: Message.of({"delta": Update(unflatten_params(u.clone(), method.models[0], names))}, n=5)
               for cid, u in flat.items()}
    old = [dict(m) for m in method.models]
    method.aggregate(3, replies)
    assert method.clusters == [[0, 1], [2, 4, 6], [3, 5, 7]]
    assert all(torch.equal(method.models[0][k], old[0][k]) for k in names)  # no participant: untouched
    for c, side in ((1, [2, 4, 6]), (2, [3, 5, 7])):
        expected = flatten_params(old[1], names) + torch.stack([flat[i] for i in side]).mean(0)
        assert torch.allclose(flatten_params(method.models[c], names), expected, atol=1e-6)
    # criteria not met (mean update too large) -> no split, one step with the mean of all six
    method.clusters, method.models = [[0, 1], [2, 3, 4, 5, 6, 7]], old
    method.hp.eps1 = 1e-6
    method.aggregate(3, replies)
    assert len(method.clusters) == 2


def test_cfl_splits_label_swap_population_and_beats_fedavg(fedavg_label_swap):
    # min_size=5: the two halves of 5 clients may not split again
    sim = Simulator(clustered("label_swap", 2, 10, method__name="cfl", method__start_round=1, method__eps1=100.0,
                              method__eps2=0.0, method__min_size=5, federation__rounds=3))
    last = run_rounds(sim)[-1]
    assert last["cluster/num"] == 2 and last["cluster/ari"] >= 0.9
    assert last["test/acc_mean"] > fedavg_label_swap + 0.05
    assert {"cfl/mean_norm", "cfl/max_norm"} <= set(last)
    d = D_SOFTMAX * 4
    assert sim.ledger.down_bytes == sim.ledger.up_bytes == 3 * 10 * d


# ---- PACFL -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("angle", ["reference", "principal"])
def test_pacfl_proximity_of_hand_made_subspaces(angle):
    e = torch.eye(6)
    theta = math.radians(30.0)
    rotated = torch.stack([math.cos(theta) * e[0] + math.sin(theta) * e[2], e[4]], dim=1)
    bases = [e[:, :2], e[:, :2].clone(), e[:, 2:4], rotated, e[:, [0]]]
    a = proximity(bases, bases, angle)
    assert a.shape == (5, 5)
    assert abs(float(a[0, 1])) < 1e-3                     # identical -> 0°
    assert abs(float(a[0, 2]) - 90.0) < 1e-3              # orthogonal -> 90°
    assert abs(float(a[0, 3]) - 30.0) < 1e-3              # cos30·e0 + sin30·e2 is 30° from span(e0, e1)
    assert abs(float(a[2, 3]) - 60.0) < 1e-3              # ... and 60° from span(e2, e3)
    assert abs(float(a[4, 0])) < 1e-3                     # a line inside the plane -> 0°, other widths padded
    assert torch.allclose(a, a.T, atol=1e-4)


def test_pacfl_reference_angle_ignores_singular_vector_signs():
    e = torch.eye(4)
    a = proximity([e[:, :2]], [-e[:, :2]], "reference")
    assert float(a[0, 0]) < 1e-3


def test_pacfl_clusters_by_threshold_and_basis_shape():
    dist = np.array([[0, 1, 9, 9], [1, 0, 9, 9], [9, 9, 0, 2], [9, 9, 2, 0]], dtype=float)
    assert list(cluster_by_threshold(dist, 3.0)) == [0, 0, 1, 1]
    assert list(cluster_by_threshold(dist, 0.5)) == [0, 1, 2, 3]
    assert list(cluster_by_threshold(dist, 10.0)) == [0, 0, 0, 0]
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(40, 2, 3, generator=gen)
    y = torch.tensor([0] * 20 + [1] * 17 + [2] * 3)
    u = data_basis(x, y, 5)
    assert u.shape == (6, 5 + 5 + 3)
    assert torch.allclose(u[:, :5].T @ u[:, :5], torch.eye(5), atol=1e-5)


def test_pacfl_recovers_rotation_clusters_counts_one_shot_upload_and_beats_fedavg():
    m, rounds, p = 12, 3, 3
    cfg = clustered("rotation", 4, m, method__name="pacfl", method__beta=11.0, method__n_basis=p,
                    federation__rounds=rounds)
    sim = Simulator(cfg)
    sim.run_round()
    up0, down0 = sim.ledger.per_round[0]
    expected = sum(64 * sum(min(p, int((c.y_train == lab).sum())) for lab in torch.unique(c.y_train)) * 4
                   for c in sim.data.clients)
    assert up0 == expected and down0 == 0
    full = [64 * p * len(torch.unique(c.y_train)) * 4 for c in sim.data.clients]
    assert expected == sum(full)  # every label has ≥ p samples here: features × p × #labels × 4 each
    last = run_rounds(sim)[-1]
    assert last["cluster/ari"] >= 0.9 and last["cluster/num"] == 4
    fedavg = final_acc(Simulator(with_overrides(cfg, ["method.name=fedavg"])))
    assert last["test/acc_mean"] > fedavg + 0.05
    assert sim.ledger.per_round[1] == (m * D_SOFTMAX * 4, m * D_SOFTMAX * 4)


def test_pacfl_partial_participation_collects_bases_then_clusters_everyone():
    sim = Simulator(clustered("rotation", 2, 8, method__name="pacfl", method__beta=11.0, federation__rounds=8,
                              federation__clients_per_round=4))
    history = run_rounds(sim)
    assert history[0]["cluster/num"] >= 4  # unreported clients count as their own clusters
    method = sim.method
    assert len(method.bases) == 8, "every client should have reported within 8 rounds at this seed"
    assert history[-1]["cluster/ari"] == 1.0
    assert set(method.labels) == set(range(8))


# ---- configuration ---------------------------------------------------------------------------------

@pytest.mark.parametrize("method, field, value", [
    ("ifca", "k", 0), ("ifca", "init", "same"), ("ifca", "weighting", "median"),
    ("cfl", "eps1", -0.1), ("cfl", "min_size", 0), ("cfl", "start_round", -1),
    ("pacfl", "beta", 0.0), ("pacfl", "beta", 120.0), ("pacfl", "n_basis", 0), ("pacfl", "angle", "cosine"),
    ("pacfl", "linkage", "ward"),
])
def test_bad_hyperparameters_name_the_field(method, field, value):
    with pytest.raises(ConfigError) as info:
        small_config(method__name=method, **{f"method__{field}": value})
    assert info.value.field == f"method.{field}"


# ---- checkpoints ---------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [
    dict(method__name="cfl", method__start_round=1, method__eps1=100.0, method__eps2=0.0, method__min_size=2),
    dict(method__name="pacfl", method__beta=11.0, federation__clients_per_round=4),
    dict(method__name="ifca", method__k=2, federation__clients_per_round=4),
])
def test_resume_continues_identically(tmp_path, overrides):
    cfg = clustered("label_swap", 2, 8, federation__rounds=4, **overrides)
    whole, resumed = straight_and_resumed(cfg, tmp_path)
    assert resumed.history[-1]["test/acc_mean"] == whole.history[-1]["test/acc_mean"]
    assert resumed.history[-1]["cluster/ari"] == whole.history[-1]["cluster/ari"]
    assert resumed.ledger.total_bytes == whole.ledger.total_bytes
