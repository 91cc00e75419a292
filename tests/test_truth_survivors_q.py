"""Truth tests for survivors of pfl/methods/ala.py's plug-in side (``_ALACore``, ``ALAStartMixin``,
``ALAPersonalMixin``): ``_ala_compute`` (the s% sample drawn per round from the client's own seeded
stream, window or subset; W persists between receptions), ``_ala_upper`` (``p_unit=tensors``),
``_ala_apply``/``personal_params`` (the evaluation-time ALA is done once and reused by the next
round: "no work is done twice"; ``eval_model=local``), ``_ala_after_training`` (the local model kept
from a LAG reply that encodes its own change), ``_ala_state`` (a client evaluated before it ever
trained) and ``personal_start`` (Ditto's hook gets the received model). The truths: three FedALA
rounds on a least-squares federation recomputed in numpy (local GD, the start phase and the later
single pass of projected GD on W, W carried over), the module docstring's rules (sample = contiguous
window of ⌊s·n/100⌋ at a random offset, or a random subset; reproducible from the run seed; the
evaluation-time ALA reused; ALA off for a client with no local model; a round without ALA reports no
ALA work; a client that uploads nothing keeps its local model), and relations between runs of a base
method with and without ALA (two small FedAvg variants are registered for the test only).
"""
import numpy as np
import pytest
import torch

from truth import close, least_squares, run_rounds, simulator, vec

import pfl.methods.ala as ala

K, LR = 3, 0.05


def _np_ala(p, i, glob, local, W, eta, passes):
    """``passes`` full-batch projected GD steps on W for θ̂ = local + (glob − local)⊙W (whole data)."""
    D = glob - local
    A, b = p.A(i), p.b(i)
    for _ in range(passes):
        th = local + D * W
        W = np.clip(W - eta * D * (A @ th - b), 0.0, 1.0)
    return W, local + D * W


def _avg(p, models):
    n = np.array([p.n(i) for i in range(p.m)], dtype=float)
    return sum(w * m for w, m in zip(n / n.sum(), models))


def test_fedala_three_rounds_carry_the_learned_weights_into_the_next_reception():
    """Round 0: no local model, ALA skipped; round 1: start phase (capped at 3 passes) from W = 1;
    round 2: one pass from the W learned in round 1 (W persists in the client state)."""
    p = least_squares(seed=3)
    eta, start_passes = 0.4, 3
    sim = simulator(p, "fedala", steps=K, lr=LR, method__p=0, method__s=100.0, method__eta=eta,
                    method__threshold=1e-12, method__window=10, method__ala_max_epochs=start_passes)
    theta = vec(sim.method.global_model)
    local = [p.gd(i, theta, K, LR) for i in range(p.m)]
    theta = _avg(p, local)
    Ws, mixes = [], []
    for i in range(p.m):
        W, start = _np_ala(p, i, theta, local[i], np.ones(p.dim), eta, start_passes)
        Ws.append(W)
        mixes.extend(W)
        local[i] = p.gd(i, start, K, LR)
    theta2 = _avg(p, local)
    for i in range(p.m):
        _, start = _np_ala(p, i, theta2, local[i], Ws[i], eta, 1)
        local[i] = p.gd(i, start, K, LR)
    theta3 = _avg(p, local)
    assert any(0.0 < w < 1.0 for w in mixes)  # W really moved off the all-ones start
    run_rounds(sim, 3)
    assert close(vec(sim.method.global_model), theta3, 1e-5)
    for i in range(p.m):
        assert close(vec(sim.client_states[i]["ala"]["local"]), local[i], 1e-5)


def _spy(monkeypatch, name):
    calls = []
    orig = getattr(ala, name)

    def spy(*a, **kw):
        out = orig(*a, **kw)
        calls.append((a, kw, out))
        return out

    monkeypatch.setattr(ala, name, spy)
    return calls


def _samples(monkeypatch, p, rounds, seed_global=0, **kw):
    calls = _spy(monkeypatch, "ala_sample_indices")
    sim = simulator(p, "fedala", steps=K, lr=LR, method__s=50.0, **kw)
    torch.manual_seed(seed_global)  # other code touching torch's global stream after the set-up
    run_rounds(sim, rounds)
    return [(a[0], out.tolist()) for a, _, out in calls]


