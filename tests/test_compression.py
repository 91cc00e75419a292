"""Compressors against direct computation (docs/methods/seminar.md §5, docs/methods/compression.md §9), and the codec in
a run: what is encoded, what the ledger counts, downlink replicas, exact resume, config errors (the
codec's rules against independent truths: tests/test_wire.py)."""

import math

import pytest
import torch

from helpers import downlink, matrix, method_config, method_names, same, small_config, straight_and_resumed
from pfl.callbacks.divergence import run_rounds
from pfl.compression import build, compress_tensor, index_bits, resolve_spec
from pfl.compression.codec import STATE_KEY
from pfl.federation.wire import Phase
from pfl.federation.simulator import Simulator
from pfl.federation.state import encode
from pfl.schema import ConfigError


def comp(name, **params):
    return build(resolve_spec({"name": name, **params}, "compression.uplink"))


def draws(c, v, n, seed=0):
    """n independent compressions of v (one generator, sequential draws)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([c.compress(v, g).decoded for _ in range(n)])


def mc_check_unbiased(samples, v, sigmas=4.0):
    """Every entry's Monte Carlo mean within `sigmas` standard errors of v (plus float slack)."""
    mean = samples.mean(0)
    se = samples.std(0) / math.sqrt(len(samples))
    assert ((mean - v).abs() <= sigmas * se + 1e-6).all(), (mean, v, se)


# ---- half precision ------------------------------------------------------------------------------

def test_fp16_rounds_to_nearest_even_and_counts_16_bits():
    c = comp("fp16")
    enc = c.compress(torch.tensor([1.0, 1 / 3, 65504.0, 1e-8]))
    assert enc.decoded.tolist() == [1.0, 0.333251953125, 65504.0, 0.0]
    assert enc.bits == 64


def test_fp16_overflow_errors_or_saturates():
    with pytest.raises(ValueError, match="overflow"):
        comp("fp16").compress(torch.tensor([7e4]))
    assert comp("fp16", overflow="saturate").compress(torch.tensor([7e4, -7e4])).decoded.tolist() == [65504.0, -65504.0]
    with pytest.raises(ValueError, match="'layer.weight'"):  # the codec names the tensor
        compress_tensor(comp("fp16"), torch.tensor([1e6]), None, "layer.weight")


def test_fp16_relative_error_and_bf16():
    g = torch.Generator().manual_seed(0)
    v = torch.exp(torch.empty(10_000).uniform_(math.log(2**-14), math.log(6e4), generator=g))
    rel = ((comp("fp16").compress(v).decoded - v).abs() / v).max()
    assert rel <= 2**-11
    enc = comp("bf16").compress(v * 1e10)  # fp32's range
    assert enc.bits == 16 * v.numel() and ((enc.decoded - v * 1e10).abs() / (v * 1e10)).max() <= 2**-8


# ---- TernGrad, QSGD, (p, s)-quantization -------------------------------------------------------

