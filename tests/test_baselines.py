"""The baselines of issue 8: SCAFFOLD, FedDyn, FedOpt, Ditto, Per-FedAvg, pFedMe, APFL, FedRep, LG-FedAvg."""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from helpers import matrix, small_config
from pfl.callbacks.divergence import run_rounds
from pfl.federation.messages import Message
from pfl.federation.simulator import Simulator
from pfl.models import layer_groups
from pfl.schema import ConfigError

GLOBAL = ["scaffold", "feddyn", "fedadam", "fedadagrad", "fedyogi", "fedavgm"]
PERSONAL = ["ditto", "perfedavg", "pfedme", "apfl", "fedrep", "lgfedavg"]
ALL = GLOBAL + PERSONAL


def _grad(model, params, x, y):
    p = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    loss = F.cross_entropy(functional_call(model, p, (x,)), y)
    return dict(zip(p, torch.autograd.grad(loss, list(p.values()))))


def _expected_bytes_per_client(method: str, sim: Simulator) -> tuple[int, int]:
    """(down, up) bytes one sampled client should cost, from the model's parameter counts."""
    params = dict(sim.ctx.model.named_parameters())
    count = lambda names: sum(params[n].numel() for n in names)  # noqa: E731
    groups = layer_groups(sim.ctx.model)
    d = count(params)
    per = {"scaffold": (2 * d, 2 * d), "fedrep": (count(groups.body),) * 2, "lgfedavg": (count(groups.head),) * 2}
    down, up = per.get(method, (d, d))
    return 4 * down, 4 * up


def _check_run(sim: Simulator, method: str, rounds: int, per_round: int) -> None:
    hist = run_rounds(sim)
    last = hist[-1]
    assert len(hist) == rounds
    for key in ("test/acc_mean", "val/acc_mean", "test/loss_mean", "train/loss", "comm/total_bytes"):
        assert key in last and math.isfinite(last[key]), key
    assert 0.0 <= last["test/acc_mean"] <= 1.0
    if method not in ("fedrep", "lgfedavg"):
        assert math.isfinite(last["global/test_acc"])
    down, up = _expected_bytes_per_client(method, sim)
    for up_bytes, down_bytes in sim.ledger.per_round:
        assert (down_bytes, up_bytes) == (per_round * down, per_round * up)
    assert last["comm/total_bytes"] == rounds * per_round * (down + up)


# ---- every method runs, logs the standard metrics, and sends what its messages should carry ---------

@pytest.mark.parametrize("method", matrix(ALL, fast=("scaffold", "ditto")))
def test_runs_on_digits_with_measured_communication(method):
    sim = Simulator(small_config(method__name=method, federation__clients_per_round=4))
    _check_run(sim, method, rounds=3, per_round=4)


@pytest.fixture(scope="module")
def fmnist_data():
    from pfl.data import load_federated

    cfg = _fmnist_config("fedavg")
    return load_federated(cfg.data, cfg.seed)


def _fmnist_config(method: str, **extra):
    return small_config(method__name=method, data__source="fmnist", data__max_samples=1500, data__num_clients=6,
                        data__partition__alpha=0.1, model__name="mlp", model__params__hidden=[32],
                        federation__clients_per_round=3, federation__batch_size=50, federation__lr=0.05,
                        data__cache=False, **extra)


@pytest.mark.parametrize("method", matrix(ALL, fast=("scaffold", "ditto")))
def test_runs_on_fmnist_dirichlet(method, fmnist_data):
    sim = Simulator(_fmnist_config(method), data=fmnist_data)
    _check_run(sim, method, rounds=3, per_round=3)


# ---- SCAFFOLD ------------------------------------------------------------------------------------

