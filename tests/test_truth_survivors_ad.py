"""Survivors of the wire's trip (``Phase``, ``Wire.__init__/send_down/client_side``), of the method
base (``Method.create``'s client role, ``Method.eval_plan``, ``ClientHandle.__init__/train``) and of
``PQuant.quantize``'s bucket count. The truths: the wire's own docstring (a copy for the receiver,
handed-over tensors the client did not keep pass without one, a reply that shares storage with the
client's state is copied after all, receivers of a worker pool share one unchanged copy only when no
stage sees the message), ``Phase``'s documented error naming the allowed kinds, the client role that
refuses attributes, the ``GLOBAL`` flag deciding ``EvalPlan.global_model``, full-batch local steps with
``federation.weight_decay`` written in numpy, and (p, s)-quantization with one norm per tensor
recomputed in numpy on a vector of realistic size."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pfl.compression.compressors import PQuant, PQuantParams
from pfl.federation.comm import CommLedger
from pfl.federation.messages import Message
from pfl.federation.state import storages
from pfl.federation.wire import Chain, Phase, Stage, Wire
from pfl.training import handed_over

from truth import close, least_squares, params_of, simulator, vec


# ---- PQuant: one norm per tensor --------------------------------------------------------------

def test_pquant_with_one_norm_quantizes_a_100k_vector_as_numpy_does():
    """bucket: null is one norm for the whole tensor (one bucket of d entries): ξ_i = ⌊r_i⌋ + [u_i < r_i −
    ⌊r_i⌋] with r_i = s|v_i|/‖v‖₂, decoded sign(v_i)‖v‖₂ξ_i/s, on a vector of a small model's size."""
    d, s = 100_000, 7
    g = torch.Generator().manual_seed(0)
    v = torch.randn(d, generator=g)
    u = torch.rand(d, generator=g)
    out = PQuant(PQuantParams(p=2.0, s=s, bucket=None)).quantize(v, u)
    vn, un = v.double().numpy(), u.double().numpy()
    norm = np.linalg.norm(vn)
    r = np.clip(s * np.abs(vn) / norm, 0, s)
    low = np.floor(r)
    xi = low + (un < r - low)
    expected = np.sign(vn) * norm * xi / s
    assert out.shape == (d,)
    assert np.allclose(out.double().numpy(), expected, rtol=1e-5, atol=1e-5 * norm / s)


# ---- Phase ----------------------------------------------------------------------------------

def test_a_phase_of_an_unknown_kind_is_refused_naming_the_kinds():
    with pytest.raises(ValueError, match=re.escape("phase kind must be one of train, eval, join, got 'bogus'")):
        Phase("bogus", 0)
    assert (Phase("eval", 3).down, Phase("eval", 3).up) == ("eval_down", "eval_up")


# ---- the wire's copies ------------------------------------------------------------------------

class _InPlace(Stage):
    """A stage that edits the message it is given in place (allowed: a stage may)."""
    key = "inplace"

    def send_down(self, phase, cid, msg):
        for part in msg.parts.values():
            for t in part.entries.values():
                t.add_(1.0)
        return msg

    def send_up(self, phase, client, msg, notes):
        return self.send_down(phase, client.cid, msg)


class _Keeper(Stage):
    """A stage that keeps what it sends in the client's state (a replica of its upload)."""
    key = "keeper"

    def send_up(self, phase, client, msg, notes):
        kept = {k: t * 2.0 for k, t in msg.parts["model"].entries.items()}
        client.state[self.key] = kept
        return Message.model(kept)


def _client(state=None):
    return SimpleNamespace(cid=0, state={} if state is None else state)


def test_a_wire_without_stages_delivers_a_counted_copy():
    """``Wire(ledger)``: no stages; the receiver gets a copy (no shared storage) and the ledger counts it."""
    ledger = CommLedger()
    wire = Wire(ledger)
    w = torch.arange(6, dtype=torch.float32)
    got = wire.send_down(Phase("train", 0), 2, Message.model({"w": w}))
    assert torch.equal(got.tensors()["w"], w)
    assert not storages(got.parts) & storages(w)
    assert (ledger.down_bytes, ledger.down_messages) == (6 * 4, 1)
    reply, local = wire.client_side(Phase("train", 0), _client(), got, lambda c, m: (Message.model(m.tensors()), 5))
    assert local == 5 and torch.equal(wire.send_up(Phase("train", 0), 2, reply, wire.sent(Phase("train", 0), 2, got))
                                      .tensors()["w"], w)
    assert ledger.up_bytes == 6 * 4


