"""The registry of data sources (``data.source``) and their parameter dataclasses (``data.params``).

A source is either *pooled* (one labelled sample pool that a partitioner splits over clients:
digits, fmnist, mnist, cifar10, cifar100) or *per-client* (a generator that makes each device's data
itself, with true clusters: fpfc_synthetic, fpfc_linear; partition kind 'natural').

Loaders return samples in their compact stored form (uint8 images) together with a ``featurize``
function; features are made per client, so the float copy of a large pool never exists twice.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..registry import Registry
from ..schema import from_dict, hp
from . import images
from .synthetic import FPFCLinearParams, FPFCSyntheticParams, generate_fpfc_linear, generate_fpfc_synthetic

CLASSIFICATION, REGRESSION = "classification", "regression"


@dataclass
class SourceData:
    """What a loader returns: the sample pool and how to turn stored samples into model inputs."""
    x: np.ndarray | None                           # (N, ...) stored form (uint8 images, float features)
    y: np.ndarray                                  # (N,) int64 labels or float32 targets
    input_shape: tuple[int, ...]                   # per-sample shape after featurize
    num_classes: int                               # 0 for regression
    task: str
    featurize: Callable[[np.ndarray], np.ndarray]  # stored rows -> float32 rows of input_shape
    image_shape: tuple[int, int, int] | None = None  # (C, H, W) view of a sample, for rotations
    devices: list[np.ndarray] | None = None        # per-client sources: each device's rows
    clusters: np.ndarray | None = None             # per-client sources: true cluster per device
    class_names: list[str] | None = None
    # file sources (pfl.data.files): features read on demand, in a given row order, already featurized
    read_rows: Callable[[np.ndarray], np.ndarray] | None = None
    client_ids: list[str] | None = None            # the data's own id of each device
    test_rows: np.ndarray | None = None            # (N,) bool: the data's own test split (LEAF)
    fingerprint: str | None = None                 # hash of what a partition is made from (cache key)
    notes: tuple[str, ...] = ()                    # natural partitions: what a person should hear (clients left out)
    where: str | None = None                       # the data's name in notes (a file or folder)
    # per-client sources: the source's own split of its devices (devices, test_fraction, val_fraction,
    # rng) -> (train, val, test) lists, instead of a stratified split per device (pfl.data.crowd)
    split: Callable[..., tuple[list, list, list]] | None = None
    # file sources: seconds reading the file took, when it ended (perf_counter; the config's check may
    # have read it before the load), and how (LEAF, CSV: parsed into the cache, or read from it)
    read_s: float = 0.0
    read_done: float = 0.0
    origin: str = ""

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """Featurized samples ``idx`` (distinct), float32 of ``input_shape``."""
        if self.read_rows is not None:
            return self.read_rows(np.asarray(idx, dtype=np.int64))
        return self.featurize(self.x[idx])


@dataclass(frozen=True)
class SourceSpec:
    """A registered data source; ``params`` is the dataclass validating ``data.params``."""
    name: str
    description: str
    params: type
    default_model: str
    task: str
    per_client: bool
    image: bool  # samples can be viewed as (C, H, W) images (rotation partitions)
    shape_fn: Callable[[Any], tuple[tuple[int, ...], int]]
    load_fn: Callable[[Any, int], SourceData]
    check_fn: Callable[[Any], None] | None = None
    # sources whose data may or may not carry its own clients (files, hf): the 'auto' partition
    # kind, whether 'natural' applies, and checks of the whole data section (client counts)
    default_kind: Callable[[Any], str] | None = None
    has_clients: Callable[[Any], bool] | None = None
    check_config: Callable[[Any], None] | None = None
    # raises the source's own reason why a natural partition finds no client ids (a column that
    # looks like them under another name); returning means it knows none
    explain_no_clients: Callable[[Any], None] | None = None
    # data with its own clients: how many a natural partition can use, which is the default
    # data.num_clients (load_fn then returns all of them; load_federated draws fewer with the seed)
    count_clients: Callable[[Any], int] | None = None

    def parse(self, params: Any = None) -> Any:
        """The params dataclass from a dict (validated) or an instance."""
        if isinstance(params, self.params):
            return params
        return from_dict(self.params, params or {}, "data.params")

    def shape(self, params: Any = None) -> tuple[tuple[int, ...], int]:
        """(per-sample input shape, number of classes; 0 for regression)."""
        return self.shape_fn(self.parse(params))

    def check(self, params: Any = None) -> None:
        """Cheap availability check (files present) so a bad directory fails before any work."""
        if self.check_fn is not None:
            self.check_fn(self.parse(params))

    def load(self, params: Any, num_clients: int) -> SourceData:
        return self.load_fn(self.parse(params), num_clients)


SOURCES: Registry[SourceSpec] = Registry("data source", "data.source")


def register_source(spec: SourceSpec) -> SourceSpec:
    return SOURCES.register(spec.name, spec)


def source_names() -> list[str]:
    return SOURCES.names()


def list_sources() -> list[SourceSpec]:
    return SOURCES.values()


def source_spec(name: str) -> SourceSpec:
    return SOURCES.get(name)


# ---------------------------------------------------------------------------------------------
# feature functions (module level so that they pickle)

def _scale(x: np.ndarray, divisor: float, shape: tuple[int, ...]) -> np.ndarray:
    return (x.astype(np.float32) / np.float32(divisor)).reshape((len(x),) + shape)


def _standardize(x: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    out = x.astype(np.float32) / np.float32(255.0)
    out -= np.asarray(mean, dtype=np.float32)[:, None, None]
    out /= np.asarray(std, dtype=np.float32)[:, None, None]
    return out


def _identity(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# scikit-learn digits

@dataclass
class DigitsParams:
    """scikit-learn's bundled 8×8 digits (1,797 samples, 10 classes) have no parameters."""


