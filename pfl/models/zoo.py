"""The small models: linear/softmax regression, MLP and the two papers' CNNs.

Each model has a params dataclass (every field documented; validated by :func:`pfl.schema.from_dict`
under ``model.params``) and a ``build_*(params, input_shape, num_classes)`` function registered in
:mod:`pfl.models`. Only ``cnn_bn`` has buffers (BatchNorm's running statistics, state like the
parameters: :mod:`pfl.models.functional`); every other model's state is its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..schema import ConfigError, hp
from .groups import params_under
from .inputs import conv_out, image_shape, vector_dim

PADDING_CHOICES = ("auto", "paper", "same")
_PADDING_DOC = ("convolution padding: 'paper' = the published layer (too small inputs fail), 'same' = "
                "pad 2 on every 5×5 conv (works from 4×4 up, e.g. 8×8 digits), 'auto' = 'paper' when the "
                "input is large enough, else 'same'")


# ---------------------------------------------------------------------------------------------
# Linear models and MLP


@dataclass
class SoftmaxRegressionParams:
    """Multinomial logistic regression has no parameters to choose."""


@dataclass
class LinearRegressionParams:
    """Least-squares linear regression has no parameters to choose."""


class SoftmaxRegression(nn.Module):
    """One linear layer d → C with bias on the flattened input (FPFC synthetic: d=60, C=10, 610 params)."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))

    def layer_units(self) -> list[list[str]]:
        return [params_under(self, ["fc"])]


class LinearRegression(nn.Module):
    """One linear layer d → 1 with bias; the prediction has shape (N,) to match (N,) targets."""

    def __init__(self, in_features: int):
        super().__init__()
        self.fc = nn.Linear(in_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1)).squeeze(-1)

    def layer_units(self) -> list[list[str]]:
        return [params_under(self, ["fc"])]


@dataclass
class MLPParams:
    hidden: list[int] = hp(default_factory=lambda: [200, 200],
                           doc="widths of the hidden layers (ReLU after each), bottom → top; [] gives "
                               "softmax regression")

    def validate(self, path: str) -> None:
        for i, width in enumerate(self.hidden):
            if width < 1:
                raise ConfigError(f"{path}.hidden[{i}]", f"a layer width must be >= 1, got {width}")


class MLP(nn.Module):
    """Fully connected ReLU network on the flattened input: fc1 … fcK hidden layers, then the head fc."""

    def __init__(self, in_features: int, hidden: Sequence[int], num_classes: int):
        super().__init__()
        self.hidden_names: list[str] = []
        width = in_features
        for i, out in enumerate(hidden, start=1):
            name = f"fc{i}"
            self.add_module(name, nn.Linear(width, out))
            self.hidden_names.append(name)
            width = out
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for name in self.hidden_names:
            x = F.relu(getattr(self, name)(x))
        return self.fc(x)

    def layer_units(self) -> list[list[str]]:
        return [params_under(self, [name]) for name in [*self.hidden_names, "fc"]]


def build_softmax_regression(params: SoftmaxRegressionParams, input_shape, num_classes: int) -> nn.Module:
    return SoftmaxRegression(vector_dim(input_shape), num_classes)


def build_linear_regression(params: LinearRegressionParams, input_shape, num_classes: int) -> nn.Module:
    return LinearRegression(vector_dim(input_shape))


def build_mlp(params: MLPParams, input_shape, num_classes: int) -> nn.Module:
    return MLP(vector_dim(input_shape), params.hidden, num_classes)


# ---------------------------------------------------------------------------------------------
# Two-conv CNNs (conv 5×5 → ReLU → maxpool 2, twice)


