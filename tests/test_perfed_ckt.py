"""PerFed-CKT: message sizes, clustering/centroids, special cases, heterogeneous models, ρ's math."""

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import adjusted_rand_score
from torch.func import functional_call

from helpers import small_config, straight_and_resumed
from pfl.callbacks.divergence import run_rounds
from pfl.federation.messages import Logits, Message
from pfl.federation.simulator import Simulator
from pfl.methods.perfed_ckt import assign_architectures, regulariser
from pfl.models import build_model, params_of
from pfl.schema import ConfigError

SMALL_ARCHS = [{"name": "mlp", "params": {"hidden": [16]}}, "cnn_fpfc"]
C = 10  # digits classes


def ckt_config(**overrides):
    base = dict(method__name="perfed_ckt", method__architectures=SMALL_ARCHS, method__public_size=40,
                data__num_clients=6, federation__clients_per_round=0, federation__rounds=2)
    base.update(overrides)
    return small_config(**base)


# ---- communication -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, b, downlink, k", [("fp32", 4, "assigned", 2), ("fp16", 2, "assigned", 2),
                                                   ("fp32", 4, "all_centroids", 3)])
def test_message_bytes_are_logits_only(dtype, b, downlink, k):
    n_t, m = 24, 6
    sim = Simulator(ckt_config(method__public_per_round=n_t, method__logit_dtype=dtype,
                               method__downlink=downlink, method__k=k))
    run_rounds(sim)
    (up0, down0), (up1, down1) = sim.ledger.per_round
    assert up0 == up1 == m * n_t * C * b           # every client uploads N_t×C logits
    assert down0 == 0                               # nobody has uploaded before round 0
    assert down1 == m * n_t * C * b * (k if downlink == "all_centroids" else 1)
    assert sim.ledger.up_messages == 2 * m


def test_client_that_never_uploaded_gets_nothing():
    sim = Simulator(ckt_config(data__num_clients=8, federation__clients_per_round=3, federation__rounds=4,
                               method__public_per_round=10))
    seen: set[int] = set()
    for rnd in range(4):
        sampled = sim.sample(rnd)
        returning = [c for c in sampled if c in seen]
        sim.run_round()
        _, down = sim.ledger.per_round[-1]
        assert down == len(returning) * 10 * C * 4
        seen.update(sampled)


def test_message_sizes_vs_paper_models_at_least_100x():
    logits = Message.of({"logits": Logits({"logits": torch.zeros(2000, 10)})}).nbytes()
    assert logits == 2000 * 10 * 4
    for name in ("vgg11", "vgg13"):
        model_bytes = Message.model(params_of(build_model(name, {}, (3, 32, 32), 10))).nbytes()
        assert model_bytes / logits >= 100, (name, model_bytes)


# ---- server: clustering and centroids ----------------------------------------------------------

def _two_groups(n, num_clients=6):
    gen = torch.Generator().manual_seed(1)
    groups = np.array([0, 1, 0, 1, 1, 0][:num_clients])
    base = [torch.randn(n, C, generator=gen) * 3 for _ in range(2)]
    z = [base[g] + 0.05 * torch.randn(n, C, generator=gen) for g in groups]
    return groups, z


def test_kmeans_recovers_hand_made_groups_and_sends_group_mean():
    sim = Simulator(ckt_config(data__num_clients=7, method__public_size=20, method__k=2))
    meth = sim.method
    groups, z = _two_groups(20)
    meth.aggregate(0, {cid: Message.of({"logits": Logits({"logits": z[cid]})}) for cid in range(6)})
    assign = meth.assign[:6].numpy()
    assert adjusted_rand_score(groups, assign) == 1.0
    for cid in range(6):
        members = [z[i] for i in range(6) if groups[i] == groups[cid]]
        sent = meth.broadcast(1, cid).tensors()["centroid"]
        assert sent.shape == (20, C)
        torch.testing.assert_close(sent, torch.stack(members).mean(0))
    assert meth.broadcast(1, 6) is None  # client 6 never uploaded


