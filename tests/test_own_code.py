"""Your own model (model.name: file.py:Class, module:factory) and your own method (plugins).

Each check compares with something the test computes itself: the bytes a head-only uplink must
cost from the head's shapes, a plugin method with α = 1 against the built-in FedAvg it reduces to,
a resumed run against the straight one.
"""

from __future__ import annotations

import textwrap

import pytest

from pfl.callbacks.divergence import run_rounds
import torch

from helpers import small_config, straight_and_resumed
from pfl.schema import ConfigError

MODEL = '''
import torch
from torch import nn


class SmallNet(nn.Module):
    def __init__(self, input_shape, num_classes, hidden: int = 16):
        super().__init__()
        d = 1
        for s in input_shape:
            d *= s
        self.fc1 = nn.Linear(d, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.fc1(x.flatten(1)))))


class Recurrent(nn.Module):
    """Modules without an init rule of pfl's own: an LSTM and a bare parameter."""
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.lstm = nn.LSTM(8, 12, batch_first=True)
        self.temperature = nn.Parameter(torch.ones(1))
        self.out = nn.Linear(12, num_classes)

    def forward(self, x):
        h, _ = self.lstm(x.reshape(len(x), 8, 8))
        return self.out(h[:, -1]) / self.temperature


class WithBatchNorm(SmallNet):
    def __init__(self, input_shape, num_classes):
        super().__init__(input_shape, num_classes)
        self.norm = nn.BatchNorm1d(16)


class RunningMean(SmallNet):
    def __init__(self, input_shape, num_classes):
        super().__init__(input_shape, num_classes)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x):
        self.seen += len(x)
        return super().forward(x)


class WrongOutput(SmallNet):
    def forward(self, x):
        return super().forward(x)[:, :3]


class NotAModule:
    def __init__(self, input_shape, num_classes):
        pass


def factory(input_shape, num_classes, hidden: int = 16):
    return SmallNet(input_shape, num_classes, hidden)
'''

METHOD = '''
from dataclasses import dataclass

from pfl.federation.messages import Message
from pfl.methods import register
from pfl.methods.fedavg import FedAvg, FedAvgHparams
from pfl.schema import hp


@dataclass
class MixHparams(FedAvgHparams):
    alpha: float = hp(0.5, "weight of the global model in a client's personal model", low=0.0, high=1.0)


@register
class FedAvgMix(FedAvg):
    name = "fedavg_mix"
    Hparams = MixHparams
    description = "FedAvg; a client's personal model is alpha*global + (1-alpha)*its last local model"

    def local_update(self, rnd, client, msg):
        result = client.train(msg.tensors(), rnd)
        client.state["local"] = result.params
        return Message.model(result.params, base="model", train_loss=result.mean_loss, n=client.n_train)

    def personal_params(self, rnd, client, received):
        local = client.state.get("local")
        if local is None or self.hp.alpha == 1.0:
            return received
        a = self.hp.alpha
        return {k: a * received[k] + (1 - a) * local[k] for k in received}
'''


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    (root / "my_model.py").write_text(MODEL)
    (root / "my_method.py").write_text(METHOD)
    return root


def run_cfg(**kw):
    kw.setdefault("federation__rounds", 2)
    return small_config(**kw)


# ---- your model -------------------------------------------------------------------------------

def test_default_head_is_the_last_linear_and_is_in_the_run_params(code):
    from pfl.callbacks.tracking import config_params
    from pfl.federation.simulator import Simulator
    from pfl.models import layer_groups

    cfg = run_cfg(model__name=f"{code}/my_model.py:SmallNet", model__params={"hidden": 24})
    assert cfg.model.head == ["out"] and cfg.model.params == {"hidden": 24}
    assert config_params(cfg)["model.head"] == ["out"]
    sim = Simulator(cfg)
    assert layer_groups(sim.ctx.model).head == ["out.weight", "out.bias"]
    run_rounds(sim)
    assert sim.history[-1]["test/acc_mean"] > 0.2  # it learns on digits in two rounds


