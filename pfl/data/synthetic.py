"""The FPFC paper's synthetic federations, generated locally from a generator seed.

``fpfc_synthetic`` (clustered multinomial-logistic data, docs/methods/fpfc.md §5.1). With m devices and K
clusters, device i belongs to cluster ⌊i·K/m⌋ (contiguous blocks). Everything is drawn from one
legacy ``numpy.random.RandomState(gen_seed)``, in the order of the official generator, so that
``gen_seed = 0`` reproduces the paper's data:

1. sizes: Z_i ~ LogNormal(4, 2) for all devices at once, n_i = 5·(⌊Z_i⌋ + 50) (at least 250);
2. cluster centres μ_k ~ N(0, 1), k < K;
3. for k = 0..K−1: W_k (C×d) then b_k (C) with entries ~ N(μ_k, 1), kept in float32 as the original;
4. device by device: x ~ U[0, 1)^d for all its samples, then the label noise ε ~ N(0, σ²·I_C) of
   each sample in turn; y = argmax(W_k x + b_k + ε).

Drawing each device's noise as one (n_i, C) block consumes the legacy stream exactly like n_i
draws of C values, so the vectorised generator yields the original's samples. ``size_scale``
shrinks every n_i (to at least 10) for quick runs; it changes the samples drawn after the sizes.

``fpfc_linear`` (clustered linear regression; the paper's regression setting is not specified in
the code, this is our choice). K clusters of contiguous devices as above. Drawn in this order from
``RandomState(gen_seed)``:

1. sizes: ``sizes: lognormal`` as above (times ``size_scale``), or ``fixed``: every device has
   ``samples_per_device`` samples (no draw);
2. β_k ∈ R^d, entries ~ N(0, 1)·``beta_scale``, k = 0..K−1 (clusters are far apart relative to the
   noise: ‖β_k − β_l‖ ≈ beta_scale·√(2d));
3. device by device: x ~ N(0, I_d), then ε ~ N(0, ``noise_std``²); y = x·β_k + ε (float32, no
   intercept).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..schema import ConfigError, hp


def contiguous_clusters(num_devices: int, num_clusters: int) -> np.ndarray:
    """Cluster id ⌊i·K/m⌋ of every device: K contiguous blocks of (nearly) equal length."""
    return (np.arange(num_devices) * num_clusters) // num_devices


def lognormal_sizes(rs: np.random.RandomState, num_devices: int, size_scale: float) -> np.ndarray:
    z = rs.lognormal(4.0, 2.0, num_devices)
    sizes = (z.astype(np.int64) + 50) * 5
    if size_scale != 1.0:
        sizes = np.maximum(10, np.round(sizes * size_scale).astype(np.int64))
    return sizes


@dataclass
class FPFCSyntheticParams:
    """Clustered softmax-regression devices of the FPFC paper (docs/methods/fpfc.md §5.1)."""
    num_features: int = hp(60, "input dimension d", low=1)
    num_classes: int = hp(10, "number of classes C", low=2)
    num_clusters: int = hp(4, "number of true clusters K (device i is in cluster ⌊i·K/m⌋)", low=1)
    noise_std: float = hp(0.5, "std of the Gaussian noise added to the logits before argmax", low=0.0)
    gen_seed: int = hp(0, "generator seed (independent of the experiment seed; 0 = the paper's data)", low=0)
    size_scale: float = hp(1.0, "multiply every device's sample count by this (at least 10 samples); "
                           "< 1 for fast runs", low=0.0, low_open=True)


@dataclass
class FPFCLinearParams:
    """Clustered linear-regression devices (our construction; see pfl.data.synthetic)."""
    num_features: int = hp(10, "input dimension d", low=1)
    num_clusters: int = hp(4, "number of true clusters K (device i is in cluster ⌊i·K/m⌋)", low=1)
    beta_scale: float = hp(1.0, "scale of the cluster coefficients: β_k entries ~ N(0, 1)·beta_scale",
                           low=0.0, low_open=True)
    noise_std: float = hp(0.5, "std of the additive Gaussian noise on y", low=0.0)
    sizes: str = hp("fixed", "device sizes: 'fixed' (samples_per_device each) or 'lognormal' "
                    "(as fpfc_synthetic: 5·(⌊Z⌋+50), Z ~ LogNormal(4, 2), times size_scale)",
                    choices=("fixed", "lognormal"))
    samples_per_device: int = hp(200, "samples per device (sizes=fixed)", low=2)
    size_scale: float = hp(1.0, "multiply lognormal sizes by this (at least 10 samples)", low=0.0, low_open=True)
    gen_seed: int = hp(0, "generator seed (independent of the experiment seed)", low=0)


@dataclass
class Generated:
    """A generated federation: all samples concatenated, device by device."""
    x: np.ndarray            # (N, d) float32
    y: np.ndarray            # (N,) int64 (classification) or float32 (regression)
    sizes: np.ndarray        # (m,) samples per device
    clusters: np.ndarray     # (m,) true cluster per device

    def device_indices(self) -> list[np.ndarray]:
        ends = np.cumsum(self.sizes)
        return [np.arange(e - n, e) for n, e in zip(self.sizes, ends)]


def _check_clusters(num_devices: int, num_clusters: int) -> None:
    if num_clusters > num_devices:
        raise ConfigError("data.params.num_clusters",
                          f"{num_clusters} clusters need at least as many devices (data.num_clients = {num_devices})")


def generate_fpfc_synthetic(p: FPFCSyntheticParams, num_devices: int) -> Generated:
    _check_clusters(num_devices, p.num_clusters)
    rs = np.random.RandomState(p.gen_seed)
    sizes = lognormal_sizes(rs, num_devices, p.size_scale)
    clusters = contiguous_clusters(num_devices, p.num_clusters)
    centres = rs.normal(0.0, 1.0, p.num_clusters)
    weights, biases = [], []
    for k in range(p.num_clusters):
        weights.append(rs.normal(centres[k], 1.0, (p.num_classes, p.num_features)).astype(np.float32))
        biases.append(rs.normal(centres[k], 1.0, (1, p.num_classes)).astype(np.float32))
    total = int(sizes.sum())
    x = np.empty((total, p.num_features), dtype=np.float32)
    y = np.empty(total, dtype=np.int64)
    start = 0
    for i, n in enumerate(sizes):
        k = clusters[i]
        xi = rs.random_sample((n, p.num_features))
        noise = rs.normal(0.0, p.noise_std, (n, p.num_classes)).astype(np.float32)
        # float64 logits from float32 parameters and noise, as the original computed them
        logits = xi @ weights[k].T.astype(np.float64) + biases[k] + noise
        x[start:start + n] = xi
        y[start:start + n] = logits.argmax(axis=1)
        start += n
    return Generated(x, y, sizes, clusters)


def generate_fpfc_linear(p: FPFCLinearParams, num_devices: int) -> Generated:
    _check_clusters(num_devices, p.num_clusters)
    rs = np.random.RandomState(p.gen_seed)
    if p.sizes == "lognormal":
        sizes = lognormal_sizes(rs, num_devices, p.size_scale)
    else:
        sizes = np.full(num_devices, p.samples_per_device, dtype=np.int64)
    clusters = contiguous_clusters(num_devices, p.num_clusters)
    betas = rs.normal(0.0, 1.0, (p.num_clusters, p.num_features)) * p.beta_scale
    total = int(sizes.sum())
    x = np.empty((total, p.num_features), dtype=np.float32)
    y = np.empty(total, dtype=np.float32)
    start = 0
    for i, n in enumerate(sizes):
        xi = rs.standard_normal((n, p.num_features))
        eps = rs.normal(0.0, p.noise_std, n)
        x[start:start + n] = xi
        y[start:start + n] = xi @ betas[clusters[i]] + eps
        start += n
    return Generated(x, y, sizes, clusters)
