"""Survivors of FedAMP (``pfl/methods/fedamp.py``: broadcast outside a round, the first self weight,
never-sampled clients, the reply's info and base, the server's bytes) and FedProto
(``pfl/methods/fedproto.py``: the task check's field, BatchNorm models, chunked prototypes, the counts'
type on the wire, the uniform mean, never-sampled clients, the reply's info, λ = 0) (triage list T).
Truths: FedAMP's cloud u_k = (1 − Σ_{j≠k} ξ_kj) w_k + Σ_{j≠k} ξ_kj w_j recomputed in numpy from a numpy
run of the rounds (the client's own model θ⁰ before it reported), θ⁰ for a client never sampled, the
reply's sample count and mean step loss by hand, the server's bytes by hand (members × p × itemsize,
two (sampled, p) tensors); FedProto's prototypes as class means of a hand-written forward pass (the
eval-mode BatchNorm CNN written with torch.nn.functional, the MLP in numpy), the uplink's bytes by hand
(D floats per present class plus one int32 count per class), the documented relation λ = 0 ≡ Local."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import downlink, uplink
from truth import close, config, least_squares, numpy_params, run_rounds, simulator, vec

LR, K = 0.1, 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(sizes=(20, 30, 24, 27, 13), clusters=[0, 0, 1, 1, 0])


# ---- FedAMP: numpy ---------------------------------------------------------------------------------

def amp_cloud(stored, k, theta0, alpha, sigma):
    own = stored.get(k, theta0)
    xi = {j: alpha * np.exp(-np.sum((own - w) ** 2) / sigma) / sigma for j, w in stored.items() if j != k}
    return (1.0 - sum(xi.values())) * own + sum(x * stored[j] for j, x in xi.items())


def amp_rounds(p, theta0, schedule, alpha, lam, sigma):
    """Rounds of FedAMP by hand: the stored models, the personal models and each client's step losses."""
    stored, personal, losses = {}, {}, {}
    for sampled in schedule:
        clouds = {k: amp_cloud(stored, k, theta0, alpha, sigma) for k in sampled}
        for k in sampled:
            w, ls = clouds[k].copy(), []
            for _ in range(K):
                ls.append(p.loss(k, w))
                w = w - LR * (p.grad(k, w) + lam / alpha * (w - clouds[k]))
            personal[k], losses[k] = w, ls
        stored.update({k: personal[k] for k in sampled})
    return stored, personal, losses


AMP = dict(alpha=0.3, lam=0.6, sigma=20.0)


def _amp(problem, per_round=3, **kw):
    return simulator(problem, "fedamp", steps=K, lr=LR, per_round=per_round,
                     **{f"method__{k}": v for k, v in AMP.items()}, **kw)


# ---- FedAMP ----------------------------------------------------------------------------------------

def test_fedamp_broadcast_outside_a_round_is_the_clients_attention_cloud(problem):
    """Before any round nothing is stored: every cloud is θ⁰. After rounds of partial participation, a
    broadcast to a client the last round did not sample is its cloud from the stored models, computed
    afresh (kills broadcast 2, 7, 12–16)."""
    sim = _amp(problem)
    theta0 = vec(sim.client_role.init)
    assert close(vec(downlink(sim, 0).tensors("model")), theta0)
    schedule = [sorted(sim.sample(r)) for r in range(3)]
    stored, _, _ = amp_rounds(problem, theta0, schedule, **AMP)
    run_rounds(sim, 3)
    outside = [k for k in range(problem.m) if k not in schedule[-1]]
    assert outside and any(k in stored for k in outside)
    for k in outside:
        got = vec(downlink(sim, k, 3).tensors("model"))
        assert close(got, amp_cloud(stored, k, theta0, AMP["alpha"], AMP["sigma"])), k
    assert max(np.abs(amp_cloud(stored, k, theta0, AMP["alpha"], AMP["sigma"]) - stored.get(k, theta0)).max()
               for k in outside) > 1e-4   # the attention moves the cloud off the client's own model


