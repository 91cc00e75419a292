"""File-backed image datasets: MNIST / Fashion-MNIST (IDX files) and CIFAR-10/100 (pickled batches).

Nothing here downloads unless the user set ``data.params.download: true``; then torchvision fetches
the official archives into the data directory and the files are read by the same code as always.
CIFAR batches are read by our own reader rather than by ``torchvision.datasets.CIFAR10``: torchvision
insists on the md5 sums of the official files, which would make the loader impossible to test on
small files of the same format.

Where files are looked for (first directory holding all files wins):

* ``data.params.data_dir`` when set (the directory itself, its named subfolder such as
  ``fashion-mnist``, and torchvision's own layout such as ``FashionMNIST/raw``); only there;
* otherwise ``$PFL_DATA_DIR`` (same three places), then the Debian package location under
  ``/usr/share/datasets``.
"""

from __future__ import annotations

import logging
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..schema import ConfigError
from .idx import read_idx

log = logging.getLogger(__name__)

SYSTEM_DATASETS = Path("/usr/share/datasets")
DEFAULT_DOWNLOAD_DIR = Path("~/.cache/pfl/datasets")


@dataclass(frozen=True)
class FileLayout:
    """Where one dataset's files live and what they are called."""
    title: str                   # for messages
    subdir: str                  # conventional subfolder of a data directory
    torchvision_subdir: str      # where torchvision's own download puts them
    files: tuple[str, ...]       # required file names (IDX names without '.gz')
    apt_package: str | None      # Debian package that ships them
    compressed_ok: bool = True   # IDX files may also be present as '<name>.gz'


MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
LAYOUTS = {
    "fmnist": FileLayout("Fashion-MNIST", "fashion-mnist", "FashionMNIST/raw", MNIST_FILES,
                         "dataset-fashion-mnist"),
    "mnist": FileLayout("MNIST", "mnist", "MNIST/raw", MNIST_FILES, None),
    "cifar10": FileLayout("CIFAR-10", "", "cifar-10-batches-py",
                          tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch", "batches.meta"),
                          None, compressed_ok=False),
    "cifar100": FileLayout("CIFAR-100", "", "cifar-100-python", ("train", "test", "meta"),
                           None, compressed_ok=False),
}


def candidate_dirs(name: str, data_dir: str | None) -> list[Path]:
    """Directories searched for ``name``'s files, in order."""
    layout = LAYOUTS[name]

    def variants(base: Path) -> list[Path]:
        out = [base]
        if layout.subdir:
            out.append(base / layout.subdir)
        out.append(base / layout.torchvision_subdir)
        return out

    if data_dir:
        return variants(Path(data_dir).expanduser())
    dirs: list[Path] = []
    env = os.environ.get("PFL_DATA_DIR")
    if env:
        dirs += variants(Path(env).expanduser())
    system = SYSTEM_DATASETS / (layout.subdir or layout.torchvision_subdir)
    dirs.append(system)
    return dirs


def _resolve_file(directory: Path, fname: str, compressed_ok: bool) -> Path | None:
    for cand in ((fname + ".gz", fname) if compressed_ok else (fname,)):
        p = directory / cand
        if p.is_file():
            return p
    return None


def find_files(name: str, data_dir: str | None) -> dict[str, Path] | None:
    """Paths of all of ``name``'s files in the first directory holding them all, or None."""
    layout = LAYOUTS[name]
    for directory in candidate_dirs(name, data_dir):
        found = {f: _resolve_file(directory, f, layout.compressed_ok) for f in layout.files}
        if all(found.values()):
            return found  # type: ignore[return-value]
    return None