def _load_digits(p: DigitsParams, num_clients: int) -> SourceData:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # pixel intensities are 0..16
    return SourceData(x=bunch.data.astype(np.float32), y=bunch.target.astype(np.int64), input_shape=(64,),
                      num_classes=10, task=CLASSIFICATION,
                      featurize=functools.partial(_scale, divisor=16.0, shape=(64,)),
                      image_shape=(1, 8, 8), class_names=[str(i) for i in range(10)])


register_source(SourceSpec(
    "digits", "scikit-learn's 8x8 handwritten digits (1,797 samples, bundled; flat (64,) in [0, 1])",
    DigitsParams, "mlp", CLASSIFICATION, per_client=False, image=True,
    shape_fn=lambda p: ((64,), 10), load_fn=_load_digits))


# ---------------------------------------------------------------------------------------------
# MNIST-format IDX files

@dataclass
class IdxImageParams:
    """Location of the IDX files (see pfl.data.images for the search order)."""
    data_dir: str | None = hp(None, "directory holding the four IDX files (.gz or not), directly, in the "
                              "subfolder fashion-mnist/ (mnist/), or in torchvision's FashionMNIST/raw "
                              "(MNIST/raw); null = $PFL_DATA_DIR, then /usr/share/datasets/fashion-mnist (mnist)")
    download: bool = hp(False, "if the files are missing, let torchvision download them into data_dir")


def _idx_loader(name: str) -> Callable[[IdxImageParams, int], SourceData]:
    def load(p: IdxImageParams, num_clients: int) -> SourceData:
        x, y = images.load_idx_pair(name, p.data_dir, p.download)
        h, w = x.shape[1:]
        return SourceData(x=x, y=y, input_shape=(1, h, w), num_classes=10, task=CLASSIFICATION,
                          featurize=functools.partial(_scale, divisor=255.0, shape=(1, h, w)),
                          image_shape=(1, h, w))
    return load


def _files_check(name: str) -> Callable[[Any], None]:
    def check(p: Any) -> None:
        if not p.download and images.find_files(name, p.data_dir) is None:
            raise images.missing_files_error(name, p.data_dir)
    return check


register_source(SourceSpec(
    "fmnist", "Fashion-MNIST (70,000 28x28 grey images, train+test pooled; local IDX files)",
    IdxImageParams, "cnn_fedavg", CLASSIFICATION, per_client=False, image=True,
    shape_fn=lambda p: ((1, 28, 28), 10), load_fn=_idx_loader("fmnist"), check_fn=_files_check("fmnist")))