@pytest.mark.slow
def test_terngrad_outputs_mean_and_exact_variance():
    c = comp("terngrad")
    v = torch.tensor([0.5, -0.25, 0.0, 1.0])
    s = draws(c, v, 100_000)
    assert set(s.unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert (s[:, 2] == 0).all() and (s[:, 3] == 1).all()
    mc_check_unbiased(s, v)
    var = ((s - v) ** 2).sum(1).mean()
    assert abs(var - 0.4375) <= 0.03 * 0.4375          # s‖v‖₁ − ‖v‖² = 1.75 − 1.3125
    assert c.compress(v).bits == 32 + 2 * 4
    assert comp("terngrad", packing="base").compress(torch.zeros(12)).bits == 32 + 8 * 3   # 5 trits per byte


@pytest.mark.slow
def test_terngrad_omega_is_attained():
    c = comp("terngrad")
    v = torch.tensor([1.0, 1 / 3, 1 / 3, 1 / 3])       # t = 1/(√d + 1) = 1/3 for d = 4
    second = (draws(c, v, 100_000) ** 2).sum(1).mean() / (v**2).sum()
    assert abs(second - 1.5) <= 0.02 * 1.5             # E‖T(v)‖²/‖v‖² = 1 + ω
    assert c.omega(4) == 0.5


@pytest.mark.slow
def test_qsgd_mean_variance_and_levels():
    c = comp("qsgd", s=2, bucket=None)
    v = torch.tensor([3.0, 4.0])
    s = draws(c, v, 100_000)
    mc_check_unbiased(s, v)
    per_entry = ((s - v) ** 2).mean(0)
    assert torch.allclose(per_entry, torch.tensor([1.0, 1.5]), rtol=0.03)   # total 2.5
    levels = (s.abs() / 5.0 * 2).round()                                    # ξ_i = |Q_i|·s/‖v‖
    assert set(levels.unique().tolist()) <= {0.0, 1.0, 2.0}
    assert c.compress(v).bits == 32 + 2 * 3                                 # ⌈log2 5⌉ = 3


def test_pquant_inf_1_is_terngrad_for_the_same_uniforms():
    pq = comp("pquant", p=float("inf"), s=1, bucket=None)
    g = torch.Generator().manual_seed(3)
    v = torch.randn(257, generator=g)
    u = torch.rand(257, generator=g)
    scale = v.abs().max()
    terngrad = scale * torch.sign(v) * (u < v.abs() / scale).float()        # T(v) written out
    assert torch.equal(pq.quantize(v, u), terngrad)


@pytest.mark.slow
def test_pquant_uses_the_p_norm_so_it_stays_unbiased():
    # the slide's ‖·‖₂ in the probability would give 0.8·v here
    s = draws(comp("pquant", p=float("inf"), s=1, bucket=None), torch.tensor([3.0, 4.0]), 100_000)
    mc_check_unbiased(s, torch.tensor([3.0, 4.0]))


@pytest.mark.parametrize("s,bucket,d", [(1, 512, 1000), (7, 512, 1000), (7, None, 1000), (127, 4, 10)])
def test_pquant_bits(s, bucket, d):
    enc = comp("qsgd", s=s, bucket=bucket).compress(torch.randn(d))
    nb = 1 if bucket is None else math.ceil(d / bucket)
    assert enc.bits == 32 * nb + d * math.ceil(math.log2(2 * s + 1))


# ---- sparsification and sign ---------------------------------------------------------------------

def test_randk_support_scale_second_moment_and_bits():
    c = comp("randk", ratio=0.1)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(100, generator=g)
    v[:5] = 0
    enc = c.compress(v, g)
    nz = enc.decoded != 0
    assert int(nz.sum()) <= 10 and not nz[:5].any()
    assert torch.allclose(enc.decoded[nz], 10 * v[nz])
    second = (draws(c, v, 20_000) ** 2).sum(1).mean()
    assert abs(second / (10 * (v**2).sum()) - 1) <= 0.02           # E‖C(v)‖² = (d/k)‖v‖²
    assert c.omega(100) == 9
    assert comp("randk", ratio=0.01).compress(torch.randn(1000)).bits == 352
    assert comp("randk", ratio=0.01, indices="explicit").compress(torch.randn(1000)).bits == 420


def test_topk_keeps_the_largest_magnitudes_ties_to_the_lower_index():
    enc = comp("topk", ratio=0.4).compress(torch.tensor([0.5, -3.0, 1.0, -1.0, 2.0]))
    assert enc.decoded.tolist() == [0.0, -3.0, 0.0, 0.0, 2.0]
    tie = comp("topk", ratio=0.5).compress(torch.tensor([1.0, -2.0, 2.0, 0.0]))
    assert tie.decoded.tolist() == [0.0, -2.0, 2.0, 0.0]
    d, k = 1000, 10
    assert comp("topk", ratio=0.01).compress(torch.randn(d)).bits == min(k * (32 + 10), d + 32 * k)


def test_sign_plain_and_scaled():
    v = torch.tensor([1.0, -2.0, 3.0, 0.0])
    plain = comp("sign", scaled=False).compress(v)
    assert plain.decoded.tolist() == [1.0, -1.0, 1.0, 1.0] and plain.bits == 4
    scaled = comp("sign").compress(v)
    assert scaled.decoded.tolist() == [1.5, -1.5, 1.5, 1.5] and scaled.bits == 4 + 32
    assert float(((scaled.decoded - v) ** 2).sum()) == 5.0 == 14 - 36 / 4


@pytest.mark.parametrize("spec", [{"name": "qsgd", "s": 1, "bucket": 16}, {"name": "qsgd", "s": 7, "bucket": None},
                                  {"name": "terngrad"}, {"name": "pquant", "p": 1.0, "s": 2, "bucket": None},
                                  {"name": "pquant", "p": 3.0, "s": 3, "bucket": 8},
                                  {"name": "randk", "ratio": 0.25}, {"name": "natural"}, {"name": "identity"}])
@pytest.mark.slow
def test_every_unbiased_compressor_mean_and_variance_bound(spec):
    """Monte Carlo (20,000 draws, seed 0): every entry's mean within 4 standard errors of v, and
    E‖C(v) − v‖² ≤ ω‖v‖² (+3 % Monte Carlo slack) on a fixed random 64-vector."""
    c = comp(**spec)
    assert c.unbiased
    v = torch.randn(64, generator=torch.Generator().manual_seed(1))
    s = draws(c, v, 20_000)
    mc_check_unbiased(s, v)
    var = ((s - v) ** 2).sum(1).mean()
    assert var <= 1.03 * c.omega(64) * (v**2).sum() + 1e-9


def test_natural_compression_rounds_to_powers_of_two():
    enc = comp("natural").compress(torch.tensor([3.0, -0.75, 0.0, 4.0]), torch.Generator().manual_seed(0))
    assert enc.bits == 36
    mags = enc.decoded.abs().tolist()
    assert mags[0] in (2.0, 4.0) and mags[1] in (0.5, 1.0) and mags[2] == 0 and mags[3] == 4.0


def test_index_bits():
    assert [index_bits(d) for d in (1, 2, 3, 4, 1000, 1024, 1025)] == [0, 1, 2, 2, 10, 10, 11]


# ---- config -------------------------------------------------------------------------------------

def test_bad_compressor_names_and_parameters_are_rejected_before_training():
    with pytest.raises(ConfigError) as err:
        small_config(compression__uplink__name="qsgdd")
    assert err.value.field == "compression.uplink.name" and "did you mean 'qsgd'" in str(err.value)
    assert "topk" in str(err.value)
    with pytest.raises(ConfigError) as err:
        small_config(compression__uplink__name="qsgd", compression__uplink__s=0)
    assert err.value.field == "compression.uplink.s"
    with pytest.raises(ConfigError) as err:
        small_config(compression__uplink__name="topk", compression__uplink__s=7)
    assert err.value.field == "compression.uplink.s" and "ratio" in str(err.value)
    with pytest.raises(ConfigError) as err:
        small_config(compression__downlink__name="randk", compression__downlink__indices="bitmap")
    assert err.value.field == "compression.downlink.indices" and "explicit" in str(err.value)
    with pytest.raises(ConfigError) as err:
        small_config(method__name="diana", compression__uplink__name="topk")
    assert err.value.field == "compression.uplink.name" and "qsgd" in str(err.value)
    with pytest.raises(ConfigError) as err:
        small_config(method__name="marina", compression__uplink__name="randk", compression__uplink__scale=False)
    assert err.value.field == "compression.uplink.name"
    with pytest.raises(ConfigError) as err:
        small_config(method__name="diana", compression__uplink__name="qsgd", compression__error_feedback=True)
    assert err.value.field == "compression.error_feedback"


def test_resolved_config_lists_every_compressor_parameter():
    cfg = small_config(compression__uplink__name="qsgd", compression__uplink__s=3)
    assert cfg.to_dict()["compression"]["uplink"] == {"name": "qsgd", "s": 3, "bucket": 512, "packing": "fixed"}
    assert cfg.to_dict()["compression"]["downlink"] == {"name": "none"}
    again = small_config(**{"compression__uplink": cfg.to_dict()["compression"]["uplink"]})
    assert again.compression.uplink == cfg.compression.uplink


# ---- the codec in a run -------------------------------------------------------------------------

def _expected_message_bytes(sim, compressor, min_numel=256):
    total = 0
    for t in sim.method.global_model.values():
        if t.numel() < min_numel:
            total += 4 * t.numel()
        else:
            total += math.ceil(compressor.compress(torch.zeros(t.numel())).bits / 8)
    return total


def test_qsgd_uplink_bytes_are_the_encodings_bits_and_accuracy_holds():
    """What `pfl run --set ... compression.uplink.name=qsgd compression.uplink.s=7` runs (run_experiment)."""
    from pfl.runner import run_experiment

    settings = dict(federation__rounds=30, federation__clients_per_round=5, federation__lr=0.1,
                    federation__eval_every=30, data__num_clients=10)
    dense = run_experiment(small_config(**settings), progress=None).final
    cfg = small_config(**settings, compression__uplink__name="qsgd", compression__uplink__s=7)
    summary = run_experiment(cfg, progress=None)
    last, sim = summary.final, summary.extra["simulator"]
    per_message = _expected_message_bytes(sim, build(cfg.compression.uplink))   # Σ ⌈bits/8⌉, biases dense
    assert last["comm/up_bytes"] == 30 * 5 * per_message
    assert last["comm/down_bytes"] == dense["comm/down_bytes"]          # the downlink stays dense
    assert last["comm/up_bytes"] <= dense["comm/up_bytes"] / 6
    assert abs(last["test/acc_mean"] - dense["test/acc_mean"]) <= 0.02, (last["test/acc_mean"], dense["test/acc_mean"])


def test_half_precision_logs_the_flushed_fraction():
    sim = Simulator(small_config(federation__rounds=2, compression__uplink__name="fp16"))
    run_rounds(sim)
    assert all(0.0 <= row["comm/fp16_flushed"] < 0.01 for row in sim.history)
    assert "comm/fp16_flushed" not in run_rounds(Simulator(small_config(federation__rounds=1)))[-1]


def test_small_and_integer_tensors_travel_dense():
    """IFCA's reply: its trained model (a Model part whose base is the chosen cluster) and its choice
    (Scalars): the choice and the tensors below min_numel travel as they are, the rest is encoded."""
    sim = Simulator(small_config(method__name="ifca", method__k=2, federation__rounds=1,
                                 compression__uplink__name="topk", compression__uplink__ratio=0.01))
    codec = sim.stage("compression")
    phase = Phase("train", 0)
    client = sim.client(0)
    notes: dict = {}
    down = codec.receive_down(phase, client, downlink(sim, 0), notes)
    reply = sim.client_role.local_update(0, client, down)
    enc = codec.send_up(phase, client, reply.copy(), notes)
    assert type(enc["choice"].entries["cluster"]) is torch.Tensor           # the integer index
    model = reply["model"]
    assert model.base == f"cluster{int(reply.tensors('choice')['cluster'][0])}"
    for k, t in model.entries.items():
        assert type(enc["model"].entries[k]).__name__ == ("Tensor" if t.numel() < 256 else "Encoded"), k


def test_error_feedback_with_identity_keeps_zero_memory_and_matches_the_uncompressed_run():
    """The memory is exactly 0; the models agree to 1e-5 (the server adds the decoded update to
    what it sent, x + (y − x), where the uncompressed run averages y itself: float rounding)."""
    plain = Simulator(small_config(federation__rounds=3))
    run_rounds(plain)
    ef = Simulator(small_config(federation__rounds=3, compression__uplink__name="identity",
                                compression__error_feedback=True))
    run_rounds(ef)
    memories = [s[STATE_KEY]["ef"] for s in ef.client_states if STATE_KEY in s]
    assert memories and all(float(t.abs().max()) == 0.0 for m in memories for t in m.values())
    for k, t in plain.method.global_model.items():   # x + (y − x) vs y: equal up to float rounding
        assert torch.allclose(ef.method.global_model[k], t, atol=1e-5), k
    assert ef.history[-1]["comm/up_bytes"] == plain.history[-1]["comm/up_bytes"]


def test_the_servers_reference_is_what_it_sent_whatever_the_client_does_with_its_copy():
    """A client may edit the downlink it received in place (it is its own copy); the uplink codec's
    reference on the server side is the server's record of what it sent, taken before."""
    from pfl.methods import METHODS
    from pfl.methods.fedavg import FedAvg

    class Scribbler(FedAvg):
        name = "fedavg_scribbler"

        def local_update(self, rnd, client, msg):
            reply = super().local_update(rnd, client, msg)
            for t in msg.tensors().values():
                t.add_(1.0)
            return reply

    METHODS.register(Scribbler.name, Scribbler)
    try:
        lossless = dict(federation__rounds=2, compression__uplink__name="identity")
        plain, scribbled = Simulator(small_config(**lossless)), Simulator(small_config(method__name=Scribbler.name,
                                                                                       **lossless))
        run_rounds(plain)
        run_rounds(scribbled)
        same(scribbled.method.global_model, plain.method.global_model)
    finally:
        METHODS.remove(Scribbler.name)


def test_downlink_compression_keeps_client_replicas_and_server_mirrors_equal():
    cfg = small_config(federation__rounds=4, federation__clients_per_round=0,
                       compression__downlink__name="qsgd", compression__downlink__s=7)
    sim = Simulator(cfg)
    run_rounds(sim)
    for cid, mirror in sim.stage("compression").mirrors.items():
        replica = sim.client_states[cid][STATE_KEY]["replica"]
        assert mirror.keys() == replica.keys()
        assert all(torch.equal(mirror[k], replica[k]) for k in mirror)
    dense = Simulator(small_config(federation__rounds=4, federation__clients_per_round=0))
    run_rounds(dense)
    # every client's first message is dense (it has no replica yet), the next three are 4-bit
    assert sim.history[0]["comm/down_bytes"] == dense.history[0]["comm/down_bytes"]
    assert sim.history[-1]["comm/down_bytes"] < 0.4 * dense.history[-1]["comm/down_bytes"]
    assert sim.history[-1]["comm/up_bytes"] == dense.history[-1]["comm/up_bytes"]


def test_compression_randomness_is_keyed_by_seed_round_client_and_tensor():
    a = Simulator(small_config(federation__rounds=2, compression__uplink__name="randk"))
    b = Simulator(small_config(federation__rounds=2, compression__uplink__name="randk"))
    run_rounds(a)
    run_rounds(b)
    assert all(torch.equal(a.method.global_model[k], b.method.global_model[k]) for k in a.method.global_model)
    g = a.ctx.generator
    assert not torch.equal(torch.rand(5, generator=g(0, 1, "compress", "up", "fc1.weight")),
                           torch.rand(5, generator=g(0, 2, "compress", "up", "fc1.weight")))


@pytest.mark.parametrize("settings", [
    {"compression__uplink__name": "topk", "compression__error_feedback": True},
    {"compression__uplink__name": "qsgd", "compression__downlink__name": "sign"},
    {"method__name": "diana", "compression__uplink__name": "randk"},
    {"method__name": "lag", "compression__uplink__name": "terngrad", "method__xi": 10.0},
])
def test_compressed_runs_resume_exactly(tmp_path, settings):
    cfg = small_config(federation__rounds=4, **settings)
    straight, resumed = straight_and_resumed(cfg, tmp_path)
    assert [{k: v for k, v in r.items() if "time" not in k} for r in resumed.history] == \
           [{k: v for k, v in r.items() if "time" not in k} for r in straight.history]
    same(encode(resumed.model_state()), encode(straight.model_state()))
    assert resumed.ledger.state_dict() == straight.ledger.state_dict()


@pytest.mark.parametrize("name", matrix(method_names(), fast=("fedavg", "diana")))
def test_every_method_runs_with_compressed_up_and_downlinks(name):
    from pfl.methods import get_method

    own = {"diana", "adiana", "marina"}
    up = {"name": "qsgd", "s": 3} if name in own else {"name": "topk", "ratio": 0.1}
    # the methods that need clients to hold exactly the server's values get an exact downlink
    down = {"name": "identity"} if get_method(name).exact_downlink else {"name": "fp16"}
    cfg = method_config(name, federation__rounds=2, compression__uplink=up,
                        compression__error_feedback=name not in own | {"lag"}, compression__downlink=down)
    sim = Simulator(cfg)
    run_rounds(sim)
    assert math.isfinite(sim.history[-1].get("test/acc_mean", sim.history[-1].get("test/rmse_mean", 0.0)))