def test_k1_target_is_mean_of_all_stored_including_stale():
    sim = Simulator(ckt_config(method__public_size=20, method__k=1))
    meth = sim.method
    _, z = _two_groups(20)
    meth.aggregate(0, {cid: Message.of({"logits": Logits({"logits": z[cid]})}) for cid in range(4)})
    meth.aggregate(1, {cid: Message.of({"logits": Logits({"logits": z[cid]})}) for cid in (4, 5)})  # 0..3 now stale
    mean = torch.stack(z).mean(0)
    for cid in range(6):
        torch.testing.assert_close(meth.broadcast(2, cid).tensors()["centroid"], mean)


def test_partial_public_rows_only_known_entries_are_targets():
    sim = Simulator(ckt_config(method__public_size=20, method__public_per_round=8, method__k=2))
    meth = sim.method
    groups, z = _two_groups(8)
    rows0 = meth.rows(0)
    assert len(rows0) == 8 and not torch.equal(rows0, meth.rows(1))
    meth.aggregate(0, {cid: Message.of({"logits": Logits({"logits": z[cid]})}) for cid in range(6)})
    rows1 = meth.rows(1)
    for cid in range(6):
        sent = meth.broadcast(1, cid).tensors()["centroid"]
        assert sent.shape == (8, C)
        members = torch.stack([z[i] for i in range(6) if groups[i] == groups[cid]]).mean(0)
        for j, row in enumerate(rows1.tolist()):
            hit = (rows0 == row).nonzero()
            if len(hit):
                torch.testing.assert_close(sent[j], members[int(hit)])
            else:
                assert torch.isnan(sent[j]).all()   # nobody has this row yet: ignored by the client


# ---- special cases -----------------------------------------------------------------------------------

def test_lambda_zero_is_local_exactly():
    common = dict(model__name="mlp", model__params={"hidden": [16]}, data__num_clients=8,
                  federation__clients_per_round=4, federation__rounds=3)
    local = Simulator(small_config(method__name="local", **common))
    run_rounds(local)
    arch = []  # the default: model.name/params, Local's model and init
    ckt = Simulator(ckt_config(method__lam=0.0, method__architectures=arch, **common))
    run_rounds(ckt)
    assert ckt.ledger.up_bytes > 0  # it still talked, but the talk had no effect
    for cid in range(8):
        a = local.personal_params(cid)
        b = ckt.personal_params(cid)
        assert all(torch.equal(a[k], b[k]) for k in a)
    # and λ > 0 does change the models (so the comparison above can fail)
    ckt2 = Simulator(ckt_config(method__lam=1.0, method__architectures=arch, **common))
    run_rounds(ckt2)
    changed = [cid for cid in range(8)
               if not all(torch.equal(local.personal_params(cid)[k], v)
                          for k, v in ckt2.personal_params(cid).items())]
    assert changed


# ---- heterogeneous clients -----------------------------------------------------------------------

def test_heterogeneous_architectures_train_upload_evaluate_and_learn():
    sim = Simulator(ckt_config(data__num_clients=8, federation__rounds=8, method__public_size=100))
    run_rounds(sim)
    kinds = {type(sim.client_role.client_model(c)).__name__ for c in range(8)}
    assert kinds == {"MLP", "CNNFPFC"}
    for cid in range(8):
        names = {n for n, _ in sim.client_role.client_model(cid).named_parameters()}
        assert set(sim.personal_params(cid)) == names
    table = sim.last_client_table
    assert all(np.isfinite(r["test_acc"]) for r in table)
    final = sim.history[-1]
    assert final["test/acc_mean"] > 0.3            # chance is 0.1
    assert "global/test_acc" not in final
    for key in ("cluster/num", "cluster/ari_arch", "cluster/size_max", "ckt/stored"):
        assert key in final


