"""Truth tests for surviving mutants of the compression codec's ``Codec`` class (survivor set F of
issue 42: ``send_down``, ``receive_down``, ``sent``, ``send_up``, ``base``, ``receive_up``, ``_gen``,
``mirror``, ``_settle_legacy``, ``state_dict``, ``load_state_dict``, ``metrics``, ``__init__``).

The codec is driven directly (its server and client hooks, a client that is only an id and a state,
a store that is one dict of mirrors), and every expected value is built here: what a client receives
and what the server reconstructs recomputed in numpy from the compressors' definitions (top-k by a
stable sort of −|v|, rand-k's Ω from ``torch.randperm`` on the generator keyed, as
docs/methods/compression.md documents, by (run seed, round, client, "compress", direction,
part/tensor)); the server's mirrors equal to the clients' replicas; a codec resumed from its
checkpoint state (and the client store) reconstructing what the uninterrupted one does, and a
checkpoint of an earlier pfl (mirrors kept in the stage's state) read back; a model's running
statistics sent as they are; the fp16 flush fraction counted by hand; the refusals naming the part,
its base, the entries and the way out.
"""

from __future__ import annotations

import copy
import types

import numpy as np
import pytest
import torch

from helpers import small_config
from pfl.compression.codec import MIRRORS, Codec
from pfl.federation.context import derive_seed
from pfl.federation.messages import Encoded, LowRank, Message, Model, Scalars, Update
from pfl.federation.store import LocalMemory
from pfl.federation.wire import Phase

SEED = 7


class _Client:
    def __init__(self, cid: int = 0):
        self.cid, self.state = cid, {}


class _Store:
    """The run's client store as the codec sees it: one memory of per-client mirrors."""

    def __init__(self):
        self.mem = LocalMemory(MIRRORS)

    def memory(self, name):
        assert name == MIRRORS
        return self.mem

    def restored(self) -> "_Store":
        """A copy, as a checkpoint of the store restores it (no storage shared)."""
        out = _Store()
        for cid, m in self.mem.entries().items():
            out.mem.save(cid, {k: v.clone() for k, v in m.items()})
        return out


def _ctx(seed: int = SEED, model=None):
    def generator(*parts):
        g = torch.Generator()
        g.manual_seed(derive_seed(seed, *parts))
        return g
    return types.SimpleNamespace(generator=generator, model=model)


def _cfg(up=None, down=None, error_feedback=False, min_numel=1):
    return small_config(compression__uplink=up or {"name": "none"}, compression__downlink=down or {"name": "none"},
                        compression__error_feedback=error_feedback, compression__min_numel=min_numel).compression


def _codec(up=None, down=None, error_feedback=False, min_numel=1, model=None, store=None) -> Codec:
    codec = Codec(_cfg(up, down, error_feedback, min_numel), _ctx(model=model))
    if store is not None:
        codec.bind_store(store)
    return codec


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().astype(np.float32)


def _omega(rnd: int, cid: int, direction: str, key: str, d: int, k: int) -> np.ndarray:
    """rand-k's index set, drawn as documented: torch.randperm(d)[:k] on the generator keyed by
    (run seed, round, client, "compress", direction, part/tensor)."""
    g = torch.Generator()
    g.manual_seed(derive_seed(SEED, rnd, cid, "compress", direction, key))
    return torch.randperm(d, generator=g)[:k].numpy()


def _on(v: np.ndarray, idx: np.ndarray, scale: float = 1.0) -> np.ndarray:
    out = np.zeros_like(v)
    out[idx] = v[idx] * np.float32(scale)
    return out


def _topk(v: np.ndarray, k: int) -> np.ndarray:
    """The k entries of largest |v_i| (ties: the lower index), zeros elsewhere."""
    return _on(v, np.argsort(-np.abs(v), kind="stable")[:k])


