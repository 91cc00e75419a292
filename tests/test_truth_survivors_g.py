"""Survivor pass G: truths for the mutants that survived (or had no test) in ``centralized``
(``pool_steps``, ``round_samples``, the round's optimizer settings, its ``train/loss`` and its
evaluation read-outs, a round without training), FedBN (``batchnorm_names``, ``FedBN.shared_names``),
``resolve_compression``, the parameter-dict helpers of ``pfl.aggregation`` (``add``, ``sub``,
``scale``, ``sq_norm``) and ``Method.fit_model`` / ``hparams_dict`` of ``pfl.methods.base``. The
truths: the pooled model spends the federated budget (docs/methods/baselines.md, "Centralized") —
full-batch gradient steps with momentum and weight decay on the pooled least-squares objective written
in numpy, its mean step loss, and sample/step counts derived by hand from the config at the boundaries
(one-sample batches, a one-sample pool, an empty pool, a one-sample client, a budget of one); BatchNorm
names read from the torch modules' own ``_parameters`` / ``_buffers``; the helpers against numpy;
config errors naming the field (``compression.uplink.*`` / ``compression.downlink.*``) and the
allowed values; ``fit_model`` as its docstring states it (the message's ``model`` part, else its
first Model part, else None, passed to ``personal_params`` with the round) checked with the
fine-tuned model of ``fedavg_ft`` recomputed in numpy and with hand-built messages.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

from truth import close, config, least_squares, simulator, vec


# ---- pfl.aggregation's parameter-dict helpers against numpy ---------------------------------------

def _dicts(seed=0):
    rs = np.random.RandomState(seed)
    a = {"w": rs.normal(size=(3, 2)), "b": rs.normal(size=4)}
    b = {"w": rs.normal(size=(3, 2)), "b": rs.normal(size=4)}
    as_t = lambda d: {k: torch.tensor(v, dtype=torch.float64) for k, v in d.items()}  # noqa: E731
    return a, b, as_t(a), as_t(b)


def test_parameter_dict_helpers_are_the_numpy_arithmetic():
    from pfl.aggregation import add, scale, sq_norm, sub

    a, b, ta, tb = _dicts()
    for k in a:
        assert np.allclose(add(ta, tb)[k].numpy(), a[k] + b[k], rtol=0, atol=1e-12)      # alpha defaults to 1
        assert np.allclose(add(ta, tb, 0.5)[k].numpy(), a[k] + 0.5 * b[k], rtol=0, atol=1e-12)
        assert np.allclose(add(ta, tb, -2.0)[k].numpy(), a[k] - 2.0 * b[k], rtol=0, atol=1e-12)
        assert np.allclose(sub(ta, tb)[k].numpy(), a[k] - b[k], rtol=0, atol=1e-12)
        assert np.allclose(scale(ta, 0.3)[k].numpy(), 0.3 * a[k], rtol=0, atol=1e-12)
    expected = sum(float(np.sum(v.astype(np.float32).astype(np.float64) ** 2)) for v in a.values())
    assert float(sq_norm(ta)) == pytest.approx(expected, rel=1e-6)
    # integer entries are counted as floats: ‖[1, 2, 3]‖² = 14
    assert float(sq_norm({"n": torch.tensor([1, 2, 3])})) == 14.0


# ---- compression: errors name compression.uplink.* / compression.downlink.* ----------------------

@pytest.mark.parametrize("side", ["uplink", "downlink"])
def test_compression_errors_name_the_side_the_field_and_the_allowed_values(side):
    from pfl.compression.compressors import COMPRESSORS
    from pfl.resolver import load
    from pfl.schema import ConfigError

    base = {"data.source": "digits", "method.name": "fedavg", "tracking.enabled": False}
    with pytest.raises(ConfigError) as err:
        load(None, {**base, f"compression.{side}": {"name": "nosuch"}})
    assert err.value.field == f"compression.{side}.name"
    assert str(err.value).startswith(f"compression.{side}.name:")
    for name in ["none", *COMPRESSORS.names()]:
        assert name in err.value.message
    with pytest.raises(ConfigError) as err:
        load(None, {**base, f"compression.{side}": {"name": "topk", "bogus": 1}})
    assert err.value.field == f"compression.{side}.bogus"
    assert "ratio" in err.value.message   # topk's one parameter, the allowed field
    with pytest.raises(ConfigError) as err:
        load(None, {**base, f"compression.{side}": 5})
    assert err.value.field == f"compression.{side}"


# ---- base: hparams_dict ---------------------------------------------------------------------------

def test_hparams_dict_is_the_dataclass_fields_and_empty_for_anything_else():
    from pfl.methods.base import hparams_dict
    from pfl.methods.fedavg import FedAvgFTHparams

    hp = FedAvgFTHparams(ft_epochs=3)
    expected = {f.name: getattr(hp, f.name) for f in dataclasses.fields(hp)}
    assert hparams_dict(hp) == expected and expected["ft_epochs"] == 3
    assert hparams_dict(None) == {}
    assert hparams_dict({"ft_epochs": 3}) == {}
    assert hparams_dict(object()) == {}


# ---- base: fit_model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def problem():
    return least_squares(sizes=(20, 30, 24, 27), clusters=[0, 1, 2, 3])


def test_fit_before_of_fedavg_ft_is_one_full_batch_epoch_at_the_rounds_decayed_lr(problem):
    """fedavg_ft's personal model is the received model fine-tuned for ft_epochs = 1 full-batch
    epoch (one gradient step) at the round's learning rate: lr·decay^r, so round 1 differs from 0."""
    p = problem
    lr, decay = 0.1, 0.5
    sim = simulator(p, "fedavg_ft", steps=2, lr=lr, per_round=2, rounds=2, evaluation__when=["before"],
                    federation__lr_decay=decay, federation__lr_decay_every=1)
    for r in range(2):
        w = vec(sim.method.global_model)
        expected = np.mean([math.sqrt(p.loss(i, p.gd(i, w, 1, lr * decay ** r))) for i in sim.sample(r)])
        wrong = np.mean([math.sqrt(p.loss(i, p.gd(i, w, 1, lr))) for i in sim.sample(r)])
        metrics = sim.run_round(evaluate=False)
        assert metrics["fit/before/test_rmse_mean"] == pytest.approx(expected, rel=1e-5)
        if r:
            assert not np.isclose(expected, wrong, rtol=1e-4)


