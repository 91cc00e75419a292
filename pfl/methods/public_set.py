"""The public unlabeled set that knowledge-transfer methods (PerFed-CKT) exchange logits on.

The set is fixed once per run from the run seed and is assumed to be pre-installed at the server
and at every client (it is public data), so it is never sent as a message.

Sources (``public_source``):

* ``same_heldout`` (default): samples of the task's own source, labels dropped, drawn from the
  samples *no client holds* — the pool left by the partition (``data.max_samples`` below the
  pool's size leaves the rest unused; the partition is recomputed from the run's own seeded draw,
  or read from the partition cache, so "unused" means unused by any client's train, validation or
  test split). When fewer unused samples are left than ``public_size`` the set is that smaller
  disjoint pool (a warning says so). When the partition uses every sample (no ``max_samples``, or
  a per-client source) the rows must come from client data: they are drawn from the whole pool and
  the overlap is counted and warned about.
* any registered pooled data source (``mnist``, ``cifar100``, ...) whose samples have the task's
  input shape: its whole pool, labels dropped (the paper's setting: CIFAR-100 images for a
  CIFAR-10 task). Its default ``data.params`` are used unless it is the task's own source (then it
  is ``same_heldout``).

``PublicSet.overlap`` is the number of public rows that are also some client's sample (train,
validation or test), logged by PerFed-CKT as ``ckt/public_overlap``; 0 by default whenever
``data.max_samples`` leaves samples unused.
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
    overlap: int         # rows that are also a client's sample (train, validation or test)
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


def client_pool_rows(ctx: "RunContext", src=None) -> np.ndarray:
    """Sorted pool indices of every sample any of the run's clients holds (train, validation, test):
    the partition the run's data was built from (the cache's when present, else made again with the
    run's seed; a source's own clients drawn as the run draws them). ``src``: the run's source as
    its config loads it, if already loaded."""
    from ..data import held_partition

    _, part, _, _ = held_partition(ctx.cfg.data, ctx.seed, src=src)
    held = [np.asarray(idx, dtype=np.int64) for split in (part.train, part.val, part.test) for idx in split]
    return np.unique(np.concatenate(held))  # three splits of at least one client: never empty


def _fewer_clients_hint(spec, src, data_cfg) -> str:
    """The data setting that would leave samples to no client, if one would: fewer of a source's own
    clients, or fewer pooled samples (a source generated client by client has none)."""
    if src.devices is None or data_cfg.partition.kind != "natural":
        return f"data.max_samples below the pool size ({len(src.y)}) or "
    return "" if spec.per_client else f"data.num_clients below its {len(src.devices)} clients or "


def build_public_set(ctx: "RunContext", source: str, size: int) -> PublicSet:
    """The run's public set: ``size`` rows (fewer if the disjoint pool is smaller), seeded by the run
    seed, disjoint from the clients' data whenever the partition leaves samples unused."""
    from ..data import source_spec

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
    held = np.zeros(0, dtype=np.int64)
    if same:
        held = client_pool_rows(ctx, src)
        unused = np.setdiff1d(pool, held, assume_unique=True)
        if len(unused):
            pool = unused
            if len(unused) < size:
                log.warning("public set: only %d samples of %s are held by no client; using %d instead of %d "
                            "(method.public_size)", len(unused), name, len(unused), size)
        else:
            log.warning("public set: every sample of %s belongs to a client, so the public rows are client "
                        "data (ckt/public_overlap > 0); set %smethod.public_source to another source for a "
                        "disjoint set", name, _fewer_clients_hint(spec, src, data_cfg))
    n = min(size, len(pool))
    if n < size and not same:
        log.warning("public set: %s has only %d samples; using %d instead of %d", name, len(pool), n, size)
    rows = np.sort(ctx.rng("public_set").choice(pool, size=n, replace=False))
    x = torch.from_numpy(src.rows(rows))
    if tuple(x.shape[1:]) != tuple(ctx.meta.input_shape):
        raise ConfigError(FIELD, f"public source {name!r} has samples of shape {tuple(x.shape[1:])}, the task "
                                 f"{data_cfg.source!r} needs {tuple(ctx.meta.input_shape)}")
    overlap = int(np.isin(rows, held).sum())
    return PublicSet(x=x.to(ctx.device), source=SAME_HELDOUT if same else name, overlap=overlap, requested=size)


__all__ = ["PublicSet", "SAME_HELDOUT", "build_public_set", "check_public_source", "client_pool_rows"]
