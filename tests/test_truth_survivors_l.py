"""Truth tests for surviving and not-yet-run mutants of the Byzantine attacks and the wire's ``Only``
wrapper (survivor set L of issue 42): ``attack_tensors``, ``Attack.generator`` / ``send_up``,
``malicious_clients``, ``attack_stage``, ``Only`` (every hook and ``__init__``), ``register_stage``,
``Message.params`` and the ledger's ``state_dict``. The truths: each attack's output recomputed here
with numpy from a torch generator keyed as documented (``derive_seed(seed, "attack", round, client)``;
same_value c·1 and sign_flip −|s|·u with one float64 normal draw per upload, gaussian one float32
normal draw per float entry in message order, times σ), integer entries and control parts left as
they were, the entry's dtype and device kept, an encoded entry keeping its format; the malicious
subset as numpy's seeded draw without replacement of round(m·fraction) clients (halves up, counted
by hand) from ``derive_seed(seed, "attack", "malicious")``; the attacked (phase, client) pairs of the
run's stage from that subset and the documented phases (training and join uploads), the head scope
from the hand-named last layer of a two-layer model; the ``Only`` routing table written out by hand
(which hooks reach the inner stage with exactly the arguments given); a registered factory called by
``build_stages``; ``params`` of disjoint parts merged, missing names skipped, a repeated entry refused
naming the entry and the parts; and a ledger snapshot that later traffic does not change."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from torch import nn

from helpers import small_config
from pfl.federation import wire
from pfl.federation.attacks import Attack, attack_stage, attack_tensors, malicious_clients
from pfl.federation.comm import CommLedger
from pfl.federation.context import derive_seed
from pfl.federation.messages import Encoded, Message, Model, Scalars, Update
from pfl.federation.wire import Only, Phase, Stage, build_stages, register_stage, stage_names


# ---- the documented draws, written out ------------------------------------------------------------

def keyed(seed: int, rnd: int, cid: int) -> torch.Generator:
    """The generator of one upload as the module docstring keys it."""
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, "attack", rnd, cid))
    return g


def expected_attack(arrays: dict[str, np.ndarray], kind: str, std: float, g: torch.Generator) -> dict[str, np.ndarray]:
    """The attacked values of the float arrays (in the order given), in numpy from the draws of ``g``."""
    if kind == "same_value":
        c = torch.randn((), generator=g, dtype=torch.float64).item() * std
        return {k: np.full_like(a, c) for k, a in arrays.items()}
    if kind == "sign_flip":
        s = abs(torch.randn((), generator=g, dtype=torch.float64).item()) * std
        return {k: a * -s for k, a in arrays.items()}
    out = {}
    for k, a in arrays.items():
        z = torch.randn(a.shape, generator=g, dtype=torch.float32).numpy()
        out[k] = (z * np.float32(std)).astype(a.dtype)
    return out


def m_fraction(m: int, fraction: float) -> int:
    """round(m·fraction) with halves up (the docstring's count), via numpy's floor."""
    return int(np.floor(m * fraction + 0.5))


def rng_choice(seed: int, m: int, count: int) -> list[int]:
    """numpy's draw of ``count`` distinct clients of ``m`` from the documented key."""
    rng = np.random.default_rng(derive_seed(seed, "attack", "malicious"))
    return [int(i) for i in rng.choice(m, size=count, replace=False)]


# ---- attack_tensors -----------------------------------------------------------------------------

ARR = {"a": np.array([[0.5, -1.25, 2.0], [3.0, -0.75, 1.5]]), "b": np.array([4.0, -2.5])}


@pytest.mark.parametrize("kind", ["same_value", "sign_flip", "gaussian"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_each_attack_is_its_definition_on_the_keyed_draws_in_the_entrys_dtype(kind, dtype):
    std = 2.5
    tensors = {k: torch.tensor(a, dtype=dtype) for k, a in ARR.items()}
    out = attack_tensors(tensors, kind, std, keyed(3, 4, 5))
    arrays = {k: t.numpy() for k, t in tensors.items()}
    expected = expected_attack(arrays, kind, std, keyed(3, 4, 5))
    assert list(out) == list(tensors)
    for k in tensors:
        assert out[k].dtype == dtype and out[k].shape == tensors[k].shape
        want = expected[k].astype(arrays[k].dtype)
        if dtype == torch.float64 or kind != "sign_flip":
            assert np.array_equal(out[k].numpy(), want), (kind, k)
        else:                                                    # −s·u rounded to the entry's precision
            np.testing.assert_allclose(out[k].numpy(), want, rtol=2e-3)
    if kind == "same_value":                                     # one c for the whole upload
        assert len({float(v) for t in out.values() for v in t.flatten()}) == 1


@pytest.mark.parametrize("kind", ["same_value", "sign_flip", "gaussian"])
def test_the_attack_draws_do_not_depend_on_torchs_default_dtype(kind):
    """c and s are float64 draws, gaussian entries float32 draws, whatever the process's default."""
    tensors = {k: torch.tensor(a, dtype=torch.float64) for k, a in ARR.items()}
    expected = expected_attack({k: t.numpy() for k, t in tensors.items()}, kind, 3.0, keyed(1, 2, 3))
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        out = attack_tensors(tensors, kind, 3.0, keyed(1, 2, 3))
    finally:
        torch.set_default_dtype(before)
    for k in tensors:
        assert np.array_equal(out[k].numpy(), expected[k])


@pytest.mark.parametrize("kind", ["same_value", "sign_flip", "gaussian"])
def test_the_attacked_tensors_stay_on_the_entrys_device(kind):
    t = torch.empty(3, 2, dtype=torch.float32, device="meta")
    out = attack_tensors({"w": t}, kind, 1.0, keyed(0, 0, 0))
    assert out["w"].device == t.device and out["w"].dtype == t.dtype and out["w"].shape == t.shape


def test_an_unknown_attack_is_refused_naming_it():
    with pytest.raises(ValueError, match="unknown attack 'gauss'"):
        attack_tensors({"w": torch.ones(2)}, "gauss", 1.0, keyed(0, 0, 0))


# ---- Attack.generator and send_up ----------------------------------------------------------------

def _mixed_upload():
    """A control part first, then a model part whose integer entry precedes its float ones, then an update."""
    return Message.of({
        "choice": Scalars({"cluster": torch.tensor([2], dtype=torch.int64), "thr": torch.tensor([0.5])}),
        "model": Model({"steps": torch.tensor([7, 8], dtype=torch.int64),
                        "w": torch.tensor([[0.5, -1.0], [2.0, 0.25]]), "b": torch.tensor([1.5, -3.0])}, base="model"),
        "dy": Update({"w": torch.tensor([0.125, -0.5, 4.0])}),
    }, n=11, train_loss=0.25)


FLOAT_ENTRIES = [("model", "w"), ("model", "b"), ("dy", "w")]   # attacked, in message order (written by hand)


@pytest.mark.parametrize("kind", ["same_value", "sign_flip", "gaussian"])
def test_attack_send_up_rewrites_the_float_entries_of_non_control_parts_from_the_round_and_client_key(kind):
    seed, rnd, cid, std = 13, 6, 4, 1.5
    clean = _mixed_upload()
    out = Attack(kind, std, seed).send_up(Phase("train", rnd), types.SimpleNamespace(cid=cid, state={}), clean, {})
    arrays = {f"{p}/{n}": clean[p].entries[n].numpy().astype(np.float64) for p, n in FLOAT_ENTRIES}
    if kind == "gaussian":
        arrays = {k: a.astype(np.float32) for k, a in arrays.items()}
    expected = expected_attack(arrays, kind, std, keyed(seed, rnd, cid))
    for p, n in FLOAT_ENTRIES:
        np.testing.assert_allclose(out[p].entries[n].numpy(), expected[f"{p}/{n}"], rtol=1e-6, atol=0)
    assert out["model"].entries["steps"].tolist() == [7, 8]
    assert out["choice"].entries["cluster"].tolist() == [2] and out["choice"].entries["thr"].tolist() == [0.5]
    assert out["model"].base == "model" and out.info == {"n": 11, "train_loss": 0.25}


def test_attack_generators_differ_by_seed_round_and_client_as_keyed():
    a = Attack("gaussian", 1.0, 21)
    for rnd, cid in [(0, 0), (3, 1), (3, 2), (4, 1)]:
        got = torch.randn(5, generator=a.generator(rnd, cid))
        assert torch.equal(got, torch.randn(5, generator=keyed(21, rnd, cid)))


def test_an_encoded_entry_keeps_its_bits_values_and_slots_under_attack():
    decoded = torch.tensor([0.0, 1.5, 0.0, -2.0, 0.5])
    msg = Message.of({"model": Model({"w": Encoded(decoded, bits=77, values=3)})})
    out = Attack("gaussian", 2.0, 5).send_up(Phase("join", 2), types.SimpleNamespace(cid=9, state={}), msg, {})
    e = out["model"].entries["w"]
    assert isinstance(e, Encoded) and e.bits == 77 and e.values == 3
    noise = expected_attack({"w": decoded.numpy()}, "gaussian", 2.0, keyed(5, 2, 9))["w"]
    assert np.array_equal(e.decoded.numpy(), np.where(decoded.numpy() != 0, noise, 0.0).astype(np.float32))


def test_a_structured_payload_is_refused_saying_the_attack_cannot_rewrite_it():
    from pfl.federation.messages import LowRank

    msg = Message.of({"model": Model({"w": LowRank(torch.ones(3, 1), torch.ones(1, 2))})})
    with pytest.raises(TypeError) as err:
        Attack("sign_flip", 1.0, 0).send_up(Phase("train", 0), types.SimpleNamespace(cid=0, state={}), msg, {})
    assert str(err.value) == ("attack: part 'model' holds a LowRank payload ('w'), "
                              "which an attack cannot rewrite")


# ---- malicious_clients -----------------------------------------------------------------------------

@pytest.mark.parametrize("seed,m,fraction,count", [(0, 10, 0.3, 3), (4, 10, 0.25, 3), (9, 7, 0.5, 4),
                                                    (2, 20, 0.45, 9), (1, 12, 0.1, 1)])
def test_malicious_clients_are_the_seeded_draw_of_round_m_fraction_distinct_clients(seed, m, fraction, count):
    cfg = small_config(seed=seed, attack__kind="sign_flip", attack__fraction=fraction)
    ids = malicious_clients(cfg, m)
    assert m_fraction(m, fraction) == count                       # the hand count (halves up)
    assert ids == tuple(sorted(rng_choice(seed, m, count)))
    assert len(set(ids)) == count and all(0 <= i < m for i in ids) and all(type(i) is int for i in ids)


def test_without_an_attack_nobody_is_malicious_whatever_the_fraction():
    cfg = small_config(attack__kind="none", attack__fraction=0.3)
    assert malicious_clients(cfg, 10) == ()
    assert attack_stage(cfg, types.SimpleNamespace(num_clients=10, model=None), None) is None


# ---- attack_stage --------------------------------------------------------------------------------------

class TwoLayer(nn.Module):
    """Its last layer (``head``) is the head: the scope ``head`` rewrites head.weight and head.bias."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 2)
        self.head = nn.Linear(2, 2)


HEAD = {"head.weight", "head.bias"}
STDS = {"same_value": 3.0, "sign_flip": 0.5, "gaussian": 2.0}


def _model_upload():
    g = torch.Generator().manual_seed(0)
    model = {"body.weight": torch.randn(2, 3, generator=g), "body.bias": torch.randn(2, generator=g),
             "head.weight": torch.randn(2, 2, generator=g), "head.bias": torch.randn(2, generator=g)}
    return Message.of({"model": Model(model), "dy": Update({"body.weight": torch.randn(2, 3, generator=g),
                                                           "head.weight": torch.randn(2, 2, generator=g)}),
                       "choice": Scalars({"cluster": torch.tensor([1])})}, n=5)


def _stage(kind, scope="model", seed=8, fraction=0.3):
    cfg = small_config(seed=seed, attack__kind=kind, attack__fraction=fraction, attack__scope=scope,
                       attack__same_value_std=STDS["same_value"], attack__sign_flip_std=STDS["sign_flip"],
                       attack__gaussian_std=STDS["gaussian"])
    return attack_stage(cfg, types.SimpleNamespace(num_clients=10, model=TwoLayer()), None)


def _check_upload(out, clean, attacked: set, kind, seed, rnd, cid):
    order = [(p, n) for p in clean for n in clean[p].entries if (p, n) in attacked]
    arrays = {f"{p}/{n}": clean[p].entries[n].numpy().astype(np.float32 if kind == "gaussian" else np.float64)
              for p, n in order}
    expected = expected_attack(arrays, kind, STDS[kind], keyed(seed, rnd, cid))
    for p in clean:
        for n, t in clean[p].entries.items():
            if (p, n) in attacked:
                np.testing.assert_allclose(out[p].entries[n].numpy(), expected[f"{p}/{n}"], rtol=1e-6, atol=0)
            else:
                assert torch.equal(out[p].entries[n], t), (p, n)


@pytest.mark.parametrize("kind", ["same_value", "sign_flip", "gaussian"])
def test_the_run_stage_attacks_training_and_join_uploads_of_the_malicious_clients_only(kind):
    seed = 8
    stage = _stage(kind, seed=seed)
    bad = set(rng_choice(seed, 10, 3))
    every = {(p, n) for p, part in _model_upload().parts.items() if not part.control for n in part.entries}
    for cid in range(10):
        for phase in ("train", "eval", "join"):
            clean = _model_upload()
            out = stage.send_up(Phase(phase, 2), types.SimpleNamespace(cid=cid, state={}), clean, {})
            hit = every if (cid in bad and phase in ("train", "join")) else set()
            _check_upload(out, clean, hit, kind, seed, 2, cid)
            down = stage.send_down(Phase(phase, 2), cid, clean)
            assert all(torch.equal(down[p].entries[n], clean[p].entries[n]) for p in clean for n in clean[p].entries)


@pytest.mark.parametrize("kind", ["same_value", "sign_flip", "gaussian"])
def test_the_head_scope_rewrites_only_the_last_layers_entries_in_every_part(kind):
    seed = 8
    stage = _stage(kind, scope="head", seed=seed)
    cid = rng_choice(seed, 10, 3)[0]
    clean = _model_upload()
    out = stage.send_up(Phase("train", 1), types.SimpleNamespace(cid=cid, state={}), clean, {})
    hit = {(p, n) for p in ("model", "dy") for n in clean[p].entries if n in HEAD}
    _check_upload(out, clean, hit, kind, seed, 1, cid)


def test_attack_config_errors_name_the_field_and_the_allowed_values():
    from pfl.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        small_config(attack__kind="gauss", attack__fraction=0.2)
    assert "attack.kind" in str(err.value)
    assert all(k in str(err.value) for k in ("same_value", "sign_flip", "gaussian"))
    with pytest.raises(ConfigError) as err:
        small_config(attack__kind="gaussian", attack__fraction=0.2, attack__scope="tail")
    assert "attack.scope" in str(err.value) and "head" in str(err.value) and "model" in str(err.value)


# ---- Only: the routing table ------------------------------------------------------------------------

class Recorder(Stage):
    """Answers every hook with a fresh marker and notes the arguments it got."""

    key = "rec"

    def __init__(self):
        self.calls: list[tuple] = []

    def _note(self, hook, *args):
        self.calls.append((hook, *args))
        return ("from inner", hook)

    def send_down(self, phase, cid, msg):
        return self._note("send_down", phase, cid, msg)

    def receive_down(self, phase, client, msg, notes):
        return self._note("receive_down", phase, client, msg, notes)

    def send_up(self, phase, client, msg, notes):
        return self._note("send_up", phase, client, msg, notes)

    def sent(self, phase, cid, msg):
        return self._note("sent", phase, cid, msg)

    def receive_up(self, phase, cid, msg, sent):
        return self._note("receive_up", phase, cid, msg, sent)


def _call(only, hook, phase, cid, msg, notes, record):
    client = types.SimpleNamespace(cid=cid, state={})
    if hook == "send_down":
        return only.send_down(phase, cid, msg), (phase, cid, msg)
    if hook == "receive_down":
        return only.receive_down(phase, client, msg, notes), (phase, client, msg, notes)
    if hook == "send_up":
        return only.send_up(phase, client, msg, notes), (phase, client, msg, notes)
    if hook == "sent":
        return only.sent(phase, cid, msg), (phase, cid, msg)
    return only.receive_up(phase, cid, msg, record), (phase, cid, msg, record)


# (phases, clients) -> the (kind, client) pairs it acts on, written out by hand for clients 0..3
TABLE = [
    (("train", "join"), (1, 3), {("train", 1), ("train", 3), ("join", 1), ("join", 3)}),
    (None, (2,), {("train", 2), ("eval", 2), ("join", 2)}),
    (("eval",), None, {("eval", 0), ("eval", 1), ("eval", 2), ("eval", 3)}),
    (None, None, {(k, c) for k in ("train", "eval", "join") for c in range(4)}),
]


@pytest.mark.parametrize("hook", ["send_down", "receive_down", "send_up", "sent", "receive_up"])
@pytest.mark.parametrize("phases,clients,acting", TABLE)
def test_only_hands_a_hook_to_its_stage_exactly_for_its_phases_and_clients(hook, phases, clients, acting):
    inner = Recorder()
    only = Only(inner, phases=phases, clients=clients)
    assert only.key == "rec"
    for kind in ("train", "eval", "join"):
        for cid in range(4):
            msg, notes, record = object(), {"n": cid}, ("record", cid)
            phase = Phase(kind, 5)
            out, args = _call(only, hook, phase, cid, msg, notes, record)
            if (kind, cid) in acting:
                assert out == ("from inner", hook)
                assert inner.calls[-1][0] == hook and all(a is b for a, b in zip(inner.calls[-1][1:], args))
                assert len(inner.calls[-1]) == len(args) + 1
            else:
                assert out is (None if hook == "sent" else msg)
    assert len(inner.calls) == len(acting)


# ---- register_stage --------------------------------------------------------------------------------------

def test_a_registered_stage_factory_is_what_build_stages_calls(monkeypatch):
    monkeypatch.setattr(wire, "_FACTORIES", dict(wire._FACTORIES))
    made, seen = Recorder(), []

    def factory(cfg, ctx, method):
        seen.append((cfg, ctx, method))
        return made

    register_stage("probe_l", factory)
    assert "probe_l" in stage_names()
    cfg = types.SimpleNamespace(federation=types.SimpleNamespace(stages=["probe_l"]))
    ctx, method = object(), object()
    chain = build_stages(cfg, ctx, method)
    assert chain.stages == [made] and len(seen) == 1 and all(a is b for a, b in zip(seen[0], (cfg, ctx, method)))


# ---- Message.params ------------------------------------------------------------------------------------

def _parts():
    return {"a": Model({"w": torch.tensor([1.0, 2.0])}), "b": Update({"v": torch.tensor([3.0])}),
            "c": Scalars({"k": torch.tensor([4])})}


def test_params_merges_the_named_parts_or_all_and_skips_missing_names():
    msg = Message(_parts())
    assert {k: t.tolist() for k, t in msg.params().items()} == {"w": [1.0, 2.0], "v": [3.0], "k": [4]}
    assert {k: t.tolist() for k, t in msg.params("a").items()} == {"w": [1.0, 2.0]}
    assert {k: t.tolist() for k, t in msg.params("missing", "b", "gone", "c").items()} == {"v": [3.0], "k": [4]}
    assert Message({}).params() == {}


def test_params_refuses_an_entry_in_two_parts_naming_it_and_the_parts():
    msg = Message({"a": Model({"w": torch.ones(1)}), "b": Update({"w": torch.ones(1)}),
                   "c": Update({"u": torch.ones(1)})})
    with pytest.raises(KeyError) as err:
        msg.params()
    assert "entry 'w' is in more than one of the parts ['a', 'b', 'c']" in str(err.value)
    with pytest.raises(KeyError) as err:
        msg.params("a", "b")
    assert "entry 'w' is in more than one of the parts ('a', 'b')" in str(err.value)


# ---- the ledger's state ---------------------------------------------------------------------------------

def test_a_ledger_snapshot_is_not_changed_by_later_traffic_and_restores_the_counts():
    ledger = CommLedger()
    up = Message.model({"w": torch.zeros(5)})                       # 5 × 4 = 20 bytes
    down = Message.model({"w": torch.zeros(3, dtype=torch.float64)})  # 3 × 8 = 24 bytes
    ledger.record(up, "up")
    ledger.record(down, "down")
    ledger.close_round()
    snap = ledger.state_dict()
    assert snap["per_round"] == [(20, 24)] and snap["up_bytes"] == 20 and snap["down_bytes"] == 24
    ledger.record(up, "up")
    ledger.close_round()
    assert ledger.per_round == [(20, 24), (20, 0)]
    assert snap["per_round"] == [(20, 24)] and snap["up_bytes"] == 20
    restored = CommLedger()
    restored.load_state_dict(snap)
    m = restored.metrics()
    assert m["comm/up_bytes"] == 20 and m["comm/down_bytes"] == 24 and m["comm/total_bytes"] == 44
    assert m["comm/round_up_bytes"] == 20 and m["comm/round_down_bytes"] == 24
    assert m["comm/params_sent"] == 8
