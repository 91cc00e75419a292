"""Truth tests for PerFed-CKT (pfl/methods/perfed_ckt.py, spec docs: specs/perfed_ckt.md): the server's
centroids with unknown entries, the distillation loss by hand, the cluster read-outs by hand count,
the rows a client uploads, the artifacts' "no cluster yet" marks and the classification-only refusal.
Every expected value is computed in the test (numpy / sklearn / a loop), never read back from pfl."""

from __future__ import annotations

import csv
import itertools

import numpy as np
import pytest
import torch
from torch.func import functional_call

from helpers import small_config


def _sim(**kw):
    from pfl.federation.simulator import Simulator

    base = dict(method__name="perfed_ckt", method__architectures=["mlp"], method__public_size=20, method__k=2,
                data__num_clients=6, federation__clients_per_round=0, federation__rounds=2)
    return Simulator(small_config(**{**base, **kw}))


def _read(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


# ---- server: centroids over the clients that know an entry ------------------------------------------

def test_centroids_fill_unknown_entries_with_the_mean_over_the_clients_that_know_them(tmp_path):
    """Three stored clients, k = 3 (each its own cluster), client 0 knows all 20 rows, client 1 rows 0–9,
    client 2 rows 0–4; client 3 never uploaded. A centroid entry is the member's value where known,
    else the mean over the stored clients that know it (spec §4/§5). Client 3 stays unassigned (−1)
    and the artifact records the clustering round."""
    sim = _sim(method__k=3)
    m = sim.method
    n, c = m.n_public, sim.ctx.meta.num_classes
    gen = torch.Generator().manual_seed(3)
    z = [torch.randn(n, c, generator=gen) + 10.0 * i for i in range(3)]
    known_rows = [n, 10, 5]
    m.logits[:] = float("nan")
    for i in range(3):
        m.logits[i, :known_rows[i]] = z[i][:known_rows[i]]
        m.known[i] = True
    m.recluster(4)
    assign = m.assign.tolist()
    assert sorted(assign[:3]) == [0, 1, 2] and all(a == -1 for a in assign[3:])
    for i in range(3):
        want = np.empty((n, c))
        for r in range(n):
            if r < known_rows[i]:
                want[r] = z[i][r].numpy()
            else:
                knowers = [j for j in range(3) if r < known_rows[j]]
                want[r] = np.mean([z[j][r].numpy() for j in knowers], axis=0)
        np.testing.assert_allclose(m.centroids[assign[i]].numpy(), want, rtol=1e-5, atol=1e-5)
    rows = _read(m.artifacts(str(tmp_path))[1])
    assert [int(r["cluster"]) for r in rows] == assign
    assert [int(r["uploaded"]) for r in rows] == [1, 1, 1, 0, 0, 0]
    assert {r["cluster_round"] for r in rows} == {"4"}


def test_identical_clients_still_get_min_k_stored_centroids_on_the_all_centroids_downlink():
    """Four stored clients, three with the same logits z and one with z + 5, k = 3: only two distinct
    points, yet the server holds min(k, #stored) = 3 centroids and sends K·N_t·C values (spec §7):
    z, z + 5 and, for the empty cluster, the mean of all stored clients, z + 5/4 (spec §4)."""
    sim = _sim(method__k=3, method__downlink="all_centroids")
    m = sim.method
    n, c = m.n_public, sim.ctx.meta.num_classes
    z = torch.randn(n, c, generator=torch.Generator().manual_seed(0))
    for i in range(4):
        m.logits[i] = z + (5.0 if i == 3 else 0.0)
        m.known[i] = True
    for rnd in range(4):
        m.recluster(rnd)
        msg = m.broadcast(rnd + 1, 0)
        cents = msg.tensors("centroids")["centroids"]
        assert tuple(cents.shape) == (3, n, c)
        a = m.assign.tolist()
        assert a[0] == a[1] == a[2] != a[3]
        want = {a[0]: z, a[3]: z + 5.0}
        empty = ({0, 1, 2} - set(want)).pop()
        want[empty] = z + 1.25
        for k in range(3):
            np.testing.assert_allclose(cents[k].numpy(), want[k].numpy(), rtol=1e-5, atol=1e-5)


def test_clustering_is_the_documented_seeded_kmeans_and_each_client_is_nearest_its_centroid():
    """sklearn KMeans(n_clusters=min(k, #stored), n_init=10, random_state from (seed, round)) on the
    flattened logit matrices (module docstring): labels reproduced from the seed, partition is a
    partition, and every client is nearest its own centroid in the clustered space."""
    from sklearn.cluster import KMeans

    from pfl.federation.context import derive_seed

    sim = _sim(method__k=3, data__num_clients=12)
    m = sim.method
    n, c = m.n_public, sim.ctx.meta.num_classes
    gen = torch.Generator().manual_seed(12)   # data where the 11th init would win: n_init matters
    z = torch.randn(12, n, c, generator=gen)
    m.logits[:] = z
    m.known[:] = True
    for rnd in (2, 5):
        m.recluster(rnd)
        feats = z.reshape(12, -1).double().numpy()
        km = KMeans(n_clusters=3, n_init=10, random_state=derive_seed(sim.ctx.seed, rnd, "kmeans") % 2**32).fit(feats)
        assert m.assign.tolist() == km.labels_.tolist()
        labels = m.assign.numpy()
        cents = np.stack([feats[labels == k].mean(0) for k in range(3)])
        d = ((feats[:, None, :] - cents[None]) ** 2).sum(-1)
        assert (d.argmin(1) == labels).all()


# ---- client: the distillation loss by hand ------------------------------------------------------------

def _kl_rows(student, teacher, t):
    s, m = student.double().numpy() / t, teacher.double().numpy() / t
    lp = m - np.log(np.exp(m - m.max(1, keepdims=True)).sum(1, keepdims=True)) - m.max(1, keepdims=True)
    lq = s - np.log(np.exp(s - s.max(1, keepdims=True)).sum(1, keepdims=True)) - s.max(1, keepdims=True)
    return t * t * (np.exp(lp) * (lp - lq)).sum(1)


def _loss_setup(**kw):
    sim = _sim(**kw)
    m = sim.method
    client = sim.client(0)
    params = client.state["params"]
    x = m.public.x[:5]
    c = sim.ctx.meta.num_classes
    target = 3.0 * torch.randn(5, c, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        student = functional_call(client.model, params, (x,))
    return m, client, params, x, target, student


def test_lambda_zero_builds_no_extra_term_and_lambda_one_is_t2_kl_on_all_rows():
    m, client, params, x, target, student = _loss_setup(method__lam=0.0)
    assert m.distillation_loss(client, 0, x, target) is None
    m, client, params, x, target, student = _loss_setup(method__lam=1.0, method__temperature=2.0,
                                                        method__public_batch=50)
    fn = m.distillation_loss(client, 0, x, target)
    assert fn is not None
    assert float(fn(params)) == pytest.approx(_kl_rows(student, target, 2.0).mean(), rel=1e-5)


def test_a_single_known_target_row_is_still_distilled():
    m, client, params, x, target, student = _loss_setup(method__lam=0.5, method__public_batch=50)
    target[1:] = float("nan")
    fn = m.distillation_loss(client, 0, x, target)
    assert fn is not None
    assert float(fn(params)) == pytest.approx(0.5 * _kl_rows(student[:1], target[:1], 1.0)[0], rel=1e-5)


@pytest.mark.parametrize("kw, size", [(dict(method__public_batch=1), 1),
                                      (dict(method__public_batch=0, federation__batch_size=2), 2)])
def test_the_public_minibatch_has_public_batch_rows_or_the_private_batch_size(kw, size):
    """λ·mean ρ over exactly `size` of the 5 rows: the value is the mean over some `size`-subset."""
    m, client, params, x, target, student = _loss_setup(method__lam=1.0, **kw)
    per_row = _kl_rows(student, target, 1.0)
    subsets = [np.mean(per_row[list(s)]) for s in itertools.combinations(range(5), size)]
    fn = m.distillation_loss(client, 0, x, target)
    for _ in range(4):
        v = float(fn(params))
        assert min(abs(v - s) for s in subsets) < 1e-5 * max(1.0, abs(v))
        assert abs(v - per_row.mean()) > 1e-4


def test_public_minibatches_are_drawn_afresh_each_round():
    """The public minibatch sequence is keyed by the round: rounds 0 and 1 draw different row sequences."""
    m, client, params, x, target, student = _loss_setup(method__lam=1.0, method__public_batch=1)
    seqs = []
    for rnd in (0, 1):
        fn = m.distillation_loss(client, rnd, x, target)
        seqs.append([round(float(fn(params)), 6) for _ in range(12)])
    assert seqs[0] != seqs[1]


# ---- client: what it uploads ------------------------------------------------------------------------

def test_a_client_uploads_its_trained_models_logits_on_this_rounds_rows():
    """With N_t < N the reply holds the client's eval-mode logits on the server's rows(rnd) (the rows
    aggregate writes), its sample count and its training loss."""
    sim = _sim(method__public_per_round=6)
    m = sim.method
    client = sim.client(1)
    rnd = 3
    rows = m.rows(rnd)
    assert len(rows) == 6 and bool((rows[1:] > rows[:-1]).all())
    reply = m.local_update(rnd, client, None)
    with torch.no_grad():
        want = functional_call(client.model, client.state["params"], (m.public.x[rows],))
    got = reply.tensors("logits")["logits"]
    torch.testing.assert_close(got, want)
    assert reply.info["n"] == client.n_train
    assert np.isfinite(reply.info["train_loss"]) and reply.info["train_loss"] > 0


def test_local_training_draws_fresh_public_rows_each_round():
    """Full private batches (batch_size 0) make the CE part of a round deterministic: from the same
    start and centroid, rounds 0 and 1 end at the same model at λ = 0 and differ at λ > 0 only because
    each round draws its own public minibatches (public_batch 1)."""
    from pfl.federation.messages import Logits, Message

    ends = {}
    for lam in (0.0, 1.0):
        sim = _sim(method__lam=lam, method__public_batch=1, federation__batch_size=0, federation__local_steps=3,
                   federation__local_epochs=0)
        m = sim.method
        client = sim.client(0)
        start = {k: v.clone() for k, v in client.state["params"].items()}
        target = 3.0 * torch.randn(m.n_public, sim.ctx.meta.num_classes, generator=torch.Generator().manual_seed(2))
        out = []
        for rnd in (0, 1):
            client.state["params"] = {k: v.clone() for k, v in start.items()}
            m.local_update(rnd, client, Message.of({"centroid": Logits({"centroid": target})}))
            out.append(torch.cat([v.flatten() for v in client.state["params"].values()]))
        ends[lam] = out
    assert torch.equal(ends[0.0][0], ends[0.0][1])
    assert not torch.allclose(ends[1.0][0], ends[1.0][1])


def test_the_run_logs_the_clients_training_loss():
    from pfl.callbacks.divergence import run_rounds

    sim = _sim(federation__rounds=1)
    run_rounds(sim, 1)
    row = sim.history[-1] if getattr(sim, "history", None) else {}
    losses = [v for k, v in row.items() if "train" in k and "loss" in k]
    assert losses and all(np.isfinite(v) for v in losses)


# ---- read-outs -------------------------------------------------------------------------------------

def test_cluster_read_outs_are_hand_counts_over_the_stored_clients():
    """Assignment [0,0,2,3,3,3,4,−1] (client 7 not stored): sizes {2,1,3,1} → num 4, max 3, min 1,
    2 singletons; ARI against the true clusters by sklearn on the stored clients; the public rows (N_t), and no
    overlap when data.max_samples leaves the public set disjoint from client data."""
    from sklearn.metrics import adjusted_rand_score

    from helpers import clustered
    from pfl.federation.simulator import Simulator

    sim = Simulator(clustered("label_swap", 2, 8, method__name="perfed_ckt", method__architectures=["mlp"],
                              method__public_size=20, method__public_per_round=7, federation__rounds=1,
                              data__max_samples=400))
    m = sim.method
    out = m.extra_metrics(0)
    assert out["ckt/public_rows"] == 7.0 and out["ckt/public_overlap"] == 0.0 and out["ckt/stored"] == 0.0
    assign = [0, 0, 2, 3, 3, 3, 4, -1]
    m.assign = torch.tensor(assign, dtype=torch.long)
    m.known = torch.tensor([a >= 0 for a in assign])
    out = m.extra_metrics(0)
    true = np.asarray(sim.ctx.meta.true_clusters)[:7]
    assert len(set(true.tolist())) == 2
    assert out["ckt/stored"] == 7.0 and out["cluster/num"] == 4.0
    assert out["cluster/ari"] == pytest.approx(adjusted_rand_score(true, assign[:7]), abs=1e-12)
    assert (out["cluster/size_max"], out["cluster/size_min"], out["cluster/singletons"]) == (3.0, 1.0, 2.0)


def test_before_any_upload_the_artifact_marks_every_client_unassigned(tmp_path):
    sim = _sim()
    rows = _read(sim.method.artifacts(str(tmp_path))[1])
    assert len(rows) == 6
    assert all(int(r["cluster"]) == -1 and r["uploaded"] == "0" and int(r["cluster_round"]) == -1 for r in rows)


def test_a_regression_task_is_refused_naming_the_method():
    from pfl.schema import ConfigError

    from pfl.federation.simulator import Simulator

    cfg = small_config(**{"method.name": "perfed_ckt", "data.source": "fpfc_linear", "data.partition.kind": "natural"})
    with pytest.raises(ConfigError) as err:
        Simulator(cfg)
    assert err.value.field == "method.name" and "classification" in err.value.message


def test_an_architecture_that_does_not_fit_the_data_is_refused_naming_the_entry_and_why():
    """cnn_fpfc needs square images; fpfc_synthetic has 60 flat features: the error names the list
    entry and keeps the model zoo's reason."""
    from pfl.federation.simulator import Simulator
    from pfl.schema import ConfigError

    cfg = small_config(**{"method.name": "perfed_ckt", "data.source": "fpfc_synthetic", "data.partition.kind": "natural",
                          "method.architectures": ["softmax_regression", "cnn_fpfc"],
                          "model.name": "softmax_regression"})
    with pytest.raises(ConfigError) as err:
        Simulator(cfg)
    assert err.value.field == "method.architectures[1]"
    assert "cnn_fpfc" in err.value.message and "image" in err.value.message and "(60,)" in err.value.message


@pytest.mark.parametrize("per_round", [0, 5])
def test_the_servers_tensors_and_the_rounds_rows_live_on_the_runs_device(per_round):
    """The method's server state and each round's public rows are made on the run's device (a
    ``meta`` device here: a tensor made without it lands on the CPU), with their shapes and dtypes."""
    import dataclasses

    sim = _sim(**{"method.public_per_round": per_round})
    method = sim.method
    method.ctx = dataclasses.replace(method.ctx, device=torch.device("meta"))
    method.setup()
    m, n, c = method.ctx.num_clients, method.n_public, method.ctx.meta.num_classes
    made = {"logits": ((m, n, c), torch.float32), "known": ((m,), torch.bool),
            "assign": ((m,), torch.long), "centroids": ((0, n, c), torch.float32)}
    for name, (shape, dtype) in made.items():
        t = getattr(method, name)
        assert t.device.type == "meta" and tuple(t.shape) == shape and t.dtype == dtype, name
    rows = method.rows(1)
    assert rows.device.type == "meta" and len(rows) == (per_round or n)
