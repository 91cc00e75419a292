"""``data.source: crowd``: a large synthetic population of devices, generated on demand.

For federations of 10⁴–10⁶ clients on one machine (``pipelines/bench_scale.py``): what a
partition needs — every device's size and labels — is drawn when the source loads, and a device's
features only when its rows are read, so the population costs its labels (8 bytes a sample) until
its clients are sampled. Our construction, not a published data set:

* device i has n_i = max(4, round(n·Z_i)) samples, Z_i ~ LogNormal(0, ``size_spread``) (n =
  ``samples_per_client``; spread 0 = all equal);
* its label mix p_i ~ Dirichlet(α·1_C) (``alpha``: small α, few classes per device), its labels
  drawn from p_i;
* a sample of class c is x = μ_c + s_i + σ·ε: class prototypes μ_c ~ N(0, ``separation``²·I_d)
  shared by everyone, a device shift s_i ~ N(0, ``shift``²·I_d) (so a personal model helps), noise
  ε ~ N(0, I_d) with σ = ``noise``.

Sizes, label mixes and labels come from one generator seeded by ``gen_seed``; a device's shift and
noise from a torch generator seeded by (``gen_seed``, device) (:func:`device_seed`), so its features
are the same whichever of its rows are read, in whatever order, whenever.

A device's samples are i.i.d. draws from its own mix, so its train/val/test split is a plain random
one (:func:`random_splits`, all devices in a few vectorized steps, from the experiment's split
generator) rather than the per-class split other natural partitions get: 10⁵ devices split in a
second instead of a quarter of a minute. The split sizes follow the same rule (round(n·fraction),
at least one test sample from 2 samples and one validation sample from 3).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..schema import hp
from .sources import CLASSIFICATION, SourceData, SourceSpec, register_source


@dataclass
class CrowdParams:
    """A large synthetic population: Dirichlet label mixes, Gaussian classes, a shift per device."""
    num_features: int = hp(64, "input dimension d", low=1)
    num_classes: int = hp(10, "number of classes C", low=2)
    samples_per_client: int = hp(40, "samples of a device (its median with size_spread > 0)", low=4)
    size_spread: float = hp(0.0, "σ of the lognormal factor on each device's size (0 = all equal)", low=0.0)
    alpha: float = hp(0.5, "Dirichlet concentration of each device's label mix", low=0.0, low_open=True)
    separation: float = hp(1.0, "std of the class prototypes' entries", low=0.0, low_open=True)
    shift: float = hp(0.5, "std of a device's feature shift", low=0.0)
    noise: float = hp(1.0, "std of the per-sample noise", low=0.0)
    gen_seed: int = hp(0, "generator seed (independent of the experiment seed)", low=0)


def _sizes(p: CrowdParams, m: int, rng: np.random.Generator) -> np.ndarray:
    if p.size_spread == 0:
        return np.full(m, p.samples_per_client, dtype=np.int64)
    z = rng.lognormal(0.0, p.size_spread, m)
    return np.maximum(4, np.round(p.samples_per_client * z)).astype(np.int64)


def _labels(p: CrowdParams, sizes: np.ndarray, rng: np.random.Generator, chunk: int = 20_000) -> np.ndarray:
    """Every device's labels, drawn from its own Dirichlet mix (a few thousand devices at a time)."""
    y = np.empty(int(sizes.sum()), dtype=np.int64)
    ends = np.cumsum(sizes)
    for lo in range(0, len(sizes), chunk):
        hi = min(lo + chunk, len(sizes))
        cdf = np.cumsum(rng.dirichlet(np.full(p.num_classes, p.alpha), hi - lo), axis=1)
        cdf[:, -1] = 1.0
        owner = np.repeat(np.arange(hi - lo), sizes[lo:hi])
        u = rng.random(len(owner))
        start = ends[lo] - sizes[lo]
        y[start:ends[hi - 1]] = (u[:, None] >= cdf[owner]).sum(axis=1)
    return y


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit integer from any 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def device_seed(gen_seed: int, dev: int) -> int:
    """The seed of device ``dev``'s features: distinct streams for distinct (gen_seed, dev)."""
    return _mix64(_mix64(gen_seed & _MASK64) ^ dev)