def test_fedamp_self_weight_before_any_round_is_one(problem):
    """No stored model yet: ξ_kk = 1 − (an empty sum) = 1 (kills setup 2, 3)."""
    sim = _amp(problem)
    assert sim.method.extra_metrics(0) == {"fedamp/self_weight": 1.0}


def test_fedamp_client_never_sampled_is_evaluated_with_the_initial_model(problem):
    """The module docstring: a client never sampled is evaluated with θ⁰; a sampled one with its
    numpy personal model (kills personal_params 2, 4)."""
    sim = _amp(problem, per_round=2)
    theta0 = vec(sim.client_role.init)
    sampled = sorted(sim.sample(0))
    _, personal, _ = amp_rounds(problem, theta0, [sampled], **AMP)
    run_rounds(sim, 1)
    for i in range(problem.m):
        assert close(vec(sim.personal_params(i)), personal.get(i, theta0)), i


def test_fedamp_reply_reports_the_sample_count_and_the_mean_step_loss(problem):
    """A client's upload: its training-sample count and the mean of its K full-batch step losses
    (before each step), by hand (kills local_update 24, 27)."""
    sim = _amp(problem)
    theta0 = vec(sim.client_role.init)
    _, personal, losses = amp_rounds(problem, theta0, [[1]], **AMP)
    reply = uplink(sim, 1, downlink(sim, 1))
    assert reply.info["n"] == problem.n(1) == 30
    assert reply.info["train_loss"] == pytest.approx(np.mean(losses[1]), rel=1e-5)
    assert close(vec(reply.tensors("model")), personal[1])


def _top1_change(w, u):
    """u + top-k(w − u) per tensor with ratio 0.5: k = 1 of the weight's 2 values (the larger |·|),
    the bias (1 value) whole."""
    d = w - u
    keep = np.zeros_like(d)
    j = int(np.argmax(np.abs(d[:2])))
    keep[j], keep[2] = d[j], d[2]
    return u + keep


def test_fedamp_with_a_lossy_uplink_stores_the_cloud_plus_the_compressed_change(problem):
    """Top-k (ratio 0.5) on the uplink, identity downlink: the reply is a model trained from the
    downlink part ``model`` (compression.md: the server applies C(y − r) to what it meant to send), so
    the server stores w_k = u_k + top-k(w − u_k) while the client keeps its own w (numpy over three
    rounds of partial participation, the clouds from the stored models) (kills local_update 22, 26,
    29, 30)."""
    a, lam, sigma = AMP["alpha"], AMP["lam"], AMP["sigma"]
    sim = _amp(problem, compression__min_numel=1, compression__uplink={"name": "topk", "ratio": 0.5},
               compression__downlink__name="identity")
    theta0 = vec(sim.client_role.init)
    schedule = [sorted(sim.sample(r)) for r in range(3)]
    stored, personal = {}, {}
    for sampled in schedule:
        clouds = {k: amp_cloud(stored, k, theta0, a, sigma) for k in sampled}
        for k in sampled:
            personal[k] = problem.gd(k, clouds[k], K, LR, pull=(lam / a, clouds[k]))
        stored.update({k: _top1_change(personal[k], clouds[k]) for k in sampled})
    run_rounds(sim, 3)
    assert sorted(sim.method.models) == sorted(stored)
    for j, w in stored.items():
        assert close(sim.method.models[j].double().numpy(), w), j
        assert close(vec(sim.personal_params(j)), personal[j]), j
    assert max(np.abs(stored[j] - personal[j]).max() for j in stored) > 1e-3   # the compression shows


