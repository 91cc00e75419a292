"""Truth tests for surviving (mostly "no tests") mutants of the wire's wrappers and a few message and
compressor helpers (survivor set J of issue 42): ``Masked`` (every hook and ``_apply``), ``Chain`` and
``Wrapper``'s ``add_tallies`` / ``load_state_dict``, ``LowRank.num_params``, ``Message`` validation,
the ledger's join counters, ``Compressor.__repr__``, ``Scaled.bits`` and the p-norm of (p, s)-quantization.
The truths: which entries a ``Masked`` stage shows its inner stage and what the receiver gets, computed
here with numpy from the message and the selection rule (selected entries doubled by a hand-written
inner stage, the rest untouched, the message's ``info`` kept, every argument handed through as it
is); tallies counted by hand (messages a counting stage sees, a message with no selected entry never
reaching it); states routed by key; r·(m + n) factor values; the bit formulas of QSGD and rand-k
written out; row-wise p-norms from ``numpy.linalg.norm``; the ledger's join bytes from the tensors the
test sends (numel × element size)."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from pfl.compression.base import Scaled
from pfl.compression.compressors import (PQuant, PQuantParams, QSGD, QSGDParams, RandK, RandKParams, TopK,
                                         TopKParams)
from pfl.federation.comm import CommLedger
from pfl.federation.messages import LowRank, Message, Model, Scalars, Update
from pfl.federation.wire import Chain, Masked, Phase, Stage


# ---- a hand-written inner stage and the message it is shown ----------------------------------------

class Doubling(Stage):
    """Doubles every entry it is shown and notes each call's arguments and the view it got."""

    key = "dbl"

    def __init__(self):
        self.calls: list[tuple] = []

    def _double(self, hook, args, msg):
        view = {p: (type(part), dict(vars(part)), sorted(part.entries)) for p, part in msg.parts.items()}
        self.calls.append((hook, args, view))
        return msg.replace({p: part.replace({k: e * 2 for k, e in part.entries.items()})
                            for p, part in msg.parts.items()})

    def send_down(self, phase, cid, msg):
        return self._double("send_down", (phase, cid), msg)

    def receive_down(self, phase, client, msg, notes):
        return self._double("receive_down", (phase, client, notes), msg)

    def send_up(self, phase, client, msg, notes):
        return self._double("send_up", (phase, client, notes), msg)

    def sent(self, phase, cid, msg):
        return ("record", phase, cid, msg)

    def receive_up(self, phase, cid, msg, sent):
        return self._double("receive_up", (phase, cid, sent), msg)


def _select(part, name):
    """The head's entries of every part an attack may touch (control parts never)."""
    return not part.control and name.startswith("head.")


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "model": {"body.w": rng.normal(size=(2, 3)), "head.w": rng.normal(size=3), "head.b": rng.normal(size=1)},
        "dy": {"head.w": rng.normal(size=3), "other": rng.normal(size=2)},
        "ctrl": {"head.k": np.array([1.0, 2.0])},        # a head-named entry of a control part: never shown
    }


def _message(arrays):
    t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return Message({"model": Model({k: t(v) for k, v in arrays["model"].items()}, base="model"),
                    "dy": Update({k: t(v) for k, v in arrays["dy"].items()}),
                    "ctrl": Scalars({k: t(v) for k, v in arrays["ctrl"].items()})},
                   {"round": 3, "n": 17})


KINDS = {"model": Model, "dy": Update, "ctrl": Scalars}
CONTROL = {"model": False, "dy": False, "ctrl": True}


def _chosen(arrays):
    """(part, entry) pairs the rule accepts, from the part kinds written above (not from pfl)."""
    return {(p, k) for p, es in arrays.items() for k in es if not CONTROL[p] and k.startswith("head.")}