def test_window_sample_is_half_the_data_at_an_offset_that_changes_from_round_to_round(monkeypatch):
    p = least_squares(seed=3)
    got = _samples(monkeypatch, p, 4)
    assert len(got) == 4 * p.m
    offsets = {}
    for n, idx in got:
        m = n // 2
        assert idx == list(range(idx[0], idx[0] + m)) and 0 <= idx[0] <= n - m
        offsets.setdefault(n, []).append(idx[0])
    # every client (sizes differ) draws a fresh offset each round, not one fixed window
    assert all(len(set(o)) > 1 for o in offsets.values())


def test_ala_sample_is_reproducible_from_the_run_seed_not_the_global_torch_stream(monkeypatch):
    p = least_squares(seed=3)
    a = _samples(monkeypatch, p, 3, seed_global=1)
    b = _samples(monkeypatch, p, 3, seed_global=2)
    assert a[-len(b):] == b


def test_subset_sample_is_a_random_subset_not_a_window(monkeypatch):
    p = least_squares(seed=3)
    got = _samples(monkeypatch, p, 3, method__ala_sample="subset")
    for n, idx in got:
        assert len(idx) == n // 2 and len(set(idx)) == len(idx) and all(0 <= k < n for k in idx)
    assert any(idx != list(range(idx[0], idx[0] + len(idx))) for _, idx in got)


def test_p_unit_tensors_learns_weights_for_the_top_tensor_only():
    """p = 1 tensor: only the last parameter tensor (the bias) is mixed; the weight is overwritten."""
    p = least_squares(seed=3)
    sim = simulator(p, "fedala", steps=K, lr=LR, method__p=1, method__p_unit="tensors", method__s=100.0)
    run_rounds(sim, 1)
    before = [vec(sim.client_states[i]["ala"]["local"]) for i in range(p.m)]
    theta = vec(sim.method.global_model)
    run_rounds(sim, 1)
    for i in range(p.m):
        w = sim.client_states[i]["ala"]["weights"]
        assert set(w) == {"fc.bias"}
    # a unit count would have mixed fc.weight too: here it starts from the global weight
    d = p.dim - 1
    for i in range(p.m):
        W = float(sim.client_states[i]["ala"]["weights"]["fc.bias"].reshape(-1)[0])
        start = np.concatenate([theta[:d], [before[i][d] + (theta[d] - before[i][d]) * W]])
        assert close(vec(sim.client_states[i]["ala"]["local"]), p.gd(i, start, K, LR), 1e-5)


def test_eval_model_local_evaluates_the_last_trained_model():
    p = least_squares(seed=3)
    sim = simulator(p, "fedala", steps=K, lr=LR, method__eval_model="local")
    theta0 = vec(sim.method.global_model)
    run_rounds(sim, 1)
    for i in range(p.m):
        assert close(vec(sim.personal_params(i)), p.gd(i, theta0, K, LR), 1e-5)


def test_evaluation_time_ala_is_done_once_and_reused_by_the_next_round(monkeypatch):
    """Module docstring: the ALA done for evaluation is cached and reused when the client is sampled
    next round with the same global model: results do not depend on evaluation and no work is done twice."""
    p = least_squares(seed=3)
    calls = _spy(monkeypatch, "adaptive_local_aggregation")
    sim = simulator(p, "fedala", steps=K, lr=LR, method__s=50.0)
    run_rounds(sim, 2)  # round 1 ran the start phase: every client has W and a local model
    calls.clear()
    cid = p.m - 1
    first = vec(sim.personal_params(cid))
    assert len(calls) == 1
    again = vec(sim.personal_params(cid))
    assert len(calls) == 1 and np.array_equal(first, again)
    run_rounds(sim, 1)
    assert len(calls) == p.m  # the client's training reused the evaluation's ALA
    # ... and the reuse is invisible: the same global model as a run without the evaluation
    other = simulator(p, "fedala", steps=K, lr=LR, method__s=50.0)
    run_rounds(other, 3)
    assert np.array_equal(vec(sim.method.global_model), vec(other.method.global_model))


