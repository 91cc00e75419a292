"""Truth tests for surviving mutants of PerFed-CKT, MOON, pFedMe, Per-FedAvg, the partial-sharing
methods (FedRep, LG-FedAvg) and Local (survivor set D of issue 42).

Every expected value is built here: numpy formulas (softmax, KL, cosine similarities, the centred
logits), full-batch gradient descent on a one-hidden-layer MLP written out in numpy (tests/truth.py),
hand counts, or a documented relation between two runs (a lossless uplink = no compression; a
plug-in whose first round adds nothing = its base). Nothing is read back from pfl's own loops.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch.func import functional_call

from helpers import small_config
from truth import (classification_data, config, least_squares, mlp_forward, mlp_grads, numpy_params,
                   run_rounds, simulator, softmax, vec)

K = 3  # local steps in the small federations


# ---- numpy helpers ------------------------------------------------------------------------------------

def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _ce_rows(p: dict, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    z, _ = mlp_forward(p, X)
    return -_log_softmax(z)[np.arange(len(y)), y]


def _gd(p: dict, X: np.ndarray, y: np.ndarray, steps: int, lr: float) -> tuple[dict, float]:
    """``steps`` full-batch gradient steps on the mean cross-entropy of the numpy MLP; returns the
    end point and the mean of the losses at the points the steps were taken from."""
    p = {k: v.copy() for k, v in p.items()}
    losses = []
    for _ in range(steps):
        losses.append(float(_ce_rows(p, X, y).mean()))
        g = mlp_grads(p, X, y)
        p = {k: v - lr * g[k] for k, v in p.items()}
    return p, float(np.mean(losses))


def _classification_sim(method: str, sizes=(12, 15, 10, 14), hidden=(6,), lr=0.1, steps=K, **kw):
    from pfl.federation.simulator import Simulator

    data, arrays = classification_data(sizes=sizes)
    cfg = config(method, data.num_clients, steps=steps, lr=lr, source="digits", model="mlp",
                 model__params={"hidden": list(hidden)}, **kw)
    return Simulator(cfg, data=data), arrays


def _ckt_sim(**kw):
    from pfl.federation.simulator import Simulator

    base = dict(method__name="perfed_ckt", method__architectures=["mlp"], method__public_size=20, method__k=2,
                data__num_clients=6, federation__clients_per_round=0, federation__rounds=2)
    return Simulator(small_config(**{**base, **kw}))


# ---- PerFed-CKT: the regulariser and the clustering space -------------------------------------------------

def _rho_numpy(s: np.ndarray, t: np.ndarray, kind: str, T: float) -> float:
    if kind == "kl":
        lp, lq = _log_softmax(t / T), _log_softmax(s / T)
        return float(T * T * (np.exp(lp) * (lp - lq)).sum(1).mean())
    if kind == "mse_logits":
        return float(((s - t) ** 2).sum(1).mean() / s.shape[1])
    return float(((softmax(s / T) - softmax(t / T)) ** 2).sum(1).mean())


@pytest.mark.parametrize("kind", ["kl", "mse_logits", "mse_probs"])
def test_regulariser_is_its_formula_over_the_class_axis_at_the_default_temperature_one(kind):
    """ρ by numpy, softmax over the classes of each row, T = 1 when not given (module docstring);
    the call names its softmax axis (no implicit-dimension warning)."""
    from pfl.methods.perfed_ckt import regulariser

    gen = torch.Generator().manual_seed(4)
    s, t = 2.0 * torch.randn(5, 4, generator=gen), 2.0 * torch.randn(5, 4, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v1 = float(regulariser(s, t, kind))
        v3 = float(regulariser(s, t, kind, 3.0))
    sn, tn = s.double().numpy(), t.double().numpy()
    assert v1 == pytest.approx(_rho_numpy(sn, tn, kind, 1.0), rel=1e-5)
    assert v3 == pytest.approx(_rho_numpy(sn, tn, kind, 3.0), rel=1e-5)


def test_an_unknown_regulariser_is_refused_naming_it_and_the_allowed_kinds():
    from pfl.methods.perfed_ckt import regulariser

    with pytest.raises(ValueError) as err:
        regulariser(torch.zeros(2, 3), torch.zeros(2, 3), "huber")
    msg = str(err.value)
    assert "'huber'" in msg and "kl, mse_logits, mse_probs" in msg


def test_the_clustering_space_by_numpy():
    """(s, N, C) logits: centred = minus each row's mean over the C classes; probs = softmax(z/T)
    over the classes; logits as they are."""
    from pfl.methods.perfed_ckt import _feature_space

    z = 3.0 * torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(6))
    zn = z.double().numpy()
    got_c = _feature_space(z, "centered_logits", 2.0).double().numpy()
    np.testing.assert_allclose(got_c, zn - zn.mean(-1, keepdims=True), rtol=1e-5, atol=1e-5)
    e = np.exp(zn / 2.0 - (zn / 2.0).max(-1, keepdims=True))
    got_p = _feature_space(z, "probs", 2.0).double().numpy()
    np.testing.assert_allclose(got_p, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(_feature_space(z, "logits", 2.0).numpy(), z.numpy())


# ---- PerFed-CKT: client and server steps ------------------------------------------------------------

def test_public_logits_of_more_than_one_chunk_are_every_rows_logits_once():
    """4100 rows (more than the 4096-row chunk): one logit row per input row, in order."""
    sim = _ckt_sim()
    m = sim.method
    client = sim.client(0)
    params = client.state["params"]
    x = torch.randn(4100, *sim.ctx.meta.input_shape, generator=torch.Generator().manual_seed(1))
    got = m._public_logits(client, params, x)
    assert got.shape == (4100, sim.ctx.meta.num_classes)
    with torch.no_grad():
        want = functional_call(client.model, params, (x,))
    torch.testing.assert_close(got, want)


def test_the_artifact_records_the_round_of_the_last_clustering(tmp_path):
    import csv

    sim = _ckt_sim()
    m = sim.method
    replies = {cid: m.local_update(3, sim.client(cid), None) for cid in (0, 1, 2)}
    m.aggregate(3, replies)
    with open(m.artifacts(str(tmp_path))[1], newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {int(r["cluster_round"]) for r in rows} == {3}
    assert sorted(int(r["uploaded"]) for r in rows) == [0, 0, 0, 1, 1, 1]


def test_all_centroids_go_down_in_the_wire_dtype():
    """logit_dtype fp16 with downlink all_centroids: the K centroids on this round's rows, as fp16."""
    sim = _ckt_sim(method__downlink="all_centroids", method__logit_dtype="fp16", method__k=2)
    m = sim.method
    m.aggregate(0, {cid: m.local_update(0, sim.client(cid), None) for cid in range(4)})
    msg = m.broadcast(1, 0)
    cents = msg.tensors("centroids")["centroids"]
    assert cents.dtype == torch.float16 and tuple(cents.shape) == tuple(m.centroids.shape)
    np.testing.assert_array_equal(cents.float().numpy(), m.centroids.half().float().numpy())


