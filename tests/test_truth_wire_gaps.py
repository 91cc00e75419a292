"""Truths for the wire's behaviours the mutation score found unguarded (docs/verification.md,
"Mutation score"): each compares with a closed form or a computation written another way, and names
the mutant it was shown to kill."""

import math

import numpy as np
import torch

from pfl.aggregation import krum_scores
from pfl.compression import build, resolve_spec
from pfl.compression.base import Scaled


def test_scaled_compressor_is_the_inner_draw_divided_by_one_plus_omega():
    """Scaled(C) = C/(1 + ω) on the same seeded draw, ω = d/k − 1 for rand-k (by hand), same bits; and
    contractive: the Monte Carlo mean of ‖v − C'(v)‖² stays below (1 − 1/(1 + ω))‖v‖² (kills
    Scaled.compress 5, which drew from the global stream instead of the given generator)."""
    d, k = 40, 10
    inner = build(resolve_spec({"name": "randk", "ratio": k / d}, "compression.downlink"))
    scaled = Scaled(inner)
    v = torch.linspace(-1.0, 2.0, d)
    omega = d / k - 1
    torch.manual_seed(123)  # the global stream: a compressor must not read it
    for seed in range(5):
        got = scaled.compress(v, torch.Generator().manual_seed(seed))
        ref = inner.compress(v, torch.Generator().manual_seed(seed))
        torch.testing.assert_close(got.decoded, ref.decoded / (1 + omega), rtol=1e-6, atol=0.0)
        assert got.bits == ref.bits
        assert int((got.decoded != 0).sum()) == k
    g = torch.Generator().manual_seed(7)
    err = np.mean([float(((v - scaled.compress(v, g).decoded) ** 2).sum()) for _ in range(400)])
    assert err <= (1 - 1 / (1 + omega)) * float((v * v).sum()) * 1.05
    assert math.isclose(inner.omega(d), omega)


def test_krum_scores_are_exact_for_replies_far_from_the_origin():
    """Krum's scores = sums of the n − f − 2 smallest squared distances, computed here directly as
    Σ(x_i − x_j)² in float64; replies at 1000 ± 0.01 make the ‖x‖² + ‖y‖² − 2xy expansion lose every
    digit in float32 (kills krum_scores 11: the float64 cast dropped)."""
    rs = np.random.RandomState(0)
    flat = (1000.0 + 0.01 * rs.normal(size=(6, 50))).astype(np.float32)
    f = 1
    x = flat.astype(np.float64)
    dist = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(dist, np.inf)
    expected = np.sort(dist, axis=1)[:, :len(x) - f - 2].sum(1)
    got = krum_scores(torch.from_numpy(flat), f).double().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6)
