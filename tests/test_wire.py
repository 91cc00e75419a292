"""The wire's stages against independent truths: compression that cannot drift (problems 1–2 of
issue 25), error feedback's memory, what a typed part is compressed against, attacks and compression
in both orders, and the configurations refused before training.

The codec is driven directly here (its server and client hooks, a client that is only an id and a
state), so every expected value is computed by hand from the compressor's definition: top-k by
torch.topk, the contraction bound from δ or ω, sums of what was sent."""

from __future__ import annotations

import math
import types

import pytest
import torch

from helpers import downlink, small_config, uplink
from pfl.callbacks.divergence import run_rounds
from pfl.compression import build, resolve_spec
from pfl.compression.codec import Codec
from pfl.federation.context import derive_seed
from pfl.federation.messages import Encoded, Message, Model, Scalars, State, Update
from pfl.federation.simulator import Simulator
from pfl.federation.wire import Phase
from pfl.schema import ConfigError

D = 4096


class _Client:
    def __init__(self, cid: int = 0):
        self.cid, self.state = cid, {}


def _ctx(seed: int = 0):
    def generator(*parts):
        g = torch.Generator()
        g.manual_seed(derive_seed(seed, *parts))
        return g
    return types.SimpleNamespace(generator=generator)


def _codec(up=None, down=None, error_feedback=False, min_numel=1) -> Codec:
    cfg = small_config(compression__uplink=up or {"name": "none"}, compression__downlink=down or {"name": "none"},
                       compression__error_feedback=error_feedback, compression__min_numel=min_numel)
    return Codec(cfg.compression, _ctx())


def _delta(spec: dict, v: torch.Tensor) -> float:
    """δ of the contractive form of a compressor on v: E‖v − C'(v)‖² ≤ (1 − δ)‖v‖², from its definition
    (unbiased: 1/(1+ω); top-k and unscaled rand-k: k/d; scaled sign: ‖v‖₁²/(d‖v‖²); half precision ~1)."""
    c = build(resolve_spec(spec, "compression.uplink"))
    d = v.numel()
    if c.unbiased:
        return 1.0 / (1.0 + c.omega(d))
    if spec["name"] in ("topk", "randk"):
        return math.ceil(spec["ratio"] * d) / d
    if spec["name"] == "sign":
        return float(v.abs().sum() ** 2 / (d * (v**2).sum()))
    return 0.99


#: every compressor, with the parameters the table uses and a few more
SPECS = [{"name": "identity"}, {"name": "fp16"}, {"name": "bf16"}, {"name": "qsgd", "s": 1},
         {"name": "qsgd", "s": 7}, {"name": "qsgd", "s": 7, "bucket": None}, {"name": "terngrad"},
         {"name": "pquant", "p": 1.0, "s": 2}, {"name": "natural"}, {"name": "randk", "ratio": 0.1},
         {"name": "randk", "ratio": 0.1, "scale": False}, {"name": "topk", "ratio": 0.01},
         {"name": "topk", "ratio": 0.1}, {"name": "sign"}]
IDS = [f"{s['name']}-" + "-".join(f"{k}{v}" for k, v in s.items() if k != "name") for s in SPECS]


