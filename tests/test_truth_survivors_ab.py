"""Truth tests for the survivors of set AB (issue 42) in pfl/compression/compressors.py: the
(p, s)-quantizer ``PQuant`` (``omega``, ``levels_bits``, ``quantize``, ``compress``) and the presets
``QSGD`` and ``TernGrad`` (their ``__init__``). The truths are the compressors' table and the specs
(docs/methods/compression.md, docs/methods/seminar.md §2.4), evaluated by hand here: ω in closed form
(QSGD min(b/s², √b/s), TernGrad (√b − 1)/2, other (p, s) min(b^{1/r}/s, b^{2/r}/(4s²)) with
r = min(p, 2)) at points where each term is worked out in the comment; the bits of ``packing: base``
from m = ⌊log_{2s+1} 256⌋ symbols per byte counted by hand (TernGrad: 5 trits per byte; 2s+1 > 256:
no symbol fits in less than a byte, so the fixed ⌈log2(2s+1)⌉ bits); the decoded vector from its
definition ξ_i = ⌊r_i⌋ + Be(r_i − ⌊r_i⌋) with the Bernoulli realised as ``u_i < r_i − ⌊r_i⌋`` on the
uniforms the test passes (Be(0) never fires, so integer levels and one-entry buckets are sent as they
are, and no level exceeds s), computed with numpy; the number of scalar values on the wire = the
number of norms (one per bucket). The presets must expand to the pquant parameters they are named
after (QSGD: p = 2; TernGrad: p = ∞, s = 1) with their own bucket and packing, and keep their preset.
"""

from __future__ import annotations

import contextlib
import math
import signal

import numpy as np
import pytest
import torch

from pfl.compression.compressors import PQuant, PQuantParams, QSGD, QSGDParams, TernGrad, TernGradParams


@contextlib.contextmanager
def _within(seconds: float):
    """Fail (TimeoutError) instead of hanging when the body does not return within ``seconds``."""
    def _raise(signum, frame):
        raise TimeoutError(f"did not return within {seconds} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _pq(p, s, bucket=None, packing="fixed"):
    return PQuant(PQuantParams(p=p, s=s, bucket=bucket, packing=packing))


# ---- ω ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("b, s, want", [
    (4, 1, 2.0),     # min(4/1, √4/1) = min(4, 2)
    (1, 2, 0.25),    # min(1/4, 1/2)
    (64, 2, 4.0),    # min(64/4, 8/2) = min(16, 4)
])
def test_qsgd_omega_is_min_of_b_over_s_squared_and_root_b_over_s(b, s, want):
    assert QSGD(QSGDParams(s=s, bucket=None)).omega(b) == pytest.approx(want)
    assert _pq(2.0, s, bucket=b).omega(10 * b) == pytest.approx(want)  # the bucket, not d


@pytest.mark.parametrize("p, s, b, want", [
    (1.0, 1, 4, 4.0),         # r = 1: min(4¹/1, 4²/4) = min(4, 4)
    (math.inf, 2, 64, 4.0),   # r = 2: min(8/2, 64/16) = min(4, 4); not TernGrad's (√64 − 1)/2 (s = 2)
    (3.0, 1, 64, 8.0),        # r = 2: min(8, 64/4) = min(8, 16)
    (3.0, 1, 4, 1.0),         # r = 2: min(2, 4/4) = min(2, 1)
    (3.0, 2, 4, 0.25),        # r = 2: min(2/2, 4/16) = min(1, 0.25)
    (math.inf, 1, 64, 3.5),   # TernGrad: (√64 − 1)/2
])
def test_pquant_omega_is_the_documented_closed_form(p, s, b, want):
    assert _pq(p, s).omega(b) == pytest.approx(want)


# ---- bits of the base packing -------------------------------------------------------------------

@pytest.mark.parametrize("s, m", [
    (1, 5),     # 3^5 = 243 ≤ 256 < 729 = 3^6
    (2, 3),     # 5^3 = 125 ≤ 256 < 625
    (3, 2),     # 7^2 = 49 ≤ 256 < 343
    (7, 2),     # 15^2 = 225 ≤ 256 < 3375
    (8, 1),     # 17 ≤ 256 < 289 = 17^2
    (127, 1),   # 255 ≤ 256
])
def test_base_packing_puts_m_symbols_in_a_byte(s, m):
    assert m == math.floor(math.log(256) / math.log(2 * s + 1))  # m = ⌊log_{2s+1} 256⌋
    for d in (1, 7, 30, 1000):
        with _within(5.0):
            bits = _pq(2.0, s, bucket=None, packing="base").bits(d)
        assert bits == 32 + 8 * math.ceil(d / m)


def test_base_packing_with_more_than_256_symbols_falls_back_to_fixed_width():
    """s = 128: 2s + 1 = 257 symbols, none fits a byte (m = 0), so ⌈log2 257⌉ = 9 bits an entry."""
    for d in (1, 10, 100):
        with _within(5.0):
            assert _pq(2.0, 128, bucket=None, packing="base").bits(d) == 32 + 9 * d
            assert _pq(2.0, 128, bucket=None, packing="fixed").bits(d) == 32 + 9 * d


@pytest.mark.parametrize("d", [1, 5, 6, 37])
def test_terngrad_base_packing_sends_five_trits_per_byte(d):
    with _within(5.0):
        assert TernGrad(TernGradParams(packing="base")).bits(d) == 32 + 8 * math.ceil(d / 5)
        assert TernGrad(TernGradParams(packing="fixed")).bits(d) == 32 + 2 * d
        assert TernGrad(TernGradParams(bucket=4, packing="base")).bits(d) == 32 * math.ceil(d / 4) + 8 * math.ceil(d / 5)