def test_lag_with_ala_keeps_the_trained_model_decoded_from_its_compressed_change():
    """LAG encodes its upload as a change of the received model; with a lossless top-k (ratio 1) the
    local model ALA keeps is the trained model, not the change."""
    p = least_squares(seed=3)
    sim = simulator(p, "lag+ala", steps=K, lr=LR, method__xi=0.6, compression__min_numel=1,
                    compression__uplink={"name": "topk", "ratio": 1.0})
    theta0 = vec(sim.method.global_model)
    run_rounds(sim, 1)
    for i in range(p.m):
        assert close(vec(sim.client_states[i]["ala"]["local"]), p.gd(i, theta0, K, LR), 1e-5)


def test_fedavg_ft_with_ala_keeps_fedavg_fts_evaluation():
    """ALA changes where training starts, not FedAvg-FT's evaluation (fine-tuning of the received
    model): after one round (ALA skipped: no local model yet) both evaluate the same models."""
    p = least_squares(seed=3)
    out = []
    for name in ("fedavg_ft", "fedavg_ft+ala"):
        sim = simulator(p, name, steps=K, lr=LR, federation__batch_size=4)
        run_rounds(sim, 1)
        out.append([vec(sim.personal_params(i)) for i in range(p.m)])
    for a, b in zip(*out):
        assert np.allclose(a, b, rtol=0, atol=1e-7)


def test_ditto_with_ala_hands_the_received_model_to_dittos_personal_start(monkeypatch):
    from pfl.methods.ditto import Ditto

    seen = []
    orig = Ditto.personal_start

    def hook(self, client, received):
        seen.append(None if received is None else vec(received))
        return orig(self, client, received)

    monkeypatch.setattr(Ditto, "personal_start", hook)
    p = least_squares(seed=3)
    sim = simulator(p, "ditto+ala", steps=K, lr=LR)
    for _ in range(2):
        theta = vec(sim.method.global_model)
        seen.clear()
        run_rounds(sim, 1)
        assert len(seen) == p.m
        assert all(s is not None and np.array_equal(s, theta) for s in seen)


def test_fedbabu_with_ala_evaluates_an_untrained_client_as_fedbabu():
    """A client that never trained has no local model: ALA is off, FedBABU's evaluation is unchanged."""
    from truth import classification_data, config

    from pfl.federation.simulator import Simulator

    data, _ = classification_data()
    out = []
    for name in ("fedbabu", "fedbabu+ala"):
        sim = Simulator(config(name, 4, model="mlp", source="digits"), data=data)
        out.append({k: v.clone() for k, v in sim.personal_params(0).items()})
    assert out[0].keys() == out[1].keys()
    for k in out[0]:
        assert torch.allclose(out[0][k], out[1][k], rtol=0, atol=1e-7)


def test_evaluation_time_ala_of_a_later_round_uses_that_rounds_sample_even_for_the_same_model():
    """The cached evaluation-time ALA is keyed by round and model: evaluating the same global model
    again one round later (nothing trained in between) gives what a fresh evaluation at that round gives."""
    p = least_squares(seed=3)
    runs = []
    for evaluate_first in (True, False):
        sim = simulator(p, "fedala", steps=K, lr=LR, method__s=50.0)
        run_rounds(sim, 2)
        earlier = [vec(sim.personal_params(i)) for i in range(p.m)] if evaluate_first else None
        sim.round += 1  # a round in which the global model did not change
        runs.append((earlier, [vec(sim.personal_params(i)) for i in range(p.m)]))
    (earlier, later), (_, fresh) = runs
    assert all(np.array_equal(a, b) for a, b in zip(later, fresh))
    # another round's sample gives another mix (for some client at least)
    assert any(not np.array_equal(a, b) for a, b in zip(earlier, later))


@pytest.fixture
def fedavg_q():
    """A FedAvg variant (registered for the test) whose round 2 sends the received model back
    without training (its start hook does not run) and whose round 3 trains but uploads nothing."""
    from pfl.federation.messages import Message, Model, Scalars
    from pfl.methods import METHODS, register
    from pfl.methods.fedavg import FedAvg

    class FedAvgQ(FedAvg):
        name = "fedavg_q"

        def local_update(self, rnd, client, msg):
            if rnd == 2:
                return Message.model(msg.tensors("model"), base="model", train_loss=0.0, n=client.n_train)
            reply = super().local_update(rnd, client, msg)
            return None if rnd == 3 else reply

    class FedAvgQ2(FedAvg):
        """FedAvg with a second (control) downlink part and uploads that name no base part."""
        name = "fedavg_q2"

        def broadcast(self, rnd, cid):
            return Message.of({"model": Model(self.global_model), "tick": Scalars({"tick": torch.ones(1)})})

        def local_update(self, rnd, client, msg):
            received = msg.tensors("model")
            result = client.train(self.start_params(client, received), rnd)
            return Message.model(result.params, train_loss=result.mean_loss, n=client.n_train)

    registered = METHODS.snapshot()
    register(FedAvgQ)
    register(FedAvgQ2)
    try:
        yield FedAvgQ
    finally:
        METHODS.restore(registered)


