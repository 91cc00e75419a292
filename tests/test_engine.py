"""Config validation, messages, the shared training loop, the simulator, resume."""

import subprocess
import sys

import pytest
import torch
from torch.func import functional_call

from helpers import small_config, straight_and_resumed
from pfl.aggregation import weighted_average
from pfl.callbacks.divergence import run_rounds
from pfl.federation.messages import Encoded, LowRank, Message, Model, Scalars, State, Update
from pfl.federation.simulator import Simulator
from pfl.resolver import load, with_overrides
from pfl.schema import ConfigError
from pfl.training import local_sgd


# ---- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, field, words", [
    ({"method.name": "fedavgg"}, "method.name", ["fedavg", "allowed"]),
    ({"data.partition.alpha": -1}, "data.partition.alpha", [">= 0.0"]),
    ({"data.source": "mnistt"}, "data.source", ["allowed", "fmnist"]),
    ({"federation.roundz": 3}, "federation.roundz", ["rounds"]),
    ({"method.name": "fedavg", "method.mu": 0.1}, "method.mu", ["server_lr"]),
    ({"method.name": "fedprox", "method.mu": -0.5}, "method.mu", [">= 0.0"]),
    ({"federation.lr": 0}, "federation.lr", ["> 0.0"]),
    ({"model.name": "resnet99"}, "model.name", ["allowed", "mlp"]),
    ({"data.partition.kind": "dirichlett"}, "data.partition.kind", ["dirichlet"]),
    ({"datum.source": "digits"}, "datum", ["data"]),
])
def test_config_errors_name_the_field(override, field, words):
    with pytest.raises(ConfigError) as info:
        load(None, override)
    assert info.value.field == field
    for word in words:
        assert word in str(info.value)


def test_config_yaml_round_trip_and_overrides(tmp_path):
    cfg = small_config(method__name="fedprox", method__mu=0.25)
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.to_yaml())
    again = load(path)
    assert again.to_dict() == cfg.to_dict()
    assert again.method.hparams.mu == 0.25
    # switching the method drops the old method's hyperparameters instead of failing on them
    switched = with_overrides(again, ["method.name=fedavg"])
    assert switched.method.name == "fedavg" and not hasattr(switched.method.hparams, "mu")
    assert with_overrides(again, ["federation.lr=0.5"]).federation.lr == 0.5
    # values given before any method name (a scenario, a preset) survive the name set later
    from pfl.config import apply_overrides
    raw = apply_overrides(apply_overrides({}, {"method.init_std": 1.0}), {"method.name": "fpfc"})
    assert raw["method"] == {"name": "fpfc", "init_std": 1.0}
    assert apply_overrides(raw, {"method.name": "fedavg"})["method"] == {"name": "fedavg"}