def _check_result(out, arrays):
    chosen = _chosen(arrays)
    assert set(out.parts) == set(arrays)
    for p, es in arrays.items():
        assert type(out[p]) is KINDS[p]
        assert set(out[p].entries) == set(es)
        for k, a in es.items():
            expected = 2 * a if (p, k) in chosen else a
            np.testing.assert_allclose(out[p].entries[k].numpy(), expected, rtol=1e-6, atol=0)
    assert out["model"].base == "model"
    assert out.info == {"round": 3, "n": 17}


def _expected_view(arrays):
    chosen = _chosen(arrays)
    view = {}
    for p in arrays:
        names = sorted(k for k in arrays[p] if (p, k) in chosen)
        if names:
            view[p] = names
    return view


def _seen_view(call):
    return {p: names for p, (_, _, names) in call[2].items()}


PHASE = Phase("train", 3)
CLIENT = types.SimpleNamespace(cid=5, state={})


@pytest.mark.parametrize("hook", ["send_down", "receive_down", "send_up", "receive_up"])
def test_masked_shows_its_stage_only_the_selected_entries_and_keeps_the_rest_in_place(hook):
    arrays = _arrays()
    msg = _message(arrays)
    inner = Doubling()
    masked = Masked(inner, _select)
    notes: dict = {"kept": 1}
    record = object()
    if hook == "send_down":
        out, args = masked.send_down(PHASE, 5, msg), (PHASE, 5)
    elif hook == "receive_down":
        out, args = masked.receive_down(PHASE, CLIENT, msg, notes), (PHASE, CLIENT, notes)
    elif hook == "send_up":
        out, args = masked.send_up(PHASE, CLIENT, msg, notes), (PHASE, CLIENT, notes)
    else:
        out, args = masked.receive_up(PHASE, 5, msg, record), (PHASE, 5, record)
    assert len(inner.calls) == 1
    name, seen_args, _ = inner.calls[0]
    assert name == hook
    assert len(seen_args) == len(args) and all(a is b for a, b in zip(seen_args, args))
    # the view: the selected entries only, parts with none dropped, each part of its own kind
    assert _seen_view(inner.calls[0]) == _expected_view(arrays) == {"model": ["head.b", "head.w"], "dy": ["head.w"]}
    assert inner.calls[0][2]["model"][0] is Model and inner.calls[0][2]["model"][1]["base"] == "model"
    assert inner.calls[0][2]["dy"][0] is Update
    _check_result(out, arrays)
    # the sender's message is not edited in place
    for p, es in arrays.items():
        for k, a in es.items():
            np.testing.assert_allclose(msg[p].entries[k].numpy(), a, rtol=1e-6, atol=0)


def test_masked_passes_a_message_with_no_selected_entry_on_without_calling_its_stage():
    msg = Message({"model": Model({"body.w": torch.ones(2, 2)}), "ctrl": Scalars({"head.k": torch.tensor([3.0])})},
                  {"round": 1})
    inner = Doubling()
    masked = Masked(inner, _select)
    assert masked.send_down(PHASE, 0, msg) is msg
    assert masked.send_up(PHASE, CLIENT, msg, {}) is msg
    assert inner.calls == []


def test_masked_keeps_the_full_downlink_as_the_servers_record():
    """``sent`` is the server's own record of the delivered downlink: the inner stage gets all of it."""
    msg = _message(_arrays(1))
    inner = Doubling()
    record = Masked(inner, _select).sent(PHASE, 7, msg)
    assert record[0] == "record" and record[1] is PHASE and record[2] == 7 and record[3] is msg


def test_a_masked_stage_in_a_chain_gets_the_servers_record_back_on_the_uplink():
    """A trip through a chain: the record ``sent`` made is what ``receive_up`` is handed."""
    inner = Doubling()
    chain = Chain([Masked(inner, _select)])
    arrays = _arrays(2)
    down = _message(arrays)
    records = chain.sent(PHASE, 4, down)
    up = chain.receive_up(PHASE, 4, _message(arrays), records)
    _check_result(up, arrays)
    assert inner.calls[0][1][2] == ("record", PHASE, 4, down)


# ---- tallies and states through chains and wrappers ------------------------------------------------