def test_fit_models_of_local_are_its_own_model_before_and_after_training(problem):
    """Local sends nothing (no downlink, no reply): before = the client's model as it starts, θ⁰ in
    round 0; after = K full-batch steps from it."""
    p = problem
    K, lr = 3, 0.1
    sim = simulator(p, "local", steps=K, lr=lr, per_round=2, rounds=1, evaluation__when=["before", "after"])
    w0 = vec(sim.ctx.init_params())
    sampled = sim.sample(0)
    metrics = sim.run_round(evaluate=False)
    assert metrics["fit/before/test_rmse_mean"] == pytest.approx(
        np.mean([math.sqrt(p.loss(i, w0)) for i in sampled]), rel=1e-5)
    assert metrics["fit/after/test_rmse_mean"] == pytest.approx(
        np.mean([math.sqrt(p.loss(i, p.gd(i, w0, K, lr))) for i in sampled]), rel=1e-5)


def test_fit_before_of_l2gd_is_the_received_xbar_part(problem):
    """L2GD's downlink has one Model part, ``xbar`` (no ``model``): the default fit model is that
    part; in round 0 it is θ⁰."""
    p = problem
    sim = simulator(p, "l2gd", steps=2, lr=0.05, per_round=2, rounds=1, evaluation__when=["before"])
    w0 = vec(sim.ctx.init_params())
    sampled = sim.sample(0)
    metrics = sim.run_round(evaluate=False)
    assert metrics["fit/before/test_rmse_mean"] == pytest.approx(
        np.mean([math.sqrt(p.loss(i, w0)) for i in sampled]), rel=1e-5)


