"""Truth tests for surviving mutants of the codec's module-level functions (survivor set E of issue
42): ``message_bits`` and ``_bits_of``, ``spec_omega``, ``compressible``, ``has_reference``,
``compress_tensor``, ``encode_update`` / ``decode_update``, ``codec_stage`` and the worker tallies
``Codec.take_tallies`` / ``Codec.add_tallies``.

Every expected value is built here from the definitions in docs/methods/compression.md and the
compressors' table: bits counted by hand (natural 9d, top-k min(k(32+⌈log2 d⌉), d+32k), QSGD
32⌈d/b⌉ + d⌈log2(2s+1)⌉, dense fp32 below ``min_numel``, each encoded tensor rounded up to whole
bytes), ω from its closed form (rand-k d/⌈ρd⌉ − 1, natural 1/8), numpy re-computations of what an
entry decodes to (float32 and float16 rounding, a factor pair's product), and the half-precision
flush tallies counted with numpy from the messages the test builds. Nothing is read back from pfl's
own loops.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from helpers import small_config
from pfl.compression import build, compress_tensor, compressible, decode_update, encode_update, message_bits, \
    spec_omega
from pfl.compression.codec import Codec, codec_stage, has_reference
from pfl.federation.context import derive_seed
from pfl.federation.messages import Encoded, LowRank, Message, Update
from pfl.federation.wire import Phase

NATURAL = {"name": "natural"}


def _ctx(seed: int = 0):
    def generator(*parts):
        return torch.Generator().manual_seed(derive_seed(seed, *parts))
    return types.SimpleNamespace(generator=generator)


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(len(name))


class _Client:
    def __init__(self, cid: int = 0):
        self.cid, self.state = cid, {}


def _fp16_codec() -> Codec:
    cfg = small_config(compression__uplink={"name": "fp16"}, compression__min_numel=1)
    return Codec(cfg.compression, _ctx())


def _flush_count(*vectors) -> list[int]:
    """[non-zeros that float16 rounds to 0, non-zeros], counted with numpy."""
    flushed = nonzero = 0
    for v in vectors:
        v = np.asarray(v, dtype=np.float32)
        nz = v != 0
        flushed += int((nz & (v.astype(np.float16) == 0)).sum())
        nonzero += int(nz.sum())
    return [flushed, nonzero]


def _bytes_bits(bits: int) -> int:
    """An encoded tensor's bits rounded up to whole bytes."""
    return 8 * math.ceil(bits / 8)


# ---- message_bits / _bits_of ----------------------------------------------------------------------

def test_message_bits_count_dense_fp32_below_min_numel_and_byte_rounded_bits_above():
    comp = build(NATURAL)  # no bits formula of its own: 9 bits an entry
    shapes = {"w": (20, 15), "b": (7,), "v": (256,)}
    # w: 300 entries, 2700 bits → 2704 (rounded up); b: 7 < 256 → dense 32·7; v: exactly min_numel → 9·256 = 2304
    expected = _bytes_bits(9 * 300) + 32 * 7 + _bytes_bits(9 * 256)
    got = message_bits(comp, shapes, 256)
    assert isinstance(got, int)
    assert got == expected == 2704 + 224 + 2304


def test_message_bits_of_a_compressor_with_a_bits_formula_follow_the_table():
    topk = build({"name": "topk", "ratio": 0.01})
    d = 1000
    k = math.ceil(0.01 * d)
    idx = math.ceil(math.log2(d))
    assert message_bits(topk, {"w": (d,)}, 1) == _bytes_bits(min(k * (32 + idx), d + 32 * k))
    qsgd = build({"name": "qsgd", "s": 7})
    assert message_bits(qsgd, {"w": (d,)}, 1) == _bytes_bits(32 * math.ceil(d / 512) + d * math.ceil(math.log2(15)))


def test_message_bits_without_a_compressor_are_dense_fp32():
    shapes = {"w": (20, 15), "b": (7,)}
    assert message_bits(None, shapes, 1) == 32 * (300 + 7)
    assert message_bits(None, shapes) == 32 * (300 + 7)