@pytest.mark.parametrize("itemsize", [4, 2])
def test_fedamp_server_bytes_are_one_model_per_member(itemsize):
    """``models``: members × p × itemsize (10 clients, 20 % newcomers: 8 members; p = 7) (kills
    server_bytes 1, 2)."""
    from pfl.methods.base import ModelSize
    from pfl.methods.fedamp import FedAMP

    cfg = config("fedamp", 10, per_round=3, newcomers__fraction=0.2)
    assert FedAMP.server_bytes(10, ModelSize(params=7, head=3, itemsize=itemsize), cfg) == 8 * 7 * itemsize


@pytest.mark.parametrize("m, per_round, newcomers, sampled", [
    (10, 3, 0.0, 3),
    (10, 3, 0.2, 3),
    (10, 0, 0.2, 8),     # 0: every member
    (10, 9, 0.2, 8),     # more per round than members: every member
])
def test_fedamp_round_work_bytes_are_two_sampled_by_p_tensors(m, per_round, newcomers, sampled):
    """The clouds and the sampled clients' own models: 2 × sampled × p × itemsize (p = 7, itemsize 2)
    (kills server_work_bytes 2, 3, 12–15)."""
    from pfl.methods.base import ModelSize
    from pfl.methods.fedamp import FedAMP

    cfg = config("fedamp", m, per_round=per_round, newcomers__fraction=newcomers)
    assert FedAMP.server_work_bytes(m, ModelSize(params=7, head=3, itemsize=2), cfg) == 2 * sampled * 7 * 2


# ---- FedProto --------------------------------------------------------------------------------------

H = 6


def _proto_sim(data, steps=1, lr=0.3, **kw):
    from pfl.federation.simulator import Simulator

    cfg = config("fedproto", data.num_clients, steps=steps, lr=lr, source="digits", model="mlp",
                 model__params={"hidden": [H]}, **kw)
    return Simulator(cfg, data=data)


def _hidden(p, X):
    return np.maximum(X @ p["fc1.weight"].T + p["fc1.bias"], 0.0)


def _federated(xs, ys, classes, shape):
    from pfl.data.federated import ClientData, FederatedData

    clients = [ClientData(x, y, x.clone(), y.clone(), x.clone(), y.clone(), cluster=0) for x, y in zip(xs, ys)]
    return FederatedData(clients=clients, num_classes=classes, input_shape=shape, task="classification",
                         source="digits", true_clusters=np.zeros(len(xs), dtype=int), partition_hash="truth-t",
                         partition_kind="natural")


def test_fedproto_refuses_a_regression_task_naming_the_method_field():
    """The error names ``method.name`` and says why (kills configure 5, 9, 10, 11)."""
    from pfl.schema import ConfigError

    with pytest.raises(ConfigError) as info:
        simulator(least_squares(), "fedproto")
    assert info.value.field == "method.name"
    assert info.value.message.startswith("fedproto needs a classification task")


def test_fedproto_prototypes_of_more_than_one_chunk_count_every_sample():
    """One client of 4,097 samples (more than the 4,096-sample chunk); class 2 holds only samples 2
    and 4,096, so the last sample is half of its prototype. After one round the global prototypes are
    that client's class means of the trained MLP's hidden layer, in numpy (kills local_prototypes
    21, 33, 44)."""
    rs = np.random.RandomState(3)
    n = 4097
    y = rs.randint(0, 2, n)
    y[[2, n - 1]] = 2
    x = rs.normal(0.0, 1.0, (n, 4)) + 2.0 * np.eye(3, 4)[y]
    x[2], x[n - 1] = 3.0, -3.0   # opposite inputs: some hidden unit is active for one and not the other
    data = _federated([torch.tensor(x, dtype=torch.float32)], [torch.tensor(y)], 3, (4,))
    sim = _proto_sim(data)
    run_rounds(sim, 1)
    h = _hidden(numpy_params(sim.personal_params(0)), x)
    expected = np.stack([h[y == c].mean(0) for c in range(3)])
    np.testing.assert_allclose(sim.method.protos.double().numpy(), expected, rtol=1e-4, atol=1e-5)
    assert np.abs(h[n - 1] - h[2]).max() > 1e-2   # the last sample matters