def test_fit_model_takes_the_model_part_else_the_first_model_part_with_the_round(problem):
    """The docstring's rule on hand-built messages: ``model`` wherever it stands, else the first Model
    part, else None (no message, or no Model part), handed to personal_params with the round."""
    from pfl.federation.messages import Message, Model, Scalars, Update
    from pfl.methods.base import Method

    class Recording(Method):
        name = ""

        def personal_params(self, rnd, client, received):
            if received is None:
                raise NotImplementedError
            return {"rnd": rnd, **received}

    rec = Recording.__new__(Recording)
    t = lambda v: {"x": torch.tensor([float(v)])}  # noqa: E731
    msgs = {
        "model after another Model part": (Message.of({"first": Model(t(1)), "model": Model(t(2))}), 2.0),
        "model first": (Message.of({"model": Model(t(2)), "other": Model(t(1))}), 2.0),
        "no model part": (Message.of({"u": Update(t(5)), "xbar": Model(t(3)), "y": Model(t(4))}), 3.0),
    }
    for what, (msg, value) in msgs.items():
        out = rec.fit_model(7, None, msg, "before")
        assert out["rnd"] == 7 and float(out["x"]) == value, what
    assert rec.fit_model(7, None, None, "before") is None
    assert rec.fit_model(7, None, Message.of({"u": Update(t(5)), "s": Scalars(t(1))}), "after") is None


# ---- centralized ----------------------------------------------------------------------------------

def test_pool_steps_and_round_samples_at_the_boundaries_counted_by_hand():
    from pfl.methods.centralized import pool_steps, round_samples

    # a budget of one sample: one minibatch of B = 4 from a pool of 10 (4 samples)
    assert pool_steps(1, 10, 4) == (1, 4)
    # one-sample minibatches: as many steps as samples
    assert pool_steps(5, 10, 1) == (5, 5)
    # a pool of one sample: every step is that sample (B ≥ pool or B ≤ 0: full-pool steps)
    assert pool_steps(3, 1, 8) == (3, 3)
    assert pool_steps(3, 1, 0) == (3, 3)
    # an empty pool (every member without training data): nothing to train on
    assert pool_steps(5, 0, 4) == (0, 0)
    assert pool_steps(5, 0, 0) == (0, 0)
    assert pool_steps(0, 10, 4) == (0, 0)
    # a client of one sample: local_epochs passes over it
    fed = config("centralized", 4, steps=None, federation__batch_size=8, federation__local_epochs=3).federation
    assert round_samples(1, fed) == 3
    # s local steps of one-sample batches on a client of 10: s samples (s < 10)
    fed = config("centralized", 4, steps=4, federation__batch_size=1).federation
    assert round_samples(10, fed) == 4
    # 12 steps of one sample on 10: a full pass and two more
    fed = config("centralized", 4, steps=12, federation__batch_size=1).federation
    assert round_samples(10, fed) == 12


def _pooled(p):
    return np.vstack([p.design(i) for i in range(p.m)]), np.concatenate(p.y)