def test_message_bits_and_omega_use_the_documented_min_numel_of_256():
    comp = build(NATURAL)
    assert message_bits(comp, {"v": (256,)}) == _bytes_bits(9 * 256)
    assert message_bits(comp, {"v": (255,)}) == 32 * 255
    randk = build({"name": "randk", "ratio": 0.1})
    assert spec_omega(randk, {"v": (256,)}) == pytest.approx(256 / math.ceil(0.1 * 256) - 1)
    assert spec_omega(randk, {"v": (255,)}) == 0.0


@pytest.mark.parametrize("min_numel", [0, 1])
def test_a_one_entry_tensor_is_compressed_when_min_numel_allows_it(min_numel):
    comp = build(NATURAL)
    assert message_bits(comp, {"s": (1,)}, min_numel) == _bytes_bits(9) == 16
    assert spec_omega(comp, {"s": ()}, min_numel) == pytest.approx(1 / 8)


def test_message_bits_leave_the_global_random_stream_alone():
    # natural compression draws uniforms; counting its bits must not consume torch's global stream
    comp = build(NATURAL)
    with torch.random.fork_rng():
        torch.manual_seed(123)
        expected = torch.rand(4)
        torch.manual_seed(123)
        message_bits(comp, {"v": (300,)}, 1)
        after = torch.rand(4)
    assert torch.equal(after, expected)


# ---- spec_omega ------------------------------------------------------------------------------------

def test_spec_omega_is_zero_without_a_compressor():
    assert spec_omega(None, {"w": (1000,)}, 1) == 0.0


def test_spec_omega_is_the_max_over_the_tensors_at_least_min_numel():
    randk = build({"name": "randk", "ratio": 0.1})
    # a: d = 256, k = 26 → ω = 256/26 − 1; b: d = 250 < 256 is sent dense although its ω = 9 is larger
    omega = spec_omega(randk, {"a": (16, 16), "b": (250,)}, 256)
    assert omega == pytest.approx(256 / 26 - 1)
    assert spec_omega(randk, {"b": (250,)}, 256) == 0.0


# ---- compressible / has_reference -----------------------------------------------------------------

def test_compressible_follows_size_dtype_and_the_dense_names():
    t = torch.zeros(300)
    dense = {"bn.running_mean"}
    assert compressible(t, 256, "model/layer.weight", dense)          # not named dense
    assert compressible(t, 256, "layer.weight", dense)
    assert not compressible(t, 256, "bn.running_mean", dense)         # a bare entry name
    assert not compressible(t, 256, "model/bn.running_mean", dense)   # part/entry
    assert not compressible(t, 301, "layer.weight", dense)
    assert not compressible(torch.zeros(300, dtype=torch.int64), 1, "layer.weight")


def test_a_tensor_without_a_name_is_none_of_the_dense_entries():
    assert compressible(torch.zeros(300), 256, dense={"XXXX", "running_var"})


def test_has_reference_needs_a_floating_tensor_of_the_same_shape():
    t = torch.zeros(3, 4)
    assert has_reference(t, torch.ones(3, 4))
    assert not has_reference(t, None)
    assert not has_reference(t, torch.ones(4, 3))
    assert not has_reference(t, torch.ones(3, 4, dtype=torch.int64))


# ---- compress_tensor -------------------------------------------------------------------------------

def test_compress_tensor_computes_in_float32_and_returns_the_tensors_shape_and_dtype():
    values = np.array([[0.1, 1 / 3, 2.0], [np.pi, -1e-3, 7.25]])
    t = torch.tensor(values, dtype=torch.float64)
    enc = compress_tensor(build({"name": "identity"}), t, None, "w")
    assert enc.decoded.dtype == torch.float64 and enc.decoded.shape == (2, 3)
    np.testing.assert_array_equal(enc.decoded.numpy(), values.astype(np.float32).astype(np.float64))
    assert enc.bits == 64 * 6 and enc.values == 6      # identity books the dtype's bits