def test_warmup_rounds_send_no_centroid_and_the_first_round_after_does():
    """warmup_rounds = 1: round 0 sends nothing; round 1 (the first after the warm-up) sends the
    client's centroid."""
    sim = _ckt_sim(method__warmup_rounds=1)
    m = sim.method
    m.aggregate(0, {cid: m.local_update(0, sim.client(cid), None) for cid in range(4)})
    assert m.broadcast(0, 0) is None
    msg = m.broadcast(1, 0)
    assert msg is not None
    got = msg.tensors("centroid")["centroid"]
    np.testing.assert_array_equal(got.numpy(), m.centroids[int(m.assign[0])].numpy())


def test_a_ckt_client_keeps_its_rounds_mean_training_loss():
    """λ = 0, full private batches, 3 steps: the client keeps the mean cross-entropy over the points
    its steps were taken from (numpy MLP), next to its trained model."""
    sim = _ckt_sim(method__architectures=[{"name": "mlp", "params": {"hidden": [8]}}], method__lam=0.0,
                   federation__batch_size=0, federation__local_steps=K, federation__local_epochs=0,
                   federation__lr=0.1)
    m = sim.method
    client = sim.client(2)
    p0 = numpy_params(client.state["params"])
    X, y = client.data.x_train.double().numpy(), client.data.y_train.numpy()
    m.local_update(0, client, None)
    p_end, mean_loss = _gd(p0, X, y, K, 0.1)
    assert client.state["train_loss"] == pytest.approx(mean_loss, rel=1e-4)
    for k, v in numpy_params(client.state["params"]).items():
        np.testing.assert_allclose(v, p_end[k], rtol=1e-4, atol=1e-5)


# ---- Local ----------------------------------------------------------------------------------------------

def test_a_local_client_keeps_its_rounds_mean_training_loss():
    """Least squares, full batch, 3 steps from the shared start: the mean of f_i at w_0, w_1, w_2."""
    problem = least_squares()
    sim = simulator(problem, "local", steps=K, lr=0.05)
    w0 = vec(sim.method.init)
    run_rounds(sim, 1)
    for i in range(problem.m):
        ws = [problem.gd(i, w0, s, 0.05) for s in range(K)]
        want = np.mean([problem.loss(i, w) for w in ws])
        assert sim.client(i).state["train_loss"] == pytest.approx(want, rel=1e-5)