@pytest.mark.parametrize("head", [None, ["fc1", "out"]])
def test_model_head_is_what_lgfedavg_sends(code, head):
    from pfl.federation.simulator import Simulator

    kw = {"model__head": head} if head else {}
    cfg = run_cfg(model__name=f"{code}/my_model.py:SmallNet", method__name="lgfedavg", federation__rounds=1,
                  federation__clients_per_round=4, **kw)
    sim = Simulator(cfg)
    run_rounds(sim)
    model = sim.ctx.model
    # the head's size from the layers themselves: out (16 -> 10), and fc1 (64 -> 16) with it
    sizes = {"out": 16 * 10 + 10, "fc1": 64 * 16 + 16}
    want = 4 * 4 * sum(sizes[p] for p in (head or ["out"]))  # 4 clients, float32
    assert sum(p.numel() for n, p in model.named_parameters() if n.startswith(("out", "fc1"))) == sum(sizes.values())
    assert sim.history[-1]["comm/up_bytes"] == want


def test_factory_from_a_module_and_its_params_are_checked(code, monkeypatch):
    monkeypatch.syspath_prepend(str(code))
    cfg = run_cfg(model__name="my_model:factory", model__params={"hidden": 8})
    assert cfg.model.params == {"hidden": 8} and cfg.model.head == ["out"]
    with pytest.raises(ConfigError) as err:
        run_cfg(model__name="my_model:factory", model__params={"hiden": 8})
    assert err.value.field == "model.params.hiden" and "did you mean 'hidden'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        run_cfg(model__name="my_model:factory", model__params={"hidden": "wide"})
    assert err.value.field == "model.params.hidden"


def test_modules_without_an_init_rule_are_seeded_by_their_own_reset(code):
    from pfl.federation.simulator import Simulator

    cfg = run_cfg(model__name=f"{code}/my_model.py:Recurrent", federation__rounds=1)
    a, b = Simulator(cfg), Simulator(cfg)
    pa, pb = a.ctx.init_params(), b.ctx.init_params()
    other = a.ctx.init_params("another")
    assert all(torch.equal(pa[k], pb[k]) for k in pa)                  # reproducible
    assert not torch.equal(pa["lstm.weight_ih_l0"], other["lstm.weight_ih_l0"])  # drawn, not copied
    assert torch.equal(pa["temperature"], torch.ones(1))              # no rule: as built
    run_rounds(a)
    assert a.history[-1]["train/loss"] == a.history[-1]["train/loss"]  # finite, ran


@pytest.mark.parametrize("target, words", [
    ("RunningMean", ["buffer 'seen' changes"]),
    ("WrongOutput", ["returns (8, 3)", "(8, 10)"]),
    ("NotAModule", ["not a torch.nn.Module"]),
    ("Missing", ["has no 'Missing'", "SmallNet"]),
])
def test_bad_models_are_refused_before_training(code, target, words):
    from pfl.federation.simulator import Simulator

    with pytest.raises(ConfigError) as err:
        Simulator(run_cfg(model__name=f"{code}/my_model.py:{target}"))
    text = str(err.value)
    assert err.value.field == "model.name" and "\n" not in text and all(w in text for w in words), text


def test_your_batchnorm_model_runs_and_its_statistics_are_federated(code):
    """Issue 43: BatchNorm is no longer refused; its running statistics are entries of the model
    dict that FedAvg averages (and the module's own buffers are never written)."""
    from pfl.callbacks.divergence import run_rounds
    from pfl.federation.simulator import Simulator

    sim = Simulator(run_cfg(model__name=f"{code}/my_model.py:WithBatchNorm", federation__rounds=1))
    run_rounds(sim)
    glob = sim.method.global_model
    assert glob["norm.num_batches_tracked"] > 0 and not torch.equal(glob["norm.running_mean"], torch.zeros(16))
    assert torch.equal(sim.ctx.model.norm.running_mean, torch.zeros(16))  # the shared module untouched


def test_a_model_file_that_does_not_import_names_the_file_and_the_error(tmp_path):
    (tmp_path / "broken.py").write_text("import torch\nfrom torch import nn\nimport not_a_package_xyz\n")
    with pytest.raises(ConfigError) as err:
        run_cfg(model__name=f"{tmp_path}/broken.py:Net")
    text = str(err.value)
    assert err.value.field == "model.name" and "broken.py" in text and "not_a_package_xyz" in text, text
    assert "(line 3)" in text and "\n" not in text
    with pytest.raises(ConfigError) as err:
        run_cfg(model__name=f"{tmp_path}/absent.py:Net")
    assert err.value.field == "model.name" and "no such file" in str(err.value)


# ---- your method --------------------------------------------------------------------------------