def test_compress_tensor_keeps_the_compressors_value_count():
    t = torch.tensor([0.5, -3.0, 1.0, 2.0, 0.0, -0.25, 4.0, 1.5, 0.1, 0.2])
    enc = compress_tensor(build({"name": "topk", "ratio": 0.3}), t, None, "w")
    assert enc.values == 3
    expected = np.zeros(10, dtype=np.float32)
    expected[[1, 3, 6]] = [-3.0, 2.0, 4.0]
    np.testing.assert_array_equal(enc.decoded.numpy(), expected)


def test_compress_tensor_names_no_tensor_when_given_none():
    comp = build({"name": "fp16"})
    t = torch.tensor([1.0, 70000.0])
    with pytest.raises(ValueError) as inner:
        comp.compress(t.clone())
    with pytest.raises(ValueError) as outer:
        compress_tensor(comp, t, None)
    assert str(outer.value) == f"fp16 on tensor '': {inner.value}"


# ---- encode_update / decode_update ------------------------------------------------------------------

def test_encode_update_names_the_entry_that_overflows():
    comp = build({"name": "fp16"})
    with pytest.raises(ValueError, match=r"fp16 on tensor 'model/w'"):
        encode_update(comp, {"model/w": torch.tensor([1.0, -70000.0])}, None, _gen, 1)


def test_encode_update_compresses_a_tensor_of_256_entries_by_default():
    comp = build({"name": "topk", "ratio": 0.01})
    t = torch.arange(256, dtype=torch.float32)
    entries, values = encode_update(comp, {"w": t}, None, _gen)
    assert isinstance(entries["w"], Encoded)
    expected = np.zeros(256, dtype=np.float32)
    expected[253:] = [253.0, 254.0, 255.0]  # k = ⌈0.01·256⌉ = 3 largest
    np.testing.assert_array_equal(values["w"].numpy(), expected)
    small, _ = encode_update(comp, {"w": t[:255]}, None, _gen)
    assert small["w"] is not None and not isinstance(small["w"], Encoded)


def test_a_factor_pair_travels_as_it_is_and_is_received_as_its_product():
    rng = np.random.default_rng(0)
    left, right = rng.normal(size=(20, 2)).astype(np.float32), rng.normal(size=(2, 30)).astype(np.float32)
    pair = LowRank(torch.from_numpy(left), torch.from_numpy(right))
    comp = build({"name": "topk", "ratio": 0.1})
    entries, values = encode_update(comp, {"f": pair}, None, _gen, 1)
    assert entries["f"] is pair
    assert isinstance(values["f"], torch.Tensor)
    np.testing.assert_allclose(values["f"].numpy(), left @ right, rtol=1e-5, atol=1e-6)
    out = decode_update({"f": pair}, None)
    assert isinstance(out["f"], torch.Tensor)
    np.testing.assert_allclose(out["f"].numpy(), left @ right, rtol=1e-5, atol=1e-6)


def test_encode_update_counts_half_precision_flushes_across_tensors():
    comp = build({"name": "fp16"})
    w = [1e-9, 0.5, 0.0, -1e-10, 2.0]
    x = [1e-12, 1.0, 1.0]
    flushed = [2, 5]  # what this round counted before
    encode_update(comp, {"w": torch.tensor(w), "x": torch.tensor(x)}, None, _gen, 1, flushed=flushed)
    count = _flush_count(w, x)
    assert count == [3, 7]
    assert flushed == [2 + count[0], 5 + count[1]]
    # without a tally list the encoding is the same and nothing is counted
    entries, values = encode_update(comp, {"w": torch.tensor(w)}, None, _gen, 1)
    np.testing.assert_array_equal(values["w"].numpy(), np.array(w, dtype=np.float32).astype(np.float16)
                                  .astype(np.float32))


def test_only_half_precision_encodings_count_flushes():
    comp = build({"name": "topk", "ratio": 0.5})
    flushed = [0, 0]
    encode_update(comp, {"w": torch.tensor([1e-9, 0.5, 0.0, -1e-10])}, None, _gen, 1, flushed=flushed)
    assert flushed == [0, 0]


