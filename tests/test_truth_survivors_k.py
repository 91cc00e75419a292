"""Truth tests for the survivors of set K (issue 42) in pfl/compression/compressors.py (the config
validation ``resolve_spec`` on every branch, ``build``, ``contractive``, ``power_of_two_below``, the
``compress`` of identity / fp16 / bf16 / natural / rand-k / top-k / sign, ``TopK.bits``,
``RandK.omega``), pfl/compression/base.py (``Scaled.bits``) and pfl/lowrank.py (``decode``,
``LayerSVT.factorized``).

The truths are built here, not read back from pfl: half-precision rounding from numpy's float16 and
bfloat16 from round-to-nearest-even on the float32 bit pattern; the fp16 overflow threshold from
numpy (float16(65520) is inf); scaled sign = (‖v‖₁/d)·sign(v) with sign(0) = +1 (the compressors'
table, docs/methods/compression.md §5); natural compression's powers of two from numpy's frexp and
its rounding rule "up iff u < (a − 2^⌊log2 a⌋)/2^⌊log2 a⌋" on the uniform draw the test makes itself
from the same seed (the rule that makes E C(v) = v exact on the draw grid; powers of two are sent
as they are); top-k's kept set from numpy's stable argsort (ties to the lower index); bit counts by
hand (identity 32d, fp16 16d, natural 9d, sign d / d + 32, top-k min(k(32+⌈log2 d⌉), d+32k), TernGrad
32 + 2d); ω closed forms (rand-k d/k − 1, biased: ∞); a low-rank payload decodes to left @ right;
a factor pair is used only when strictly smaller than the dense matrix. The config errors must name
the field (``compression.uplink.name``, ``compression.uplink.<param>``) and the allowed values (the
names listed in docs/methods/compression.md).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pfl.compression.base import Scaled
from pfl.compression.compressors import (
    BFloat16, CompressorSpec, HalfParams, HalfPrecision, Identity, Natural, NoParams, QSGDParams, RandK,
    RandKParams, Sign, SignParams, TernGrad, TernGradParams, TopK, TopKParams, build, contractive,
    power_of_two_below, resolve_spec,
)
from pfl.federation.messages import Encoded, LowRank
from pfl.lowrank import LayerSVT, decode, encode
from pfl.schema import ConfigError

PATH = "compression.uplink"
#: the ``name`` values docs/methods/compression.md lists (plus ``none``)
DOC_NAMES = ("none", "identity", "fp16", "bf16", "pquant", "qsgd", "terngrad", "natural", "randk", "topk", "sign")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- resolve_spec: every branch ------------------------------------------------------------------

@pytest.mark.parametrize("raw", [None, {}, {"name": None}, {"name": "none"}, "none"])
def test_no_compressor_is_spelled_none_a_missing_name_a_null_name_or_the_string_none(raw):
    spec = resolve_spec(raw, PATH)
    assert spec == CompressorSpec("none", None)
    assert spec.build() is None
    assert spec.to_dict() == {"name": "none"}


def test_a_bare_string_names_a_compressor_with_its_documented_defaults():
    assert resolve_spec("topk", PATH) == CompressorSpec("topk", TopKParams(ratio=0.01))
    assert resolve_spec("qsgd", PATH) == CompressorSpec("qsgd", QSGDParams(s=7, bucket=512, packing="fixed"))
    assert resolve_spec("sign", PATH).params == SignParams(scaled=True)
    assert resolve_spec("fp16", PATH).params == HalfParams(overflow="error")
    assert resolve_spec("natural", PATH) == CompressorSpec("natural", NoParams())


def test_a_mapping_gets_the_given_parameters_and_the_defaults_for_the_rest():
    spec = resolve_spec({"name": "randk", "ratio": 0.25}, PATH)
    assert spec == CompressorSpec("randk", RandKParams(ratio=0.25, scale=True, indices="seed"))
    assert spec.to_dict() == {"name": "randk", "ratio": 0.25, "scale": True, "indices": "seed"}
    assert spec["ratio"] == 0.25


def test_an_already_resolved_spec_resolves_to_itself():
    for spec in (CompressorSpec("qsgd", QSGDParams(s=3, bucket=None, packing="base")),
                 CompressorSpec("randk", RandKParams(ratio=0.5, scale=False, indices="explicit")),
                 CompressorSpec("sign", SignParams(scaled=False)), CompressorSpec()):
        assert resolve_spec(spec, PATH) == spec


def test_the_input_mapping_is_not_consumed():
    raw = {"name": "topk", "ratio": 0.5}
    resolve_spec(raw, PATH)
    assert raw == {"name": "topk", "ratio": 0.5}


@pytest.mark.parametrize("raw", [5, ["qsgd"], 0.5, True])
def test_a_value_that_is_not_a_mapping_is_refused_naming_the_section_and_the_expected_form(raw):
    with pytest.raises(ConfigError) as e:
        resolve_spec(raw, PATH)
    assert e.value.field == PATH
    assert "expected a mapping" in e.value.message and "name" in e.value.message
    assert repr(raw) in e.value.message
    assert str(e.value).startswith(f"{PATH}: ")


@pytest.mark.parametrize("raw", [{"name": "bogus"}, "bogus", {"name": "NONE"}, {"name": "topk1"}])
def test_an_unknown_name_is_refused_naming_the_field_the_value_and_every_allowed_name(raw):
    wrong = raw if isinstance(raw, str) else raw["name"]
    with pytest.raises(ConfigError) as e:
        resolve_spec(raw, PATH)
    assert e.value.field == f"{PATH}.name"
    assert repr(wrong) in e.value.message
    allowed = e.value.message.split("allowed:")[1]
    assert {n.strip() for n in allowed.split(",")} == set(DOC_NAMES)


@pytest.mark.parametrize("raw", [{"name": "none", "s": 3}, {"s": 3}, {"name": None, "s": 3}])
def test_parameters_without_a_compressor_are_refused_naming_the_parameter(raw):
    with pytest.raises(ConfigError) as e:
        resolve_spec(raw, "compression.downlink")
    assert e.value.field == "compression.downlink.s"
    assert e.value.message.startswith("name=none takes no parameters")
    assert e.value.message.endswith("; allowed: name")


@pytest.mark.parametrize("raw, field, words", [
    ({"name": "qsgd", "s": 0}, "s", (">= 1",)),
    ({"name": "qsgd", "p": 3}, "p", ("unknown field", "bucket", "packing", "s")),
    ({"name": "topk", "ratio": 1.5}, "ratio", ("<= 1",)),
    ({"name": "fp16", "overflow": "wrap"}, "overflow", ("error", "saturate")),
    ({"name": "randk", "indices": "list"}, "indices", ("seed", "explicit")),
])
def test_a_bad_parameter_is_refused_naming_compression_uplink_param_and_what_is_allowed(raw, field, words):
    with pytest.raises(ConfigError) as e:
        resolve_spec(raw, PATH)
    assert e.value.field == f"{PATH}.{field}"
    for w in words:
        assert w in e.value.message


# ---- build and the contractive form -----------------------------------------------------------------

def test_build_makes_the_named_compressor_and_nothing_for_none():
    assert build(None) is None
    assert build({"name": "none"}) is None
    assert build(CompressorSpec()) is None
    comp = build({"name": "randk", "ratio": 0.25})
    assert isinstance(comp, RandK) and comp.p == RandKParams(ratio=0.25)
    comp = build(CompressorSpec("topk", TopKParams(ratio=0.5)))
    assert isinstance(comp, TopK) and comp.p.ratio == 0.5
    assert isinstance(build("natural"), Natural)


@pytest.mark.parametrize("raw, field", [({"name": "bogus"}, "compression.name"),
                                        ({"name": "qsgd", "s": 0}, "compression.s"),
                                        (7, "compression")])
def test_build_of_a_bad_mapping_names_the_compression_field(raw, field):
    with pytest.raises(ConfigError) as e:
        build(raw)
    assert e.value.field == field


def test_the_contractive_form_is_the_identity_itself_scaled_for_unbiased_and_as_is_for_contractive():
    ident = Identity(NoParams())
    assert contractive(ident) is ident
    top = TopK(TopKParams(ratio=0.5))
    assert contractive(top) is top
    nat = Natural(NoParams())
    form = contractive(nat)
    assert isinstance(form, Scaled) and form.inner is nat


def test_plain_sign_has_no_contractive_form_and_the_error_says_so():
    with pytest.raises(ValueError) as e:
        contractive(Sign(SignParams(scaled=False)))
    assert "sign" in str(e.value) and "neither unbiased nor contractive" in str(e.value)


# ---- Scaled.bits -------------------------------------------------------------------------------------

@pytest.mark.parametrize("inner, per_entry, extra", [
    (Natural(NoParams()), 9, 0), (Sign(SignParams()), 1, 32), (Identity(NoParams()), 32, 0),
    (HalfPrecision(HalfParams()), 16, 0)])
def test_scaled_bits_of_a_compressor_without_a_formula_are_its_hand_count(inner, per_entry, extra):
    for d in (1, 7, 300):
        assert Scaled(inner).bits(d) == per_entry * d + extra


def test_counting_the_bits_of_scaled_natural_draws_nothing_from_the_global_random_stream():
    """The codec seeds every draw ("randomness comes only from the generator it is given"): counting
    bits must leave torch's global stream where it was."""
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    assert Scaled(Natural(NoParams())).bits(1000) == 9000
    assert torch.equal(torch.rand(5), expected)