class Counting(Stage):
    """Counts the downlinks its client side receives; a worker hands the count to the run's stage."""

    def __init__(self, key):
        self.key = key
        self.count = 0
        self.loaded: list = []

    def receive_down(self, phase, client, msg, notes):
        self.count += 1
        return msg

    def metrics(self):
        return {f"{self.key}/seen": float(self.count)}

    def take_tallies(self):
        out, self.count = ({"seen": self.count} if self.count else {}), 0
        return out

    def add_tallies(self, tallies):
        self.count += tallies["seen"]

    def load_state_dict(self, state):
        self.loaded.append(state)


def _pair():
    return Chain([Masked(Counting("a"), _select), Counting("b")])


def test_a_workers_tallies_reach_the_run_stages_by_key_through_a_wrapper():
    worker, run = _pair(), _pair()
    msgs = [Message.model({"head.w": torch.ones(2)}), Message.model({"body.w": torch.ones(2)}),
            Message.model({"head.b": torch.ones(1), "body.w": torch.ones(3)}), Message.model({"x": torch.ones(1)}),
            Message.model({"head.w": torch.ones(2)})]
    for m in msgs:
        worker.receive_down(PHASE, CLIENT, m, {})
    # by hand: 3 of the 5 have a head entry (only those reach the masked counter); b sees all 5
    shown = sum(any(k.startswith("head.") for k in m["model"].entries) for m in msgs)
    assert shown == 3
    tallies = worker.take_tallies()
    assert tallies == {"a": {"seen": shown}, "b": {"seen": len(msgs)}}
    run.add_tallies(tallies)
    assert run.metrics() == {"a/seen": 3.0, "b/seen": 5.0}
    run.add_tallies({"b": {"seen": 2}})          # a worker whose clients the masked stage never saw
    assert run.metrics() == {"a/seen": 3.0, "b/seen": 7.0}
    run.add_tallies({"a": {"seen": 4}})
    assert run.metrics() == {"a/seen": 7.0, "b/seen": 7.0}


def test_a_chain_hands_each_stage_its_own_state_and_an_empty_one_when_absent():
    chain = _pair()
    masked, b = chain.stages
    a = masked.inner
    chain.load_state_dict({"a": {"pending": {1: 2}}, "zz": {"stray": 1}})
    assert a.loaded == [{"pending": {1: 2}}] and b.loaded == [{}]
    chain.load_state_dict({"b": {"x": 1}})
    assert a.loaded[-1] == {} and b.loaded[-1] == {"x": 1}
    chain.load_state_dict(None)                  # a run without stage state
    assert a.loaded[-1] == {} and b.loaded[-1] == {}
    assert all(isinstance(s, dict) for s in a.loaded + b.loaded)


# ---- message sizes, validation and the ledger ------------------------------------------------------

@pytest.mark.parametrize("m,n,r", [(5, 3, 2), (4, 7, 1), (6, 6, 3)])
def test_low_rank_factors_put_r_times_m_plus_n_values_on_the_wire(m, n, r):
    lr = LowRank(torch.ones(m, r), torch.ones(r, n))
    assert lr.num_params() == r * (m + n)
    assert lr.nbytes() == 4 * r * (m + n)
    ledger = CommLedger()
    ledger.record(Message.model({"w": lr, "b": torch.zeros(n)}), "up")
    assert ledger.metrics()["comm/params_sent"] == r * (m + n) + n


def test_a_message_part_that_is_not_a_part_is_refused_naming_the_part_and_its_type():
    with pytest.raises(TypeError, match=r"part 'model' must be a Part.*got dict"):
        Message({"model": {"w": torch.ones(2)}})
    with pytest.raises(TypeError, match=r"part 'x' must be a Part.*got Tensor"):
        Message({"x": torch.ones(2)})


