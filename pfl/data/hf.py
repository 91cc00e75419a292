"""``data.source: hf``: a Hugging Face data set through the optional ``datasets`` library
(``pip install -e .[hf]``).

``name`` is a hub name, or one of the local builders (``parquet``, ``csv``, ``json``,
``imagefolder``) with ``data_files`` or ``data_dir``; ``split`` picks one split. The loaded
data set's Arrow table is read like a Parquet file (:mod:`.files`): a label column, features (number
columns, one list column, or one image column, decoded from its encoded bytes), optional client and
cluster columns, natural partitions by client id. Nothing is downloaded unless ``name`` is a hub
name; the hub is then reached as ``datasets`` usually does (``HF_HUB_OFFLINE=1`` forbids it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..schema import ConfigError, hp
from ..paths import absolute_path, shipped_path
from .files import (Inspected, check_inspected, default_kind, explain_missing_clients, inspect_table, source_data,
                    usable_clients)
from .readers import table_from_arrow
from .sources import CLASSIFICATION, REGRESSION, SourceSpec, register_source

LOCAL_BUILDERS = ("parquet", "csv", "json", "imagefolder", "audiofolder", "text", "arrow")
EXTRA = "the hf source needs the optional 'datasets' package: pip install -e '.[hf]' (or pip install datasets)"


@dataclass
class HFParams:
    """Which data set and split, and how to read its columns."""
    name: str | None = hp(None, "a hub name (e.g. 'mnist') or a local builder: parquet, csv, json, imagefolder")
    data_files: list[str] | None = hp(None, "local files for a builder (relative to the current directory)")
    data_dir: str | None = hp(None, "local folder for a builder (imagefolder: one subfolder per class)")
    config_name: str | None = hp(None, "the data set's configuration (hub data sets with several)")
    revision: str | None = hp(None, "hub revision (a tag or commit) to pin the data")
    split: str = hp("train", "split to load, e.g. train, test, train[:10%]")
    label_column: str = hp("label", "label column")
    feature_columns: list[str] | None = hp(None, "feature columns; null = every column except label, client and "
                                                 "cluster (one image or list column, or number columns)")
    client_column: str = hp("client", "column of client ids, for natural partitions")
    cluster_column: str = hp("cluster", "column of true cluster ids (only for cluster metrics)")
    task: str = hp("auto", "auto = classification for integer labels, regression for floats",
                   choices=("auto", CLASSIFICATION, REGRESSION))
    input_shape: list[int] | None = hp(None, "one sample's shape; null = as stored (images: C, H, W)")
    scale: float | None = hp(None, "divide every feature by this; null = 255 for images, else 1",
                             low=0.0, low_open=True)
    min_client_samples: int = hp(0, "natural partitions: leave out clients with fewer samples", low=0)

    def make_paths_absolute(self) -> None:
        if self.data_files:
            self.data_files = [f if "://" in f else absolute_path(f) for f in self.data_files]
        if self.data_dir and "://" not in self.data_dir:
            self.data_dir = absolute_path(self.data_dir)

    def validate(self, path: str) -> None:
        if not self.name:
            raise ConfigError(f"{path}.name", "the hf source needs data.params.name (a hub name, or parquet/csv/"
                                              "json/imagefolder with data_files or data_dir)")
        if self.name in LOCAL_BUILDERS and not (self.data_files or self.data_dir):
            raise ConfigError(f"{path}.data_files", f"the {self.name!r} builder needs data_files or data_dir")


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.source", EXTRA) from None
    return datasets


@functools.lru_cache(maxsize=2)
def _inspect_cached(key: tuple, stamp: tuple) -> Inspected:
    p = HFParams(**dict(key))
    datasets = _datasets()
    kwargs = {"split": p.split}
    if p.data_files:
        kwargs["data_files"] = [str(shipped_path(f)) if "://" not in f else f for f in p.data_files]
    if p.data_dir:
        kwargs["data_dir"] = str(shipped_path(p.data_dir)) if "://" not in p.data_dir else p.data_dir
    if p.revision:
        kwargs["revision"] = p.revision
    args = [p.name] + ([p.config_name] if p.config_name else [])
    try:
        ds = datasets.load_dataset(*args, **kwargs)
    except Exception as err:  # the library's many error types: one line naming the key
        text = f"{type(err).__name__}: {err}".splitlines()[0]
        key_name = "data.params.split" if "split" in text.lower() and "Unknown split" in text else "data.params.name"
        raise ConfigError(key_name, f"load_dataset({', '.join(map(repr, args))}) failed: {text}") from None
    if not hasattr(ds, "data"):
        raise ConfigError("data.params.split", f"{p.name}: expected one split, got {type(ds).__name__} "
                                               f"(set data.params.split)")
    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    indices = getattr(ds, "_indices", None)
    if indices is not None:  # a selected or shuffled view: its rows, in its order
        table = table.take(indices.column(0))
    where = f"{p.name}[{p.split}]" + (f" ({p.data_dir or ', '.join(p.data_files or [])})"
                                      if p.name in LOCAL_BUILDERS else "")
    return inspect_table(table_from_arrow(table, p, where), p)


def _key(p: HFParams) -> tuple:
    out = []
    for k, v in vars(p).items():
        out.append((k, tuple(v) if isinstance(v, list) else v))
    return tuple(out)


def _stamp(p: HFParams) -> tuple:
    """Size and modification time of the local files (an edited file is read again)."""
    paths = [shipped_path(f) for f in (p.data_files or []) + ([p.data_dir] if p.data_dir else []) if "://" not in f]
    files = [q for path in paths for q in ([path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir()
                                          else []) if q.is_file()]
    return tuple((str(q), q.stat().st_size, q.stat().st_mtime_ns) for q in files)


def inspect(p: HFParams) -> Inspected:
    return _inspect_cached(_key(p), _stamp(p))


def _check_config(cfg) -> None:
    p = HFParams(**{k: v for k, v in cfg.params.items()})
    check_inspected(inspect(p), p, cfg)


register_source(SourceSpec(
    "hf", "a Hugging Face data set (hub name, or local parquet/csv/imagefolder files; optional extra "
    "pip install -e '.[hf]')", HFParams, "mlp", CLASSIFICATION, per_client=False, image=False,
    shape_fn=lambda p: (inspect(p).input_shape, inspect(p).num_classes),
    load_fn=lambda p, m: source_data(inspect(p), p, m), check_fn=inspect,
    default_kind=lambda p: default_kind(inspect(p)), has_clients=lambda p: inspect(p).ids is not None,
    check_config=_check_config, explain_no_clients=lambda p: explain_missing_clients(inspect(p)),
    count_clients=lambda p: len(usable_clients(inspect(p), p))))

__all__ = ["EXTRA", "HFParams", "inspect"]