@pytest.mark.slow
def test_cli_rejects_bad_config_before_training(tmp_path):
    db = tmp_path / "cli.db"
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{db}", "PATH": "/usr/bin:/bin"}
    for bad in ("method.name=fedavgg", "data.partition.alpha=-1"):
        proc = subprocess.run([sys.executable, "-m", "pfl", "run", "--set", bad, "data.source=digits"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode != 0
        assert bad.split("=")[0] in proc.stderr
        assert not db.exists(), "nothing may be tracked or trained for an invalid config"


# ---- messages and aggregation --------------------------------------------------------------------

def test_message_bytes_are_measured_from_entries():
    msg = Message.of({"model": Model({"w": torch.zeros(10, 3), "lr": LowRank(torch.zeros(8, 2), torch.zeros(2, 5))}),
                      "extra": State({"b": torch.zeros(3, dtype=torch.float64)}),
                      "delta": Update({"q": Encoded(torch.zeros(100), bits=203, values=10)}),
                      "index": Scalars({"k": torch.zeros(1, dtype=torch.int64)})})
    assert msg.nbytes() == 10 * 3 * 4 + 3 * 8 + (8 + 5) * 2 * 4 + 26 + 8
    assert msg.num_params() == 30 + 3 + 26 + 10 + 1
    assert msg.tensors("model")["lr"].shape == (8, 5)
    with pytest.raises(KeyError, match="name the one"):  # which part is meant is never guessed
        msg.tensors()
    with pytest.raises(TypeError, match="must be a Part"):
        Message.of({"w": torch.zeros(3)})


def test_weighted_average_matches_direct_sum():
    gen = torch.Generator().manual_seed(0)
    models = [{"a": torch.randn(4, 3, generator=gen), "b": torch.randn(2, generator=gen)} for _ in range(3)]
    weights = [1.0, 2.0, 5.0]
    avg = weighted_average(models, weights)
    for k in ("a", "b"):
        direct = sum(w * m[k] for w, m in zip(weights, models)) / sum(weights)
        torch.testing.assert_close(avg[k], direct)
    uniform = weighted_average(models)
    torch.testing.assert_close(uniform["a"], sum(m["a"] for m in models) / 3)


# ---- the shared SGD loop -------------------------------------------------------------------------

def test_full_batch_step_equals_manual_gradient_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = torch.randn(20, 5), torch.randint(0, 3, (20,))
    out = local_sgd(model, params, x, y, lr=0.3, epochs=1, batch_size=0)
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    loss = torch.nn.functional.cross_entropy(functional_call(model, p, (x,)), y)
    grads = torch.autograd.grad(loss, list(p.values()))
    for (k, v), g in zip(params.items(), grads):
        torch.testing.assert_close(out.params[k], v - 0.3 * g)
    assert out.steps == 1
    # the input dict is left untouched
    for k, v in model.named_parameters():
        torch.testing.assert_close(params[k], v.detach())


def test_fedprox_gradient_is_loss_gradient_plus_mu_pull():
    from pfl.methods.fedavg import FedProx

    cfg = small_config(method__name="fedprox", method__mu=0.7)
    sim = Simulator(cfg)
    method: FedProx = sim.method
    client = sim.client(0)
    anchor = {k: v + 0.1 for k, v in method.global_model.items()}
    hook = method.train_kwargs(client, anchor)["grad_hook"]
    start = method.global_model
    one = client.train(start, 0, steps=1, batch_size=0, grad_hook=hook)
    p = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    loss = torch.nn.functional.cross_entropy(functional_call(client.model, p, (client.data.x_train,)),
                                             client.data.y_train)
    grads = dict(zip(p, torch.autograd.grad(loss, list(p.values()))))
    lr = sim.ctx.lr(0)
    for k in start:
        expected = start[k] - lr * (grads[k] + 0.7 * (start[k] - anchor[k]))
        torch.testing.assert_close(one.params[k], expected, rtol=1e-5, atol=1e-6)


def test_fedprox_with_mu_zero_is_fedavg_exactly():
    a = Simulator(small_config(method__name="fedavg"))
    b = Simulator(small_config(method__name="fedprox", method__mu=0.0))
    run_rounds(a)
    run_rounds(b)
    for k in a.method.global_model:
        assert torch.equal(a.method.global_model[k], b.method.global_model[k])


# ---- simulator -----------------------------------------------------------------------------------

def _num_params(sim):
    return sum(v.numel() for v in sim.method.global_params().values())


def test_fedavg_communication_equals_what_messages_carry():
    sim = Simulator(small_config(federation__rounds=3, federation__clients_per_round=4))
    run_rounds(sim)
    d = _num_params(sim)
    expected_each_way = 3 * 4 * d * 4  # rounds × clients × params × float32 bytes
    assert sim.ledger.down_bytes == expected_each_way
    assert sim.ledger.up_bytes == expected_each_way
    assert sim.history[-1]["comm/total_bytes"] == 2 * expected_each_way


def test_local_sends_nothing():
    sim = Simulator(small_config(method__name="local"))
    run_rounds(sim)
    assert sim.ledger.total_bytes == 0
    assert sim.history[-1]["comm/total_bytes"] == 0


def test_sampling_is_seeded_per_round():
    sim = Simulator(small_config(federation__clients_per_round=3))
    assert sim.sample(5) == sim.sample(5)
    assert len(set(sim.sample(5))) == 3
    assert any(sim.sample(r) != sim.sample(5) for r in range(5))


@pytest.mark.parametrize("method", ["fedavg", "local", "fedprox"])
def test_resume_equals_uninterrupted(tmp_path, method):
    cfg = small_config(method__name=method, federation__rounds=4, federation__momentum=0.5)
    straight, resumed = straight_and_resumed(cfg, tmp_path)
    for cid in range(straight.num_clients):
        pa = straight.personal_params(cid)
        pb = resumed.personal_params(cid)
        for k in pa:
            assert torch.equal(pa[k], pb[k])
    last_a, last_b = straight.history[-1], resumed.history[-1]
    for key in ("test/acc_mean", "comm/total_bytes", "val/loss_mean"):
        assert last_a[key] == last_b[key]


def test_eval_every_and_last_round():
    sim = Simulator(small_config(federation__rounds=5, federation__eval_every=2))
    run_rounds(sim)
    evaluated = [int(m["round"]) for m in sim.history if "test/acc_mean" in m]
    assert evaluated == [1, 3, 4]
