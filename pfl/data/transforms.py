"""Per-cluster transforms that give pooled data a known cluster structure.

* Label swap (FPFC's MNIST/FMNIST setting): a client of cluster k sees labels k and C−2−k
  exchanged (C = 10: cluster 0 swaps 0↔8, 1: 1↔7, 2: 2↔6, 3: 3↔5). The K maps are distinct only
  while k < (C−2)/2 for k < K−1, i.e. C ≥ 2K; with C = 2K the last cluster's map is the identity.
  Two clusters disagree on at most 4 of the C labels.
* Label shift: a client of cluster k sees label (y + k) mod C, so any two clusters (K ≤ C) disagree
  on every label. A concept shift for methods that exchange predictions rather than models
  (PerFed-CKT's logits), where a 2-label swap leaves most of a mixed teacher right.
* Rotation: a client of cluster k sees its images rotated counter-clockwise by k·360/K degrees;
  quarter turns are exact (``torch.rot90``), other angles resample bilinearly with zero padding.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def swap_pair(cluster: int, num_classes: int) -> tuple[int, int]:
    return cluster, num_classes - 2 - cluster


def swap_labels(y: np.ndarray, cluster: int, num_classes: int) -> np.ndarray:
    a, b = swap_pair(cluster, num_classes)
    mapping = np.arange(num_classes)
    mapping[a], mapping[b] = b, a
    return mapping[y]


def shift_labels(y: np.ndarray, cluster: int, num_classes: int) -> np.ndarray:
    return (y + cluster) % num_classes


def rotation_degrees(cluster: int, num_clusters: int) -> float:
    return cluster * 360.0 / num_clusters


def rotate_images(x: torch.Tensor, degrees: float) -> torch.Tensor:
    """Rotate a batch of (N, C, H, W) images counter-clockwise by ``degrees``."""
    turns = degrees / 90.0
    if abs(turns - round(turns)) < 1e-9:
        return torch.rot90(x, int(round(turns)) % 4, dims=(-2, -1))
    return rotate_resampled(x, degrees)


def rotate_resampled(x: torch.Tensor, degrees: float) -> torch.Tensor:
    """Counter-clockwise rotation of (N, C, H, W) images by any angle (bilinear, zero padding)."""
    rad = math.radians(degrees)
    cos, sin = math.cos(rad), math.sin(rad)
    # affine_grid maps each output pixel (column, row coordinates in [-1, 1], rows pointing down)
    # to the input location it reads; reading from the clockwise-rotated position turns the picture
    # counter-clockwise, matching torch.rot90's direction
    theta = torch.tensor([[cos, -sin, 0.0], [sin, cos, 0.0]], dtype=x.dtype, device=x.device)
    grid = F.affine_grid(theta.expand(x.shape[0], 2, 3), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def rotate_samples(x: torch.Tensor, degrees: float, image_shape: tuple[int, int, int]) -> torch.Tensor:
    """Rotate samples of any stored shape (e.g. flat 64-vectors of 8×8 digits) viewed as images."""
    if x.shape[0] == 0 or degrees % 360 == 0:
        return x
    shape = x.shape
    return rotate_images(x.reshape((shape[0],) + tuple(image_shape)), degrees).reshape(shape).contiguous()