def _features(idx: np.ndarray, p: CrowdParams, starts: np.ndarray, sizes: np.ndarray, y: np.ndarray,
              protos: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """Rows ``idx`` (any order): each device's block generated from its own seed, the rows picked.

    A device's generator draws an (n_i + 1) × d block of standard normals: its shift, then one row
    of noise per sample. The draws of up to ``chunk`` asked-for devices go into one buffer, and the
    rest is two gathers: the rows' noise, and their class prototype plus device shift from a
    (device, class) table. torch's normal sampler, because the draws are most of what building a
    round's data costs (4 against 9 ms with numpy's for 10⁶ floats)."""
    idx = np.asarray(idx, dtype=np.int64)
    owner = np.searchsorted(starts, idx, side="right") - 1
    devs = np.unique(owner)
    if not len(devs):
        return np.zeros((0, p.num_features), dtype=np.float32)
    rank = np.searchsorted(devs, owner)                  # each row's device among the asked-for ones
    protos_t = torch.from_numpy(protos)
    g = torch.Generator()
    out = torch.empty((len(idx), p.num_features), dtype=torch.float32) if len(devs) > chunk else None
    for lo in range(0, len(devs), chunk):
        part = devs[lo:lo + chunk]
        rows = np.flatnonzero((rank >= lo) & (rank < lo + chunk)) if len(devs) > chunk else slice(None)
        at = np.concatenate([[0], np.cumsum(sizes[part] + 1)])   # where each device's draws start
        draws = torch.empty((int(at[-1]), p.num_features), dtype=torch.float32)
        for dev, a, b in zip(part.tolist(), at[:-1].tolist(), at[1:].tolist()):
            g.manual_seed(device_seed(p.gen_seed, dev))
            torch.randn((b - a, p.num_features), generator=g, out=draws[a:b])
        k = rank[rows] - lo
        mine = idx[rows]
        x = draws.index_select(0, torch.from_numpy(at[:-1][k] + 1 + mine - starts[owner[rows]])).mul_(p.noise)
        shifts = draws.index_select(0, torch.from_numpy(at[:-1])).mul_(p.shift)
        table = (shifts[:, None, :] + protos_t[None, :, :]).reshape(-1, p.num_features)
        x.add_(table.index_select(0, torch.from_numpy(k * p.num_classes + y[mine])))
        if out is None:
            return x.numpy()   # one chunk: its rows are every row, in order
        out[torch.from_numpy(rows)] = x
    return out.numpy()


def random_splits(devices: list[np.ndarray], test_fraction: float, val_fraction: float,
                  rng: np.random.Generator) -> tuple[list, list, list]:
    """Every device's rows split at random into (train, val, test) (see the module docstring)."""
    sizes = np.array([len(d) for d in devices], dtype=np.int64)
    rows = np.concatenate(devices) if devices else np.zeros(0, dtype=np.int64)
    n_test = np.round(sizes * test_fraction).astype(np.int64)
    n_val = np.round(sizes * val_fraction).astype(np.int64)
    if test_fraction > 0:
        n_test = np.where(sizes >= 2, np.maximum(n_test, 1), n_test)
    if val_fraction > 0:
        n_val = np.where(sizes >= 3, np.maximum(n_val, 1), n_val)
    n_test = np.minimum(n_test, np.maximum(sizes - 1, 0))
    n_val = np.minimum(n_val, np.maximum(sizes - 1 - n_test, 0))
    owner = np.repeat(np.arange(len(sizes)), sizes)
    # devices in turn, each one's rows shuffled: the device number plus a uniform fraction, sorted
    order = np.argsort(owner + rng.random(len(rows)))
    rank = np.arange(len(rows)) - (np.cumsum(sizes) - sizes)[owner]
    test = rank < n_test[owner]
    val = ~test & (rank < (n_test + n_val)[owner])
    shuffled = rows[order]
    out = []
    for mask in (~(test | val), val, test):
        picked = shuffled[mask]
        ends = np.cumsum(np.bincount(owner[mask], minlength=len(sizes))).tolist()
        out.append([picked[a:b] for a, b in zip([0] + ends[:-1], ends)])
    return out[0], out[1], out[2]


def _as_is(x: np.ndarray) -> np.ndarray:
    return x


def load(p: CrowdParams, num_clients: int) -> SourceData:
    rng = np.random.default_rng([p.gen_seed, 0])
    protos = (p.separation * rng.standard_normal((p.num_classes, p.num_features))).astype(np.float32)
    sizes = _sizes(p, num_clients, rng)
    y = _labels(p, sizes, rng)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    devices = [np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts.tolist(), sizes.tolist())]
    read = functools.partial(_features, p=p, starts=starts, sizes=sizes, y=y, protos=protos)
    return SourceData(x=None, y=y, input_shape=(p.num_features,), num_classes=p.num_classes, task=CLASSIFICATION,
                      featurize=_as_is, devices=devices, read_rows=read, split=random_splits)


register_source(SourceSpec(
    "crowd", "a large synthetic population (10^4-10^6 devices): Dirichlet label mixes, Gaussian classes, a "
    "feature shift per device; features generated when a device is read",
    CrowdParams, "mlp", CLASSIFICATION, per_client=True, image=False,
    shape_fn=lambda p: ((p.num_features,), p.num_classes), load_fn=load))


__all__ = ["CrowdParams", "load", "random_splits"]