def _moving(rounds: int, step: float, seed: int = 0):
    """A slowly moving vector: x_0 ~ N(0, I), each round x moves by step·‖x_0‖ in a random direction."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(D, generator=g)
    scale = step * float(x.norm())
    for _ in range(rounds):
        yield x.clone()
        move = torch.randn(D, generator=g)
        x = x + scale * move / move.norm()


def _bound(delta: float, step: float) -> float:
    """Relative error the contraction allows at stationarity: e⁺ = (e + Δ) − C'(e + Δ) with
    E‖e⁺‖² ≤ (1 − δ)‖e + Δ‖² ≤ (1 − δ/2)‖e‖² + (1 − δ)(1 + 2/δ)‖Δ‖², so E‖e‖² ≤ 2(1 − δ)(2 + δ)/δ²·‖Δ‖²;
    twice its square root (one realisation, not the expectation), relative to ‖x‖ with ‖Δ‖ = step·‖x‖."""
    return 2.0 * step * math.sqrt(2 * (1 - delta) * (2 + delta)) / delta + 1e-6


# ---- problem 1: the downlink replica stays near the value ------------------------------------------

@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_the_clients_replica_stays_within_the_contraction_bound_over_300_rounds(spec):
    codec, client, step = _codec(down=spec), _Client(), 0.01
    errors, deltas = [], []
    for rnd, x in enumerate(_moving(300, step)):
        if rnd:  # what is encoded: the value minus the replica (scaled sign's δ depends on it)
            deltas.append(_delta(spec, x - client.state["compression"]["replica"]["model/w"]))
        sent = codec.send_down(Phase("train", rnd), 0, Message.model({"w": x}))
        got = codec.receive_down(Phase("train", rnd), client, sent.copy(), {}).tensors()["w"]
        errors.append(float((got - x).norm() / x.norm()))
        if rnd == 0:
            assert not isinstance(sent["model"].entries["w"], Encoded)   # no replica yet: sent dense
    bound = _bound(min(deltas), step)
    assert max(errors[150:]) <= bound, (max(errors[150:]), bound)
    assert torch.equal(codec.mirrors[0]["model/w"], client.state["compression"]["replica"]["model/w"])


def test_the_unscaled_replica_rule_drifts_with_an_unbiased_compressor():
    """Why the contractive form: replica ← replica + C(x − replica) with rand-k 10 % (ω = 9)
    multiplies the error by about √ω per round, which the bound above would catch at once."""
    c = build(resolve_spec({"name": "randk", "ratio": 0.1}, "compression.downlink"))
    g = torch.Generator().manual_seed(0)
    replica = torch.zeros(D)
    errors = []
    for x in _moving(30, 0.01):
        replica = replica + c.compress(x - replica, g).decoded
        errors.append(float((x - replica).norm() / x.norm()))
    assert errors[-1] > 1e6 and errors[-1] > 100 * _bound(0.1, 0.01)


# ---- problem 2: error feedback's memory --------------------------------------------------------------

EF_SPECS = [(s, i) for s, i in zip(SPECS, IDS)
            if s["name"] == "identity" or not build(resolve_spec(s, "compression.uplink")).unbiased]


@pytest.mark.parametrize("spec", [s for s, _ in EF_SPECS], ids=[i for _, i in EF_SPECS])
def test_error_feedback_keeps_the_sum_of_what_was_sent_within_the_bound(spec):
    """Σ decoded = Σ u − e_T (the memory telescopes), and e_T stays within the contraction bound of the
    per-round update u, for every compressor error feedback accepts (the biased ones, and identity)."""
    codec, client, step = _codec(up=spec, error_feedback=True), _Client(), 0.01
    total_u = torch.zeros(D)
    total_sent = torch.zeros(D)
    norms, deltas = [], []
    for rnd, x in enumerate(_moving(300, step)):
        u = x * step                          # updates of size step·‖x‖, slowly changing direction
        memory = client.state.get("compression", {}).get("ef", {}).get("u/w", torch.zeros(D))
        deltas.append(_delta(spec, u + memory))   # what is encoded: the update plus the memory
        msg = codec.send_up(Phase("train", rnd), client, Message.of({"u": Update({"w": u})}), {})
        got = codec.receive_up(Phase("train", rnd), 0, msg.copy(), None).tensors("u")["w"]
        total_u += u
        total_sent += got
        norms.append(float(u.norm()))
    memory = client.state["compression"]["ef"]["u/w"]
    assert torch.allclose(total_sent + memory, total_u, rtol=1e-4, atol=1e-3)
    bound = _bound(min(deltas), 1.0) * max(norms)
    assert float(memory.norm()) <= bound, (float(memory.norm()), bound)


def test_error_feedback_memory_is_the_top_k_remainder_by_hand():
    codec, client = _codec(up={"name": "topk", "ratio": 0.25}, error_feedback=True), _Client()
    u1 = torch.tensor([4.0, -1.0, 0.5, 3.0, 0.0, -6.0, 2.0, 1.0])
    u2 = torch.tensor([0.0, 2.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])

    def topk(v, k=2):
        out = torch.zeros_like(v)
        idx = torch.topk(v.abs(), k).indices
        out[idx] = v[idx]
        return out

    sent = []
    for rnd, u in enumerate((u1, u2)):
        msg = codec.send_up(Phase("train", rnd), client, Message.of({"u": Update({"w": u})}), {})
        sent.append(msg["u"].entries["w"].decoded)
    assert torch.equal(sent[0], topk(u1))                                     # −6 and 4
    e1 = u1 - topk(u1)
    assert torch.equal(sent[1], topk(u2 + e1))                                # 3 and 2 (= 2 + 0 vs 2 + 1: index 1)
    assert torch.equal(client.state["compression"]["ef"]["u/w"], u2 + e1 - topk(u2 + e1))
    assert float(client.state["compression"]["ef"]["u/w"].abs().sum()) > 0


# ---- problem 6 ---------------------------------------------------------------------------------------

def test_the_flushed_fraction_counts_what_error_feedback_encodes():
    """fp16 flushes |v| ≤ 2⁻²⁵ to 0. Round 0 sends u = 2e-8 (flushed: the memory keeps it); round 1 sends
    u = 0, so what is encoded is the memory alone, 2e-8, flushed again: 1.0 both rounds (counting the
    update alone, round 1 would have no non-zero to count)."""
    codec, client = _codec(up={"name": "fp16"}, error_feedback=True), _Client()
    fractions = []
    for rnd, u in enumerate((torch.full((8,), 2e-8), torch.zeros(8))):
        codec.send_up(Phase("train", rnd), client, Message.of({"u": Update({"w": u})}), {})
        fractions.append(codec.metrics()["comm/fp16_flushed"])
    assert fractions == [1.0, 1.0]
    assert torch.equal(client.state["compression"]["ef"]["u/w"], torch.full((8,), 2e-8))


def test_natural_compression_takes_the_exact_power_of_two_below():
    from pfl.compression.compressors import power_of_two_below

    values = [1 - 2**-24, 2 - 2**-23, 0.75, 2**-130, 3.0, 1.0, 1e30]
    low = power_of_two_below(torch.tensor(values, dtype=torch.float32))
    for v, lo in zip(values, low.tolist()):
        v32 = float(torch.tensor(v, dtype=torch.float32))
        m, e = math.frexp(v32)
        assert lo == 2.0 ** (e - 1) and lo <= v32 < 2 * lo, (v, lo)


def test_identity_books_the_dtypes_bits():
    from pfl.compression import compress_tensor

    ident = build(resolve_spec({"name": "identity"}, "compression.uplink"))
    for dtype, bits in ((torch.float64, 64), (torch.float32, 32), (torch.float16, 16)):
        assert compress_tensor(ident, torch.ones(300, dtype=dtype), None).bits == 300 * bits


# ---- what a part is compressed against: its declaration ----------------------------------------------

def test_an_uplink_model_is_the_change_to_the_downlink_part_it_declares():
    """Two downlink models with the same entry names; the reply trained from cluster 1 declares it and
    is decoded as cluster1 + top-k(trained − cluster1), by hand."""
    codec, client = _codec(up={"name": "topk", "ratio": 0.5}), _Client(3)
    c0, c1 = torch.arange(8.0), torch.arange(8.0) * -1
    down = Message.of({"cluster0": Model({"w": c0}), "cluster1": Model({"w": c1})})
    phase = Phase("train", 0)
    notes: dict = {}
    delivered = codec.send_down(phase, 3, down.copy())
    record = codec.sent(phase, 3, delivered)
    codec.receive_down(phase, client, delivered.copy(), notes)
    trained = c1 + torch.tensor([5.0, 0, 0, -3, 0, 0.1, 0, 2])
    reply = Message.of({"model": Model({"w": trained}, base="cluster1"),
                        "choice": Scalars({"k": torch.tensor([1])})})
    sent = codec.send_up(phase, client, reply.copy(), notes)
    assert isinstance(sent["choice"].entries["k"], torch.Tensor)               # control values: never encoded
    change = trained - c1
    topk = torch.zeros(8)
    idx = torch.topk(change.abs(), 4).indices
    topk[idx] = change[idx]
    got = codec.receive_up(phase, 3, sent.copy(), record).tensors("model")["w"]
    assert torch.equal(got, c1 + topk)


@pytest.mark.parametrize("up", [None, {"name": "identity"}])
def test_a_trained_model_is_rebased_on_what_the_server_meant_to_send(up):
    """Lossy downlink: the client holds r ≠ x and trains y from it. A model declared trained from the
    part (``base``) reaches the server as x + (y − r), the client's change on the server's own model
    (the replica's error stays with the client); one only compared with it (``ref``) as y itself."""
    codec, client = _codec(up=up, down={"name": "topk", "ratio": 0.5}), _Client()
    x0, x1 = torch.zeros(6), torch.tensor([4.0, -3.0, 2.0, 1.0, 0.5, -0.25])
    for rnd, x in enumerate((x0, x1)):
        phase = Phase("train", rnd)
        notes: dict = {}
        delivered = codec.send_down(phase, 0, Message.model({"w": x}))
        record = codec.sent(phase, 0, delivered)          # the server's record, before the client works
        got = codec.receive_down(phase, client, delivered.copy(), notes)
    r = got.tensors()["w"]
    assert torch.equal(r, torch.tensor([4.0, -3.0, 2.0, 0.0, 0.0, 0.0]))       # top-3 of x1 − x0
    y = r + torch.tensor([0.1, 0.2, -0.3, 0.4, -0.5, 0.6])
    reply = Message.of({"trained": Model({"w": y}, base="model"), "own": Model({"w": y.clone()}, ref="model")})
    out = codec.receive_up(phase, 0, codec.send_up(phase, client, reply, notes).copy(), record)
    assert torch.allclose(out.tensors("trained")["w"], x1 + (y - r))
    assert torch.allclose(out.tensors("own")["w"], y)


def test_an_uplink_model_without_a_base_in_the_trip_stops_the_run_naming_the_part():
    codec, client = _codec(up={"name": "qsgd"}), _Client()
    notes = {"received": {"model": {"w": torch.zeros(4)}}}
    with pytest.raises(RuntimeError, match="'mine'.*base 'xbar'"):
        codec.send_up(Phase("train", 0), client, Message.of({"mine": Model({"w": torch.ones(4)}, base="xbar")}),
                      notes)
    with pytest.raises(RuntimeError, match="'mine'.*base None"):
        codec.send_up(Phase("train", 0), client, Message.of({"mine": Model({"w": torch.ones(4)})}), notes)


def test_parts_with_the_same_entry_names_keep_their_own_replicas():
    """SCAFFOLD's model and control variate share every entry name; each has its own replica."""
    codec, client = _codec(down={"name": "topk", "ratio": 0.5}), _Client()
    theta, c = torch.ones(8), torch.full((8,), -2.0)
    for rnd in range(3):
        msg = Message.of({"theta": Model({"w": theta * (rnd + 1)}), "c": State({"w": c * (rnd + 1)})})
        got = codec.receive_down(Phase("train", rnd), client, codec.send_down(Phase("train", rnd), 0, msg).copy(), {})
    replica = client.state["compression"]["replica"]
    assert set(replica) == {"theta/w", "c/w"}
    assert float((replica["theta/w"] - 3).abs().max()) < 3 and float((replica["c/w"] + 6).abs().max()) < 6
    assert torch.equal(got.tensors("theta")["w"], replica["theta/w"])


# ---- attacks and compression, in both orders ------------------------------------------------------------

def _one_trip(order, compressor, kind="sign_flip"):
    """FedAvg, client 0 malicious: (what the server decoded, what the client trained, the server's model
    before the round, the attack's scale s)."""
    settings = dict(federation__rounds=1, federation__clients_per_round=1, attack__kind=kind, attack__fraction=0.2,
                    compression__uplink=compressor, compression__min_numel=0, federation__stages=order)
    sim = Simulator(small_config(**settings))
    bad = sorted(sim.malicious)[0]
    start = {k: v.clone() for k, v in sim.method.global_model.items()}
    clean = Simulator(small_config(federation__rounds=1, federation__clients_per_round=1))
    trained = uplink(clean, bad, downlink(clean, bad)).tensors()
    got = uplink(sim, bad, downlink(sim, bad)).tensors()
    attack = sim.stage("attack")
    s = abs(float(torch.randn((), generator=attack.generator(0, bad), dtype=torch.float64))) * 10.0
    return got, trained, start, s


def test_a_byzantine_client_behind_a_compressed_uplink():
    """[attack, compression]: the attacker's upload −s·y is encoded like any other, as the change to
    what it received: the server decodes x + top-k(−s·y − x)."""
    got, trained, x, s = _one_trip(["attack", "compression"], {"name": "topk", "ratio": 0.3})
    for k in trained:
        change = (-s * trained[k] - x[k]).flatten()
        kept = torch.zeros_like(change)
        idx = torch.topk(change.abs(), math.ceil(0.3 * change.numel())).indices
        kept[idx] = change[idx]
        assert torch.allclose(got[k], x[k] + kept.view_as(x[k]), rtol=1e-5, atol=1e-5), k


@pytest.mark.parametrize("order, expected", [
    (["attack", "compression"], lambda y, x, s: -s * y),           # the model is flipped, then sent
    (["compression", "attack"], lambda y, x, s: x - s * (y - x)),  # the encoded change is flipped
])
def test_attack_and_compression_compose_in_either_order(order, expected):
    got, trained, x, s = _one_trip(order, {"name": "identity"})
    for k in trained:
        assert torch.allclose(got[k], expected(trained[k], x[k], s), rtol=1e-5, atol=1e-4), k


def test_an_attack_after_compression_keeps_the_encodings_format():
    """[compression, attack] with top-k: the attacker's noise sits in the k slots its encoding carries,
    and its message costs what an honest one does."""
    got, trained, x, _ = _one_trip(["compression", "attack"], {"name": "topk", "ratio": 0.1}, kind="gaussian")
    for k in trained:
        change = got[k] - x[k]
        assert int(change.count_nonzero()) <= math.ceil(0.1 * change.numel()), k
        assert float(change.abs().max()) > 20                          # noise of σ = 100, not a trained change
    sims = [Simulator(small_config(federation__rounds=1, federation__clients_per_round=0, attack__kind=kind,
                                   attack__fraction=0.5 if kind != "none" else 0.0,
                                   compression__uplink={"name": "topk", "ratio": 0.1},
                                   federation__stages=["compression", "attack"])) for kind in ("gaussian", "none")]
    for sim in sims:
        run_rounds(sim)
    assert sims[0].ledger.up_bytes == sims[1].ledger.up_bytes           # the same bits on the wire


@pytest.mark.parametrize("name", ["diana", "lag"])
def test_the_methods_that_encode_their_own_uplink_can_be_attacked(name):
    cfg = small_config(method__name=name, federation__rounds=2, attack__kind="sign_flip", attack__fraction=0.2,
                       compression__uplink={"name": "qsgd", "s": 3})
    sim = Simulator(cfg)
    run_rounds(sim)
    assert math.isfinite(sim.history[-1]["train/loss"])


# ---- refused before training -------------------------------------------------------------------------

@pytest.mark.parametrize("settings, field", [
    ({"compression__downlink": {"name": "sign", "scaled": False}}, "compression.downlink.scaled"),
    ({"compression__uplink": {"name": "sign", "scaled": False}, "compression__error_feedback": True},
     "compression.uplink.scaled"),
    ({"compression__uplink": {"name": "randk", "ratio": 0.1}, "compression__error_feedback": True},
     "compression.error_feedback"),
    ({"compression__uplink": {"name": "qsgd"}, "compression__error_feedback": True}, "compression.error_feedback"),
    ({"method__name": "marina", "compression__downlink": {"name": "qsgd"}}, "compression.downlink.name"),
    ({"method__name": "adiana", "compression__downlink": {"name": "topk"}}, "compression.downlink.name"),
    ({"method__name": "lag", "compression__downlink": {"name": "fp16"}}, "compression.downlink.name"),
    ({"method__name": "fedpd", "compression__downlink": {"name": "randk"}}, "compression.downlink.name"),
    ({"federation__stages": ["compression"]}, "federation.stages"),
    ({"federation__stages": ["attack", "attack"]}, "federation.stages"),
])
def test_configurations_that_cannot_be_stable_or_exact_are_refused(settings, field):
    with pytest.raises(ConfigError) as err:
        small_config(**settings)
    assert err.value.field == field


@pytest.mark.parametrize("name", ["marina", "adiana", "lag", "fedpd"])
def test_the_methods_that_need_an_exact_downlink_accept_an_exact_one(name):
    cfg = small_config(method__name=name, federation__clients_per_round=0, compression__downlink={"name": "identity"})
    assert cfg.compression.downlink.name == "identity"


# ---- in a run: the reproductions of problems 1 and 2 ------------------------------------------------------

RUN = dict(data__source="digits", data__num_clients=10, federation__rounds=30, federation__eval_every=30,
           federation__local_epochs=1)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [s for s in SPECS if s["name"] != "identity"], ids=IDS[1:])