def test_a_round_without_ala_reports_no_ala_work_and_the_local_model_is_what_the_client_trained(fedavg_q):
    """The local model ALA mixes with is the one the client last trained (the module docstring), not
    what it sent: a round that sends the received model back untrained keeps it; a round that trains
    and uploads nothing replaces it with what it trained."""
    p = least_squares(seed=3)
    sim = simulator(p, "fedavg_q+ala", steps=K, lr=LR, method__threshold=1e-12, method__window=2,
                    method__ala_max_epochs=4)
    run_rounds(sim, 2)
    assert sim.method.ala_stats["passes"] == 4 * p.m  # round 1: every client's start phase
    kept = [vec(sim.client_states[i]["ala"]["local"]) for i in range(p.m)]
    run_rounds(sim, 1)  # round 2: no client ran ALA or trained
    assert sim.method.ala_stats["passes"] == 0 and sim.method.ala_stats["time_s"] == 0.0
    for i in range(p.m):
        assert np.array_equal(vec(sim.client_states[i]["ala"]["local"]), kept[i])
    theta = vec(sim.method.global_model)
    assert not any(close(k, theta, 1e-3) for k in kept)
    run_rounds(sim, 1)  # round 3: every client runs ALA and trains, nobody uploads
    assert np.array_equal(vec(sim.method.global_model), theta)
    for i in range(p.m):  # K steps from θ_i + (θ − θ_i) ⊙ W, W as ALA learned it this round
        w = sim.client_states[i]["ala"]["weights"]
        W = np.concatenate([w["fc.weight"].double().numpy().reshape(-1), w["fc.bias"].double().numpy().reshape(-1)])
        start = kept[i] + (theta - kept[i]) * W
        assert close(vec(sim.client_states[i]["ala"]["local"]), p.gd(i, start, K, LR), 1e-5)


def test_a_base_whose_uploads_name_no_base_part_gets_the_same_ala_as_fedavg(fedavg_q):
    """An upload without ``base`` is the model itself: ALA keeps it as the local model, as FedAvg+ALA does."""
    p = least_squares(seed=3)
    out = []
    for name in ("fedavg+ala", "fedavg_q2+ala"):
        sim = simulator(p, name, steps=K, lr=LR, method__s=50.0)
        run_rounds(sim, 3)
        out.append((vec(sim.method.global_model), [vec(sim.client_states[i]["ala"]["local"]) for i in range(p.m)]))
    assert np.array_equal(out[0][0], out[1][0])
    assert all(np.array_equal(a, b) for a, b in zip(out[0][1], out[1][1]))


@pytest.mark.parametrize("base, settings", [("scaffold", {}), ("fednova", {}), ("diana", {}),
                                            ("lag", {"method__xi": 1e6})])
def test_ala_on_a_method_that_uploads_changes_mixes_with_what_the_client_trained(base, settings):
    """SCAFFOLD, FedNova and DIANA upload changes or gradients, LAG (with a huge ξ) nothing at all:
    ALA's local model is still the client's trained model — K plain gradient steps from θ⁰ in round
    0 (no correction yet) — and ALA runs from round 1 (it read the local model from Model parts of
    the reply, so these composed methods were their base method, bit for bit)."""
    p = least_squares(seed=3)
    sim = simulator(p, base + "+ala", steps=K, lr=LR, **settings)
    theta0 = vec(sim.ctx.init_params())
    run_rounds(sim, 1)
    for i in range(p.m):
        assert close(vec(sim.client_states[i]["ala"]["local"]), p.gd(i, theta0, K, LR), 1e-5)
    for _ in range(2):  # rounds 1 and 2 (a LAG client that skipped round 1 still has its local model)
        run_rounds(sim, 1)
        assert sim.method.ala_stats["passes"] >= p.m