def test_scaled_bits_are_the_inner_formula_for_every_d_empty_included():
    """Same bits as C: TernGrad per tensor is 32 + 2d (d = 0: the scale alone)."""
    scaled = Scaled(TernGrad(TernGradParams(bucket=None)))
    for d in (0, 1, 9, 1000):
        assert scaled.bits(d) == 32 + 2 * d


# ---- identity, half precision --------------------------------------------------------------------------

def test_identity_sends_every_float_at_32_bits():
    v = torch.tensor([1.5, -2.0, 0.0, 3.25])
    enc = Identity(NoParams()).compress(v)
    assert torch.equal(enc.decoded, v)
    assert enc.bits == 32 * 4 and enc.values == 4


def test_fp16_rounds_like_numpy_float16_and_counts_16_bits_per_entry():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=20) * 10.0 ** rng.integers(-6, 4, size=20),
                        [1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 65519.0, -65504.0, 1e-8, 0.0]]).astype(np.float32)
    enc = HalfPrecision(HalfParams()).compress(torch.from_numpy(x))
    assert enc.decoded.dtype == torch.float32
    np.testing.assert_array_equal(enc.decoded.numpy(), x.astype(np.float16).astype(np.float32))
    assert enc.bits == 16 * len(x) and enc.values == len(x)


