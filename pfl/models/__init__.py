"""The model zoo: a registry of named models, their parameter dataclasses, and their layer groups.

Your own model (``model.name: path/to/file.py:Class``) is built and checked by :mod:`.custom`.

Conventions every model follows (the engine relies on them):

- a plain ``nn.Module`` whose state is its ``named_parameters()`` and, for BatchNorm models
  (``cnn_bn``, ``resnet18_bn``), its layers' running statistics, which are entries of the same dict
  (:mod:`.functional`), so one module object can be shared by all clients through
  ``torch.func.functional_call``;
- ``forward`` takes a batch (leading batch dimension) and returns logits, or an (N,) prediction
  for regression;
- ``layer_units()`` lists the units (a layer or residual block) bottom → top by parameter name;
  the last unit is the head (the final linear classifier). :func:`layer_groups` derives body,
  head, matrices and the top-p selection from it.

``input_shape`` is one sample's shape: (d,) for vectors, (C, H, W) for images; image models also
accept a flat (d,) with d a perfect square (read as 1×√d×√d).
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from ..registry import Registry
from ..schema import ConfigError, describe, from_dict, to_dict
from .functional import flatten_params, init_params, num_params, params_of, unflatten_params
from .groups import LayerGroups, layer_groups
from .spec import ModelSpec
from .resnet import ResNet18BNParams, ResNet18GNParams, build_resnet18_bn, build_resnet18_gn
from .vgg import VGGParams, build_vgg11, build_vgg13
from .zoo import (CNNFedAvgParams, CNNFPFCParams, LinearRegressionParams, MLPParams,
                  SoftmaxRegressionParams, build_cnn_bn, build_cnn_fedavg, build_cnn_fpfc, build_linear_regression,
                  build_mlp, build_softmax_regression)


_VECTOR = "any shape (flattened to d features)"
_IMAGE = "images (C, H, W), or flat (d,) with d a perfect square"

MODELS: Registry[ModelSpec] = Registry("model", "model.name")


def register(spec: ModelSpec) -> ModelSpec:
    return MODELS.register(spec.name, spec)


for _spec in (
    ModelSpec("softmax_regression", "multinomial logistic regression: one Linear d→C with bias "
              "(FPFC synthetic, 610 params at d=60, C=10)", SoftmaxRegressionParams,
              build_softmax_regression, _VECTOR),
    ModelSpec("linear_regression", "least-squares linear model: Linear d→1 with bias, (N,) output "
              "(FPFC regression)", LinearRegressionParams, build_linear_regression, _VECTOR),
    ModelSpec("mlp", "fully connected ReLU network, hidden widths configurable", MLPParams,
              build_mlp, _VECTOR),
    ModelSpec("cnn_fpfc", "FPFC's MNIST ConvNet: conv 6, conv 16 (5×5), linear head on 400 features "
              "(2,572 body + 4,010 head on 1×28×28)", CNNFPFCParams, build_cnn_fpfc, _IMAGE),
    ModelSpec("cnn_fedavg", "FedALA's 4-layer CNN (FedAvgCNN): conv 32, conv 64 (5×5), fc 512, head "
              "(582,026 params on 1×28×28, 878,538 on 3×32×32)", CNNFedAvgParams, build_cnn_fedavg, _IMAGE),
    ModelSpec("cnn_bn", "cnn_fedavg with BatchNorm after conv1, conv2 and fc1 (its running statistics "
              "are state: averaged with the parameters, or kept local by fedbn)", CNNFedAvgParams,
              build_cnn_bn, _IMAGE),
    ModelSpec("resnet18_bn", "the CIFAR ResNet-18 of resnet18_gn with BatchNorm (torchvision's bn1/bn2 "
              "names), bias-free head (11,173,952 params at C=10, plus 9,620 running-statistic values)",
              ResNet18BNParams, build_resnet18_bn, _IMAGE),
    ModelSpec("resnet18_gn", "FedSLR's CIFAR ResNet-18 with GroupNorm(2), bias-free head "
              "(11,173,952 params at C=10, 11,220,032 at C=100)", ResNet18GNParams, build_resnet18_gn, _IMAGE),
    ModelSpec("vgg11", "CIFAR VGG-11 with GroupNorm, one linear head (9,231,114 params at C=10)",
              VGGParams, build_vgg11, _IMAGE),
    ModelSpec("vgg13", "CIFAR VGG-13 with GroupNorm, one linear head (9,416,010 params at C=10)",
              VGGParams, build_vgg13, _IMAGE),
):
    register(_spec)

_DATA_PACKAGE = __name__.rsplit(".", 1)[0] + ".data"
# Used by resolve_model_config only while pfl.data (which owns each source's default) is absent.
_FALLBACK_DEFAULTS = {
    "digits": "mlp",
    "fmnist": "cnn_fedavg",
    "mnist": "cnn_fpfc",
    "cifar10": "cnn_fedavg",
    "cifar100": "cnn_fedavg",
    "fpfc_synthetic": "softmax_regression",
    "fpfc_linear": "linear_regression",
}


def list_models() -> list[ModelSpec]:
    """Every registered model, in registration order."""
    return MODELS.values()


def model_spec(name: str) -> ModelSpec:
    """The spec of model ``name``, or a ConfigError on ``model.name`` listing the allowed names."""
    from .custom import is_custom, model_spec_for

    if is_custom(name):  # your own model: 'file.py:Class' or 'module:factory' (pfl/models/custom.py)
        return model_spec_for(name)
    return MODELS.get(name)


def _params_instance(spec: ModelSpec, params: Any) -> Any:
    if isinstance(params, spec.params):
        return params
    if params is not None and not isinstance(params, dict):
        raise ConfigError("model.params", f"expected a mapping of {spec.name}'s parameters, got {params!r}")
    return from_dict(spec.params, params or {}, "model.params")


def build_model(name: str, params: dict | Any | None, input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """Instantiate model ``name`` for samples of ``input_shape`` and ``num_classes`` outputs.

    ``params`` is a dict (validated against the model's params dataclass; missing keys take their
    defaults) or an instance of that dataclass. Parameters get PyTorch's default initialisation from
    the global RNG; use :func:`init_params` with a seeded generator for reproducible runs.
    Errors that come from the configuration are ConfigErrors naming ``model.name`` or
    ``model.params.<key>``.
    """
    spec = model_spec(name)
    if int(num_classes) < 0:
        raise ValueError(f"num_classes must be >= 0 (0 = regression, one output), got {num_classes}")
    outputs = max(1, int(num_classes))
    return spec.build(_params_instance(spec, params), tuple(int(s) for s in input_shape), outputs)


def default_model(source: str) -> str:
    """The model ``model.name: auto`` stands for with data source ``source``."""
    try:
        from ..data import source_spec
    except ImportError as err:
        # Only a missing pfl.data (or a pfl.data without source_spec) selects the local table; a
        # broken import inside pfl.data must still surface.
        if err.name != _DATA_PACKAGE:
            raise
        source_spec = None
    name = getattr(source_spec(source), "default_model", None) if source_spec else _FALLBACK_DEFAULTS.get(source)
    if not name:
        raise ConfigError("model.name", f"'auto' has no default model for data source {source!r}; "
                                        f"set one of: {', '.join(MODELS.names())}")
    return name


def resolve_model_config(cfg: Any) -> None:
    """Resolve ``cfg.model`` (a :class:`pfl.config.ExperimentConfig`) in place.

    ``auto`` becomes the data source's default model; the name is checked against the registry and
    ``cfg.model.params`` is replaced by the complete, validated parameter dict (defaults filled in).
    """
    from .custom import is_custom, resolve_head

    if cfg.model.name == "auto":
        cfg.model.name = default_model(cfg.data.source)
    if is_custom(cfg.model.name):
        cfg.model.name = _absolute_model_file(cfg.model.name)
    spec = model_spec(cfg.model.name)
    cfg.model.params = to_dict(_params_instance(spec, cfg.model.params))
    if is_custom(cfg.model.name):
        from ..data import source_spec

        shape, num_classes = source_spec(cfg.data.source).shape(cfg.data.params)
        resolve_head(cfg, shape, max(1, num_classes), build_model)


def _absolute_model_file(name: str) -> str:
    """'rel/file.py:Class' with the file made absolute (a Ray trial runs in another directory)."""
    from ..plugins import is_file_entry
    from ..paths import absolute_path

    where, _, attr = name.rpartition(":")
    return f"{absolute_path(where)}:{attr}" if where and is_file_entry(where) else name


def params_doc(name: str) -> list[tuple[str, str, Any, str]]:
    """(field, type, default, doc) rows of model ``name``'s parameters (for the CLI listing)."""
    return describe(model_spec(name).params)


__all__ = [
    "LayerGroups", "ModelSpec", "build_model", "check_model_on", "default_model", "flatten_params", "init_params",
    "layer_groups", "list_models", "model_spec", "num_params", "params_doc", "params_of", "register",
    "resolve_model_config", "unflatten_params",
]


def check_model_on(cfg: Any, data: Any) -> None:
    """Build the run's model and check it on ``data`` (a sweep does this before Ray starts)."""
    from .custom import prepare_model

    model = build_model(cfg.model.name, cfg.model.params, data.input_shape, data.num_classes)
    prepare_model(model, cfg, data)