register_source(SourceSpec(
    "mnist", "MNIST (70,000 28x28 grey digits, train+test pooled; local IDX files)",
    IdxImageParams, "cnn_fpfc", CLASSIFICATION, per_client=False, image=True,
    shape_fn=lambda p: ((1, 28, 28), 10), load_fn=_idx_loader("mnist"), check_fn=_files_check("mnist")))


# ---------------------------------------------------------------------------------------------
# CIFAR (python pickle batches)

# per-channel mean and std of the training images, the constants everyone normalises with
CIFAR_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


@dataclass
class CifarParams:
    """Location of the pickled batches (see pfl.data.images for the search order)."""
    data_dir: str | None = hp(None, "directory holding cifar-10-batches-py/ resp. cifar-100-python/ "
                              "(or the folder itself); null = $PFL_DATA_DIR")
    download: bool = hp(False, "if the files are missing, let torchvision download them into data_dir")
    normalize: bool = hp(True, "standardise each channel with the usual CIFAR mean/std "
                         "(else only scale to [0, 1])")


def _cifar_loader(name: str, num_classes: int) -> Callable[[CifarParams, int], SourceData]:
    def load(p: CifarParams, num_clients: int) -> SourceData:
        x, y, class_names = images.load_cifar(name, p.data_dir, p.download)
        if p.normalize:
            mean, std = CIFAR_STATS[name]
            featurize = functools.partial(_standardize, mean=mean, std=std)
        else:
            featurize = functools.partial(_scale, divisor=255.0, shape=(3, 32, 32))
        return SourceData(x=x, y=y, input_shape=(3, 32, 32), num_classes=num_classes, task=CLASSIFICATION,
                          featurize=featurize, image_shape=(3, 32, 32), class_names=class_names or None)
    return load


register_source(SourceSpec(
    "cifar10", "CIFAR-10 (60,000 32x32 colour images, train+test pooled; python batches folder)",
    CifarParams, "cnn_fedavg", CLASSIFICATION, per_client=False, image=True,
    shape_fn=lambda p: ((3, 32, 32), 10), load_fn=_cifar_loader("cifar10", 10),
    check_fn=_files_check("cifar10")))

register_source(SourceSpec(
    "cifar100", "CIFAR-100 (60,000 32x32 colour images, 100 fine labels, train+test pooled)",
    CifarParams, "cnn_fedavg", CLASSIFICATION, per_client=False, image=True,
    shape_fn=lambda p: ((3, 32, 32), 100), load_fn=_cifar_loader("cifar100", 100),
    check_fn=_files_check("cifar100")))


# ---------------------------------------------------------------------------------------------
# FPFC generators (per-client)

def _load_fpfc_synthetic(p: FPFCSyntheticParams, num_clients: int) -> SourceData:
    g = generate_fpfc_synthetic(p, num_clients)
    return SourceData(x=g.x, y=g.y, input_shape=(p.num_features,), num_classes=p.num_classes,
                      task=CLASSIFICATION, featurize=_identity, devices=g.device_indices(), clusters=g.clusters)


def _load_fpfc_linear(p: FPFCLinearParams, num_clients: int) -> SourceData:
    g = generate_fpfc_linear(p, num_clients)
    return SourceData(x=g.x, y=g.y, input_shape=(p.num_features,), num_classes=0,
                      task=REGRESSION, featurize=_identity, devices=g.device_indices(), clusters=g.clusters)


register_source(SourceSpec(
    "fpfc_synthetic", "FPFC's clustered softmax-regression devices (lognormal sizes, K clusters of "
    "contiguous devices; gen_seed 0 = the paper's data)",
    FPFCSyntheticParams, "softmax_regression", CLASSIFICATION, per_client=True, image=False,
    shape_fn=lambda p: ((p.num_features,), p.num_classes), load_fn=_load_fpfc_synthetic))

register_source(SourceSpec(
    "fpfc_linear", "clustered linear-regression devices (K clusters of contiguous devices, y = x·β_k + ε)",
    FPFCLinearParams, "linear_regression", REGRESSION, per_client=True, image=False,
    shape_fn=lambda p: ((p.num_features,), 0), load_fn=_load_fpfc_linear))


def params_dict(spec: SourceSpec, params: Any) -> dict:
    """The complete ``data.params`` dict (defaults filled) for ``spec``."""
    return dataclasses.asdict(spec.parse(params))