def _cnn_bn_representation(p, x):
    """cnn_bn in eval mode written with torch.nn.functional: the input of its head ``fc``."""
    import torch.nn.functional as F

    def bn(z, name):
        return F.batch_norm(z, p[f"{name}.running_mean"], p[f"{name}.running_var"], p[f"{name}.weight"],
                            p[f"{name}.bias"], training=False, eps=1e-5)

    z = F.max_pool2d(F.relu(bn(F.conv2d(x, p["conv1.weight"], p["conv1.bias"], padding=2), "bn1")), 2)
    z = F.max_pool2d(F.relu(bn(F.conv2d(z, p["conv2.weight"], p["conv2.bias"], padding=2), "bn2")), 2)
    return F.relu(bn(F.linear(z.flatten(1), p["fc1.weight"], p["fc1.bias"]), "bn3"))


def test_fedproto_with_batchnorm_takes_prototypes_of_the_eval_mode_representation():
    """A BatchNorm CNN (``cnn_bn``: BatchNorm1d before the head, so one sample in train mode cannot be
    normalised): the representation's size is the hidden width, and the prototypes are class means of
    the eval-mode representation (BatchNorm by its running statistics) under the trained model
    (kills configure 26, local_prototypes 13)."""
    from pfl.federation.simulator import Simulator

    rs = np.random.RandomState(5)
    xs, ys = [], []
    for i in range(2):
        y = np.arange(12) % 3
        xs.append(torch.tensor(rs.normal(0.0, 1.0, (12, 1, 8, 8)) + y[:, None, None, None], dtype=torch.float32))
        ys.append(torch.tensor(y))
    data = _federated(xs, ys, 3, (1, 8, 8))
    cfg = config("fedproto", 2, steps=2, lr=0.1, source="digits", model="cnn_bn",
                 model__params={"channels": [2, 3], "hidden": 5, "padding": "same"})
    sim = Simulator(cfg, data=data)
    assert sim.method.dim == 5
    run_rounds(sim, 1)
    with torch.no_grad():
        local = []
        for i in range(2):
            p = {k: v.detach().float() for k, v in sim.personal_params(i).items()}
            z = _cnn_bn_representation(p, xs[i])
            local.append(torch.stack([z[ys[i] == c].mean(0) for c in range(3)]))
        expected = (local[0] + local[1]) / 2
    torch.testing.assert_close(sim.method.protos.float(), expected, rtol=1e-4, atol=1e-5)


def test_fedproto_uplink_carries_d_floats_per_present_class_and_int32_counts():
    """The module docstring's traffic: the prototypes of the classes present (D = 6 float32 values
    each) and the class counts, int32: a client holding classes 0 and 1 of 3 uploads 2·6·4 + 3·4 = 60
    bytes (kills local_prototypes 56)."""
    from truth import Recorder

    rs = np.random.RandomState(1)
    xs = [torch.tensor(rs.normal(0.0, 1.0, (8, 4)), dtype=torch.float32) for _ in range(2)]
    ys = [torch.tensor([0, 1] * 4), torch.tensor([0, 1, 2, 2] * 2)]
    data = _federated(xs, ys, 3, (4,))
    rec = Recorder()
    from pfl.federation.simulator import Simulator
    cfg = config("fedproto", 2, steps=1, lr=0.1, source="digits", model="mlp", model__params={"hidden": [H]})
    sim = Simulator(cfg, data=data, stages=[rec])
    run_rounds(sim, 1)
    up0, up1 = rec.up[0, 0], rec.up[0, 1]
    assert up0.parts["protos"].nbytes() + up0.parts["counts"].nbytes() == 2 * H * 4 + 3 * 4
    assert up1.parts["protos"].nbytes() + up1.parts["counts"].nbytes() == 3 * H * 4 + 3 * 4
    assert up0.tensors("counts")["counts"].tolist() == [4, 4, 0]