def test_scaffold_option_two_control_variate_is_the_mean_path_gradient():
    sim = Simulator(small_config(method__name="scaffold", federation__batch_size=0, federation__local_steps=4,
                                 federation__clients_per_round=2))
    method, client = sim.method, sim.client(0)
    gen = torch.Generator().manual_seed(1)
    method.c = {k: 0.05 * torch.randn(v.shape, generator=gen) for k, v in method.global_model.items()}
    c_k = {k: 0.05 * torch.randn(v.shape, generator=gen) for k, v in method.global_model.items()}
    client.state["c"] = c_k
    theta, c = dict(method.global_model), dict(method.c)
    reply = sim.client_role.local_update(0, client, method.broadcast(0, 0))
    # the local path by hand: y ← y − η(∇f(y) + c − c_k), full batch
    lr, y, path_grads = sim.ctx.lr(0), dict(theta), []
    x, yy = client.data.x_train, client.data.y_train
    for _ in range(4):
        g = _grad(client.model, y, x, yy)
        path_grads.append(g)
        y = {k: y[k] - lr * (g[k] + c[k] - c_k[k]) for k in y}
    for k in theta:
        mean_grad = sum(g[k] for g in path_grads) / 4
        torch.testing.assert_close(client.state["c"][k], mean_grad, rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(reply.tensors("dy")[k], y[k] - theta[k], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(reply.tensors("dc")[k], client.state["c"][k] - c_k[k])
    # server: θ += mean Δy (η_g = 1), c += (1/N) Σ Δc
    method.aggregate(0, {0: reply})
    for k in theta:
        torch.testing.assert_close(method.global_model[k], theta[k] + reply.tensors("dy")[k])
        torch.testing.assert_close(method.c[k], c[k] + reply.tensors("dc")[k] / sim.num_clients)


# ---- FedDyn --------------------------------------------------------------------------------------

def test_feddyn_state_after_one_round_matches_hand_computation():
    alpha = 0.3
    sim = Simulator(small_config(method__name="feddyn", method__alpha=alpha, federation__batch_size=0,
                                 federation__local_steps=3, federation__clients_per_round=3))
    theta0 = dict(sim.method.global_model)
    sampled = sim.sample(0)
    lr = sim.ctx.lr(0)
    finals = {}
    for cid in sampled:
        c = sim.client(cid)
        w = dict(theta0)
        for _ in range(3):  # g_k = 0 in the first round
            g = _grad(c.model, w, c.data.x_train, c.data.y_train)
            w = {k: w[k] - lr * (g[k] + alpha * (w[k] - theta0[k])) for k in w}
        finals[cid] = w
    sim.run_round()
    n = sim.num_clients
    for k in theta0:
        for cid in sampled:
            torch.testing.assert_close(sim.client_states[cid]["g"][k], -alpha * (finals[cid][k] - theta0[k]),
                                       rtol=1e-4, atol=1e-6)
        mean = sum(finals[c][k] for c in sampled) / len(sampled)
        h = -alpha * sum(finals[c][k] - theta0[k] for c in sampled) / n
        torch.testing.assert_close(sim.method.h[k], h, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(sim.method.global_model[k], mean - h / alpha, rtol=1e-4, atol=1e-6)


# ---- FedOpt ----------------------------------------------------------------------------------------

def test_fedopt_moment_rules_on_a_three_vector():
    from pfl.methods.fedopt import server_moments

    m0, v0 = torch.tensor([0.1, -0.2, 0.3]), torch.tensor([0.04, 0.5, 0.01])
    delta = torch.tensor([0.5, 0.1, -0.3])
    b1, b2 = 0.9, 0.99
    for rule, v_expected in [
        ("adagrad", v0 + delta ** 2),
        ("adam", b2 * v0 + (1 - b2) * delta ** 2),
        ("yogi", torch.tensor([0.04 + 0.01 * 0.25, 0.5 - 0.01 * 0.01, 0.01 + 0.01 * 0.09])),
    ]:
        m, v = server_moments(m0, v0, delta, rule, b1, b2)
        torch.testing.assert_close(m, b1 * m0 + (1 - b1) * delta)
        torch.testing.assert_close(v, v_expected)
    m, v = server_moments(m0, v0, delta, "momentum", b1, b2)
    torch.testing.assert_close(m, b1 * m0 + delta)


def test_fedadam_first_step_closed_form():
    sim = Simulator(small_config(method__name="fedadam", method__server_lr=0.03, method__tau=1e-3))
    method = sim.method
    theta = dict(method.global_model)
    gen = torch.Generator().manual_seed(0)
    models = [{k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in theta.items()} for _ in range(2)]
    method.aggregate(0, {0: Message.model(models[0], n=10), 1: Message.model(models[1], n=30)})
    for k in theta:
        delta = (10 * models[0][k] + 30 * models[1][k]) / 40 - theta[k]
        step = 0.03 * (1 - 0.9) * delta / (torch.sqrt((1 - 0.99) * delta ** 2) + 1e-3)
        torch.testing.assert_close(method.global_model[k] - theta[k], step, rtol=1e-4, atol=1e-7)


# ---- Ditto -----------------------------------------------------------------------------------------

def test_ditto_personal_gradient_is_loss_gradient_plus_lambda_pull():
    sim = Simulator(small_config(method__name="ditto", method__lam=0.7, federation__batch_size=0))
    method, client = sim.method, sim.client(0)
    theta = {k: v + 0.1 for k, v in method.global_model.items()}  # the received global model
    v = method.personal_start(client, theta)
    kwargs = method.personal_kwargs(client, theta, 0)
    one = client.train(v, 0, **{**kwargs, "epochs": 1})
    g = _grad(client.model, v, client.data.x_train, client.data.y_train)
    for k in v:
        expected = v[k] - sim.ctx.lr(0) * (g[k] + 0.7 * (v[k] - theta[k]))
        torch.testing.assert_close(one.params[k], expected, rtol=1e-5, atol=1e-6)


# ---- APFL ------------------------------------------------------------------------------------------

def test_apfl_alpha_zero_personal_model_is_the_global_model():
    sim = Simulator(small_config(method__name="apfl", method__alpha=0.0, method__adaptive=False))
    run_rounds(sim)
    for cid in (0, 3):
        personal = sim.personal_params(cid)
        for k, v in sim.method.global_model.items():
            assert torch.equal(personal[k], v)


@pytest.mark.parametrize("mix", ["params", "logits"])
def test_apfl_one_step_updates_w_v_and_alpha(mix):
    sim = Simulator(small_config(method__name="apfl", method__alpha=0.4, method__mix=mix,
                                 federation__batch_size=0, federation__local_steps=1))
    method, client = sim.method, sim.client(1)
    theta = dict(method.global_model)
    v = {k: t + 0.05 * torch.randn(t.shape, generator=torch.Generator().manual_seed(3)) for k, t in theta.items()}
    client.state["v"] = v
    reply = sim.client_role.local_update(0, client, method.broadcast(0, 1))
    lr, a = sim.ctx.lr(0), 0.4
    x, y, model = client.data.x_train, client.data.y_train, client.model
    w_grad = _grad(model, theta, x, y)
    vp = {k: t.clone().requires_grad_(True) for k, t in v.items()}
    ap = torch.tensor(a, requires_grad=True)
    if mix == "params":
        out = functional_call(model, {k: ap * vp[k] + (1 - ap) * theta[k] for k in theta}, (x,))
    else:
        out = ap * functional_call(model, vp, (x,)) + (1 - ap) * functional_call(model, theta, (x,))
    grads = torch.autograd.grad(F.cross_entropy(out, y), [*vp.values(), ap])
    v_grad, a_grad = dict(zip(vp, grads[:-1])), grads[-1]
    if mix == "params":
        # the α-gradient is ⟨v − w, ∇f(v̄)⟩ with ∇f(v̄) = ∇_v / α
        direct = sum(((v[k] - theta[k]) * v_grad[k] / a).sum() for k in v)
        torch.testing.assert_close(a_grad, direct, rtol=1e-4, atol=1e-7)
    for k in theta:
        torch.testing.assert_close(reply.tensors()[k], theta[k] - lr * w_grad[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(client.state["v"][k], v[k] - lr * v_grad[k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(client.state["alpha"], torch.clamp(a - lr * a_grad, 0, 1), rtol=1e-5, atol=1e-7)


# ---- FedRep / LG-FedAvg ---------------------------------------------------------------------------

def test_fedrep_trains_head_then_body_each_with_the_other_frozen(monkeypatch):
    from pfl.methods.base import ClientHandle

    sim = Simulator(small_config(method__name="fedrep", method__head_epochs=2))
    groups = layer_groups(sim.ctx.model)
    calls = []
    original = ClientHandle.train

    def recording(self, params, rnd, **kw):
        out = original(self, params, rnd, **kw)
        calls.append((dict(params), out.params, list(kw.get("trainable") or [])))
        return out

    monkeypatch.setattr(ClientHandle, "train", recording)
    method, client = sim.method, sim.client(2)
    client.state["own"] = {k: v + 0.3 for k, v in method.init_own.items()}
    msg = method.broadcast(0, 2)
    reply = sim.client_role.local_update(0, client, msg)
    assert [c[2] for c in calls] == [groups.head, groups.body]
    (in1, out1, _), (in2, out2, _) = calls
    for k in groups.body:
        assert torch.equal(in1[k], msg.tensors()[k]) and torch.equal(out1[k], in1[k])  # body frozen in head epochs
        assert not torch.equal(out2[k], in2[k])
    for k in groups.head:
        torch.testing.assert_close(in1[k], method.init_own[k] + 0.3)  # starts from the client's own head
        assert not torch.equal(out1[k], in1[k])
        assert torch.equal(out2[k], in2[k])  # head frozen in body epochs
    assert set(reply.tensors()) == set(groups.body)
    assert all(torch.equal(client.state["own"][k], out2[k]) for k in groups.head)


def test_lgfedavg_every_client_holds_the_same_head_after_aggregation():
    sim = Simulator(small_config(method__name="lgfedavg", federation__clients_per_round=5))
    run_rounds(sim)
    groups = layer_groups(sim.ctx.model)
    personal = [sim.personal_params(c) for c in range(sim.num_clients)]
    for p in personal[1:]:
        for k in groups.head:
            assert torch.equal(p[k], personal[0][k])
    trained = [c for c in range(sim.num_clients) if "own" in sim.client_states[c]]
    assert len(trained) >= 2
    a, b = (sim.personal_params(c) for c in trained[:2])
    assert any(not torch.equal(a[k], b[k]) for k in groups.body)  # bodies stay personal


def test_lgfedavg_warmup_is_fedavg_then_sends_the_head():
    sim = Simulator(small_config(method__name="lgfedavg", method__warmup_rounds=2, federation__rounds=4,
                                 federation__clients_per_round=4))
    run_rounds(sim)
    d = sum(p.numel() for p in sim.ctx.model.parameters())
    head = sum(p.numel() for n, p in sim.ctx.model.named_parameters() if n in layer_groups(sim.ctx.model).head)
    up = [u for u, _ in sim.ledger.per_round]
    assert up[:2] == [4 * 4 * d, 4 * 4 * d]
    assert up[3] == 4 * 4 * head


# ---- Per-FedAvg ------------------------------------------------------------------------------------

def test_perfedavg_hessian_free_matches_exact_hessian_vector_product():
    from pfl.methods.perfedavg import BatchGradient, meta_gradient

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
    w = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = torch.randn(30, 4, dtype=torch.float64), torch.randint(0, 3, (30,))
    fn = BatchGradient(model, x, y, "classification")
    d1, d2, d3 = torch.arange(0, 10), torch.arange(10, 20), torch.arange(20, 30)
    grad_d = fn(w, d1)
    exact = meta_gradient(fn, w, grad_d, [d2, d3], 0.1, "exact", 1e-3)
    hf = meta_gradient(fn, w, grad_d, [d2, d3], 0.1, "hf", 1e-5)
    fo = meta_gradient(fn, w, grad_d, [d2], 0.1, "fo", 1e-3)
    w_tilde = {k: w[k] - 0.1 * grad_d[k] for k in w}
    g = fn(w_tilde, d2)
    for k in w:
        torch.testing.assert_close(hf[k], exact[k], rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(fo[k], g[k])
        assert not torch.allclose(exact[k], g[k])  # the Hessian term matters


# ---- pFedMe ----------------------------------------------------------------------------------------

def test_pfedme_server_beta_one_is_the_average_and_beta_mixes():
    for beta in (1.0, 0.5):
        sim = Simulator(small_config(method__name="pfedme", method__beta=beta))
        theta = dict(sim.method.global_model)
        gen = torch.Generator().manual_seed(0)
        models = [{k: v + torch.randn(v.shape, generator=gen) for k, v in theta.items()} for _ in range(2)]
        sim.method.aggregate(0, {0: Message.model(models[0], n=1), 1: Message.model(models[1], n=3)})
        for k in theta:
            avg = (models[0][k] + 3 * models[1][k]) / 4
            torch.testing.assert_close(sim.method.global_model[k], (1 - beta) * theta[k] + beta * avg)


def test_pfedme_inner_steps_approach_the_prox_point_and_outer_step_moves_w():
    lam, eta_p, eta = 2.0, 0.1, 0.05
    # a smooth model: on a ReLU network plain GD stalls at the kinks instead of reaching the prox point
    sim = Simulator(small_config(method__name="pfedme", method__lam=lam, method__personal_lr=eta_p,
                                 model__name="softmax_regression", method__inner_steps=300, method__inner_weight_decay=0.0, method__local_iters=1,
                                 federation__batch_size=0, federation__lr=eta))
    method, client = sim.method, sim.client(0)
    w0 = dict(method.global_model)
    reply = sim.client_role.local_update(0, client, method.broadcast(0, 0))
    theta = client.state["personal"]
    # the prox point θ* = argmin f(θ) + λ/2‖θ − w‖² satisfies ∇f(θ*) + λ(θ* − w) = 0
    g = _grad(client.model, theta, client.data.x_train, client.data.y_train)
    residual = max(float((g[k] + lam * (theta[k] - w0[k])).abs().max()) for k in w0)
    assert residual < 1e-5
    assert max(float((theta[k] - w0[k]).abs().max()) for k in w0) > 1e-2  # it did move
    for k in w0:
        torch.testing.assert_close(reply.tensors()[k], w0[k] - eta * lam * (w0[k] - theta[k]))


# ---- configuration errors ----------------------------------------------------------------------------

@pytest.mark.parametrize("method, field, value", [
    ("ditto", "lam", -1.0), ("ditto", "personal_epochs", 0), ("apfl", "alpha", 1.5), ("apfl", "mix", "outputs"),
    ("feddyn", "alpha", 0.0), ("fedadam", "beta1", 1.0), ("fedyogi", "tau", 0.0), ("fedadagrad", "optimizer", "sgd"),
    ("perfedavg", "variant", "so"), ("perfedavg", "delta", 0.0), ("pfedme", "lam", 0.0), ("pfedme", "beta", -1.0),
    ("fedrep", "head_epochs", 0), ("scaffold", "server_lr", 0.0), ("lgfedavg", "warmup_rounds", -1),
    ("scaffold", "mu", 0.1),
])
def test_bad_hyperparameters_name_the_field(method, field, value):
    with pytest.raises(ConfigError) as info:
        small_config(method__name=method, **{f"method__{field}": value})
    assert info.value.field == f"method.{field}"


# ---- learning --------------------------------------------------------------------------------------

def test_personalized_methods_beat_fedavg_under_label_skew():
    common = dict(data__num_clients=10, data__partition__kind="shards", data__partition__classes_per_client=2,
                  federation__rounds=12, federation__clients_per_round=5, federation__eval_every=12,
                  federation__lr=0.1)
    acc = {}
    for method in ("fedavg", "fedrep", "ditto"):
        sim = Simulator(small_config(method__name=method, **common))
        acc[method] = run_rounds(sim)[-1]["test/acc_mean"]
    assert max(acc["fedrep"], acc["ditto"]) > acc["fedavg"] + 0.05, acc
    assert acc["fedrep"] > 0.5, acc  # 2 classes per client: chance is about 0.5


# ---- search spaces and the comparison pipeline -----------------------------------------------------

@pytest.mark.parametrize("name", ["ditto", "apfl", "pfedme"])
def test_search_spaces_load_and_check(name):
    from pfl.tune.space import base_config, check_space, load_space

    root = Path(__file__).resolve().parents[1]
    space = load_space(root / "search_spaces" / f"{name}.yaml")
    for smoke in (False, True):
        check_space(space, base_config(space, smoke=smoke))
    assert space.fixed["method.name"] == name


@pytest.mark.slow
def test_compare_baselines_pipeline_logs_parent_table_and_children(ray_cluster, tmp_path):
    """pipelines/compare_baselines.py: tables/baselines.yaml's cells on Ray, the table on one parent."""
    import subprocess

    import pandas as pd
    from mlflow.tracking import MlflowClient

    root = Path(__file__).resolve().parents[1]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    code, out = ray_cluster.run(
        [sys.executable, str(root / "pipelines" / "compare_baselines.py"), "--quick", "--scenario", "digits_dir05",
         "--methods", "fedavg", "scaffold", "fedrep", "--seeds", "0", "1", "--last", "2", "--out", str(tmp_path),
         "--storage", str(tmp_path / "ray_results"), "--quiet",
         "--set", "data.source=digits", "data.max_samples=null", "data.num_clients=6", "federation.rounds=2",
         "federation.clients_per_round=3", "federation.eval_every=1"],
        {"MLFLOW_TRACKING_URI": uri, "PFL_CACHE_DIR": str(tmp_path / "cache"), "RAY_ADDRESS": ray_cluster.address})
    assert code == 0, out[-4000:]
    table = pd.read_csv(tmp_path / "baselines-quick.csv")
    assert list(table["row"]) == ["fedavg", "scaffold", "fedrep"]
    assert (table["seeds"] == 2).all()
    runs = pd.read_csv(tmp_path / "baselines-quick_runs.csv")
    assert len(runs) == 6 and (runs["status"] == "FINISHED").all()
    by = table.set_index("row")
    assert by.loc["scaffold", "total_bytes_mean"] == 2 * by.loc["fedavg", "total_bytes_mean"]
    assert by.loc["fedrep", "total_bytes_mean"] < by.loc["fedavg", "total_bytes_mean"]
    assert math.isnan(by.loc["fedrep", "global_acc_mean"]) and by.loc["fedavg", "global_acc_mean"] > 0
    assert (table["mark"] == "ref").sum() == 1   # the best row is the reference
    text = (tmp_path / "baselines-quick.md").read_text()
    assert sum(ln.startswith("|") for ln in text.splitlines()) == 5 and "CIFAR-10" in text and "±" in text
    mc = MlflowClient(tracking_uri=uri)
    parent = next(r for e in mc.search_experiments() for r in mc.search_runs([e.experiment_id])
                  if "mlflow.parentRunId" not in r.data.tags)
    artifacts = {a.path for a in mc.list_artifacts(parent.info.run_id)}
    assert {"baselines-quick.csv", "baselines-quick.md", "baselines-quick_runs.csv"} <= artifacts
    children = mc.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.info.run_name for r in children) == sorted(f"{m} [seed {s}]" for m in ("fedavg", "fedrep", "scaffold")
                                                               for s in (0, 1))
    assert all("test/acc_mean" in r.data.metrics for r in children)