def test_fp16_overflow_starts_at_65520_where_numpy_float16_gives_inf():
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(np.float32(65520.0))) and not np.isinf(np.float16(np.float32(65519.99)))
    err = HalfPrecision(HalfParams(overflow="error"))
    with pytest.raises(ValueError) as e:
        err.compress(torch.tensor([1.0, 65520.0]))
    assert "overflow fp16" in str(e.value)
    assert "overflow=saturate or name=bf16" in str(e.value)
    with pytest.raises(ValueError):
        err.compress(torch.tensor([-65520.0]))
    sat = HalfPrecision(HalfParams(overflow="saturate"))
    x = np.array([65520.0, -65520.0, 1e6, -1e9, 70000.0, 3.0], dtype=np.float32)
    enc = sat.compress(torch.from_numpy(x))
    expected = np.clip(x, -65504.0, 65504.0).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(enc.decoded.numpy(), expected)
    assert np.isfinite(enc.decoded.numpy()).all() and enc.values == len(x)


def _bf16(x: np.ndarray) -> np.ndarray:
    """bfloat16 by round to nearest even on the float32 bit pattern (finite inputs)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def test_bf16_rounds_to_nearest_even_on_the_float32_bits_and_never_overflows():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(size=30) * 10.0 ** rng.integers(-8, 30, size=30),
                        [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 65520.0, 1e30]]).astype(np.float32)
    enc = BFloat16(HalfParams()).compress(torch.from_numpy(x))
    assert enc.decoded.dtype == torch.float32
    np.testing.assert_array_equal(enc.decoded.numpy(), _bf16(x))
    assert enc.bits == 16 * len(x) and enc.values == len(x)


# ---- natural compression -----------------------------------------------------------------------------

def test_power_of_two_below_is_numpys_and_zero_at_zero():
    a = np.array([0.0, 1.0, 1.5, 2.0, 3.999, 0.3, 1e-30, 6e4, np.nextafter(np.float32(4.0), np.float32(0))],
                 dtype=np.float32)
    _, e = np.frexp(a.astype(np.float64))
    expected = np.where(a > 0, np.ldexp(1.0, e - 1), 0.0)
    np.testing.assert_array_equal(power_of_two_below(torch.from_numpy(a)).numpy(), expected.astype(np.float32))


def test_natural_rounds_up_exactly_when_the_draw_is_below_the_excess_and_keeps_powers_of_two():
    """decoded_i = sign(v_i)·(2^⌊log2|v_i|⌋ or twice that), up iff u_i < p_i = |v_i|/2^⌊log2|v_i|⌋ − 1,
    u the seed's uniforms: E over u is exactly |v_i| (1 − p)·low + p·2low. Entries built with
    p_i = u_i exactly must stay down (Pr(u < p) = p on the draw grid), zeros stay 0, powers of two
    are sent as they are."""
    n, seed = 64, 5
    u = torch.rand(n, generator=_gen(seed)).numpy().astype(np.float64)
    rng = np.random.default_rng(2)
    low = 2.0 ** rng.integers(-6, 6, size=n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    a = low * (1 + rng.random(n))
    grid = np.round(u * 2 ** 24)
    tie = grid % 2 == 0                       # 1 + u is exact in float32 there: p = u
    a[tie] = low[tie] * (1 + u[tie])
    a[:3] = low[:3]                           # powers of two
    a[3] = 0.0
    v = (sign * a).astype(np.float32)
    enc = Natural(NoParams()).compress(torch.from_numpy(v), _gen(seed))
    av = np.abs(v.astype(np.float64))
    _, e = np.frexp(av)
    lo = np.where(av > 0, np.ldexp(1.0, e - 1), 0.0)
    p = np.where(av > 0, (av - lo) / np.where(av > 0, lo, 1.0), 0.0)
    tie[:4] = False
    assert tie.sum() >= 10 and np.array_equal(p[tie], u[tie])
    expected = np.sign(v) * np.where(u < p, 2 * lo, lo)
    np.testing.assert_array_equal(enc.decoded.numpy(), expected.astype(np.float32))
    assert enc.decoded[3] == 0 and np.array_equal(np.abs(enc.decoded.numpy()[:3]), low[:3].astype(np.float32))
    assert enc.bits == 9 * n and enc.values == n


# ---- sparsification -----------------------------------------------------------------------------------

def test_topk_keeps_the_k_largest_magnitudes_ties_to_the_lower_index():
    rng = np.random.default_rng(3)
    x = rng.integers(-2, 3, size=200).astype(np.float32)   # many ties
    for ratio in (0.05, 0.2, 0.5):
        enc = TopK(TopKParams(ratio=ratio)).compress(torch.from_numpy(x))
        k = math.ceil(ratio * len(x))
        keep = np.argsort(-np.abs(x), kind="stable")[:k]
        expected = np.zeros_like(x)
        expected[keep] = x[keep]
        np.testing.assert_array_equal(enc.decoded.numpy(), expected)
        assert enc.values == k


@pytest.mark.parametrize("d, ratio", [(100, 0.5), (100, 0.01), (1000, 0.2), (1000, 0.03), (7, 1.0), (2, 0.5)])
def test_topk_bits_are_the_cheaper_of_indices_and_a_bitmap(d, ratio):
    k = max(1, math.ceil(ratio * d))
    ib = math.ceil(math.log2(d))
    expected = min(k * (32 + ib), d + 32 * k)
    comp = TopK(TopKParams(ratio=ratio))
    assert comp.bits(d) == expected
    assert comp.compress(torch.arange(float(d))).bits == expected


def test_randk_omega_is_d_over_k_minus_one_scaled_and_infinite_unscaled():
    for d, ratio in ((100, 0.1), (10, 0.3), (7, 1.0)):
        k = math.ceil(ratio * d)
        assert RandK(RandKParams(ratio=ratio)).omega(d) == d / k - 1
        assert RandK(RandKParams(ratio=ratio, scale=False)).omega(d) == math.inf


def test_randk_keeps_k_entries_scaled_by_d_over_k():
    v = torch.arange(1.0, 21.0)
    enc = RandK(RandKParams(ratio=0.25)).compress(v, _gen(4))
    kept = enc.decoded.numpy() != 0
    assert kept.sum() == 5 and enc.values == 5
    np.testing.assert_allclose(enc.decoded.numpy()[kept], v.numpy()[kept] * 4.0)


# ---- sign ---------------------------------------------------------------------------------------------

def test_scaled_sign_is_the_mean_magnitude_times_the_sign_with_sign_zero_plus_one():
    for x in (np.array([3.0, -1.0, 0.0, 2.0, -0.5], dtype=np.float32), np.array([-3.0], dtype=np.float32)):
        enc = Sign(SignParams(scaled=True)).compress(torch.from_numpy(x))
        s = np.where(x >= 0, 1.0, -1.0)
        np.testing.assert_allclose(enc.decoded.numpy(), s * np.abs(x).sum() / len(x), rtol=1e-7)
        assert enc.bits == len(x) + 32 and enc.values == 1


def test_plain_sign_sends_one_bit_per_entry_and_no_value():
    x = np.array([3.0, -1.0, 0.0, -0.0, 2.0], dtype=np.float32)
    enc = Sign(SignParams(scaled=False)).compress(torch.from_numpy(x))
    np.testing.assert_array_equal(enc.decoded.numpy(), [1.0, -1.0, 1.0, 1.0, 1.0])
    assert enc.bits == 5 and enc.values == 0


# ---- low rank ----------------------------------------------------------------------------------------

def test_decode_gives_left_times_right_and_the_decoded_value_of_an_encoded_payload():
    rng = np.random.default_rng(4)
    left, right = rng.normal(size=(4, 2)).astype(np.float32), rng.normal(size=(2, 3)).astype(np.float32)
    dense = rng.normal(size=5).astype(np.float32)
    out = decode({"m": LowRank(torch.from_numpy(left), torch.from_numpy(right)),
                  "q": Encoded(torch.from_numpy(dense), 80, 5),
                  "t": torch.ones(2)})
    np.testing.assert_allclose(out["m"].numpy(), left @ right, rtol=1e-6)
    np.testing.assert_array_equal(out["q"].numpy(), dense)
    assert torch.equal(out["t"], torch.ones(2))


@pytest.mark.parametrize("rows, cols, rank, smaller", [(2, 2, 1, False), (4, 4, 2, False), (6, 3, 2, False),
                                                      (4, 4, 1, True), (10, 8, 4, True), (10, 8, 5, False)])
def test_a_factor_pair_is_used_only_when_strictly_smaller_than_the_matrix(rows, cols, rank, smaller):
    assert ((rows + cols) * rank < rows * cols) == smaller
    layer = LayerSVT(shape=(rows, cols), rank=rank, max_rank=min(rows, cols), left=torch.ones(rows, rank),
                     right=torch.ones(rank, cols), kept=torch.ones(rank))
    assert layer.factorized() is smaller
    entry = encode({"w": torch.full((rows, cols), float(rank))}, {"w": layer})["w"]
    assert isinstance(entry, LowRank) is smaller