@pytest.mark.slow
def test_clusters_of_shifted_labels_are_found_and_beat_unclustered_and_local():
    # two clusters whose labels differ everywhere (y → y+1 mod 10), iid within a cluster: the
    # all-client teacher (k=1) blends both labelings, the cluster teacher (k=2) is right
    def final(k, lam):
        sim = Simulator(ckt_config(
            seed=0, method__architectures=[{"name": "mlp", "params": {"hidden": [32]}}, "cnn_fpfc"],
            method__public_size=200, method__k=k, method__lam=lam, data__num_clients=10,
            data__partition__kind="label_shift", data__partition__alpha=0.0, data__partition__num_clusters=2,
            data__test_fraction=0.3, federation__rounds=40, federation__eval_every=40, federation__local_epochs=2))
        run_rounds(sim)
        return sim.history[-1]

    clustered, unclustered, local = final(2, 1.0), final(1, 1.0), final(2, 0.0)
    assert clustered["cluster/ari"] >= 0.9
    assert clustered["test/acc_mean"] > unclustered["test/acc_mean"] + 0.03
    assert clustered["test/acc_mean"] > local["test/acc_mean"]


def test_architecture_assignment_balanced_and_seeded():
    n = np.array([5, 50, 500, 10, 1000, 20, 7])
    a1, s1 = assign_architectures(n, 3, np.random.default_rng(0))
    a2, _ = assign_architectures(n, 3, np.random.default_rng(0))
    assert np.array_equal(a1, a2)
    assert sorted(np.bincount(a1).tolist()) == [2, 2, 3]
    # larger models go to the higher scores
    for a in range(2):
        assert s1[a1 == a].max() <= s1[a1 == a + 1].min()


def test_artifacts_and_resume(tmp_path):
    cfg = ckt_config(data__num_clients=6, federation__clients_per_round=3, federation__rounds=4,
                     method__public_per_round=20)
    straight, resumed = straight_and_resumed(cfg, tmp_path)
    for cid in range(6):
        a = straight.personal_params(cid)
        b = resumed.personal_params(cid)
        assert all(torch.equal(a[k], b[k]) for k in a)
    paths = straight.method.artifacts(str(tmp_path))
    rows = list(csv.DictReader(Path(paths[1]).open()))
    assert len(rows) == 6 and {r["arch_id"] for r in rows} == {"0", "1"}
    assert [int(r["cluster"]) for r in rows] == straight.method.assign.tolist()


def _rows_held_by_clients(sim, x_pub):
    """How many public rows equal some client's sample (train, val or test), by content."""
    held = {tuple(row.tolist()) for c in sim.data.clients for x in (c.x_train, c.x_val, c.x_test) for row in x}
    return sum(tuple(row.tolist()) in held for row in x_pub)


def test_public_set_is_disjoint_from_client_data_by_default_and_counts_its_overlap(caplog):
    sim = Simulator(ckt_config(data__max_samples=600, method__public_size=200))
    pub = sim.method.public
    assert pub.overlap == 0 and len(pub) == 200
    assert _rows_held_by_clients(sim, pub.x) == 0                 # checked by content, not by index
    run_rounds(sim)
    assert sim.history[-1]["ckt/public_overlap"] == 0.0
    # fewer unused samples than asked for: the smaller disjoint pool, with a warning
    with caplog.at_level("WARNING", logger="pfl.methods.public_set"):
        small = Simulator(ckt_config(data__max_samples=1700, method__public_size=500)).method.public
    assert small.overlap == 0 and len(small) == 1797 - 1700 and "held by no client" in caplog.text
    # the partition uses every sample: the overlap cannot be zero, is counted and warned about
    caplog.clear()
    with caplog.at_level("WARNING", logger="pfl.methods.public_set"):
        whole = Simulator(ckt_config(method__public_size=300))
    assert whole.method.public.overlap == 300 == _rows_held_by_clients(whole, whole.method.public.x)
    assert "belongs to a client" in caplog.text


def test_default_architecture_is_the_runs_model():
    sim = Simulator(small_config(method__name="perfed_ckt", model__name="mlp", model__params={"hidden": [16]},
                                 method__public_size=40, data__max_samples=600))
    archs = {type(sim.client_role.client_model(c)).__name__ for c in range(sim.num_clients)}
    assert archs == {"MLP"} and [a.name for a in sim.method.archs] == ["mlp"]
    assert sim.method.archs[0].params == {"hidden": [16]}