# ---- MOON -----------------------------------------------------------------------------------------------

def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_moon_loss_is_per_sample_cross_entropy_plus_mu_times_the_contrastive_term():
    """Per sample: CE_i + μ(log(e^{s_g/τ} + e^{s_p/τ}) − s_g/τ), s the cosine similarity of the hidden
    representation with the global and the previous model's (numpy)."""
    from pfl.methods.moon import MOONLoss

    sim, arrays = _classification_sim("moon")
    model = sim.ctx.model
    gen = torch.Generator().manual_seed(9)
    base = sim.method.global_model
    glob, prev, params = ({k: v + 0.5 * torch.randn(v.shape, generator=gen) + (3.0 if k == "fc1.bias" else 0.0)
                           for k, v in base.items()} for _ in range(3))  # the bias keeps hidden units alive
    X, y = arrays[1]
    mu, tau = 2.0, 0.5
    got = MOONLoss(model, "fc", glob, prev, mu, tau)(params, torch.tensor(X, dtype=torch.float32),
                                                         torch.tensor(y)).detach().double().numpy()
    p, pg, pp = numpy_params(params), numpy_params(glob), numpy_params(prev)
    _, h = mlp_forward(p, X)
    _, hg = mlp_forward(pg, X)
    _, hp = mlp_forward(pp, X)
    assert min(np.linalg.norm(a, axis=1).min() for a in (h, hg, hp)) > 1e-3
    sg, sp = _cos(h, hg) / tau, _cos(h, hp) / tau
    want = _ce_rows(p, X, y) + mu * (np.logaddexp(sg, sp) - sg)
    assert got.shape == (len(y),)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_moon_round_zero_is_gradient_descent_on_ce_and_reports_ce_plus_mu_log_2():
    """Round 0: global = previous = θ⁰, so the two similarities are equal, the contrastive term is
    log 2 with zero gradient: the client runs plain full-batch GD on its cross-entropy, and its
    reported loss is the mean CE over the steps plus μ·log 2."""
    mu = 2.0
    sim, arrays = _classification_sim("moon", method__mu=mu, method__tau=0.5)
    m = sim.method
    p0 = numpy_params(m.global_model)
    for cid in (0, 2):
        reply = m.local_update(0, sim.client(cid), m.broadcast(0, cid))
        X, y = arrays[cid]
        p_end, mean_loss = _gd(p0, X, y, K, 0.1)
        assert reply.info["train_loss"] == pytest.approx(mean_loss + mu * math.log(2.0), rel=1e-5)
        got = numpy_params(reply.tensors())
        for k in p_end:
            np.testing.assert_allclose(got[k], p_end[k], rtol=1e-4, atol=1e-5)


def test_moon_refuses_a_regression_task_naming_the_method_field():
    from pfl.federation.simulator import Simulator
    from pfl.schema import ConfigError

    problem = least_squares()
    with pytest.raises(ConfigError) as err:
        Simulator(config("moon", problem.m), data=problem.federated())
    assert err.value.field == "method.name"
    assert err.value.message.startswith("moon needs a classification task")


# ---- the uplink's base: a lossless uplink changes nothing ------------------------------------------

@pytest.mark.parametrize("method, kw, rounds", [
    ("moon", {"method__mu": 1.0}, 2),
    ("lgfedavg", {"method__warmup_rounds": 1}, 2),
    ("fedrep", {}, 2),
])
def test_a_lossless_uplink_gives_the_uncompressed_run_of_a_classifier(method, kw, rounds):
    """The identity compressor sends each model as its exact change from the part it was trained
    from (its ``base``): the server's model is the uncompressed run's (to float32 rounding)."""
    runs = []
    for extra in ({}, {"compression__uplink__name": "identity", "compression__min_numel": 1}):
        sim, _ = _classification_sim(method, rounds=rounds, **kw, **extra)
        start = {k: v.clone() for k, v in sim.method.global_model.items()}
        run_rounds(sim, rounds)
        runs.append({k: v.double().numpy() for k, v in sim.method.global_model.items()})
    assert set(runs[0]) == set(runs[1])
    for k in runs[0]:
        np.testing.assert_allclose(runs[1][k], runs[0][k], rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(runs[0][k], start[k].double().numpy(), atol=1e-4) for k in runs[0])


# ---- a plug-in whose first round adds nothing -------------------------------------------------------------