def test_a_30_round_digits_run_with_a_compressed_downlink_does_not_diverge(spec):
    """Issue 25's reproduction (FedAvg, digits, 10 clients, 30 rounds; rand-k 10 % diverged at round 8)
    with every compressor on the downlink: every round's loss is finite, the last below the first, and
    the model is better than chance (10 %). How fast it learns depends on δ (measured: top-k 10 % 85 %,
    scaled sign 82 %, QSGD s = 7 74 %, rand-k 10 % 28 %, QSGD s = 1 21 %; dense 88 %)."""
    sim = Simulator(small_config(**RUN, compression__downlink=spec))
    history = run_rounds(sim)
    losses = [h["train/loss"] for h in history]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert history[-1]["test/acc_mean"] > 0.15, history[-1]["test/acc_mean"]


@pytest.mark.slow
def test_rand_k_learns_without_error_feedback_and_refuses_it():
    """Issue 25's second reproduction (rand-k 10 % + error feedback fell to 11 % by round 3): refused
    before training; rand-k alone, unbiased, learns."""
    with pytest.raises(ConfigError, match="compression.error_feedback"):
        small_config(**RUN, compression__uplink={"name": "randk", "ratio": 0.1}, compression__error_feedback=True)
    sim = Simulator(small_config(**RUN, compression__uplink={"name": "randk", "ratio": 0.1}))
    last = run_rounds(sim)[-1]
    assert math.isfinite(last["train/loss"]) and last["test/acc_mean"] > 0.8, last["test/acc_mean"]