@pytest.mark.parametrize("d", [1, 5, 6, 37])
def test_qsgd_base_packing_is_its_own_option(d):
    with _within(5.0):
        assert QSGD(QSGDParams(s=1, bucket=4, packing="base")).bits(d) == 32 * math.ceil(d / 4) + 8 * math.ceil(d / 5)
        assert QSGD(QSGDParams(s=1, bucket=4, packing="fixed")).bits(d) == 32 * math.ceil(d / 4) + 2 * d
        assert QSGD(QSGDParams(s=2, bucket=None, packing="base")).bits(d) == 32 + 8 * math.ceil(d / 3)


# ---- the presets ------------------------------------------------------------------------------------

def test_qsgd_and_terngrad_expand_to_their_pquant_parameters_and_keep_the_preset():
    q = QSGDParams(s=3, bucket=8, packing="base")
    qsgd = QSGD(q)
    assert qsgd.preset is q
    assert qsgd.p == PQuantParams(p=2.0, s=3, bucket=8, packing="base")
    t = TernGradParams(bucket=16, packing="base")
    tern = TernGrad(t)
    assert tern.preset is t
    assert tern.p == PQuantParams(p=math.inf, s=1, bucket=16, packing="base")


def test_terngrad_with_buckets_scales_each_bucket_by_its_own_max():
    """T(x)_i = ‖x_B‖_∞·sign(x_i)·Be(|x_i|/‖x_B‖_∞) per bucket B; u = 0 makes every Be(q > 0) fire,
    u → 1 only the bucket's largest entry (q = 1); bits 32·⌈d/b⌉ + 2d, one scale per bucket."""
    v = np.array([0.5, -2.0, 1.0, 0.0, 3.0, -0.25, 0.75, 1.5, -4.0, 2.0], dtype=np.float32)
    d, b = v.size, 4
    tern = TernGrad(TernGradParams(bucket=b))
    scale = np.repeat([np.abs(v[i:i + b]).max() for i in range(0, d, b)], b)[:d]
    low = tern.quantize(torch.tensor(v), torch.zeros(d)).numpy()
    np.testing.assert_array_equal(low, np.sign(v) * scale)
    high = tern.quantize(torch.tensor(v), torch.full((d,), 1 - 2**-24)).numpy()
    np.testing.assert_array_equal(high, np.where(np.abs(v) == scale, v, 0.0))
    enc = tern.compress(torch.tensor(v), torch.Generator().manual_seed(0))
    assert enc.bits == 32 * math.ceil(d / b) + 2 * d
    assert enc.values == math.ceil(d / b)


# ---- quantize / compress ----------------------------------------------------------------------------

@pytest.mark.parametrize("bucket, d, norms", [(4, 10, 3), (None, 10, 1), (3, 3, 1), (1, 5, 5)])
def test_pquant_sends_one_norm_per_bucket_as_its_scalar_values(bucket, d, norms):
    enc = _pq(2.0, 7, bucket=bucket).compress(torch.arange(1.0, d + 1), torch.Generator().manual_seed(1))
    assert enc.values == norms
    assert enc.bits == 32 * norms + 4 * d  # ⌈log2 15⌉ = 4 bits an entry


@pytest.mark.parametrize("bucket, bits", [(None, 32), (4, 0)])
def test_an_empty_vector_quantizes_to_an_empty_vector(bucket, bits):
    """d = 0: nothing to quantize; per tensor the norm is still sent (32 bits), with buckets none."""
    for p in (1.0, 2.0, 3.0):
        enc = _pq(p, 3, bucket=bucket).compress(torch.zeros(0), torch.Generator().manual_seed(0))
        assert enc.decoded.shape == (0,)
        assert enc.bits == bits


def test_integer_levels_are_sent_exactly_whatever_the_uniform():
    """v = (3, 4, 0), ‖v‖₂ = 5, s = 5: r = (3, 4, 0) are integers, Be(0) never fires, so Q(v) = v for
    every u ∈ [0, 1), u = 0 included."""
    v = torch.tensor([3.0, -4.0, 0.0])
    comp = _pq(2.0, 5, bucket=None)
    for u in (0.0, 0.5, 1 - 2**-24):
        np.testing.assert_allclose(comp.quantize(v, torch.full((3,), u)).numpy(), [3.0, -4.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_a_bucket_of_one_entry_is_sent_exactly_and_no_level_exceeds_s(p):
    """Buckets of one entry: ‖x_B‖_p = |x_i|, r_i = s, so ξ_i = s and Q(x)_i = x_i, also where
    s·|x_i|/‖x_B‖_p rounds above s in float32 (the level stays in {−s..s}). (u ≤ 1/2: where r_i rounds
    a unit below s, ⌊r_i⌋ = s − 1 and Be(1 − 2⁻²²) is read off u, so u → 1 could give s − 1.)"""
    rng = np.random.default_rng(7)
    v = (rng.normal(size=400) * 10).astype(np.float32)
    for s in (3, 5, 7):
        comp = _pq(p, s, bucket=1)
        for u in (0.0, 0.5):
            out = comp.quantize(torch.tensor(v), torch.full((v.size,), u)).numpy()
            np.testing.assert_allclose(out, v, rtol=1e-6)


def test_terngrad_scales_a_long_tensor_by_its_max():
    """One scale per tensor over 2^17 entries: with u = 0 every non-zero entry becomes
    sign(v_i)·‖v‖_∞ (numpy)."""
    d = 2**17
    v = np.random.default_rng(3).normal(size=d).astype(np.float32)
    v[::97] = 0.0
    out = TernGrad(TernGradParams()).quantize(torch.tensor(v), torch.zeros(d)).numpy()
    np.testing.assert_array_equal(out, np.sign(v) * np.abs(v).max())