def test_a_handed_over_model_the_client_did_not_keep_goes_on_without_a_copy():
    wire = Wire(CommLedger(), Chain())
    fresh = handed_over(torch.ones(4))
    reply, _ = wire.client_side(Phase("train", 0), _client({"other": torch.zeros(2)}), None,
                                lambda c, m: (Message.model({"w": fresh}), None))
    assert reply.parts["model"].entries["w"] is fresh


def test_a_handed_over_model_the_client_kept_is_copied_before_the_stages_edit_it():
    wire = Wire(CommLedger(), Chain([_InPlace()]))
    kept = handed_over(torch.ones(4))
    client = _client({"w": kept})
    reply, _ = wire.client_side(Phase("train", 0), client, None, lambda c, m: (Message.model({"w": kept}), None))
    assert torch.equal(client.state["w"], torch.ones(4))      # the client's state is untouched
    assert torch.equal(reply.tensors()["w"], torch.full((4,), 2.0))
    assert not storages(reply.parts) & storages(client.state)


def test_a_reply_a_stage_keeps_in_the_client_state_is_copied_after_all():
    wire = Wire(CommLedger(), Chain([_Keeper()]))
    client = _client()
    w = torch.tensor([1.0, -2.0, 3.0])
    reply, _ = wire.client_side(Phase("train", 0), client, None, lambda c, m: (Message.model({"w": w.clone()}), None))
    assert reply is not None and torch.equal(reply.tensors()["w"], 2.0 * w)
    assert storages(client.state["keeper"])
    assert not storages(reply.parts) & storages(client.state)


def test_receivers_share_one_unchanged_copy_only_when_no_stage_sees_the_message():
    w = torch.arange(3, dtype=torch.float32)
    bare = Wire(CommLedger())
    shared: dict = {}
    a = bare.send_down(Phase("train", 0), 0, Message.model({"w": w}), shared=shared).tensors()["w"]
    b = bare.send_down(Phase("train", 0), 1, Message.model({"w": w}), shared=shared).tensors()["w"]
    assert a is b and a is not w and torch.equal(a, w)
    staged = Wire(CommLedger(), Chain([_InPlace()]))
    shared = {}
    a = staged.send_down(Phase("train", 0), 0, Message.model({"w": w}), shared=shared).tensors()["w"]
    b = staged.send_down(Phase("train", 0), 1, Message.model({"w": w}), shared=shared).tensors()["w"]
    assert torch.equal(a, w + 1) and torch.equal(b, w + 1) and a is not b
    assert torch.equal(w, torch.arange(3, dtype=torch.float32))


# ---- the method base --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def problem():
    return least_squares(sizes=(6, 7, 5, 8), d=2)


def test_the_client_role_refuses_attributes_and_the_server_sets_them(problem):
    sim = simulator(problem, "fedavg")
    with pytest.raises(AttributeError, match=r"cannot set 'cache' .*client\.state"):
        sim.client_role.cache = {}
    sim.method.cache = {}
    assert sim.method.cache == {}


def test_client_train_applies_the_federations_weight_decay_and_records_its_result(problem):
    """K full-batch steps w ← w − η(A_i w − b_i + λw) (``federation.weight_decay`` λ), written in numpy;
    ``client.trained`` is None until the client trains, then what its training ended with."""
    K, lr, lam = 4, 0.05, 0.3
    sim = simulator(problem, "fedavg", steps=K, lr=lr, federation__weight_decay=lam)
    client = sim.client(1)
    assert client.trained is None
    w0 = np.array([1.5, -1.0, 0.75])
    res = client.train(params_of(w0, sim.method.global_model), 0)
    w = w0.copy()
    for _ in range(K):
        w = w - lr * (problem.grad(1, w) + lam * w)
    assert close(vec(res.params), w)
    assert close(vec(client.trained), w)


def test_an_evaluation_plan_has_a_global_model_only_from_a_message_flagged_global(problem):
    from pfl.methods.base import GLOBAL

    sim = simulator(problem, "fedavg")
    client = sim.client(0)
    w = np.array([0.5, 0.25, -1.0])
    plain = sim.client_role.eval_plan(0, client, Message.model(params_of(w, sim.method.global_model)))
    assert plain.global_model is None and close(vec(plain.personal), w)
    flagged = sim.client_role.eval_plan(0, client, Message.model(params_of(w, sim.method.global_model),
                                                                 **{GLOBAL: True}))
    assert close(vec(flagged.global_model), w) and close(vec(flagged.personal), w)
