"""The public unlabeled set that knowledge-transfer methods (PerFed-CKT) exchange logits on.

The set is fixed once per run from the run seed and is assumed to be pre-installed at the server
and at every client (it is public data), so it is never sent as a message.

Sources (``public_source``):

* ``same_heldout`` (default): samples of the task's own source, labels dropped. When the
  partition uses only a stratified subset of the pool (``data.max_samples``), the public rows are
  drawn from the samples *no client holds* (the complement of that subset, recomputed with the
  partition's own seeded subset draw). When the partition uses the whole pool (no
  ``max_samples``, or a per-client source) there is no unused sample, so the rows are drawn from
  the whole pool and may overlap client data; that overlap is accepted and reported
  (``PublicSet.overlap``). Label swaps and rotations of clustered partitions are client-side
  transforms and are not applied to public samples.
* any registered pooled data source (``mnist``, ``cifar100``, ...) whose samples have the task's
  input shape: its whole pool, labels dropped (the paper's setting: CIFAR-100 images for a
  CIFAR-10 task). Its default ``data.params`` are used unless it is the task's own source.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..schema import ConfigError

if TYPE_CHECKING:
    from ..federation.context import RunContext

log = logging.getLogger(__name__)

SAME_HELDOUT = "same_heldout"
FIELD = "method.public_source"


@dataclass
class PublicSet:
    x: torch.Tensor      # (N, *input_shape) float32 on the run's device
    source: str          # what it was drawn from
    overlap: bool        # True when rows may also be client training data
    requested: int       # the configured size (N may be smaller when the pool is smaller)

    def __len__(self) -> int:
        return int(self.x.shape[0])


def check_public_source(name: str) -> None:
    """Config-time check: ``same_heldout`` or a registered pooled source (ConfigError on the field)."""
    if name == SAME_HELDOUT:
        return
    from ..data import list_sources, source_spec

    try:
        spec = source_spec(name)
    except ConfigError as err:
        pooled = [s.name for s in list_sources() if not s.per_client]
        raise ConfigError(FIELD, f"unknown public source {name!r}; allowed: {SAME_HELDOUT}, "
                                 f"{', '.join(pooled)}") from err
    if spec.per_client:
        raise ConfigError(FIELD, f"{name!r} generates per-device data and has no sample pool; use "
                                 f"{SAME_HELDOUT} or an image source")


def build_public_set(ctx: "RunContext", source: str, size: int) -> PublicSet:
    """The run's public set: ``size`` rows (fewer if the pool is smaller), seeded by the run seed."""
    from ..data import source_spec
    from ..data.partition import rng_for, stratified_subset

    data_cfg = ctx.cfg.data
    same = source in (SAME_HELDOUT, data_cfg.source)
    name = data_cfg.source if same else source
    spec = source_spec(name)
    params = data_cfg.params if name == data_cfg.source else {}
    try:
        spec.check(params)
    except ConfigError as err:
        raise ConfigError(FIELD, f"public source {name!r} is not available: {err}") from None
    src = spec.load(params, data_cfg.num_clients)
    pool = np.arange(len(src.y))
    overlap = True
    if source == SAME_HELDOUT and src.devices is None and data_cfg.max_samples is not None \
            and data_cfg.max_samples < len(pool):
        # the partition's own subset draw (same seed and tag), so "unused" means unused
        used = stratified_subset(src.y, data_cfg.max_samples, rng_for(ctx.seed, "pfl.data.subset"))
        unused = np.setdiff1d(pool, used, assume_unique=True)
        if len(unused) >= size:
            pool, overlap = unused, False
    n = min(size, len(pool))
    if n < size:
        log.warning("public set: %s has only %d samples; using %d instead of %d", name, len(pool), n, size)
    rows = np.sort(ctx.rng("public_set").choice(pool, size=n, replace=False))
    x = torch.from_numpy(src.rows(rows))
    if tuple(x.shape[1:]) != tuple(ctx.meta.input_shape):
        raise ConfigError(FIELD, f"public source {name!r} has samples of shape {tuple(x.shape[1:])}, the task "
                                 f"{data_cfg.source!r} needs {tuple(ctx.meta.input_shape)}")
    return PublicSet(x=x.to(ctx.device), source=name if source != SAME_HELDOUT else SAME_HELDOUT,
                     overlap=overlap, requested=size)


__all__ = ["PublicSet", "SAME_HELDOUT", "build_public_set", "check_public_source"]
