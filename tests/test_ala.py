"""FedALA: the ALA formula, weight learning, layer range, start phase, plug-in composition, comm, learning."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import pfl.methods.ala as ala
from helpers import small_config
from pfl.callbacks.divergence import run_rounds
from pfl.federation.checkpoint import load_checkpoint, save_checkpoint
from pfl.federation.simulator import Simulator
from pfl.methods import get_method, list_methods
from pfl.models import build_model, layer_groups
from pfl.resolver import load
from pfl.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return build_model("mlp", {"hidden": [8, 8]}, (6,), 3)


def perturbed(params, seed, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in params.items()}


def toy_data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def run_ala(model, glob, local, upper, x, y, **kw):
    args = dict(weights=None, start_phase=False, eta=1.0, batch_size=10, threshold=0.1, window=3,
                max_epochs=50)
    args.update(kw)
    return ala.adaptive_local_aggregation(model, glob, local, upper, x, y, **args)


# ---- the formula ---------------------------------------------------------------------------------

def test_mix_formula_elementwise():
    glob = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([[4.0, 5.0]])}
    local = {"a": torch.tensor([0.0, 4.0, -3.0]), "b": torch.tensor([[1.0, 1.0]])}
    w = {"a": torch.tensor([0.0, 0.5, 0.25])}
    out = ala.ala_mix(glob, local, w)
    for i, (g, l, wi) in enumerate(zip([1.0, 2.0, 3.0], [0.0, 4.0, -3.0], [0.0, 0.5, 0.25])):
        assert out["a"][i].item() == pytest.approx(l + (g - l) * wi)
    assert torch.equal(out["b"], glob["b"])  # not in W: overwritten by the global model
    assert out["a"].tolist() == [0.0, 3.0, -1.5]


def test_w_one_gives_global_and_w_zero_gives_local():
    model = tiny_model()
    glob = dict(model.named_parameters())
    glob = {k: v.detach() for k, v in glob.items()}
    local = perturbed(glob, 1)
    upper = ala.upper_names(model, list(glob), 0)
    ones = {k: torch.ones_like(glob[k]) for k in upper}
    zeros = {k: torch.zeros_like(glob[k]) for k in upper}
    assert all(torch.allclose(ala.ala_mix(glob, local, ones)[k], glob[k]) for k in glob)
    # p = all and W ≡ 0: the local model is unchanged
    assert all(torch.equal(ala.ala_mix(glob, local, zeros)[k], local[k]) for k in glob)
    # p = 1 and W ≡ 0: upper layers stay local, lower layers become global
    head = ala.upper_names(model, list(glob), 1)
    mixed = ala.ala_mix(glob, local, {k: torch.zeros_like(glob[k]) for k in head})
    for k in glob:
        assert torch.equal(mixed[k], local[k] if k in head else glob[k])


def test_p_selects_layers_units_and_tensors():
    model = tiny_model()
    names = [n for n, _ in model.named_parameters()]
    units = layer_groups(model).units
    assert ala.upper_names(model, names, 1) == units[-1] == ["fc.weight", "fc.bias"]
    assert ala.upper_names(model, names, 2) == units[-2] + units[-1]
    assert ala.upper_names(model, names, 0) == names
    assert ala.upper_names(model, names, 99) == names
    assert ala.upper_names(model, names, 1, "tensors") == ["fc.bias"]
    assert ala.upper_names(model, names, 2, "tensors") == ["fc.weight", "fc.bias"]  # code's layer_idx=2
    assert ala.upper_names(model, names, 0, "tensors") == names
    # a received part (FedRep's body) counts its own layers
    body = layer_groups(model).body
    assert ala.upper_names(model, body, 1) == ["fc2.weight", "fc2.bias"]
    # the 4-layer CNN: p=1 is the last Linear's weight and bias (spec table)
    cnn = build_model("cnn_fedavg", {}, (1, 28, 28), 10)
    cnn_names = [n for n, _ in cnn.named_parameters()]
    assert len(cnn_names) == 8
    assert ala.upper_names(cnn, cnn_names, 1) == ala.upper_names(cnn, cnn_names, 2, "tensors") == cnn_names[-2:]
    assert ala.upper_names(cnn, cnn_names, 3) == cnn_names[-6:]


def test_lower_layers_equal_global_after_ala():
    model = tiny_model()
    glob = {k: v.detach() for k, v in model.named_parameters()}
    local = perturbed(glob, 2)
    x, y = toy_data()
    upper = ala.upper_names(model, list(glob), 1)
    res = run_ala(model, glob, local, upper, x, y, start_phase=True)
    assert not res.skipped and set(res.weights) == set(upper)
    for k in glob:
        if k in upper:
            assert not torch.equal(res.params[k], glob[k])
            expected = local[k] + (glob[k] - local[k]) * res.weights[k]
            assert torch.allclose(res.params[k], expected)
        else:
            assert torch.equal(res.params[k], glob[k])


def test_weight_gradient_equals_autograd_through_mix():
    model = tiny_model()
    glob = {k: v.detach() for k, v in model.named_parameters()}
    local = perturbed(glob, 3)
    x, y = toy_data(12)
    upper = ala.upper_names(model, list(glob), 2)
    g = torch.Generator().manual_seed(4)
    w = {k: torch.rand(glob[k].shape, generator=g) for k in upper}
    grads, loss = ala.ala_weight_grad(model, glob, local, w, x, y)
    # direct: gradient of the loss at θ̂ as a leaf, times (θ − θ_i)
    theta_hat = {k: (ala.ala_mix(glob, local, w)[k]).clone().requires_grad_(k in upper) for k in glob}
    direct_loss = F.cross_entropy(functional_call(model, theta_hat, (x,)), y)
    g_hat = torch.autograd.grad(direct_loss, [theta_hat[k] for k in upper])
    for k, gk in zip(upper, g_hat):
        assert torch.allclose(grads[k], gk * (glob[k] - local[k]), atol=1e-7)
        assert grads[k].abs().sum() > 0
    assert loss == pytest.approx(float(direct_loss.detach()))
    # one coordinate by finite differences (float64)
    model64 = tiny_model().double()
    g64 = {k: v.double() for k, v in glob.items()}
    l64 = {k: v.double() for k, v in local.items()}
    w64 = {k: v.double() for k, v in w.items()}
    grads64, _ = ala.ala_weight_grad(model64, g64, l64, w64, x.double(), y)
    k = "fc.weight"
    eps = 1e-6
    plus, minus = dict(w64), dict(w64)
    plus[k] = w64[k].clone(); plus[k][1, 2] += eps
    minus[k] = w64[k].clone(); minus[k][1, 2] -= eps
    f = lambda ww: float(F.cross_entropy(functional_call(model64, ala.ala_mix(g64, l64, ww), (x.double(),)), y))  # noqa: E731
    assert grads64[k][1, 2].item() == pytest.approx((f(plus) - f(minus)) / (2 * eps), rel=1e-5, abs=1e-9)


def test_weights_stay_in_unit_interval_after_every_step(monkeypatch):
    seen = []
    step = ala.ala_step

    def recording_step(weights, grads, eta):
        out = step(weights, grads, eta)
        seen.append(out)
        return out

    monkeypatch.setattr(ala, "ala_step", recording_step)
    model = tiny_model()
    glob = {k: v.detach() for k, v in model.named_parameters()}
    local = perturbed(glob, 5, scale=3.0)
    x, y = toy_data()
    res = run_ala(model, glob, local, ala.upper_names(model, list(glob), 0), x, y, eta=50.0, start_phase=True)
    assert len(seen) == res.passes * 4  # 40 samples, batches of 10
    lo_hit = hi_hit = False
    for w in seen:
        for v in w.values():
            assert float(v.min()) >= 0.0 and float(v.max()) <= 1.0
            lo_hit |= bool((v == 0).any())
            hi_hit |= bool((v == 1).any())
    assert lo_hit and hi_hit  # the large step really hit both bounds: clipping was exercised


def test_start_phase_then_one_pass_and_weights_persist():
    model = tiny_model()
    glob = {k: v.detach() for k, v in model.named_parameters()}
    local = perturbed(glob, 6)
    x, y = toy_data()
    upper = ala.upper_names(model, list(glob), 1)
    first = run_ala(model, glob, local, upper, x, y, start_phase=True, window=5, threshold=0.05)
    assert first.started and not first.start_phase
    assert first.passes > 5  # more than K passes
    stds = [np.std(first.losses[i - 5:i]) for i in range(6, first.passes)]
    assert all(s >= 0.05 for s in stds) and (first.passes == 50 or np.std(first.losses[-5:]) < 0.05)
    glob2 = perturbed(glob, 7, 0.1)
    second = run_ala(model, glob2, first.params, upper, x, y, weights=first.weights, start_phase=False)
    assert second.passes == 1 and not second.started
    # the one pass continued from the stored W (not from ones): redo it by hand
    w = {k: v.clone() for k, v in first.weights.items()}
    for start in range(0, 40, 10):
        grads, _ = ala.ala_weight_grad(model, glob2, first.params, w, x[start:start + 10], y[start:start + 10])
        w = ala.ala_step(w, grads, 1.0)
    assert all(torch.allclose(second.weights[k], w[k]) for k in upper)
    # the cap ends a start phase that would not converge
    capped = run_ala(model, glob, local, upper, x, y, start_phase=True, threshold=1e-12, max_epochs=7)
    assert capped.passes == 7


def test_identical_models_skip_ala():
    model = tiny_model()
    glob = {k: v.detach() for k, v in model.named_parameters()}
    x, y = toy_data()
    upper = ala.upper_names(model, list(glob), 1)
    for local in (None, {k: v.clone() for k, v in glob.items()}):
        res = run_ala(model, glob, local, upper, x, y, start_phase=True)
        assert res.skipped and res.passes == 0 and res.weights is None and res.start_phase
        assert all(torch.equal(res.params[k], glob[k]) for k in glob)


def test_sample_is_s_percent():
    g = torch.Generator().manual_seed(0)
    idx = ala.ala_sample_indices(50, 80, "window", g)
    assert len(idx) == 40 and torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + 40))
    sub = ala.ala_sample_indices(50, 10, "subset", g)
    assert len(sub) == 5 and len(set(sub.tolist())) == 5
    assert len(ala.ala_sample_indices(3, 5, "window", g)) == 1


# ---- the method in the simulator -----------------------------------------------------------------

def ala_config(name="fedala", **kw):
    base = dict(method__name=name, data__partition__alpha=0.1, data__num_clients=8,
                federation__clients_per_round=0, federation__rounds=4, federation__eval_every=1)
    base.update(kw)
    return small_config(**base)


def test_simulator_start_phase_once_then_one_pass():
    cfg = ala_config(method__window=4, federation__rounds=3)
    sim = Simulator(cfg)
    m0 = sim.run_round()  # first reception: every client holds the initial model, ALA is skipped
    assert m0["ala/passes"] == 0 and m0["ala/start_clients"] == 0
    assert all(s["ala"]["weights"] is None and s["ala"]["start_phase"] for s in sim.client_states)
    m1 = sim.run_round()
    n = sim.num_clients
    assert m1["ala/start_clients"] == n and m1["ala/start_passes"] == m1["ala/passes"] >= n * 5
    weights1 = [{k: v.clone() for k, v in s["ala"]["weights"].items()} for s in sim.client_states]
    m2 = sim.run_round()
    assert m2["ala/passes"] == n and m2["ala/start_clients"] == n
    assert m2["ala/start_passes"] == m1["ala/start_passes"] and m2["ala/time_s"] > 0
    for w1, s in zip(weights1, sim.client_states):
        w2 = s["ala"]["weights"]
        assert set(w2) == {"fc.weight", "fc.bias"}
        diff = max(float((w2[k] - w1[k]).abs().max()) for k in w1)
        assert 0 < diff < 1  # one pass moved the stored W, which was not reset to ones


def test_evaluation_time_ala_does_not_change_training():
    a = Simulator(ala_config(federation__eval_every=1))
    run_rounds(a)
    b = Simulator(ala_config(federation__eval_every=100))
    run_rounds(b)
    ga, gb = a.method.global_params(), b.method.global_params()
    assert all(torch.equal(ga[k], gb[k]) for k in ga)
    assert a.history[-1]["test/acc_mean"] == b.history[-1]["test/acc_mean"]
    # with evaluation every round the ALA of rounds 1.. was computed at evaluation and reused
    assert a.method.ala_stats["time_at_eval_total_s"] > 0
    assert b.method.ala_stats["time_at_eval_total_s"] == 0


def test_resume_continues_identically(tmp_path):
    cfg = ala_config()
    full = Simulator(cfg)
    run_rounds(full)
    part = Simulator(cfg)
    run_rounds(part, until=2)
    ckpt = save_checkpoint(part, tmp_path / "ckpt.pt")
    resumed = Simulator(cfg)
    load_checkpoint(resumed, ckpt)
    run_rounds(resumed)
    gf, gr = full.method.global_params(), resumed.method.global_params()
    assert all(torch.equal(gf[k], gr[k]) for k in gf)
    assert full.history[-1]["test/acc_mean"] == resumed.history[-1]["test/acc_mean"]


def test_fedala_communication_equals_fedavg():
    runs = {}
    for name in ("fedavg", "fedala"):
        sim = Simulator(ala_config(name, federation__clients_per_round=5))
        run_rounds(sim)
        runs[name] = sim
    comm = {n: {k: v for k, v in s.history[-1].items() if k.startswith("comm/")} for n, s in runs.items()}
    assert comm["fedavg"] and comm["fedavg"] == comm["fedala"]
    assert runs["fedavg"].ledger.state_dict() == runs["fedala"].ledger.state_dict()
    assert comm["fedala"]["comm/up_bytes"] > 0


# ---- composition and configuration ---------------------------------------------------------------

def test_fedprox_ala_resolves_with_merged_hyperparameters():
    cfg = load(None, {"method.name": "fedprox+ala", "method.mu": 0.01, "method.p": 1, "method.s": 80,
                      "data.source": "digits", "tracking.enabled": False})
    hp = cfg.method.hparams
    assert (hp.mu, hp.p, hp.s, hp.eta, hp.server_lr, hp.threshold, hp.window) == (0.01, 1, 80.0, 1.0, 1.0, 0.1, 10)
    cls = get_method("fedprox+ala")
    assert issubclass(cls, get_method("fedprox")) and cls.name == "fedprox+ala"
    sim = Simulator(cfg)
    assert {"ala_stats", "global_model"} <= set(sim.method.server_state())
    assert get_method("fedala").Hparams().s == 80.0 and "fedala" in {m.name for m in list_methods()}


@pytest.mark.parametrize("override, field, words", [
    ({"method.name": "fedprox+ala", "method.sx": 5}, "method.sx", ["'s'", "mu"]),
    ({"method.name": "fedprox+ala", "method.s": 0}, "method.s", ["> 0.0"]),
    ({"method.name": "fedala", "method.s": 120}, "method.s", ["<= 100.0"]),
    ({"method.name": "fedala", "method.p": -1}, "method.p", [">= 0"]),
    ({"method.name": "fedala", "method.eta": 0}, "method.eta", ["> 0.0"]),
    ({"method.name": "fedavg+ala", "method.p_unit": "layers"}, "method.p_unit", ["units", "tensors"]),
    ({"method.name": "fedavg+ala", "method.ala_sample": "random"}, "method.ala_sample", ["window"]),
    ({"method.name": "fedavg+alb"}, "method.name", ["ala"]),
])
def test_bad_hyperparameters_name_the_field(override, field, words):
    with pytest.raises(ConfigError) as info:
        load(None, {**override, "data.source": "digits"})
    assert info.value.field == field
    for word in words:
        assert word in str(info.value)


def test_fedprox_ala_runs_and_keeps_the_received_anchor():
    sims = {}
    for name, mu in (("fedala", None), ("fedprox+ala", 1.0)):
        kw = {} if mu is None else {"method__mu": mu}
        sims[name] = Simulator(ala_config(name, federation__rounds=3, **kw))
        hist = run_rounds(sims[name])
        assert hist[-1]["ala/start_clients"] == sims[name].num_clients
        assert hist[-1]["test/acc_mean"] > 0.3
    ga, gp = sims["fedala"].method.global_params(), sims["fedprox+ala"].method.global_params()
    assert max(float((ga[k] - gp[k]).abs().max()) for k in ga) > 1e-3  # the proximal term acted
    # ALA changes only the start point: FedProx's proximal gradient (anchored at the received θ) is kept
    assert get_method("fedprox+ala").train_kwargs is get_method("fedprox").train_kwargs


def _registered(name):
    try:
        get_method(name)
        return True
    except ConfigError:
        return False


@pytest.mark.parametrize("base", ["ditto", "fedrep"])
def test_ala_composes_with_personal_methods(base):
    if not _registered(base):
        pytest.skip(f"{base} is not registered")
    plain = Simulator(ala_config(base, federation__rounds=3))
    run_rounds(plain)
    composed = Simulator(ala_config(f"{base}+ala", federation__rounds=3))
    hist = run_rounds(composed)
    assert hist[-1]["ala/start_clients"] == composed.num_clients
    comm = lambda s: {k: v for k, v in s.history[-1].items() if k.startswith("comm/")}  # noqa: E731
    assert comm(plain) == comm(composed)
    assert hist[-1]["test/acc_mean"] > 0.3


def test_search_space_file_loads_and_checks():
    from pfl.tune.space import base_config, check_space, load_space

    space = load_space(ROOT / "search_spaces" / "fedala.yaml")
    assert set(space.distributions) == {"method.s", "method.p", "method.eta"}
    for smoke in (False, True):
        raw = base_config(space, smoke=smoke)
        check_space(space, raw)
    cfg = load(None, base_config(space))
    assert (cfg.method.name, cfg.method.hparams.p, cfg.method.hparams.s, cfg.method.hparams.eta) == ("fedala", 1, 80.0, 1.0)
    assert cfg.data.num_clients == 20 and cfg.federation.clients_per_round == 0


# ---- learning ------------------------------------------------------------------------------------

def test_fedala_beats_fedavg_on_personalized_accuracy():
    acc = {}
    for name in ("fedavg", "fedala"):
        cfg = ala_config(name, data__num_clients=10, federation__rounds=5, federation__eval_every=5)
        acc[name] = run_rounds(Simulator(cfg))[-1]["test/acc_mean"]
    # digits, Dir(0.1), all 10 clients: FedAvg's global model ~0.1-0.2, FedALA ~0.6 after 5 rounds
    assert acc["fedala"] > acc["fedavg"] + 0.2, acc
    assert acc["fedala"] > 0.5, acc