def test_pfedme_with_ala_starts_from_the_received_model_in_a_clients_first_round():
    problem = least_squares()
    runs = []
    for name in ("pfedme", "pfedme+ala"):
        sim = simulator(problem, name, steps=K, lr=0.05, method__lam=2.0, method__personal_lr=0.05)
        run_rounds(sim, 1)
        runs.append(vec(sim.method.global_model))
    assert np.allclose(runs[0], runs[1], rtol=0, atol=1e-7)


def test_moon_with_ala_starts_from_the_received_model_in_a_clients_first_round():
    runs = []
    for name in ("moon", "moon+ala"):
        sim, _ = _classification_sim(name, method__mu=1.0)
        run_rounds(sim, 1)
        runs.append(torch.cat([v.flatten() for v in sim.method.global_model.values()]).double().numpy())
    assert np.allclose(runs[0], runs[1], rtol=0, atol=1e-7)


# ---- LG-FedAvg: warm-up, the adopted body, the shared head ---------------------------------------------

BODY, HEAD = ("fc1.weight", "fc1.bias"), ("fc.weight", "fc.bias")


@pytest.mark.parametrize("warm", [0, 2])
def test_lgfedavg_round_zero_is_gd_on_the_whole_model_and_the_client_keeps_the_trained_body(warm):
    """Round 0 starts every client at θ⁰ (the received part + its own θ⁰ part) and trains all
    layers jointly (full-batch GD, numpy MLP). It replies the whole model during the warm-up, else
    the head; either way it reports its mean loss over the steps and keeps the trained body, which
    it is then evaluated with next to the server's head."""
    sim, arrays = _classification_sim("lgfedavg", method__warmup_rounds=warm)
    m = sim.method
    p0 = numpy_params(m.global_model)
    for cid in (1, 3):
        client = sim.client(cid)
        reply = m.local_update(0, client, m.broadcast(0, cid))
        X, y = arrays[cid]
        p_end, mean_loss = _gd(p0, X, y, K, 0.1)
        sent = numpy_params(reply.tensors())
        assert set(sent) == (set(BODY + HEAD) if warm else set(HEAD))
        for k in sent:
            np.testing.assert_allclose(sent[k], p_end[k], rtol=1e-4, atol=1e-5)
        assert reply.info["train_loss"] == pytest.approx(mean_loss, rel=1e-5)
        head = {k: torch.full_like(v, 0.25) for k, v in m.global_model.items() if k in HEAD}
        personal = numpy_params(m.personal_params(0, client, head))
        for k in BODY:
            np.testing.assert_allclose(personal[k], p_end[k], rtol=1e-4, atol=1e-5)
        for k in HEAD:
            np.testing.assert_array_equal(personal[k], 0.25)


def test_lgfedavg_after_the_warm_up_averages_heads_only_and_keeps_the_warm_up_body():
    """warmup_rounds = 1, every client every round: round 0 is FedAvg (sample-weighted mean of the
    clients' GD models from θ⁰); in round 1 each client starts from that whole model, and the server
    averages only the returned heads; its body stays the warm-up's."""
    sizes = (12, 15, 10, 14)
    sim, arrays = _classification_sim("lgfedavg", sizes=sizes, method__warmup_rounds=1, rounds=2)
    p0 = numpy_params(sim.method.global_model)
    w = np.asarray(sizes, dtype=float) / sum(sizes)

    def mean(models):
        return {k: sum(wi * mi[k] for wi, mi in zip(w, models)) for k in models[0]}

    g0 = mean([_gd(p0, X, y, K, 0.1)[0] for X, y in arrays])
    g1 = mean([_gd(g0, X, y, K, 0.1)[0] for X, y in arrays])
    run_rounds(sim, 2)
    got = numpy_params(sim.method.global_model)
    assert set(got) == set(BODY + HEAD)
    for k in BODY:
        np.testing.assert_allclose(got[k], g0[k], rtol=1e-4, atol=1e-5)
    for k in HEAD:
        np.testing.assert_allclose(got[k], g1[k], rtol=1e-4, atol=1e-5)


# ---- pFedMe: a client without training data ------------------------------------------------------------