def test_fedproto_uniform_prototype_is_the_plain_mean_even_near_the_float_range():
    """``uniform``: P̄_c = the plain mean of the uploaded C_{k,c}: one client's prototype of 2·10³⁸ is
    the mean (a finite float32; a weight of 2 would overflow the sum), two clients' 0..5 and 2·(0..5)
    average to 1.5·(0..5) whatever their counts (kills aggregate 26)."""
    from pfl.federation.messages import Message, Scalars, State

    data, _ = _blobs()
    sim = _proto_sim(data)
    big = torch.full((H,), 2e38)
    small = torch.arange(H, dtype=torch.float32)
    replies = {0: Message.of({"protos": State({"0": big, "1": small}),
                              "counts": Scalars({"counts": torch.tensor([3, 2, 0], dtype=torch.int32)})}),
               1: Message.of({"protos": State({"1": 2 * small}),
                              "counts": Scalars({"counts": torch.tensor([0, 7, 0], dtype=torch.int32)})})}
    sim.method.aggregate(0, replies)
    assert torch.equal(sim.method.protos[0], big)
    assert torch.equal(sim.method.protos[1], 1.5 * small)
    assert sim.method.known.tolist() == [True, True, False]


def _blobs():
    from truth import classification_data

    return classification_data()


def test_fedproto_client_never_sampled_is_evaluated_with_the_initial_model():
    """``newcomer_rule``/Local's rule: a client never sampled keeps θ⁰ (kills personal_params 2, 4)."""
    data, _ = _blobs()
    sim = _proto_sim(data, per_round=2)
    sampled = set(sim.sample(0))
    init = numpy_params(sim.client_role.init)
    run_rounds(sim, 1)
    for i in range(data.num_clients):
        got = numpy_params(sim.personal_params(i))
        same = all(np.array_equal(got[k], init[k]) for k in init)
        assert same == (i not in sampled), i


def test_fedproto_reply_reports_the_sample_count_and_the_first_round_loss():
    """Round 0 has no global prototype: the loss is plain cross-entropy; one full-batch step, so the
    reported loss is the cross-entropy of θ⁰ on the client's data, in numpy; n its sample count
    (kills local_update 70, 72, 73)."""
    from truth import softmax

    data, arrays = _blobs()
    sim = _proto_sim(data)
    p = numpy_params(sim.client_role.init)
    X, y = arrays[1]
    z = _hidden(p, X) @ p["fc.weight"].T + p["fc.bias"]
    ce = -np.mean(np.log(softmax(z)[np.arange(len(y)), y]))
    reply = uplink(sim, 1, downlink(sim, 1))
    assert reply.info["n"] == len(y) == 15
    assert reply.info["train_loss"] == pytest.approx(ce, rel=1e-5)


def test_fedproto_with_lambda_zero_is_local_training():
    """The hyperparameter's documentation: λ = 0 is Local (plain cross-entropy, no prototype term).
    Same seed, same data: every client's model after three rounds, and the last round's training loss,
    are Local's, bit for bit (kills local_update 38, whose λ·0 term averages per-sample losses, which
    rounds the reported loss differently from the fused cross-entropy mean)."""
    from pfl.federation.simulator import Simulator
    from truth import classification_data

    data, _ = classification_data(sizes=(120, 150, 100, 140))
    proto = _proto_sim(data, steps=K, method__lam=0.0)
    local = Simulator(config("local", data.num_clients, steps=K, lr=0.3, source="digits", model="mlp",
                             model__params={"hidden": [H]}), data=data)
    run_rounds(proto, 3)
    run_rounds(local, 3)
    for i in range(data.num_clients):
        a, b = proto.personal_params(i), local.personal_params(i)
        assert all(torch.equal(a[k], b[k]) for k in b), i
    local_losses = [local.client(i).state["train_loss"] for i in range(data.num_clients)]
    assert proto.history[-1]["train/loss"] == float(np.mean(local_losses))