def test_the_ledger_reports_join_bytes_from_the_tensors_sent():
    ledger = CommLedger()
    assert "comm/join_up_bytes" not in ledger.metrics()
    up = Message.model({"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float64)})
    down = Message({"g": Update({"h": torch.zeros(7, dtype=torch.float16)})})
    ledger.record(up, "join_up")
    ledger.record(up, "join_up")
    ledger.record(down, "join_down")
    out = ledger.metrics()
    assert out["comm/join_up_bytes"] == 2 * (12 * 4 + 5 * 8)
    assert out["comm/join_down_bytes"] == 7 * 2
    assert out["comm/up_bytes"] == out["comm/down_bytes"] == 0.0


# ---- compressors --------------------------------------------------------------------------------------

def test_a_compressors_repr_names_its_class_and_parameters():
    for comp in (TopK(TopKParams(ratio=0.25)), RandK(RandKParams(ratio=0.5))):
        text = repr(comp)
        assert text.startswith(type(comp).__name__ + "(")
        assert repr(comp.p) in text
    assert repr(Scaled(QSGD(QSGDParams(s=3)))).startswith("Scaled(QSGD(")


@pytest.mark.parametrize("d", [1, 10, 37])
def test_the_scaled_form_sends_the_bits_of_its_compressor(d):
    """C/(1 + ω) sends what C sends: QSGD 32·⌈d/b⌉ + d·⌈log2(2s+1)⌉, rand-k 32·k + 32 (seeded indices)."""
    qsgd = Scaled(QSGD(QSGDParams(s=7, bucket=4)))
    assert qsgd.bits(d) == 32 * math.ceil(d / 4) + d * math.ceil(math.log2(15))
    randk = Scaled(RandK(RandKParams(ratio=0.3)))
    k = min(d, max(1, math.ceil(0.3 * d)))
    assert randk.bits(d) == 32 * k + 32


def test_the_scaled_form_of_a_compressor_without_a_bits_formula_counts_what_it_sends():
    """Natural compression sends 9 bits an entry (sign and exponent); its contractive form C/(1 + ω)
    sends the same message, so the codec's count of it (whole bytes) is ⌈9·d/8⌉·8, as for natural."""
    from pfl.compression import build, message_bits
    from pfl.compression.compressors import contractive

    natural = build({"name": "natural"})
    assert Scaled(natural).bits(300) == 9 * 300
    assert message_bits(contractive(natural), {"w": (300,)}, 1) == math.ceil(9 * 300 / 8) * 8

@pytest.mark.parametrize("p", [1.0, 3.0, 1.5])
def test_p_quantization_levels_are_relative_to_the_rows_p_norm(p):
    """Q(x)_i = ‖x‖_p · sign(x_i) · ξ_i / s with ξ_i = ⌊s|x_i|/‖x‖_p⌋ + [u_i < frac], per bucket,
    ‖·‖_p from numpy.linalg.norm."""
    rng = np.random.default_rng(int(p * 10))
    s, b, d = 3, 4, 10
    v = rng.normal(size=d)
    u = rng.uniform(size=d)
    comp = PQuant(PQuantParams(p=p, s=s, bucket=b))
    out = comp.quantize(torch.tensor(v, dtype=torch.float32), torch.tensor(u, dtype=torch.float32)).numpy()
    expected = np.zeros(d)
    for start in range(0, d, b):
        row = v[start:start + b]
        norm = np.linalg.norm(row, ord=p)
        r = np.clip(s * np.abs(row) / norm, 0, s)
        xi = np.floor(r) + (u[start:start + b] < r - np.floor(r))
        expected[start:start + b] = np.sign(row) * norm * xi / s
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_uniforms_are_drawn_on_the_cpu_and_delivered_on_the_tensors_device():
    """The documented contract of ``_uniform``: CPU draws (one seed, one sequence on any device) moved
    to ``like``'s device; ``meta`` stands in for an accelerator on a machine without one."""
    from pfl.compression.compressors import _uniform

    cpu = _uniform(5, torch.Generator().manual_seed(3), torch.zeros(1))
    assert torch.equal(cpu, torch.rand(5, generator=torch.Generator().manual_seed(3)))
    moved = _uniform(5, torch.Generator().manual_seed(3), torch.zeros(1, device="meta"))
    assert moved.device.type == "meta" and moved.shape == (5,)