def _randn(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


# ---- the keyed random streams -------------------------------------------------------------------------

def test_downlink_rand_k_draws_omega_from_the_key_of_round_client_direction_and_tensor():
    """Two clients, two tensors of one shape, rand-k 25 % (d/k = 4, ω = 3): the change the second
    downlink carries is C'(x1 − x0) = (1/(1+ω))·(d/k)·(x1 − x0) on Ω = x1 − x0 on Ω, Ω drawn from the
    documented key of each (round, client, "down", part/tensor): different clients and tensors draw
    different sets. The server's mirror equals each client's replica."""
    d, k = 512, 128
    codec = _codec(down={"name": "randk", "ratio": 0.25})
    g = torch.Generator().manual_seed(1)
    for cid in (2, 5):
        client = _Client(cid)
        x0 = {"w": _randn(g, d), "v": _randn(g, d)}
        x1 = {"w": _randn(g, d), "v": _randn(g, d)}
        for rnd, x in ((0, x0), (1, x1)):
            delivered = codec.send_down(Phase("train", rnd), cid, Message.model({n: t.clone() for n, t in x.items()}))
            got = codec.receive_down(Phase("train", rnd), client, delivered.copy(), {}).tensors()
        for name in ("w", "v"):
            assert isinstance(delivered["model"].entries[name], Encoded)
            change = _np(x1[name]) - _np(x0[name])
            want = _np(x0[name]) + _on(change, _omega(1, cid, "down", f"model/{name}", d, k))
            np.testing.assert_allclose(_np(got[name]), want, rtol=1e-6, atol=1e-7)
        mirror, replica = codec.mirrors[cid], client.state["compression"]["replica"]
        assert sorted(mirror) == sorted(replica) == ["model/v", "model/w"]
        for key in mirror:
            assert torch.equal(mirror[key], replica[key])


def test_uplink_rand_k_draws_omega_from_the_key_of_round_client_direction_and_tensor():
    """Uplink rand-k 25 % (unbiased, no error feedback): a model trained from the downlink part reaches
    the server as x + (d/k)·(y − x) on Ω, an update as (d/k)·u on Ω, each Ω from the documented key
    (round, client, "up", part/tensor) — the model's key is the downlink's tensor name, drawn apart
    from it by the direction. A control part ahead of them travels as it is and stops nothing."""
    d, k, rnd, cid = 512, 128, 3, 4
    codec, client = _codec(up={"name": "randk", "ratio": 0.25}), _Client(cid)
    g = torch.Generator().manual_seed(2)
    x, y, u = _randn(g, d), _randn(g, d), _randn(g, d)
    phase, notes = Phase("train", rnd), {}
    delivered = codec.send_down(phase, cid, Message.model({"w": x.clone()}))
    record = codec.sent(phase, cid, delivered)
    codec.receive_down(phase, client, delivered.copy(), notes)
    j = torch.tensor([1])
    reply = Message.of({"j": Scalars({"j": j}), "model": Model({"w": y.clone()}, base="model"),
                        "u": Update({"w": u.clone()})})
    sent = codec.send_up(phase, client, reply, notes)
    out = codec.receive_up(phase, cid, sent.copy(), record)
    assert torch.equal(out.tensors("j")["j"], j)
    want_model = _np(x) + _on(_np(y) - _np(x), _omega(rnd, cid, "up", "model/w", d, k), d / k)
    want_u = _on(_np(u), _omega(rnd, cid, "up", "u/w", d, k), d / k)
    np.testing.assert_allclose(_np(out.tensors("model")["w"]), want_model, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_np(out.tensors("u")["w"]), want_u, rtol=1e-6, atol=1e-6)


# ---- what a downlink part is compressed as -----------------------------------------------------------

def test_a_downlink_update_is_compressed_as_values_by_c_itself_not_its_contractive_form():
    """Parts the receiver does not keep go as C(value): rand-k 25 % of a 64-entry update (above
    ``min_numel`` = 1) arrives as (d/k)·u on Ω of the key (round, client, "down", "upd/d"), unscaled by
    1/(1+ω). A control part before it and a model after it arrive as they are (a first downlink)."""
    d, k, rnd, cid = 64, 16, 2, 1
    codec, client = _codec(down={"name": "randk", "ratio": 0.25}), _Client(cid)
    g = torch.Generator().manual_seed(3)
    u, x = _randn(g, d), _randn(g, 300)
    j = torch.tensor([2])
    msg = Message.of({"flag": Scalars({"j": j}), "upd": Update({"d": u.clone()}), "model": Model({"w": x.clone()})})
    delivered = codec.send_down(Phase("train", rnd), cid, msg)
    assert isinstance(delivered["upd"].entries["d"], Encoded)
    got = codec.receive_down(Phase("train", rnd), client, delivered.copy(), {})
    np.testing.assert_allclose(_np(got.tensors("upd")["d"]), _on(_np(u), _omega(rnd, cid, "down", "upd/d", d, k), d / k),
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(got.tensors("flag")["j"], j)
    assert torch.equal(got.tensors("model")["w"], x)
    assert torch.equal(codec.mirrors[cid]["model/w"], client.state["compression"]["replica"]["model/w"])


def test_fp16_flush_fraction_counts_the_encoded_model_change_and_update_entries():
    """``comm/fp16_flushed`` = non-zeros sent as 0 / non-zeros encoded, by hand: round 0 sends the
    model dense (nothing encoded: 0); round 1 encodes the model's change (3 of 8 non-zeros below
    fp16's smallest subnormal, 6e-8) and an update (2 of 6): 5/14."""
    codec, client = _codec(down={"name": "fp16"}), _Client(0)
    tiny = 1e-10
    x0 = torch.zeros(8)
    x1 = torch.tensor([tiny, tiny, tiny, 1.0, 2.0, -1.0, 0.5, 3.0])
    upd = torch.tensor([tiny, -tiny, 0.0, 0.0, 2.0, 1.0, -1.0, 4.0])
    codec.receive_down(Phase("train", 0), client, codec.send_down(Phase("train", 0), 0, Message.model({"w": x0})), {})
    assert codec.metrics() == {"comm/fp16_flushed": 0.0}
    msg = Message.of({"model": Model({"w": x1}), "upd": Update({"d": upd})})
    got = codec.receive_down(Phase("train", 1), client, codec.send_down(Phase("train", 1), 0, msg), {})
    assert torch.equal(got.tensors("model")["w"], torch.tensor([0.0, 0, 0, 1, 2, -1, 0.5, 3]))
    assert codec.metrics() == {"comm/fp16_flushed": 5 / 14}


def test_running_statistics_travel_as_they_are_and_the_mirror_equals_the_replica():
    """A BatchNorm's statistics (named as the model names them) are never encoded, in a kept model or
    in an update: they arrive exactly as sent, the client keeps no replica of them, and the server's
    mirror holds exactly the client's replica; the model's weight arrives as x0 + top-k(x1 − x0)."""
    d, k = 300, 30
    codec = _codec(down={"name": "topk", "ratio": 0.1}, model=torch.nn.BatchNorm1d(d))
    client = _Client(6)
    g = torch.Generator().manual_seed(4)
    xs = [_randn(g, d) for _ in range(2)]
    vs = [_randn(g, d).abs() + 1 for _ in range(2)]
    ms = [_randn(g, d) for _ in range(2)]
    for rnd in range(2):
        msg = Message.of({"model": Model({"w": xs[rnd].clone(), "running_var": vs[rnd].clone()}),
                          "delta": Update({"running_mean": ms[rnd].clone()})})
        delivered = codec.send_down(Phase("train", rnd), 6, msg)
        assert not isinstance(delivered["model"].entries["running_var"], Encoded)
        assert not isinstance(delivered["delta"].entries["running_mean"], Encoded)
        got = codec.receive_down(Phase("train", rnd), client, delivered.copy(), {})
        assert torch.equal(got.tensors("model")["running_var"], vs[rnd])
        assert torch.equal(got.tensors("delta")["running_mean"], ms[rnd])
    want = _np(xs[0]) + _topk(_np(xs[1]) - _np(xs[0]), k)
    np.testing.assert_allclose(_np(got.tensors("model")["w"]), want, rtol=1e-6, atol=1e-7)
    mirror, replica = codec.mirrors[6], client.state["compression"]["replica"]
    assert sorted(mirror) == sorted(replica) == ["model/w"]
    assert torch.equal(mirror["model/w"], replica["model/w"])


def test_error_feedback_without_an_uplink_compressor_leaves_the_downlink_as_without_it():
    """``error_feedback`` with no uplink compressor (allowed: nothing to feed back) changes nothing:
    the downlink of such a codec is the top-k downlink of one without it, by hand."""
    for ef in (False, True):
        codec, client = _codec(down={"name": "topk", "ratio": 0.5}, error_feedback=ef), _Client(0)
        assert codec.up is None
        x0, x1 = torch.zeros(6), torch.tensor([4.0, -3.0, 2.0, 1.0, 0.5, -0.25])
        for rnd, x in enumerate((x0, x1)):
            got = codec.receive_down(Phase("train", rnd), client, codec.send_down(Phase("train", rnd), 0,
                                                                                   Message.model({"w": x})), {})
        assert torch.equal(got.tensors()["w"], torch.tensor([4.0, -3.0, 2.0, 0.0, 0.0, 0.0]))


# ---- the uplink's bases ---------------------------------------------------------------------------------

def _trip(codec, client, down: Message, rnd: int = 0):
    phase, notes = Phase("train", rnd), {}
    delivered = codec.send_down(phase, client.cid, down)
    record = codec.sent(phase, client.cid, delivered)
    got = codec.receive_down(phase, client, delivered.copy(), notes)
    return phase, notes, record, got


def test_uplink_running_statistics_need_no_base_and_arrive_as_they_are():
    """A reply carrying a statistic its base part lacks is fine (statistics are never encoded): it
    arrives as it is, the weight as x + top-k(y − x)."""
    d = 300
    codec, client = _codec(up={"name": "topk", "ratio": 0.1}, model=torch.nn.BatchNorm1d(d)), _Client(1)
    g = torch.Generator().manual_seed(5)
    x, y, m = _randn(g, d), _randn(g, d), _randn(g, d)
    phase, notes, record, _ = _trip(codec, client, Message.model({"w": x.clone()}))
    reply = Message.model({"w": y.clone(), "running_mean": m.clone()}, base="model")
    sent = codec.send_up(phase, client, reply, notes)
    assert not isinstance(sent["model"].entries["running_mean"], Encoded)
    out = codec.receive_up(phase, 1, sent.copy(), record).tensors("model")
    assert torch.equal(out["running_mean"], m)
    np.testing.assert_allclose(_np(out["w"]), _np(x) + _topk(_np(y) - _np(x), 30), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("extra", [torch.ones(5), torch.ones(3, 4)], ids=["new-entry", "other-shape"])
def test_an_uplink_entry_without_a_same_shape_base_tensor_stops_naming_it_and_the_base(extra):
    codec, client = _codec(up={"name": "topk", "ratio": 0.5}), _Client(0)
    phase, notes, _, _ = _trip(codec, client, Message.model({"w": torch.zeros(4), "b": torch.zeros(12)}))
    name = "v" if extra.dim() == 1 else "b"
    reply = Message.model({"w": torch.ones(4), name: extra}, base="model")
    with pytest.raises(RuntimeError) as err:
        codec.send_up(phase, client, reply, notes)
    assert str(err.value) == (f"uplink part 'model': entries [{name!r}] have no tensor of the same shape in its "
                              "base part 'model'")


def test_an_uplink_model_whose_base_the_trip_did_not_carry_names_it_and_the_way_out():
    codec, client = _codec(up={"name": "topk", "ratio": 0.5}), _Client(0)
    phase, notes, _, _ = _trip(codec, client, Message.model({"w": torch.zeros(4)}))
    with pytest.raises(RuntimeError) as err:
        codec.send_up(phase, client, Message.of({"mine": Model({"w": torch.ones(4)}, base="xbar")}), notes)
    text = str(err.value)
    assert "uplink part 'mine'" in text and "base 'xbar'" in text and "(['model'])" in text
    assert text.endswith("a model must name the downlink part it started from or is close to "
                         "(or be sent as an Update)")


def test_a_model_trained_from_a_factored_downlink_entry_is_decoded_against_its_product():
    """A downlink entry sent as factors (LowRank, never encoded) is the client's base as left @ right;
    the server decodes the trained model's change against that same product: r + top-k(y − r)."""
    codec, client = _codec(up={"name": "topk", "ratio": 0.25}), _Client(2)
    g = torch.Generator().manual_seed(6)
    left, right, y = _randn(g, 4, 1), _randn(g, 1, 4), _randn(g, 4, 4)
    phase, notes, record, _ = _trip(codec, client, Message.model({"w": LowRank(left.clone(), right.clone())}))
    sent = codec.send_up(phase, client, Message.model({"w": y.clone()}, base="model"), notes)
    got = codec.receive_up(phase, 2, sent.copy(), record).tensors("model")["w"]
    r = _np(left) @ _np(right)
    want = r + _topk((_np(y) - r).reshape(-1), 4).reshape(4, 4)
    np.testing.assert_allclose(_np(got), want, rtol=1e-5, atol=1e-6)


def test_a_reply_with_no_record_of_its_trip_is_taken_as_it_is():
    """No downlink this trip (the wire's record is None): nothing to rebase on, so a model declared
    trained from ``model`` reaches the server as the client sent it."""
    codec = _codec(down={"name": "topk", "ratio": 0.5})
    y = torch.tensor([1.0, -2.0, 3.0, 0.5])
    out = codec.receive_up(Phase("train", 0), 0, Message.model({"w": y.clone()}, base="model"), None)
    assert torch.equal(out.tensors("model")["w"], y)


# ---- checkpoints ----------------------------------------------------------------------------------------

def test_a_resumed_codec_rebases_a_trip_in_flight_like_the_uninterrupted_one():
    """Lossy downlink, no uplink compressor (the asynchronous driver checkpoints between a downlink
    and its reply): the codec restored from its state_dict and the client store gives the model
    trained from ``model`` as x1 + (y − r) — what the server meant to send plus the client's change,
    by hand — like the codec that was never interrupted; an update ahead of it passes as it is. With
    the trip completed nothing is in flight: nothing to checkpoint."""
    store = _Store()
    codec, client = _codec(down={"name": "topk", "ratio": 0.25}, store=store), _Client(1)
    g = torch.Generator().manual_seed(8)
    x0, x1 = _randn(g, 16), _randn(g, 16)
    phase, notes, record, _ = _trip(codec, client, Message.model({"w": x0.clone()}), rnd=0)
    codec.receive_up(phase, 1, Message.model({"w": x0.clone()}, base="model"), record)
    phase = Phase("train", 1)
    delivered = codec.send_down(phase, 1, Message.model({"w": x1.clone()}))
    state = codec.state_dict()
    resumed = _codec(down={"name": "topk", "ratio": 0.25}, store=store.restored())
    resumed.load_state_dict(copy.deepcopy(state))
    r = codec.receive_down(phase, client, delivered.copy(), {}).tensors()["w"]
    np.testing.assert_allclose(_np(r), _np(x0) + _topk(_np(x1) - _np(x0), 4), rtol=1e-6, atol=1e-7)
    y = r + torch.arange(16.0) / 10
    u = torch.tensor([1.0, 2.0])
    reply = Message.of({"u": Update({"d": u}), "model": Model({"w": y}, base="model")})
    want = _np(x1) + (_np(y) - _np(r))
    for c in (codec, resumed):
        rec = c.sent(phase, 1, delivered.copy())
        out = c.receive_up(phase, 1, reply.copy(), rec)
        assert torch.equal(out.tensors("u")["d"], u)
        np.testing.assert_allclose(_np(out.tensors("model")["w"]), want, rtol=1e-6, atol=1e-6)
        assert c.state_dict() == {}


def test_a_checkpoint_of_an_earlier_pfl_with_mirrors_in_the_stage_state_is_read_back():
    """An earlier pfl kept the downlink mirrors in the stage's own state ({"mirrors": {cid: ...}}):
    read back, client 3's mirror is h, so its next downlink is the change C'(x − h) = top-k(x − h)
    (not a dense first send), the client (replica h) decodes h + top-k(x − h), and mirror and replica
    agree. A codec asked for nothing yet lists the mirror as h, and its next checkpoint moves it into
    the client store, where a codec resumed from that checkpoint finds it."""
    g = torch.Generator().manual_seed(9)
    h, x = _randn(g, 16), _randn(g, 16)
    legacy = {"mirrors": {3: {"model/w": h.clone()}}}
    down = {"name": "topk", "ratio": 0.25}

    codec, client = _codec(down=down), _Client(3)
    client.state = {"compression": {"replica": {"model/w": h.clone()}}}
    codec.load_state_dict({"mirrors": {3: {"model/w": h.clone()}}})
    delivered = codec.send_down(Phase("train", 5), 3, Message.model({"w": x.clone()}))
    assert isinstance(delivered["model"].entries["w"], Encoded)
    np.testing.assert_allclose(_np(delivered["model"].entries["w"].decoded), _topk(_np(x) - _np(h), 4),
                               rtol=1e-6, atol=1e-7)
    got = codec.receive_down(Phase("train", 5), client, delivered.copy(), {}).tensors()["w"]
    np.testing.assert_allclose(_np(got), _np(h) + _topk(_np(x) - _np(h), 4), rtol=1e-6, atol=1e-7)
    assert torch.equal(codec.mirrors[3]["model/w"], client.state["compression"]["replica"]["model/w"])

    listed = _codec(down=down)
    listed.load_state_dict(legacy)
    mirrors = listed.mirrors
    assert list(mirrors) == [3] and list(mirrors[3]) == ["model/w"] and torch.equal(mirrors[3]["model/w"], h)

    store = _Store()
    old = _codec(down=down, store=store)
    old.load_state_dict({"mirrors": {3: {"model/w": h.clone()}}})
    state = old.state_dict()
    assert "mirrors" not in state
    resumed = _codec(down=down, store=store.restored())
    resumed.load_state_dict(state)
    assert torch.equal(resumed.mirror(3)["model/w"], h)