def test_a_reference_of_another_shape_is_not_subtracted():
    comp = build({"name": "identity"})
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    entries, values = encode_update(comp, {"w": t}, {"w": torch.ones(2, 3)}, _gen, 1)
    np.testing.assert_array_equal(entries["w"].decoded.numpy(), t.numpy())
    np.testing.assert_array_equal(values["w"].numpy(), t.numpy())
    ref = torch.full((3, 2), 0.5)
    entries, values = encode_update(comp, {"w": t}, {"w": ref}, _gen, 1)
    np.testing.assert_array_equal(entries["w"].decoded.numpy(), t.numpy() - 0.5)
    np.testing.assert_array_equal(decode_update(entries, {"w": ref})["w"].numpy(), t.numpy())


# ---- codec_stage -----------------------------------------------------------------------------------

def test_no_stage_without_compression():
    method = types.SimpleNamespace(compresses_uplink=False)
    assert codec_stage(small_config(), _ctx(), method) is None
    # a method that compresses its own uplink leaves the codec nothing to do
    cfg = small_config(compression__uplink={"name": "fp16"})
    assert codec_stage(cfg, _ctx(), types.SimpleNamespace(compresses_uplink=True)) is None


def test_the_stage_compresses_training_traffic_only():
    cfg = small_config(compression__uplink={"name": "fp16"}, compression__min_numel=1)
    stage = codec_stage(cfg, _ctx(), types.SimpleNamespace(compresses_uplink=False))
    v = [0.1, 1 / 3, -2.5, 1e-9]
    for kind in ("eval", "join"):
        t = torch.tensor(v)
        out = stage.send_up(Phase(kind, 0), _Client(), Message({"u": Update({"w": t})}), {})
        assert out["u"].entries["w"] is t
    out = stage.send_up(Phase("train", 0), _Client(), Message({"u": Update({"w": torch.tensor(v)})}), {})
    enc = out["u"].entries["w"]
    assert isinstance(enc, Encoded)
    np.testing.assert_array_equal(enc.decoded.numpy(), np.array(v, dtype=np.float32).astype(np.float16)
                                  .astype(np.float32))


# ---- the worker tallies ----------------------------------------------------------------------------

def _send(codec: Codec, *vectors) -> None:
    msg = Message({"u": Update({f"w{i}": torch.tensor(v) for i, v in enumerate(vectors)})})
    codec.send_up(Phase("train", 0), _Client(), msg, {})


def test_take_tallies_hands_over_the_flushes_counted_since_the_last_call():
    worker = _fp16_codec()
    assert worker.take_tallies() == {}            # nothing counted yet
    a, b = [1e-9, 0.5, 0.0, -1e-10, 2.0], [1e-12, 1.0, 3.0]
    _send(worker, a, b)
    assert worker.take_tallies() == {"flushed": _flush_count(a, b)} == {"flushed": [3, 7]}
    assert worker.take_tallies() == {}            # reset
    c = [1e-11, 0.25, -4.0]
    _send(worker, c)
    assert worker.take_tallies() == {"flushed": _flush_count(c)} == {"flushed": [1, 3]}


def test_add_tallies_adds_the_workers_counts_to_the_runs_stage():
    a, b, c = [1e-9, 0.5, 0.0, -1e-10, 2.0], [1e-12, 1.0, 3.0], [1e-11, 0.25, -4.0]
    run = _fp16_codec()
    _send(run, c)                                 # the run's own client
    worker = _fp16_codec()
    _send(worker, a, b)
    run.add_tallies(worker.take_tallies())
    run.add_tallies(worker.take_tallies())        # a worker that counted nothing since: {}
    expected = [x + y for x, y in zip(_flush_count(c), _flush_count(a, b))]
    assert expected == [4, 10]
    assert run.metrics() == {"comm/fp16_flushed": pytest.approx(4 / 10)}


def test_add_tallies_of_nothing_changes_nothing():
    run = _fp16_codec()
    run.add_tallies({})
    assert run.take_tallies() == {}
    run.add_tallies({"flushed": [2, 5]})
    run.add_tallies({})
    assert run.take_tallies() == {"flushed": [2, 5]}