def test_pfedme_client_without_training_data_returns_the_received_model_and_a_nan_loss():
    """No sample, so no minibatch: w and θ stay the received model, the reported loss is NaN (no
    numpy warning about an empty mean), the sample count 0."""
    from pfl.data.federated import ClientData
    from pfl.federation.simulator import Simulator

    problem = least_squares()
    data = problem.federated()
    c0 = data.clients[0]
    data.clients[0] = ClientData(torch.zeros(0, c0.x_train.shape[1]), torch.zeros(0), c0.x_val, c0.y_val,
                                 c0.x_test, c0.y_test, cluster=0)
    sim = Simulator(config("pfedme", problem.m, steps=K, lr=0.05), data=data)
    m = sim.method
    client = sim.client(0)
    sent = vec(m.global_model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reply = m.local_update(0, client, m.broadcast(0, 0))
    assert math.isnan(reply.info["train_loss"]) and reply.info["n"] == 0
    np.testing.assert_array_equal(vec(reply.tensors()), sent)
    np.testing.assert_array_equal(vec(m.personal_params(0, client, None)), sent)


# ---- Per-FedAvg: every forward pass of a meta-step updates BatchNorm's statistics --------------------------

@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("variant, passes", [("fo", 2), ("hf", 4)])
def test_perfedavg_meta_steps_count_every_training_mode_forward_in_the_batchnorm_statistics(variant, passes):
    """The statistics ride along the meta-gradient and are updated by each forward pass in training
    mode (BatchGradient: "read and updated, never differentiated"): a fo step runs the model on D
    and at w̃ on D′ (2 passes), an hf step also at w ± δg on D″ (4). Two steps: 2·passes batches."""
    from pfl.federation.simulator import Simulator

    cfg = small_config(**{"method.name": "perfedavg", "method.variant": variant, "method.steps": 2,
                          "model.name": "cnn_bn", "model.params": {"channels": [2, 3], "hidden": 4},
                          "data.num_clients": 4, "federation.clients_per_round": 0, "federation.batch_size": 0,
                          "federation.rounds": 1, "federation.cohort": "sequential"})
    sim = Simulator(cfg)
    m = sim.method
    reply = m.local_update(0, sim.client(0), m.broadcast(0, 0))
    counts = {k: int(v) for k, v in reply.tensors().items() if k.endswith("num_batches_tracked")}
    assert counts and set(counts.values()) == {2 * passes}


# ---- PerFed-CKT: the public minibatches come from a stream of their own ---------------------------------

def test_public_minibatches_are_drawn_apart_from_the_private_ones():
    """Public set = the client's own training rows, public_batch = batch_size: the private batches
    are exactly the ones training without the term sees (Local's), and the public minibatch of a step
    is not a copy of its private minibatch (a stream of its own, not the private one replayed)."""
    b = 4
    sim = _ckt_sim(method__architectures=[{"name": "mlp", "params": {"hidden": [8]}}], method__lam=1.0,
                   method__public_batch=b, federation__batch_size=b, federation__local_steps=3,
                   federation__local_epochs=0)
    m = sim.method
    client = sim.client(0)
    x = client.data.x_train
    target = torch.randn(len(x), sim.ctx.meta.num_classes, generator=torch.Generator().manual_seed(3))
    seen = []
    handle = client.model.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    try:
        client.train(client.state["params"], 0)
        plain = list(seen)
        seen.clear()
        client.train(client.state["params"], 0, extra_loss=m.distillation_loss(client, 0, x, target))
    finally:
        handle.remove()
    private, public = seen[0::2], seen[1::2]
    assert len(plain) == 3 and len(private) == 3 and len(public) == 3
    assert all(torch.equal(a, b_) for a, b_ in zip(plain, private))
    assert all(len(p) == b for p in public)
    assert not any(torch.equal(a, p) for a, p in zip(private, public))


# ---- PerFed-CKT: the clustering on an accelerator -----------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="the labels' device only matters off the CPU")
def test_recluster_on_a_gpu_keeps_every_tensor_there_and_centroids_are_member_means():
    """Logit matrices on CUDA, k = 2 with two far-apart groups: the centroids (on CUDA) are each
    group's mean by numpy, the assignment groups them."""
    sim = _ckt_sim(federation__device="cuda", method__k=2)
    m = sim.method
    n, c = m.n_public, sim.ctx.meta.num_classes
    gen = torch.Generator().manual_seed(7)
    z = torch.randn(6, n, c, generator=gen) + torch.tensor([0.0, 0.0, 0.0, 20.0, 20.0, 20.0]).view(6, 1, 1)
    m.logits[:] = z.to(m.logits.device)
    m.known[:] = True
    m.recluster(1)
    assert m.centroids.device.type == "cuda"
    assign = m.assign.cpu().tolist()
    assert assign[0] == assign[1] == assign[2] != assign[3] == assign[4] == assign[5]
    for group in ((0, 1, 2), (3, 4, 5)):
        want = z[list(group)].double().numpy().mean(0)
        np.testing.assert_allclose(m.centroids[assign[group[0]]].cpu().double().numpy(), want, rtol=1e-5, atol=1e-5)