def missing_files_error(name: str, data_dir: str | None) -> ConfigError:
    layout = LAYOUTS[name]
    searched = ", ".join(str(d) for d in candidate_dirs(name, data_dir))
    suffix = " (each optionally .gz)" if layout.compressed_ok else ""
    where = (f"in a folder {layout.torchvision_subdir}/ of the data directory" if not layout.subdir
             else "in the data directory or its subfolder " + layout.subdir + "/")
    how = []
    if layout.apt_package:
        how.append(f"`apt-get install {layout.apt_package}` (installs them in "
                   f"{SYSTEM_DATASETS / layout.subdir})")
    how.append("set data.params.download: true to let torchvision download them into "
               "data.params.data_dir (default $PFL_DATA_DIR, else ~/.cache/pfl/datasets)")
    return ConfigError("data.params.data_dir",
                       f"{layout.title} files not found; searched: {searched}. Expected {where}: "
                       f"{', '.join(layout.files)}{suffix}. To get them: {'; or '.join(how)}; or point "
                       f"data.params.data_dir (or $PFL_DATA_DIR) at a copy")


def download_dir(data_dir: str | None) -> Path:
    if data_dir:
        return Path(data_dir).expanduser()
    env = os.environ.get("PFL_DATA_DIR")
    return Path(env).expanduser() if env else DEFAULT_DOWNLOAD_DIR.expanduser()


def _download(name: str, root: Path) -> None:
    """Fetch the official files with torchvision (only called when the user allowed it)."""
    import torchvision.datasets as tvd

    root.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s into %s (data.params.download is true)", LAYOUTS[name].title, root)
    cls = {"fmnist": tvd.FashionMNIST, "mnist": tvd.MNIST, "cifar10": tvd.CIFAR10,
           "cifar100": tvd.CIFAR100}[name]
    cls(root=str(root), train=True, download=True)
    cls(root=str(root), train=False, download=True)


def locate(name: str, data_dir: str | None, download: bool) -> dict[str, Path]:
    """The dataset's files, downloading them first if allowed and needed; ConfigError otherwise."""
    found = find_files(name, data_dir)
    if found is None and download:
        root = download_dir(data_dir)
        _download(name, root)
        found = find_files(name, str(root))
    if found is None:
        raise missing_files_error(name, data_dir)
    return found


def load_idx_pair(name: str, data_dir: str | None, download: bool) -> tuple[np.ndarray, np.ndarray]:
    """MNIST-format images (N, 28, 28) uint8 and labels (N,) int64, train and test pooled."""
    files = locate(name, data_dir, download)
    xs, ys = [], []
    for part in ("train", "t10k"):
        try:
            x = read_idx(files[f"{part}-images-idx3-ubyte"])
            y = read_idx(files[f"{part}-labels-idx1-ubyte"])
        except ValueError as err:
            raise ConfigError("data.source", f"{name}: {err}; replace the file (or point "
                                             "data.params.data_dir / $PFL_DATA_DIR at intact files)") from None
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ConfigError("data.source", f"{files[f'{part}-images-idx3-ubyte']}: expected (N, H, W) images "
                                             f"and N labels, got {x.shape} and {y.shape}")
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys).astype(np.int64)


def _unpickle(path: Path) -> dict:
    with open(path, "rb") as f:
        # the official batches were pickled by Python 2; latin1 maps its byte strings 1:1
        return pickle.load(f, encoding="latin1")


def load_cifar(name: str, data_dir: str | None, download: bool) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """CIFAR images (N, 3, 32, 32) uint8, labels (N,) int64 (fine labels for CIFAR-100) and class names;
    train and test pooled."""
    files = locate(name, data_dir, download)
    if name == "cifar10":
        parts = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        label_key, meta_file, names_key = "labels", "batches.meta", "label_names"
    else:
        parts = ["train", "test"]
        label_key, meta_file, names_key = "fine_labels", "meta", "fine_label_names"
    xs, ys = [], []
    for part in parts:
        entry = _unpickle(files[part])
        data = np.asarray(entry["data"], dtype=np.uint8)
        labels = np.asarray(entry[label_key], dtype=np.int64)
        # rows hold 1024 red, then 1024 green, then 1024 blue values of a 32x32 image
        xs.append(data.reshape(-1, 3, 32, 32))
        ys.append(labels)
        if len(xs[-1]) != len(labels):
            raise ValueError(f"{files[part]}: {len(xs[-1])} images but {len(labels)} labels")
    class_names = list(_unpickle(files[meta_file]).get(names_key, []))
    return np.concatenate(xs), np.concatenate(ys), class_names