def test_centralized_steps_use_momentum_and_weight_decay_and_report_their_mean_loss(problem):
    """Full-batch steps on the pooled objective with the federation's momentum μ and weight decay λ
    (v ← μv + g + λw, w ← w − ηv; v restarts every round) for ⌈budget/N⌉ steps; ``train/loss`` is the
    mean of the pooled loss before each step; the evaluation reports the cumulative counts."""
    p = problem
    Z, y = _pooled(p)
    N = len(y)
    K, lr, mu, wd = 3, 0.05, 0.9, 0.1
    sim = simulator(p, "centralized", steps=K, lr=lr, per_round=2, rounds=2, federation__momentum=mu,
                    federation__weight_decay=wd)
    w = vec(sim.method.global_model)
    plain = w.copy()
    budget = seen = 0
    for r in range(2):
        samples = K * sum(p.n(i) for i in sim.sample(r))
        steps = math.ceil(samples / N)
        budget += samples
        seen += steps * N
        v = np.zeros_like(w)
        losses = []
        for s in range(steps):
            losses.append(float(np.mean((Z @ w - y) ** 2)))
            g = (2.0 / N) * Z.T @ (Z @ w - y) + wd * w
            v = g if s == 0 else mu * v + g
            w = w - lr * v
        for _ in range(steps):
            plain = plain - lr * (2.0 / N) * Z.T @ (Z @ plain - y)
        metrics = sim.run_round(evaluate=False)
        assert close(vec(sim.method.global_model), w, 1e-4)
        assert metrics["train/loss"] == pytest.approx(np.mean(losses), rel=1e-5)
        assert metrics["centralized/samples"] == seen and metrics["centralized/budget"] == budget
    assert not close(w, plain, 1e-3)   # the wrong variant: plain SGD, the settings dropped
    ev = sim.evaluate(final=True)
    assert ev["centralized/samples"] == seen and ev["centralized/budget"] == budget


def test_centralized_round_without_a_budget_trains_nothing_and_reports_no_loss(problem):
    """local_epochs = 0: the federated round processes no sample, so the pooled model takes no step,
    stays θ⁰ and reports a budget of 0 and no training loss."""
    p = problem
    sim = simulator(p, "centralized", steps=None, per_round=2, rounds=2, federation__local_epochs=0)
    w0 = vec(sim.ctx.init_params())
    for _ in range(2):
        metrics = sim.run_round(evaluate=False)
        assert "train/loss" not in metrics
        assert metrics["centralized/samples"] == 0 and metrics["centralized/budget"] == 0
    assert close(vec(sim.method.global_model), w0, 0.0)


# ---- FedBN: BatchNorm names read from the modules ----------------------------------------------

class GatedBN(nn.BatchNorm1d):
    """A BatchNorm layer that holds another module (a custom model's conditional normalisation)."""

    def __init__(self, n: int):
        super().__init__(n)
        self.gate = nn.InstanceNorm1d(n, affine=True, track_running_stats=True)


class TinyBN(nn.Module):
    """A custom model (``model.name: test_truth_survivors_g:TinyBN``): linear, BatchNorm, linear."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc1 = nn.Linear(int(np.prod(input_shape)), 6)
        self.bn = nn.BatchNorm1d(6)
        self.fc = nn.Linear(6, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.fc1(x.flatten(1)))))


def _own_entries(module: nn.Module, prefix: str) -> list[str]:
    return [prefix + k for k, v in module._parameters.items() if v is not None] + \
           [prefix + k for k, v in module._buffers.items() if v is not None]


def test_batchnorm_names_are_each_bn_layers_own_parameters_and_statistics():
    from pfl.methods.fedbn import batchnorm_names

    bare = nn.BatchNorm1d(3)   # the model is itself one BatchNorm layer: names without a prefix
    assert batchnorm_names(bare) == _own_entries(bare, "")
    assert batchnorm_names(bare) == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    model = nn.Sequential(nn.Linear(3, 3), GatedBN(3), nn.Linear(3, 2))
    # the layer's own entries, not those of the module it holds (an InstanceNorm: not BatchNorm)
    assert batchnorm_names(model) == _own_entries(model[1], "1.")
    assert not any(n.startswith("1.gate.") for n in batchnorm_names(model))


def test_fedbn_shares_every_parameter_but_the_batchnorm_layers():
    from truth import classification_data

    from pfl.federation.simulator import Simulator

    data, _ = classification_data()
    cfg = config("fedbn", 4, model="test_truth_survivors_g:TinyBN", source="digits", federation__batch_size=4)
    sim = Simulator(cfg, data=data)
    net = sim.ctx.model
    expected = [n for n, _ in net.named_parameters() if not n.startswith("bn.")]
    assert sim.method.shared_names() == expected == ["fc1.weight", "fc1.bias", "fc.weight", "fc.bias"]
