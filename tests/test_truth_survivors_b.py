"""Truths for the mutants that survived in pfl/compression/checks.py, pfl/methods/ifca.py,
pfl/methods/l2gd.py and pfl/methods/fpfc_admm.py (issue 42, survivor list B): each test holds pfl's
answer against something worked out apart from it (the documented refusal and its wording, a round
of the algorithm redone in numpy on a least-squares federation, a byte count of the tensors a run
holds, the ADMM residuals from their definitions over the pairs i < j), and its docstring names the
mutants it was checked to kill.

Only inputs come from the code under test (the data, the seeded initial models, the shared coin
stream); every expected value is built here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from truth import CudaDeviceRules, close, least_squares, params_of, run_rounds, simulator, vec

LR, K = 0.2, 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(clusters=[0, 0, 1, 1])


def _refusal(**settings):
    from helpers import small_config

    from pfl.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        small_config(**settings)
    return err.value


# ---- pfl/compression/checks.py ------------------------------------------------------------------------

def test_error_feedback_on_a_biased_uplink_that_is_not_contractive_says_why():
    """(kills check_method_compression 28, 29)"""
    err = _refusal(compression__uplink={"name": "sign", "scaled": False}, compression__error_feedback=True)
    assert err.field == "compression.uplink.scaled"
    assert str(err) == ("compression.uplink.scaled: error feedback needs a contractive compressor; sign with "
                        "scaled=false is not (its memory grows): use scaled=true")


def test_error_feedback_on_natural_compression_is_refused_and_says_what_to_use():
    """Natural compression is unbiased with ω = 1/8 (< 1, still > 0): error feedback is refused
    (docs/methods/compression.md §0b, the table's first row), with the reason and the biased
    compressors to use instead (kills check_method_compression 39, 41, 46–51)."""
    err = _refusal(compression__uplink={"name": "natural"}, compression__error_feedback=True)
    assert err.field == "compression.error_feedback"
    assert err.message == ("natural is unbiased and needs no error feedback (with it the memory grows unless the "
                           "compressor is scaled by 1/(1+ω), which holds every update back by about ω rounds); "
                           "set error_feedback=false, or use a biased compressor (topk, sign, randk with "
                           "scale=false, fp16, bf16)")


def test_a_lossy_downlink_for_an_exact_method_names_the_allowed_values():
    """(kills check_method_compression 55, 61)"""
    err = _refusal(method__name="marina", compression__downlink={"name": "qsgd"})
    assert err.field == "compression.downlink.name"
    assert err.message.startswith("marina needs every client to hold exactly what the server holds (")
    assert err.message.endswith("; a lossy downlink would make the copies differ. Allowed values: none, identity")


def test_error_feedback_for_a_method_that_compresses_its_own_uplink_is_refused():
    """DIANA encodes its own differences: error feedback does not apply (kills
    check_method_compression 64–69)."""
    from pfl.methods import get_method

    err = _refusal(method__name="diana", compression__error_feedback=True)
    assert err.field == "compression.error_feedback"
    assert err.message == (f"diana compresses its uplink inside its own protocol ({get_method('diana').description}); "
                           "error feedback does not apply to it — set it to false")


@pytest.mark.parametrize("uplink, got", [
    ({"name": "randk", "ratio": 0.5, "scale": False}, "'randk' with scale=false"),
    ({"name": "topk", "ratio": 0.5}, "'topk'"),
])
def test_a_biased_uplink_for_diana_names_it_and_the_unbiased_ones(uplink, got):
    """Only rand-k has a scale switch to mention (kills check_method_compression 77–80, 82, 87)."""
    err = _refusal(method__name="diana", compression__uplink=uplink)
    assert err.field == "compression.uplink.name"
    assert err.message == (f"diana needs an unbiased compressor (its step sizes use ω), got {got}; allowed values: "
                           "none, identity, pquant, qsgd, terngrad, natural, randk (randk with scale=true)")


# ---- pfl/methods/ifca.py --------------------------------------------------------------------------------

def test_the_chosen_index_travels_in_the_smallest_integer_type():
    """uint8 for K ≤ 256 (index 255 of 256), int32 above (index 256 of 257) (kills index_tensor 2, 4–8)."""
    from pfl.methods.ifca import index_tensor

    small, large = index_tensor(255, 256), index_tensor(256, 257)
    assert small.dtype == torch.uint8 and int(small[0]) == 255 and small.element_size() == 1
    assert large.dtype == torch.int32 and int(large[0]) == 256


def _ifca_round(p, models, clients):
    """One IFCA round by hand: each client picks its lowest-loss model, takes K steps from it, and a
    chosen model becomes the mean of its choosers' results (an unchosen one stays)."""
    picks = {i: int(np.argmin([p.loss(i, w) for w in models])) for i in clients}
    trained = {i: p.gd(i, models[picks[i]], K, LR) for i in clients}
    out = [w.copy() for w in models]
    for j in set(picks.values()):
        out[j] = np.mean([trained[i] for i in clients if picks[i] == j], axis=0)
    losses = [np.mean([p.loss(i, w) for w in _path(p, i, models[picks[i]])]) for i in clients]
    return out, picks, float(np.mean(losses))


def _path(p, i, w):
    """The K full-batch iterates a local run is evaluated at (before each step)."""
    out = []
    for _ in range(K):
        out.append(w)
        w = p.gd(i, w, 1, LR)
    return out


def test_ifca_independent_models_two_rounds_by_hand():
    """``init: independent``: model j is the seeded draw init_params('ifca', j), so the K starts
    differ; two rounds of pick/train/average by hand, and the round's train/loss is the mean of the
    clients' mean step losses (kills setup 2–4, 6–11; local_update 20)."""
    p = least_squares(sizes=(20, 30, 24, 27, 22, 25), clusters=[0, 0, 0, 1, 1, 1])
    sim = simulator(p, "ifca", steps=K, lr=LR, method__k=3)
    models = [vec(sim.ctx.init_params("ifca", j)) for j in range(3)]
    assert not close(models[0], models[1], 1e-3)
    for w, got in zip(models, sim.method.models):
        assert close(vec(got), w, 1e-7)
    for _ in range(2):
        models, _, loss = _ifca_round(p, models, range(p.m))
        run_rounds(sim, 1)
        for w, got in zip(models, sim.method.models):
            assert close(vec(got), w, 1e-5)
        assert sim.history[-1]["train/loss"] == pytest.approx(loss, rel=1e-5)


def test_ifca_shared_models_start_as_copies_and_collapse():
    """``init: shared``: K copies of the draw init_params('ifca', 0); every client picks model 0 (the
    first of equal losses), which becomes the mean of their trained models, and the others stay the
    start (kills setup 13–15, 17, 18, 20–22)."""
    p = least_squares(clusters=[0, 0, 1, 1])
    sim = simulator(p, "ifca", steps=K, lr=LR, method__k=3, method__init="shared")
    start = vec(sim.ctx.init_params("ifca", 0))
    assert len(sim.method.models) == 3
    for got in sim.method.models:
        assert close(vec(got), start, 1e-7)
    run_rounds(sim, 1)
    expected = np.mean([p.gd(i, start, K, LR) for i in range(p.m)], axis=0)
    assert close(vec(sim.method.models[0]), expected, 1e-5)
    for got in sim.method.models[1:]:
        assert close(vec(got), start, 1e-7)


def test_ifca_with_one_cluster_model_is_fedavg_unweighted():
    """K = 1: the one model is the plain mean of the clients' K-step results (kills aggregate 10)."""
    p = least_squares()
    sim = simulator(p, "ifca", steps=K, lr=LR, method__k=1)
    start = vec(sim.method.models[0])
    run_rounds(sim, 1)
    assert len(sim.method.models) == 1
    assert close(vec(sim.method.models[0]), np.mean([p.gd(i, start, K, LR) for i in range(p.m)], axis=0), 1e-5)


def test_ifca_reports_choices_only_after_an_evaluation():
    """Before any evaluation there are no choices (no cluster metrics, no assignment); after one, each
    client's choice is its lowest-loss model (kills setup 23, extra_metrics 2, cluster_assignment 1)."""
    p = least_squares(sizes=(20, 30, 24, 27, 22, 25), clusters=[0, 0, 0, 1, 1, 1])
    sim = simulator(p, "ifca", steps=K, lr=LR, method__k=2)
    assert sim.method.extra_metrics(0) == {}
    assert sim.method.cluster_assignment() is None
    run_rounds(sim, 1)
    metrics = sim.evaluate()
    models = [vec(m) for m in sim.method.models]
    picks = {i: int(np.argmin([p.loss(i, w) for w in models])) for i in range(p.m)}
    assert sim.method.cluster_assignment() == picks
    assert metrics["cluster/num"] == len(set(picks.values()))


# ---- pfl/methods/l2gd.py --------------------------------------------------------------------------------

def test_l2gd_averaging_with_gamma_zero_or_no_steps_is_exactly_x():
    """λ = 0 (γ = 0) is exactly Local, and A = 0 averaging steps leave x as it is: x itself, not
    x̄ + (x − x̄), which loses x's small digits next to a large x̄ in float32 (kills l2gd_average 1, 3)."""
    from pfl.methods.l2gd import l2gd_average

    x = {"w": torch.tensor([1e-3, -2.5e-4], dtype=torch.float32)}
    xbar = {"w": torch.tensor([1e6, 3e6], dtype=torch.float32)}
    for gamma, steps in ((0.0, 4), (0.3, 0), (0.0, 0)):
        out = l2gd_average(x, xbar, gamma, steps)
        assert torch.equal(out["w"], x["w"])
    half = l2gd_average({"w": torch.tensor([2.0])}, {"w": torch.tensor([0.0])}, 0.5, 2)
    assert float(half["w"][0]) == pytest.approx(0.5)   # 0 + (1 − 0.5)² · 2


def _coins(sim, rnd, prob):
    rng = sim.ctx.rng(rnd, "l2gd")
    return int(rng.geometric(prob)), int(rng.geometric(1 - prob))


def test_l2gd_counts_its_coin_flips_and_local_steps():
    """l2gd/iterations = Σ_t (B_t + A_t), l2gd/local_steps = Σ_t B_t over the rounds so far, from the
    shared coins of each round (kills aggregate 2–5, setup 4)."""
    p, prob = least_squares(), 0.3
    sim = simulator(p, "l2gd", lr=LR, method__lam=0.5, method__p=prob)
    assert sim.method.extra_metrics(0)["l2gd/iterations"] == 0.0
    counts = []
    for rnd in range(3):
        run_rounds(sim, 1)
        counts.append(_coins(sim, rnd, prob))
    out = sim.method.extra_metrics(2)
    assert out["l2gd/iterations"] == sum(b + a for b, a in counts)
    assert out["l2gd/local_steps"] == sum(b for b, _ in counts)
    assert any(a > 0 for _, a in counts)


def test_l2gd_with_a_decaying_lr_uses_each_rounds_gamma():
    """β_t = lr·decay^t: round t's averaging (applied at the start of round t + 1, and in the
    evaluation after round t) uses γ_t = λβ_t(1 − p)/p; the personal model at an evaluation is
    x̄ + (1 − γ_t)^{A_t}(x_i − x̄), the global one x̄ (kills broadcast 28, 29; eval_plan 24, 26;
    local_update 41)."""
    p, lam, prob, decay = least_squares(clusters=[0, 0, 1, 1]), 0.5, 0.3, 0.5
    sim = simulator(p, "l2gd", lr=LR, method__lam=lam, method__p=prob, federation__lr_decay=decay,
                    federation__lr_decay_every=1)
    x = np.array([vec(sim.method.init)] * p.m)
    for rnd in range(3):
        lr = LR * decay ** rnd
        B, A = _coins(sim, rnd, prob)
        path_losses = [np.mean([p.loss(i, p.gd(i, x[i], s, lr)) for s in range(B)]) for i in range(p.m)]
        x = np.array([p.gd(i, x[i], B, lr) for i in range(p.m)])
        xbar = x.mean(0)
        run_rounds(sim, 1)
        assert sim.history[-1]["train/loss"] == pytest.approx(np.mean(path_losses), rel=1e-5)
        gamma = lam * lr * (1 - prob) / prob
        x = xbar + (1 - gamma) ** A * (x - xbar)
    metrics = sim.evaluate()
    rmse = [math.sqrt(p.loss(i, x[i])) for i in range(p.m)]
    assert metrics["test/rmse_mean"] == pytest.approx(np.mean(rmse), rel=1e-4)
    assert metrics["global/test_loss"] == pytest.approx(np.mean([p.loss(i, xbar) for i in range(p.m)]), rel=1e-4)


def test_l2gd_evaluated_before_any_round_is_the_start():
    """Nothing aggregated yet: every client is evaluated with x⁰ (kills eval_plan 5)."""
    p = least_squares()
    sim = simulator(p, "l2gd", lr=LR, method__lam=0.5, method__p=0.3)
    w0 = vec(sim.method.init)
    metrics = sim.evaluate()
    assert metrics["test/loss_mean"] == pytest.approx(np.mean([p.loss(i, w0) for i in range(p.m)]), rel=1e-5)


def _l2gd_refusal(problem, **kw):
    from pfl.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        simulator(problem, "l2gd", **kw)
    return err.value


def test_l2gd_refuses_an_averaging_weight_above_one_and_shows_the_product(problem):
    """γ = λβ(1 − p)/p = 3·0.5·0.5/0.5 = 1.5 > 1 (kills configure 9–15, 18–21)."""
    err = _l2gd_refusal(problem, lr=0.5, method__lam=3.0, method__p=0.5)
    assert err.field == "method.lam"
    assert err.message == ("the averaging weight γ = λβ(1−p)/p = 3.0·0.5·0.5/0.5 = 1.5 must be ≤ 1; lower λ or "
                           "the client lr, or raise p")


def test_l2gd_accepts_an_averaging_weight_of_exactly_one(problem):
    """γ = 2·0.5·0.5/0.5 = 1: the bound is inclusive (kills configure 8)."""
    sim = simulator(problem, "l2gd", lr=0.5, method__lam=2.0, method__p=0.5)
    assert sim.method.gamma(0) == 1.0


def test_l2gd_checks_gamma_with_the_first_rounds_lr(problem):
    """With lr 0.5 decaying by 1/2 per round, γ_0 = 3·0.5·1 = 1.5 > 1 is refused (γ_1 = 0.75 would
    pass), and the message shows β_0 (kills configure 7, 16, 17)."""
    err = _l2gd_refusal(problem, lr=0.5, method__lam=3.0, method__p=0.5, federation__lr_decay=0.5,
                        federation__lr_decay_every=1)
    assert err.field == "method.lam"
    assert "= 3.0·0.5·0.5/0.5 = 1.5 must be ≤ 1" in err.message


def test_l2gd_server_bytes_are_the_clients_stale_models():
    """Every training client every round: nothing kept (0 bytes); under sampling every member's latest
    x_i: members × params × itemsize (8 − 2 newcomers = 6 members, 7 values of 4 bytes: 168)
    (kills server_bytes 1–3, 8, 9)."""
    from pfl.methods.base import ModelSize
    from pfl.methods.l2gd import L2GD
    from truth import config

    size = ModelSize(params=7, head=3, features=6, classes=0, itemsize=4)
    everyone = config("l2gd", 8, per_round=0)
    assert L2GD.server_bytes(8, size, everyone) == 0
    sampled = config("l2gd", 8, per_round=3, newcomers__fraction=0.25)
    assert L2GD.server_bytes(8, size, sampled) == 6 * 7 * 4


# ---- pfl/methods/fpfc_admm.py: the residuals -------------------------------------------------------------

def _antisymmetric(rs, m, p, scale, present):
    a = rs.normal(0.0, scale, (m, m, p))
    a = a - a.transpose(1, 0, 2)
    keep = np.zeros((m, m), dtype=bool)
    keep[np.ix_(present, present)] = True
    return a * keep[:, :, None]


def _residuals_by_pairs(W, theta, v, rho, before, present):
    """Boyd's residuals over the pairs i < j of the present devices, written from their definitions."""
    pairs = [(i, j) for a, i in enumerate(present) for j in present[a + 1:]]
    primal = math.sqrt(sum(np.sum((W[i] - W[j] - theta[i, j]) ** 2) for i, j in pairs))
    spread = sum(np.sum((W[i] - W[j]) ** 2) for i, j in pairs)
    theta_sq = sum(np.sum(theta[i, j] ** 2) for i, j in pairs)
    rows = [sum(theta[i, j] for j in range(len(W))) for i in present]
    dual = rho * math.sqrt(sum(np.sum((r - before[i]) ** 2) for r, i in zip(rows, present)))
    vrows = [sum(v[i, j] for j in range(len(W))) for i in present]
    return {"fpfc/primal_residual": primal, "fpfc/dual_residual": dual,
            "fpfc/primal_scale": math.sqrt(max(spread, theta_sq)),
            "fpfc/dual_scale": max(math.sqrt(sum(np.sum(r ** 2) for r in vrows)),
                                   rho * math.sqrt(sum(np.sum(r ** 2) for r in rows)))}


@pytest.mark.parametrize("theta_scale, v_scale", [(0.05, 0.01), (3.0, 0.01), (0.05, 5.0)])
def test_residuals_over_the_present_devices_from_their_definitions(theta_scale, v_scale):
    """Device 2 is absent (no pairs, θ = v = 0 there, its w far away): the residuals and scales over
    the pairs of the four others; small θ (the spread ‖Dw‖ is the primal scale), large θ (‖θ‖ is), a
    large v (‖Dᵀv‖ is the dual scale) (kills Residuals.report 12, 27, 31, 33, 68)."""
    from pfl.methods.fpfc_admm import Residuals

    rs = np.random.RandomState(3)
    m, p, rho, present = 5, 3, 1.5, [0, 1, 3, 4]
    W = rs.normal(0.0, 1.0, (m, p))
    W[2] += 40.0
    theta = _antisymmetric(rs, m, p, theta_scale, present)
    v = _antisymmetric(rs, m, p, v_scale, present)
    before = rs.normal(0.0, 0.1, (m, p))
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    out, rowsum = Residuals().report(t(W), t(theta), t(v), rho, t(before), present)
    expected = _residuals_by_pairs(W, theta, v, rho, before, present)
    assert set(out) == set(expected)
    for k, value in expected.items():
        assert out[k] == pytest.approx(value, rel=1e-9), k
    assert np.allclose(rowsum.numpy(), theta.sum(1))


def test_residuals_after_a_reset_are_those_of_the_new_state():
    """A reset drops the cached pair residuals: the next report is that of the state then, as from a
    fresh tracker (kills Residuals.reset 1)."""
    from pfl.methods.fpfc_admm import Residuals

    rs = np.random.RandomState(4)
    m, p, rho, everyone = 4, 2, 1.0, [0, 1, 2, 3]
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    tracker = Residuals()
    tracker.report(t(rs.normal(size=(m, p))), t(_antisymmetric(rs, m, p, 1.0, everyone)),
                   t(np.zeros((m, m, p))), rho, t(np.zeros((m, p))))
    tracker.reset()
    W, theta = rs.normal(size=(m, p)), _antisymmetric(rs, m, p, 1.0, everyone)
    tracker.update_rows(t(W), t(theta), [1])
    out, _ = tracker.report(t(W), t(theta), t(np.zeros((m, m, p))), rho, t(np.zeros((m, p))))
    expected = _residuals_by_pairs(W, theta, np.zeros((m, m, p)), rho, np.zeros((m, p)), everyone)
    assert out["fpfc/primal_residual"] == pytest.approx(expected["fpfc/primal_residual"], rel=1e-9)


# ---- pfl/methods/fpfc_admm.py: the declared server memory ------------------------------------------------

def _fpfc_mlp(m=5, **kw):
    from pfl.federation.simulator import Simulator
    from truth import classification_data, config

    data, _ = classification_data(sizes=(12, 15, 10, 14, 11, 13)[:m])
    cfg = config("fpfc", data.num_clients, steps=1, lr=0.1, source="digits", model="mlp",
                 model__params={"hidden": [6]}, **kw)
    return Simulator(cfg, data=data)


@pytest.mark.parametrize("layers, stale", [("none", False), ("body", False), ("body", True)])
def test_fpfc_server_bytes_are_the_bytes_of_its_pairwise_state(layers, stale):
    """W, θ, v, Dᵀθ in the model's dtype, n_i in float64, and with ``stale_body`` every device's body
    average: the bytes of those tensors in a run, p the clustered parameters (the head's 3·(6+1) with
    ``shared_layers: body``, all 4·6+6+21 without) (kills FPFCMemory._clustered 1–5, server_bytes 8–25)."""
    from pfl.methods.fpfc_admm import FPFCMemory
    from pfl.methods.base import ModelSize

    sim = _fpfc_mlp(method__shared_layers=layers, method__stale_body=stale)
    meth = sim.method
    total = sum(t.numel() for t in meth.init.values())
    head = 3 * 7 if layers == "body" else total
    assert total == 4 * 6 + 6 + 3 * 7 and meth.W.shape == (5, head)
    state = [meth.W, meth.theta, meth.v, meth.theta_rowsum, meth.n_seen]
    if stale:
        state.append(meth.body_of)
    else:
        assert meth.body_of is None
    held = sum(t.numel() * t.element_size() for t in state)
    size = ModelSize(params=total, head=3 * 7, features=4, classes=3, itemsize=4)
    assert FPFCMemory.server_bytes(5, size, sim.cfg) == held


@pytest.mark.parametrize("m, per_round, newcomers, sampled", [
    (10, 0, 0.0, 10),     # everyone: 4·10 > 2·10
    (10, 3, 0.0, 3),      # 2·10 > 4·3
    (10, 7, 0.0, 7),      # 4·7 > 2·10
    (10, 8, 0.2, 8),      # 8 per round of 8 members: everyone
    (10, 0, 0.2, 8),
])
def test_fpfc_round_work_bytes_by_hand(m, per_round, newcomers, sampled):
    """A round's temporaries: four (|A|, m, p) tensors of the sampled rows, or the residuals' two
    (m, m, p) ones, whichever is larger; |A| the clients per round, all the members when every one
    trains (kills FPFCMemory.server_work_bytes 2, 3, 12–14, 19–22)."""
    from pfl.methods.fpfc_admm import FPFCMemory
    from pfl.methods.base import ModelSize
    from truth import config

    cfg = config("fpfc", m, per_round=per_round, newcomers__fraction=newcomers)
    size = ModelSize(params=11, head=5, itemsize=2)
    assert FPFCMemory.server_work_bytes(m, size, cfg) == 2 * max(2 * m, 4 * sampled) * m * 11


# ---- pfl/methods/fpfc_admm.py: the newcomers' join -------------------------------------------------------

def _fpfc_newcomers(tol):
    """Six devices, two of them newcomers (0 and 2), after two training rounds."""
    p = least_squares(sizes=(20, 30, 24, 27, 22, 25), clusters=[0, 0, 0, 1, 1, 1])
    sim = simulator(p, "fpfc", steps=2, lr=0.2, newcomers__fraction=0.34, method__lam=0.5, method__xi=0.0,
                    newcomers__tol=tol)
    run_rounds(sim, 2)
    assert sorted(sim.ctx.newcomers) == [0, 2]
    return sim


def _uploads(meth, rows):
    from pfl.federation.messages import Message, Model

    return {c: Message.of({"w": Model(params_of(np.asarray(w, dtype=float), meth.init))}, n=10 + c)
            for c, w in rows.items()}


def _set_rows(meth, rows):
    for c, w in rows.items():
        meth.W[c] = torch.tensor(w, dtype=meth.W.dtype)


def test_fpfc_join_settles_from_step_one_on_each_newcomers_own_change():
    """newcomers.tol = 0.5: step 0 (the upload after training alone) never settles, even unchanged;
    at step 1 newcomer 0 moved by exactly tol·‖w‖ (0.5 of 1: settled, the bound is inclusive) and
    newcomer 2 by 0.25 ≤ 0.5·2 (settled): each judged on its own row. The pair of the two newcomers
    does not exist and stays θ = v = 0 while their pairs with the members move (kills
    FPFCJoin.join_aggregate 57, 61–63, 68, 70, 76, 78, 87)."""
    sim = _fpfc_newcomers(tol=0.5)
    meth = sim.method
    meth.join_begin(2, [0, 2])
    start = {0: [0.0, 0.0, 1.0], 2: [0.0, 2.0, 0.0]}
    _set_rows(meth, start)
    meth.join_aggregate(2, 0, _uploads(meth, start))
    assert meth.settled == [] and meth.join_active(1) == [0, 2]
    step1 = {0: [0.0, 0.0, 1.5], 2: [0.0, 2.0, 0.25]}
    meth.join_aggregate(2, 1, _uploads(meth, step1))
    assert np.allclose(meth.W[[0, 2]].numpy(), [step1[0], step1[2]])
    assert sorted(meth.settled) == [0, 2] and meth.join_active(2) == []
    assert float(meth.theta[0, 2].norm()) == 0.0 and float(meth.v[0, 2].norm()) == 0.0
    assert float(meth.theta[2, 0].norm()) == 0.0
    assert all(float(meth.theta[0, j].norm()) > 0 for j in sim.ctx.members)


def test_fpfc_join_keeps_the_newcomers_that_settled_earlier():
    """Newcomer 0 settles at step 1; newcomer 2 (‖w‖ = 0.5 < 1: its tolerance is 0.5·0.5, not 0.5)
    moved 0.4 and goes on alone, settling at step 2; then nobody is left (kills
    FPFCJoin.join_aggregate 80, 81)."""
    sim = _fpfc_newcomers(tol=0.5)
    meth = sim.method
    meth.join_begin(2, [0, 2])
    _set_rows(meth, {0: [0.0, 0.0, 1.0], 2: [0.0, 0.5, 0.0]})
    meth.join_aggregate(2, 1, _uploads(meth, {0: [0.0, 0.0, 1.5], 2: [0.0, 0.5, 0.4]}))
    assert meth.settled == [0] and meth.join_active(2) == [2]
    meth.join_aggregate(2, 2, _uploads(meth, {2: [0.0, 0.5, 0.45]}))
    assert sorted(meth.settled) == [0, 2] and meth.join_active(3) == []


def test_fpfc_join_with_tol_zero_runs_every_round():
    """newcomers.tol = 0: "always all rounds", even for an upload that did not move (kills
    FPFCJoin.join_aggregate 64)."""
    sim = _fpfc_newcomers(tol=0.0)
    meth = sim.method
    meth.join_begin(2, [0, 2])
    rows = {0: [0.0, 0.0, 1.0], 2: [0.0, 2.0, 0.0]}
    _set_rows(meth, rows)
    meth.join_aggregate(2, 1, _uploads(meth, rows))
    assert meth.settled == [] and meth.join_active(2) == [0, 2]


def test_fpfc_join_messages_carry_the_body_and_the_newcomers_zeta():
    """Step 0: the body average only, and the newcomer trains alone (``local``); from step 1 on also
    ζ_i = (1/|F|) Σ_{j∈F} (w_j + θ_ij − v_ij/ρ) over F = the members and i itself (the other
    newcomer is not a partner), here with θ, v of i's pairs set at random (kills FPFCJoin.join_message
    2, 4–7, 9, 18, 34, 40)."""
    sim = _fpfc_mlp(m=6, method__shared_layers="body", newcomers__fraction=0.34, method__rho=2.0)
    meth = sim.method
    run_rounds(sim, 1)
    members, newcomers = sorted(sim.ctx.members), sorted(sim.ctx.newcomers)
    assert len(newcomers) == 2
    i, other = newcomers
    rs = np.random.RandomState(5)
    p = meth.W.shape[1]
    meth.W[other] = torch.tensor(rs.normal(0.0, 3.0, p), dtype=meth.W.dtype)
    for j in members:
        t, v = rs.normal(0.0, 1.0, p), rs.normal(0.0, 1.0, p)
        meth.theta[i, j], meth.theta[j, i] = torch.tensor(t), torch.tensor(-t)
        meth.v[i, j], meth.v[j, i] = torch.tensor(v), torch.tensor(-v)
    body = {k: t.clone() for k, t in meth.body.items()}

    first = meth.join_message(1, 0, i)
    assert set(first.parts) == {"body"} and first.info.get("local") is True
    assert all(torch.equal(first.tensors("body")[k], body[k]) for k in body)

    later = meth.join_message(1, 1, i)
    assert set(later.parts) == {"body", "zeta"} and not later.info.get("local")
    assert all(torch.equal(later.tensors("body")[k], body[k]) for k in body)
    W, theta, v = (a.double().numpy() for a in (meth.W, meth.theta, meth.v))
    F = members + [i]
    zeta = np.mean([W[j] + theta[i, j] - v[i, j] / 2.0 for j in F], axis=0)
    got = torch.cat([later.tensors("zeta")[k].reshape(-1) for k in meth.clustered]).double().numpy()
    assert np.allclose(got, zeta, atol=1e-5)


def test_fpfc_newcomer_minibatches_come_from_the_join_streams():
    """A newcomer's minibatch order is the client stream of its join step: step 0's local updates k =
    0, 1 draw from the tags ``join_local0``, ``join_local1`` (no pull), step 1's pulled update from
    ``join``; one SGD step of 5 samples each, done by hand from those orders (kills
    FPFCJoin.join_update 11, 16, 22, 27, 29, 30)."""
    from pfl.federation.newcomers import join_newcomers

    p, lr, rho, b = least_squares(sizes=(20, 30, 24, 27, 22, 25), clusters=[0, 0, 0, 1, 1, 1]), 0.1, 1.0, 5
    sim = simulator(p, "fpfc", steps=1, lr=lr, newcomers__fraction=0.17, method__lam=0.5, method__xi=0.0,
                    newcomers__tol=0.0, newcomers__rounds=2, newcomers__local_rounds=2, federation__batch_size=b)
    run_rounds(sim, 1)
    (n,) = sim.ctx.newcomers
    meth, uploads, zetas = sim.method, [], []
    agg, message = meth.join_aggregate, meth.join_message

    def record_aggregate(rnd, step, replies):
        uploads.append(vec(replies[n].tensors("w")))
        agg(rnd, step, replies)

    def record_message(rnd, step, cid):
        msg = message(rnd, step, cid)
        if "zeta" in msg.parts:
            zetas.append(vec(msg.tensors("zeta")))
        return msg

    meth.join_aggregate, meth.join_message = record_aggregate, record_message
    start = sim.round
    join_newcomers(sim)
    Z, y = p.design(n), p.y[n]

    def step(w, tag, rnd, pull=None):
        idx = torch.randperm(len(y), generator=sim.ctx.generator(rnd, n, tag)).numpy()[:b]
        g = 2.0 / b * Z[idx].T @ (Z[idx] @ w - y[idx])
        if pull is not None:
            g = g + rho * (w - pull)
        return w - lr * g

    w = vec(meth.init)
    w = step(step(w, "join_local0", start), "join_local1", start)
    assert len(uploads) == 2 and close(uploads[0], w, 1e-5)
    w = step(w, "join", start + 1, pull=zetas[0])
    assert close(uploads[1], w, 1e-5)


def test_l2gd_compressed_upload_is_the_change_to_the_received_mean():
    """x_i is uploaded as its change to the x̄ it received (``ref``): with top-k (ratio 1/2, per
    tensor: the larger of the two weights, and the bias) the server holds x̄ + topk(x_i − x̄), and
    the new x̄ is their mean (kills local_update 46, 48–50)."""
    p, lam, prob = least_squares(), 0.5, 0.3
    sim = simulator(p, "l2gd", lr=LR, method__lam=lam, method__p=prob,
                    compression__uplink={"name": "topk", "ratio": 0.5}, compression__min_numel=1)
    w0 = vec(sim.method.init)
    B, _ = _coins(sim, 0, prob)

    def topk(delta):
        out = delta.copy()
        weight = out[:2]
        weight[np.argmin(np.abs(weight))] = 0.0
        return out

    held = [w0 + topk(p.gd(i, w0, B, LR) - w0) for i in range(p.m)]
    run_rounds(sim, 1)
    assert close(vec(sim.method.xbar), np.mean(held, axis=0), 1e-5)


# ---- the server's index tensors live on the server's device (checked on ``meta``) ----------------------

def test_the_residual_cache_indexes_on_the_servers_device():
    """(kills Residuals.update_rows 10, 13)"""
    from pfl.methods.fpfc_admm import Residuals

    W, theta = torch.zeros(4, 3, device="meta"), torch.zeros(4, 4, 3, device="meta")
    tracker = Residuals()
    with CudaDeviceRules():
        tracker.update_rows(W, theta, [0, 2])
        tracker.update_rows(W, theta, [1])
    assert tracker.pair_sq.device.type == "meta" and tuple(tracker.pair_sq.shape) == (4, 4)


def test_an_fpfc_join_message_is_computed_on_the_servers_device():
    """ζ of a newcomer from W, θ, v held on ``meta`` (kills FPFCJoin.join_message 17, 21, 24, 42, 44)."""
    sim = _fpfc_newcomers(tol=0.5)
    meth = sim.method
    meth.join_begin(2, [0, 2])
    meth.W, meth.theta, meth.v = (t.to("meta") for t in (meth.W, meth.theta, meth.v))
    with CudaDeviceRules():
        msg = meth.join_message(2, 1, 0)
    zeta = msg.tensors("zeta")
    assert set(zeta) == set(meth.clustered) and all(t.device.type == "meta" for t in zeta.values())