# ---- the regulariser ---------------------------------------------------------------------------------

def _direct(s, m, kind, t):
    """ρ averaged over rows and dρ/ds, written out in numpy."""
    def softmax(a):
        e = np.exp(a - a.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)
    b, c = s.shape
    q, p = softmax(s / t), softmax(m / t)
    if kind == "kl":
        value = t * t * np.mean(np.sum(p * (np.log(p) - np.log(q)), 1))
        grad = t * (q - p) / b
    elif kind == "mse_logits":
        value = np.mean(np.sum((s - m) ** 2, 1) / c)
        grad = 2 * (s - m) / (b * c)
    else:
        d = q - p
        value = np.mean(np.sum(d ** 2, 1))
        grad = (2 / t) * q * (d - np.sum(d * q, 1, keepdims=True)) / b
    return value, grad


@pytest.mark.parametrize("kind", ["kl", "mse_logits", "mse_probs"])
@pytest.mark.parametrize("t", [1.0, 2.5])
def test_regulariser_value_and_gradient_on_a_tiny_model(kind, t):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    teacher = torch.randn(5, 4, generator=gen, dtype=torch.float64) * 2
    lin = torch.nn.Linear(3, 4).double()
    params = {k: v.detach().clone().requires_grad_(True) for k, v in lin.named_parameters()}
    student = functional_call(lin, params, (x,))
    loss = regulariser(student, teacher, kind, t)
    gw, gb = torch.autograd.grad(loss, [params["weight"], params["bias"]])
    value, g = _direct(student.detach().numpy(), teacher.numpy(), kind, t)
    assert float(loss.detach()) == pytest.approx(value, rel=1e-10)
    np.testing.assert_allclose(gw.numpy(), g.T @ x.numpy(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(gb.numpy(), g.sum(0), rtol=1e-9, atol=1e-12)
    assert float(regulariser(teacher, teacher, kind, t)) == pytest.approx(0.0, abs=1e-12)


# ---- configuration -----------------------------------------------------------------------------------

@pytest.mark.parametrize("override, field", [
    ({"method.k": 0}, "method.k"),
    ({"method.lam": -0.1}, "method.lam"),
    ({"method.temperature": 0}, "method.temperature"),
    ({"method.reg": "l1"}, "method.reg"),
    ({"method.cluster_space": "pca"}, "method.cluster_space"),
    ({"method.downlink": "everything"}, "method.downlink"),
    ({"method.logit_dtype": "int8"}, "method.logit_dtype"),
    ({"method.public_size": 10, "method.public_per_round": 20}, "method.public_per_round"),
    ({"method.public_source": "imagenet"}, "method.public_source"),
    ({"method.architectures": ["mlp", "resnet99"]}, "method.architectures[1]"),
    ({"method.architectures": [{"name": "mlp", "params": {"hidden": [0]}}]},
     "method.architectures[0].params.hidden[0]"),
    ({"method.architectures": [{"nme": "mlp"}]}, "method.architectures[0]"),
])
def test_bad_hyperparameters_name_the_field(override, field):
    from pfl.resolver import load

    with pytest.raises(ConfigError) as info:
        load(None, {"method.name": "perfed_ckt", "tracking.enabled": False, **override})
    assert info.value.field == field


def test_public_source_with_wrong_shape_fails_before_training():
    # digits samples are 64-vectors; Fashion-MNIST images are 1×28×28
    if not Path("/usr/share/datasets/fashion-mnist").exists():
        pytest.skip("Fashion-MNIST files not installed")
    with pytest.raises(ConfigError) as info:
        Simulator(ckt_config(method__public_source="fmnist"))
    assert info.value.field == "method.public_source"


def test_search_space_file_is_valid():
    from pfl.tune.space import base_config, check_space, load_space

    path = Path(__file__).resolve().parents[1] / "search_spaces" / "perfed_ckt.yaml"
    space = load_space(path)
    assert {"method.k", "method.lam"} <= set(space.distributions)
    check_space(space, base_config(space))
    check_space(space, base_config(space, smoke=True))