def test_plugin_method_is_listed_and_runs_like_a_built_in(code, capsys):
    from pfl import cli
    from pfl.federation.simulator import Simulator

    assert cli.main(["methods", "--plugin", str(code / "my_method.py")]) == 0
    assert "fedavg_mix: FedAvg; a client's personal model" in capsys.readouterr().out
    # alpha = 1: the personal model is the global one, so the run is FedAvg's, number for number
    mixed = Simulator(run_cfg(plugins=[str(code / "my_method.py")], method__name="fedavg_mix", method__alpha=1.0))
    plain = Simulator(run_cfg(method__name="fedavg"))
    run_rounds(mixed)
    run_rounds(plain)
    for key in ("test/acc_mean", "val/acc_mean", "train/loss", "comm/up_bytes"):
        assert mixed.history[-1][key] == plain.history[-1][key], key
    # alpha = 0: each client's own last model, which differs
    local = Simulator(run_cfg(plugins=[str(code / "my_method.py")], method__name="fedavg_mix", method__alpha=0.0))
    run_rounds(local)
    assert local.history[-1]["test/acc_mean"] != plain.history[-1]["test/acc_mean"]


def test_pfl_run_with_plugin_and_own_model_exits_0(code, capsys, monkeypatch):
    from pfl import cli

    monkeypatch.chdir(code)  # relative paths, as a user types them
    code_ = cli.main(["run", "--no-track", "--plugin", "my_method.py", "--set", "method.name=fedavg_mix",
                      "model.name=my_model.py:SmallNet", "federation.rounds=2", "data.num_clients=6"])
    out = capsys.readouterr().out
    assert code_ == 0 and "method fedavg_mix on digits: FINISHED" in out


def test_plugin_method_resumes_compresses_and_batches(code, tmp_path):
    from pfl.federation.simulator import Simulator

    plugin = [str(code / "my_method.py")]
    cfg = run_cfg(plugins=plugin, method__name="fedavg_mix", federation__rounds=3,
                  model__name=f"{code}/my_model.py:SmallNet")
    straight, resumed = straight_and_resumed(cfg, tmp_path)
    for cid in range(cfg.data.num_clients):
        a, b = straight.client(cid).state.get("local"), resumed.client(cid).state.get("local")
        assert (a is None) == (b is None) and (a is None or all(torch.equal(a[k], b[k]) for k in a))
    assert straight.history[-1]["test/acc_mean"] == resumed.history[-1]["test/acc_mean"]
    qsgd = Simulator(run_cfg(plugins=plugin, method__name="fedavg_mix", compression__uplink={"name": "qsgd", "s": 4}))
    run_rounds(qsgd)
    dense = Simulator(run_cfg(plugins=plugin, method__name="fedavg_mix"))
    run_rounds(dense)
    assert qsgd.history[-1]["comm/up_bytes"] < dense.history[-1]["comm/up_bytes"] / 4
    batched = Simulator(run_cfg(plugins=plugin, method__name="fedavg_mix", federation__cohort="vectorized"))
    run_rounds(batched)
    assert batched.history[-1]["test/acc_mean"] == pytest.approx(dense.history[-1]["test/acc_mean"], abs=0.02)


@pytest.mark.parametrize("body, words", [
    ("from pfl.methods import register\nfrom pfl.methods.fedavg import FedAvg\n\n@register\nclass Again(FedAvg):\n"
     "    name = 'fedavg'\n", ["method 'fedavg' is already registered", "new names"]),
    ("raise RuntimeError('needs a GPU cluster')\n", ["does not import", "RuntimeError: needs a GPU cluster", "(line 1)"]),
    ("def broken(:\n", ["does not import", "SyntaxError"]),
])
def test_bad_plugins_exit_2_naming_the_entry(tmp_path, capsys, body, words):
    from pfl import cli
    from pfl.methods import get_method

    (tmp_path / "plug.py").write_text(textwrap.dedent(body))
    code = cli.main(["run", "--no-track", "--plugin", str(tmp_path / "plug.py"), "--set", "federation.rounds=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("config error: plugins[0]:") and all(w in err[0] for w in words), err
    assert get_method("fedavg").__module__ == "pfl.methods.fedavg"  # the built-in is untouched
    assert cli.main(["run", "--no-track", "--plugin", str(tmp_path / "absent.py")]) == 2
    assert "plugins[0]: no such file" in capsys.readouterr().err
