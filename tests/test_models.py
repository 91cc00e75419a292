"""Model zoo: shapes, published parameter counts, layer groups, functional helpers, config errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from pfl.config import ExperimentConfig
from pfl.models import (LayerGroups, build_model, flatten_params, init_params, layer_groups, list_models,
                        num_params, params_of, resolve_model_config, unflatten_params)
from pfl.schema import ConfigError

# (name, params, input_shape, num_classes): each model on its typical input; deep models kept narrow
# where only structure is checked.
TYPICAL = [
    ("softmax_regression", {}, (60,), 10),
    ("linear_regression", {}, (13,), 1),
    ("mlp", {}, (64,), 10),
    ("cnn_fpfc", {}, (1, 28, 28), 10),
    ("cnn_fedavg", {}, (1, 28, 28), 10),
    ("cnn_fedavg", {}, (3, 32, 32), 10),
    ("cnn_fedavg", {"channels": [4, 8], "hidden": 16}, (64,), 10),
    ("cnn_fpfc", {}, (64,), 10),
    ("resnet18_gn", {"width": 0.125}, (3, 32, 32), 100),
    ("resnet18_gn", {"width": 0.125}, (64,), 10),
    ("vgg11", {"width": 0.125}, (3, 32, 32), 10),
    ("vgg13", {"width": 0.125}, (1, 28, 28), 10),
    ("vgg11", {"width": 0.125}, (64,), 10),
]
IDS = [f"{n}-{'x'.join(map(str, s))}-{i}" for i, (n, _, s, _) in enumerate(TYPICAL)]


def _model(name, params, shape, classes, seed=0):
    torch.manual_seed(seed)
    return build_model(name, params, shape, classes)


def test_registry_lists_every_model():
    names = [spec.name for spec in list_models()]
    assert names == ["softmax_regression", "linear_regression", "mlp", "cnn_fpfc", "cnn_fedavg", "cnn_bn",
                     "resnet18_bn", "resnet18_gn", "vgg11", "vgg13"]
    for spec in list_models():
        assert spec.description and spec.inputs
        spec.params()  # every field has a default


@pytest.mark.parametrize("name,params,shape,classes", TYPICAL, ids=IDS)
def test_forward_shape_and_no_buffers(name, params, shape, classes):
    model = _model(name, params, shape, classes)
    out = model(torch.rand(2, *shape))
    assert out.shape == ((2,) if name == "linear_regression" else (2, classes))
    assert list(model.buffers()) == []


@pytest.mark.parametrize("name,params,shape", [("cnn_bn", {"channels": [4, 8], "hidden": 16}, (64,)),
                                               ("resnet18_bn", {"width": 0.125}, (3, 32, 32))])
def test_batchnorm_models_carry_their_statistics_after_their_parameters(name, params, shape):
    from pfl.models.functional import state_buffers

    model = _model(name, params, shape, 10)
    assert model(torch.rand(2, *shape)).shape == (2, 10)
    stats = state_buffers(model)
    assert stats and all(s.rpartition(".")[2] in ("running_mean", "running_var", "num_batches_tracked") for s in stats)
    fresh = init_params(model, torch.Generator().manual_seed(0))
    names = [n for n, _ in model.named_parameters()]
    assert list(fresh) == names + stats                     # parameters first, then the statistics
    assert fresh[stats[2]].dtype == torch.int64 and int(fresh[stats[2]]) == 0
    assert torch.equal(fresh[stats[1]], torch.ones_like(fresh[stats[1]]))  # a fresh variance is 1
    assert sorted(layer_groups(model).names) == sorted(names)  # units cover the parameters only
    if name == "resnet18_bn":  # the GroupNorm network's parameters, norm for norm
        assert num_params(model) == num_params(_model("resnet18_gn", params, shape, 10))


def test_flat_images_are_reshaped():
    model = _model("cnn_fedavg", {"channels": [4, 8], "hidden": 16}, (1, 8, 8), 10)
    x = torch.rand(3, 1, 8, 8)
    flat = _model("cnn_fedavg", {"channels": [4, 8], "hidden": 16}, (64,), 10)
    flat.load_state_dict(model.state_dict())
    assert torch.allclose(model(x), flat(x.reshape(3, 64)))


@pytest.mark.parametrize("name,params,shape,classes,expected", [
    ("cnn_fedavg", {}, (1, 28, 28), 10, 582_026),
    ("cnn_fedavg", {}, (3, 32, 32), 10, 878_538),
    ("cnn_fedavg", {}, (3, 32, 32), 100, 924_708),
    ("cnn_fpfc", {}, (1, 28, 28), 10, 2_572 + 4_010),
    ("softmax_regression", {}, (60,), 10, 610),
    ("resnet18_gn", {}, (3, 32, 32), 100, 11_220_032),
    ("resnet18_gn", {}, (3, 32, 32), 10, 11_173_952),
    ("vgg11", {}, (3, 32, 32), 10, 9_231_114),
    ("vgg13", {}, (3, 32, 32), 10, 9_416_010),
])
def test_published_parameter_counts(name, params, shape, classes, expected):
    assert num_params(build_model(name, params, shape, classes)) == expected


def test_fpfc_body_and_head_split():
    model = build_model("cnn_fpfc", {}, (1, 28, 28), 10)
    groups = layer_groups(model)
    named = dict(model.named_parameters())
    assert [u[0].split(".")[0] for u in groups.units] == ["conv1", "conv2", "fc1"]
    assert sum(named[n].numel() for n in groups.body) == 2_572
    assert sum(named[n].numel() for n in groups.head) == 4_010


def test_resnet_structure_matches_fedslr():
    model = build_model("resnet18_gn", {}, (3, 32, 32), 100)
    groups = layer_groups(model)
    named = dict(model.named_parameters())
    assert [u[0].split(".")[0] for u in groups.units] == ["conv1", "layer1", "layer2", "layer3", "layer4", "fc"]
    assert groups.units[0] == ["conv1.weight", "gn1.weight", "gn1.bias"]
    assert groups.head == ["fc.weight"]  # the head has no bias
    assert len(groups.matrices) == 21 and sum(named[n].numel() for n in groups.matrices) == 11_210_432
    vectors = [n for n in named if n not in groups.matrices]
    assert len(vectors) == 40 and sum(named[n].numel() for n in vectors) == 9_600
    assert len(groups.norms) == 40
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert all(m.num_groups == 2 for m in model.modules() if isinstance(m, nn.GroupNorm))
    # FedALA's tensor counts: p = 1 → 1 tensor here (no fc bias), p = 2 adds layer4's 15 tensors.
    assert len(groups.top(2)) == 16


@pytest.mark.parametrize("name,params,shape,classes", TYPICAL, ids=IDS)
def test_layer_groups_cover_every_parameter_once(name, params, shape, classes):
    model = _model(name, params, shape, classes)
    groups = layer_groups(model)
    named = dict(model.named_parameters())
    flat = [n for unit in groups.units for n in unit]
    assert sorted(flat) == sorted(named) and len(flat) == len(set(flat))
    assert flat == list(named)  # units bottom → top follow the registration order
    # The head is the final linear layer (the module producing the output).
    last_linear = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    assert [named[n] for n in groups.head] == list(last_linear.parameters())
    assert groups.head == groups.units[-1]
    assert groups.body == [n for unit in groups.units[:-1] for n in unit]
    assert groups.matrices == [n for n, p in named.items() if p.ndim >= 2]
    assert groups.top(1) == groups.head
    assert groups.top(0) == flat == groups.top(len(groups.units)) == groups.top(-1) == groups.top(99)


def test_fedavg_cnn_units_match_fedala_tensor_counts():
    groups = layer_groups(build_model("cnn_fedavg", {}, (1, 28, 28), 10))
    assert isinstance(groups, LayerGroups)
    assert [len(groups.top(p)) for p in (1, 2, 3, 4)] == [2, 4, 6, 8]
    assert groups.top(2) == ["fc1.weight", "fc1.bias", "fc.weight", "fc.bias"]


def test_layer_groups_fallback_and_validation():
    seq = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    groups = layer_groups(seq)
    assert groups.units == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]

    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

        def layer_units(self):
            return [["a.weight"], ["b.weight", "b.bias"]]

    with pytest.raises(ValueError, match="a.bias"):
        layer_groups(Bad())


@pytest.mark.parametrize("name,params,shape,classes", TYPICAL, ids=IDS)
def test_functional_call_with_params_of_matches_forward(name, params, shape, classes):
    model = _model(name, params, shape, classes)
    x = torch.rand(2, *shape)
    params_dict = params_of(model)
    assert list(params_dict) == [n for n, _ in model.named_parameters()]
    assert all(not t.requires_grad for t in params_dict.values())
    assert torch.allclose(functional_call(model, params_dict, (x,)), model(x))


def test_functional_gradients_through_shared_module():
    model = _model("cnn_fedavg", {"channels": [4, 8], "hidden": 16}, (1, 28, 28), 10)
    params = params_of(model)
    x, y = torch.rand(4, 1, 28, 28), torch.randint(0, 10, (4,))

    def loss(p):
        return nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

    grads = torch.func.grad(loss)(params)
    assert set(grads) == set(params) and all(g.shape == params[n].shape for n, g in grads.items())
    # vmap over two clients' stacked parameters, one module object
    stacked = {n: torch.stack([t, t + 0.01]) for n, t in params.items()}
    out = torch.func.vmap(lambda p: functional_call(model, p, (x,)))(stacked)
    assert out.shape == (2, 4, 10)
    assert torch.allclose(out[0], model(x), atol=1e-6)


def test_flatten_unflatten_round_trip():
    model = _model("mlp", {"hidden": [5, 4]}, (6,), 3)
    params = params_of(model)
    vec = flatten_params(params)
    assert vec.shape == (num_params(model),)
    back = unflatten_params(vec, params)
    assert list(back) == list(params)
    assert all(torch.equal(back[n], params[n]) for n in params)
    head = layer_groups(model).head
    head_vec = flatten_params(params, head)
    assert head_vec.numel() == 4 * 3 + 3
    assert torch.equal(unflatten_params(head_vec, params, head)["fc.weight"], params["fc.weight"])
    with pytest.raises(ValueError):
        unflatten_params(vec[:-1], params)


def test_num_params_accepts_modules_dicts_and_iterables():
    model = _model("softmax_regression", {}, (60,), 10)
    assert num_params(model) == num_params(params_of(model)) == num_params(model.parameters()) == 610


def test_init_params_is_reproducible_and_in_place():
    model = _model("cnn_fpfc", {}, (1, 28, 28), 10)
    first = init_params(model, torch.Generator().manual_seed(7))
    assert all(torch.equal(first[n], p) for n, p in model.named_parameters())
    again = init_params(model, torch.Generator().manual_seed(7))
    other = init_params(model, torch.Generator().manual_seed(8))
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not torch.equal(first["conv1.weight"], other["conv1.weight"])
    bound = 1 / (1 * 5 * 5) ** 0.5  # PyTorch default: U(±1/√fan_in)
    assert first["conv1.weight"].abs().max() <= bound and first["conv1.bias"].abs().max() <= bound
    gn = init_params(_model("vgg11", {"width": 0.125}, (3, 32, 32), 10), torch.Generator().manual_seed(0))
    assert torch.equal(gn["norm1.weight"], torch.ones(8)) and torch.equal(gn["norm1.bias"], torch.zeros(8))


def test_small_inputs_padding_and_shape_errors():
    assert layer_groups(build_model("cnn_fpfc", {}, (64,), 10))  # auto padding fits 8×8 digits
    with pytest.raises(ConfigError) as err:
        build_model("cnn_fpfc", {"padding": "paper"}, (64,), 10)
    assert err.value.field == "model.params.padding"
    with pytest.raises(ConfigError) as err:
        build_model("cnn_fedavg", {}, (60,), 10)  # 60 is not a square: not an image
    assert err.value.field == "model.name" and "cnn_fedavg" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build_model("cnn_fedavg", {}, (1, 3, 3), 10)
    assert err.value.field == "model.name"
    # 'auto' keeps the published layer wherever it fits
    assert build_model("cnn_fedavg", {"padding": "paper"}, (1, 28, 28), 10).fc1.in_features == 1024


def _cfg(name="auto", params=None, source="digits"):
    cfg = ExperimentConfig()
    cfg.data.source = source
    cfg.model.name = name
    cfg.model.params = dict(params or {})
    return cfg


def test_resolve_model_config_fills_defaults_in_place():
    cfg = _cfg("mlp", {"hidden": [32]})
    resolve_model_config(cfg)
    assert cfg.model.params == {"hidden": [32]}
    cfg = _cfg("cnn_fedavg")
    resolve_model_config(cfg)
    assert cfg.model.params == {"channels": [32, 64], "hidden": 512, "padding": "auto"}


@pytest.mark.parametrize("source,expected", [("digits", "mlp"), ("fpfc_synthetic", "softmax_regression"),
                                             ("fpfc_linear", "linear_regression")])
def test_resolve_auto_picks_the_source_default(source, expected):
    cfg = _cfg("auto", source=source)
    resolve_model_config(cfg)
    assert cfg.model.name == expected


@pytest.mark.parametrize("name,params,field", [
    ("resnet19", {}, "model.name"),
    ("mlp", {"hiden": [3]}, "model.params.hiden"),
    ("mlp", {"hidden": [3, 0]}, "model.params.hidden[1]"),
    ("vgg11", {"width": 0}, "model.params.width"),
    ("cnn_fedavg", {"padding": "valid"}, "model.params.padding"),
    ("cnn_fedavg", {"channels": [8]}, "model.params.channels"),
])
def test_resolve_model_config_errors_name_the_field(name, params, field):
    with pytest.raises(ConfigError) as err:
        resolve_model_config(_cfg(name, params))
    assert err.value.field == field
    if field == "model.name":
        assert "allowed" in str(err.value) and "resnet18_gn" in str(err.value)