def _two_conv_geometry(model_name: str, hw: tuple[int, int], mode: str,
                       paper: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Paddings of the two 5×5 convs and the final spatial size (h, w) for the chosen mode."""

    def final(pads: tuple[int, int]) -> tuple[int, int] | None:
        out = []
        for size in hw:
            for pad in pads:
                size = conv_out(size, 5, pad) // 2  # conv, then 2×2 max-pool (floor)
                if size < 1:
                    return None
            out.append(size)
        return out[0], out[1]

    same = (2, 2)
    candidates = {"paper": [paper], "same": [same], "auto": [paper, same]}[mode]
    for pads in candidates:
        size = final(pads)
        if size is not None:
            return pads, size
    if mode == "paper":
        raise ConfigError("model.params.padding", f"{model_name} with padding 'paper' does not fit "
                          f"{hw[0]}×{hw[1]} inputs (the feature map shrinks to nothing); use 'same' or 'auto'")
    raise ConfigError("model.name", f"{model_name} supports images of at least 4×4 pixels; "
                                    f"the data is {hw[0]}×{hw[1]}")


class _ImageModel(nn.Module):
    """Reshapes a batch of flat rows to images when the data stores them flat (digits: 64 → 1×8×8)."""

    image_shape: tuple[int, int, int]

    def as_images(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], *self.image_shape)


@dataclass
class CNNFPFCParams:
    channels: list[int] = hp(default_factory=lambda: [6, 16],
                             doc="output channels of conv1 and conv2 (FPFC's ConvNet: [6, 16])")
    padding: str = hp("auto", _PADDING_DOC + "; 'paper' pads conv1 by 2 and conv2 by 0",
                      choices=PADDING_CHOICES)

    def validate(self, path: str) -> None:
        _check_channels(self.channels, path)


class CNNFPFC(_ImageModel):
    """FPFC's MNIST ConvNet: conv 5×5 (pad 2) → ReLU → pool → conv 5×5 → ReLU → pool → linear head.

    On 1×28×28 with C=10: body conv1+conv2 = 2,572 params, head fc1 = 400·10+10 = 4,010 (FPFC
    clusters only fc1). There is no hidden linear layer: the head reads the 400 conv features.
    """

    def __init__(self, image: tuple[int, int, int], chans: Sequence[int], paddings: tuple[int, int],
                 out_hw: tuple[int, int], num_classes: int):
        super().__init__()
        self.image_shape = image
        self.conv1 = nn.Conv2d(image[0], chans[0], 5, padding=paddings[0])
        self.conv2 = nn.Conv2d(chans[0], chans[1], 5, padding=paddings[1])
        self.fc1 = nn.Linear(chans[1] * out_hw[0] * out_hw[1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(self.as_images(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc1(x.flatten(1))

    def layer_units(self) -> list[list[str]]:
        return [params_under(self, [name]) for name in ("conv1", "conv2", "fc1")]


@dataclass
class CNNFedAvgParams:
    channels: list[int] = hp(default_factory=lambda: [32, 64],
                             doc="output channels of conv1 and conv2 (FedAvgCNN: [32, 64]); smaller or "
                                 "larger values give PerFed-CKT's small/large variants")
    hidden: int = hp(512, "width of the hidden linear layer fc1 (FedAvgCNN: 512)", low=1)
    padding: str = hp("auto", _PADDING_DOC + "; 'paper' pads neither conv", choices=PADDING_CHOICES)

    def validate(self, path: str) -> None:
        _check_channels(self.channels, path)


class CNNFedAvg(_ImageModel):
    """FedALA's "4-layer CNN" (PFLlib FedAvgCNN): two 5×5 convs, then Linear(dim → 512) → ReLU → Linear.

    dim = 64·4·4 = 1024 on 28×28 inputs and 64·5·5 = 1600 on 32×32; 582,026 params on 1×28×28 and
    878,538 on 3×32×32 (C=10). Units conv1, conv2, fc1, fc (FedALA's p = 1 … 4).
    """

    def __init__(self, image: tuple[int, int, int], chans: Sequence[int], hidden: int,
                 paddings: tuple[int, int], out_hw: tuple[int, int], num_classes: int):
        super().__init__()
        self.image_shape = image
        self.conv1 = nn.Conv2d(image[0], chans[0], 5, padding=paddings[0])
        self.conv2 = nn.Conv2d(chans[0], chans[1], 5, padding=paddings[1])
        self.fc1 = nn.Linear(chans[1] * out_hw[0] * out_hw[1], hidden)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(self.as_images(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc(x)

    def layer_units(self) -> list[list[str]]:
        return [params_under(self, [name]) for name in ("conv1", "conv2", "fc1", "fc")]


class CNNBN(_ImageModel):
    """FedAvgCNN with BatchNorm after each conv and after the hidden linear layer (FedBN's CNNs put
    BN after every layer but the classifier): conv → BN → ReLU → pool twice, fc1 → BN → ReLU, fc.
    Units conv1+bn1, conv2+bn2, fc1+bn3, fc; the head is fc, so a head-sharing method never sends BN.
    """

    def __init__(self, image: tuple[int, int, int], chans: Sequence[int], hidden: int,
                 paddings: tuple[int, int], out_hw: tuple[int, int], num_classes: int):
        super().__init__()
        self.image_shape = image
        self.conv1 = nn.Conv2d(image[0], chans[0], 5, padding=paddings[0])
        self.bn1 = nn.BatchNorm2d(chans[0])
        self.conv2 = nn.Conv2d(chans[0], chans[1], 5, padding=paddings[1])
        self.bn2 = nn.BatchNorm2d(chans[1])
        self.fc1 = nn.Linear(chans[1] * out_hw[0] * out_hw[1], hidden)
        self.bn3 = nn.BatchNorm1d(hidden)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(self.as_images(x)))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.relu(self.bn3(self.fc1(x.flatten(1))))
        return self.fc(x)

    def layer_units(self) -> list[list[str]]:
        return [params_under(self, pair) for pair in (["conv1", "bn1"], ["conv2", "bn2"], ["fc1", "bn3"], ["fc"])]


def _check_channels(chans: Sequence[int], path: str) -> None:
    if len(chans) != 2:
        raise ConfigError(f"{path}.channels", f"expected two channel counts [conv1, conv2], got {list(chans)}")
    for i, c in enumerate(chans):
        if c < 1:
            raise ConfigError(f"{path}.channels[{i}]", f"a channel count must be >= 1, got {c}")


def build_cnn_fpfc(params: CNNFPFCParams, input_shape, num_classes: int) -> nn.Module:
    image = image_shape("cnn_fpfc", input_shape)
    pads, out_hw = _two_conv_geometry("cnn_fpfc", image[1:], params.padding, paper=(2, 0))
    return CNNFPFC(image, params.channels, pads, out_hw, num_classes)


def build_cnn_fedavg(params: CNNFedAvgParams, input_shape, num_classes: int) -> nn.Module:
    image = image_shape("cnn_fedavg", input_shape)
    pads, out_hw = _two_conv_geometry("cnn_fedavg", image[1:], params.padding, paper=(0, 0))
    return CNNFedAvg(image, params.channels, params.hidden, pads, out_hw, num_classes)


def build_cnn_bn(params: CNNFedAvgParams, input_shape, num_classes: int) -> nn.Module:
    image = image_shape("cnn_bn", input_shape)
    pads, out_hw = _two_conv_geometry("cnn_bn", image[1:], params.padding, paper=(0, 0))
    return CNNBN(image, params.channels, params.hidden, pads, out_hw, num_classes)


__all__ = [
    "SoftmaxRegression", "LinearRegression", "MLP", "CNNFPFC", "CNNFedAvg", "CNNBN", "build_cnn_bn",
    "SoftmaxRegressionParams", "LinearRegressionParams", "MLPParams", "CNNFPFCParams", "CNNFedAvgParams",
    "build_softmax_regression", "build_linear_regression", "build_mlp", "build_cnn_fpfc", "build_cnn_fedavg",
]
