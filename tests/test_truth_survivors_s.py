"""Survivor triage S (issue 42): FPFC's hyperparameter checks and FedSLR's round, against independent truths.

FPFCHparams.validate: every invalid setting (a robust aggregator without a shared body, ξ ≥ λ under SCAD,
(a−1)·ρ ≤ 1 under SCAD, a bad inherited byzantine_share) is refused with a ConfigError whose field and
message are exactly the code's wording, the boundary values ((a−1)·ρ just above 1, ξ just below λ) are
accepted, and FPFC-L1 (no SCAD) is not subject to the SCAD conditions. FedSLR (docs/methods/fedslr.md,
/work/shared/specs/fedslr.md) on tests/truth.py's least-squares federation: the Phase I upload is K
gradient steps on f_i + (1/(2η))‖w − w^t‖² + (ω/2)‖w‖² written in numpy (federation.weight_decay
ignored), ``train/loss`` the mean of those steps' losses; Phase II is one proximal-gradient step on P per
round from P = 0 that persists across rounds; λ = 0 skips the SVD (no timings, full ranks); the SVT's
wall time is a real duration; the GKR is sent factorised (rank 0: an empty pair) unless
``factorize_downlink`` is off; evaluation reports the GKR's own test loss as ``global/*``;
``lowrank_exclude`` names are checked against the model's matrices; a keep-everything top-k uplink
(the change from the received GKR) leaves the iterates as without compression; on a BatchNorm model
both server variants run and agree, P's statistics are torch's own BatchNorm update of the initial
statistics, and the personal model's statistics are P's (not added to the GKR's).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from truth import Recorder, close, config, least_squares, run_rounds, simulator, vec, WEIGHT, BIAS

LR, K = 0.1, 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(clusters=[0, 0, 1, 1])


def _soft(z, k):
    return np.sign(z) * np.maximum(np.abs(z) - k, 0.0)


# ---- FPFCHparams.validate ------------------------------------------------------------------------

def _fpfc(method="fpfc", **kw):
    from helpers import small_config

    return small_config(**{"method.name": method, **{f"method.{k}": v for k, v in kw.items()}})


def _refused(method="fpfc", **kw):
    from pfl.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        _fpfc(method, **kw)
    return err.value


@pytest.mark.parametrize("agg", ["median", "krum"])
def test_fpfc_robust_aggregator_without_a_shared_body_is_refused_with_the_reason(agg):
    err = _refused(aggregator=agg)
    assert err.field == "method.aggregator"
    assert err.message == (f"{agg!r} combines FPFC's shared body, and with shared_layers=none nothing is "
                           "averaged: use aggregator=mean, or shared_layers=body")
    assert str(err) == f"method.aggregator: {err.message}"


def test_fpfc_robust_aggregator_with_a_shared_body_and_mean_without_are_accepted():
    assert _fpfc(aggregator="median", shared_layers="body").method.hparams.aggregator == "median"
    assert _fpfc(aggregator="mean", shared_layers="none").method.hparams.shared_layers == "none"


def test_fpfc_inherited_byzantine_share_check_names_the_method_field():
    err = _refused(byzantine_share=-0.5)
    assert err.field == "method.byzantine_share"
    assert err.message == "must be in [0, 1) or -1 (the attack fraction), got -0.5"


@pytest.mark.parametrize("xi,lam", [(0.8, 0.8), (0.9, 0.8), (0.5, 0.0)])
def test_fpfc_scad_smoothing_not_below_lambda_is_refused(xi, lam):
    err = _refused(xi=xi, lam=lam)
    assert err.field == "method.xi"
    assert err.message == f"the SCAD smoothing must satisfy ξ < λ, got ξ={xi}, λ={lam}"


def test_fpfc_scad_smoothing_just_below_lambda_is_accepted():
    hp = _fpfc(xi=0.79, lam=0.8).method.hparams
    assert (hp.xi, hp.lam) == (0.79, 0.8)


@pytest.mark.parametrize("a,rho", [(3.0, 0.5), (3.0, 0.4), (2.5, 0.6), (4.0, 0.25)])
def test_fpfc_scad_prox_condition_at_or_below_one_is_refused(a, rho):
    """(a−1)·ρ ≤ 1: (3−1)·0.5 = 1 (the boundary), 0.8, 0.9, 0.75."""
    assert (a - 1) * rho <= 1
    err = _refused(a=a, rho=rho)
    assert err.field == "method.rho"
    assert err.message == f"the SCAD proximal map needs (a−1)·ρ > 1, got a={a}, ρ={rho}"


@pytest.mark.parametrize("a,rho", [(3.0, 0.75), (2.5, 0.7), (3.7, 1.0), (5.0, 0.3)])
def test_fpfc_scad_prox_condition_above_one_is_accepted(a, rho):
    """(a−1)·ρ > 1 (1.5, 1.05, 2.7, 1.2), including cases where (a−2)·ρ ≤ 1 or (a−1)·ρ ≤ 2."""
    assert (a - 1) * rho > 1
    hp = _fpfc(a=a, rho=rho).method.hparams
    assert (hp.a, hp.rho) == (a, rho)


def test_fpfc_l1_is_not_subject_to_the_scad_conditions():
    """FPFC-L1's group lasso has no ξ and no SCAD prox: ξ ≥ λ and (a−1)·ρ ≤ 1 are both accepted."""
    hp = _fpfc("fpfc_l1", xi=0.5, lam=0.2, a=3.0, rho=0.5).method.hparams
    assert hp.penalty == "l1" and hp.xi == 0.5 and hp.rho == 0.5


# ---- FedSLR: configure ---------------------------------------------------------------------------

def _matrices():
    """The mlp's matrix parameters on digits, listed from a freshly built module (≥ 2 dims)."""
    from pfl.models import build_model

    model = build_model("mlp", None, (64,), 10)
    return [n for n, p in model.named_parameters() if p.ndim >= 2]


def _fedslr_sim(**kw):
    from helpers import small_config
    from pfl.federation.simulator import Simulator

    return Simulator(small_config(**{"method.name": "fedslr", "model.name": "mlp", "federation.rounds": 1,
                                     **{k.replace("__", "."): v for k, v in kw.items()}}))


def test_fedslr_lowrank_exclude_unknown_name_is_refused_listing_the_matrices():
    from pfl.schema import ConfigError

    mats = _matrices()
    assert len(mats) >= 2
    with pytest.raises(ConfigError) as err:
        _fedslr_sim(method__lowrank_exclude=["bogus", mats[0]])
    assert err.value.field == "method.lowrank_exclude"
    assert err.value.message == f"['bogus'] are not matrix parameters of mlp; allowed: {', '.join(mats)}"


def test_fedslr_lowrank_exclude_of_a_matrix_is_accepted_and_leaves_it_unthresholded():
    mats = _matrices()
    sim = _fedslr_sim(method__lowrank_exclude=[mats[0]])
    assert sim.method.low_rank_names == mats[1:]


# ---- FedSLR: Phase I upload, train loss --------------------------------------------------------

def test_fedslr_phase_one_upload_is_the_proximal_local_gd_and_ignores_federation_weight_decay(problem):
    """Round 0 (γ = 0): w_i = K steps w ← w − ℓ(∇f_i(w) + (w − w⁰)/η + ωw) from w⁰; federation.weight_decay
    (0.3 here) is replaced by ω; ``train/loss`` = mean over clients of the mean f_i(w_k), k < K."""
    from pfl.federation.simulator import Simulator

    p, eta, omega = problem, 0.4, 0.05
    rec = Recorder()
    sim = Simulator(config("fedslr", p.m, steps=K, lr=LR, method__lam=0.0, method__eta=eta,
                           method__weight_decay=omega, method__phase2_epochs=0, federation__weight_decay=0.3),
                    data=p.federated(), stages=[rec])
    w0 = vec(sim.method.global_model)
    row = sim.run_round(evaluate=False)
    losses = []
    for i in range(p.m):
        w, seen = w0.copy(), []
        for _ in range(K):
            seen.append(p.loss(i, w))
            w = w - LR * (p.grad(i, w) + (w - w0) / eta + omega * w)
        assert close(vec(rec.up[0, i]["model"].tensors()), w, 1e-5)
        assert not close(w, p.gd(i, w0, K, LR, pull=(eta, w0)), 1e-3)  # the weight is 1/η, not η
        losses.append(np.mean(seen))
    assert row["train/loss"] == pytest.approx(np.mean(losses), rel=1e-5)


# ---- FedSLR: Phase II persists, starts at zero ---------------------------------------------------

def test_fedslr_phase_two_starts_at_zero_and_continues_from_last_rounds_p(problem):
    """p_init zeros, one full-batch Phase II step per round: P¹ = S(0 − ℓ∇f_i(w⁰), ℓμ), then
    P² = S(P¹ − ℓ(∇f_i(w¹ + P¹) + ω₂P¹), ℓμ) around the GKR w¹ received in round 1."""
    p, mu, omega2 = problem, 0.05, 0.01
    sim = simulator(p, "fedslr", steps=K, lr=LR, method__lam=0.0, method__eta=2.0, method__mu=mu,
                    method__phase2_epochs=1, method__phase2_weight_decay=omega2, method__p_init="zeros")
    w0 = vec(sim.method.global_model)
    run_rounds(sim, 1)
    w1 = vec(sim.method.global_model)
    P1 = [_soft(-LR * p.grad(i, w0), LR * mu) for i in range(p.m)]
    for i in range(p.m):
        assert close(vec(sim.client_states[i]["P"]), P1[i], 1e-5)
    run_rounds(sim, 1)
    for i in range(p.m):
        P2 = _soft(P1[i] - LR * (p.grad(i, w1 + P1[i]) + omega2 * P1[i]), LR * mu)
        got = vec(sim.client_states[i]["P"])
        assert close(got, P2, 1e-5)
        fresh = _soft(-LR * p.grad(i, w1), LR * mu)
        assert not close(got, fresh, 1e-3)  # a P restarted at zero would differ


def test_fedslr_phase_two_shuffles_with_its_own_stream_not_a_replay_of_phase_one(problem, monkeypatch):
    """Minibatch epochs: Phase II's permutation of the client's samples is a fresh draw, not Phase I's
    first-epoch order again (kills a Phase II that reuses the training stream)."""
    drawn = []
    real = torch.randperm

    def spy(*args, **kw):
        out = real(*args, **kw)
        drawn.append(out.clone())
        return out

    sim = simulator(problem, "fedslr", steps=K, lr=LR, per_round=1, method__lam=0.0, method__phase2_epochs=1,
                    federation__batch_size=5, federation__local_steps=None, federation__local_epochs=1,
                    federation__cohort="sequential", federation__threads=1)
    monkeypatch.setattr(torch, "randperm", spy)
    run_rounds(sim, 1)
    monkeypatch.undo()
    n = {len(x) for x in drawn}
    assert len(drawn) == 2 and len(n) == 1  # one epoch of Phase I, one of Phase II, same client
    assert not torch.equal(drawn[0], drawn[1])


# ---- FedSLR: λ = 0 and the SVT's bookkeeping ----------------------------------------------------

def test_fedslr_without_nuclear_penalty_skips_the_svd_and_reports_full_ranks(problem):
    """λ = 0: no SVD runs (no timing kept, no factor layers), every matrix reports (min(rows, cols),)*2
    and the downlink carries the dense weight."""
    sim = simulator(problem, "fedslr", steps=K, lr=LR, method__lam=0.0, method__phase2_epochs=0)
    run_rounds(sim, 2)
    assert sim.method.svd_seconds == []
    assert sim.method.layers == {}
    shape = sim.method.global_model[WEIGHT].shape
    full = min(shape[0], int(np.prod(shape[1:])))
    assert sim.method.ranks() == {WEIGHT: (full, full)}
    metrics = sim.method.extra_metrics(sim.round)
    assert metrics["model/rank_mean"] == full and metrics["model/rank_kept_ratio"] == 1.0
    entry = sim.method.broadcast(2, 0)["model"].entries[WEIGHT]
    assert isinstance(entry, torch.Tensor)


def test_fedslr_svd_seconds_are_one_real_duration_per_round(problem):
    sim = simulator(problem, "fedslr", steps=K, lr=LR, method__lam=0.1, method__phase2_epochs=0)
    start = time.perf_counter()
    run_rounds(sim, 2)
    elapsed = time.perf_counter() - start
    secs = sim.method.svd_seconds
    assert len(secs) == 2
    assert all(isinstance(s, float) and 0.0 <= s <= elapsed for s in secs)


@pytest.mark.parametrize("factorize", [True, False])
def test_fedslr_rank_zero_gkr_is_sent_as_an_empty_pair_unless_factorizing_is_off(problem, factorize):
    """τ = ηλ far above the weight's singular value: the GKR weight is exactly 0 (rank 0); with
    factorize_downlink it travels as a LowRank pair of rank 0 (0 scalars), else as the dense zero."""
    from pfl.federation.messages import LowRank

    sim = simulator(problem, "fedslr", steps=K, lr=LR, method__lam=100.0, method__eta=2.0,
                    method__phase2_epochs=0, method__factorize_downlink=factorize)
    run_rounds(sim, 1)
    assert torch.count_nonzero(sim.method.global_model[WEIGHT]) == 0
    for msg in (sim.method.broadcast(1, 0), sim.method.eval_message(1, 0)):
        entry = msg["model"].entries[WEIGHT]
        if factorize:
            assert isinstance(entry, LowRank) and entry.left.shape[1] == 0
        else:
            assert isinstance(entry, torch.Tensor) and torch.count_nonzero(entry) == 0
        assert isinstance(msg["model"].entries[BIAS], torch.Tensor)


def test_fedslr_global_metrics_evaluate_the_gkr(problem):
    """``global/test_loss`` is the mean over clients of the GKR's test MSE (numpy); the personal models
    (GKR + P) give another number."""
    sim = simulator(problem, "fedslr", steps=K, lr=LR, method__lam=0.1, method__mu=0.01)
    run_rounds(sim, 2)
    gkr = vec(sim.method.global_model)
    msg = sim.method.eval_message(2, 1)
    from pfl.methods.base import GLOBAL
    assert msg.info[GLOBAL] is True
    row = sim.evaluate()
    expected = np.mean([problem.loss(i, gkr) for i in range(problem.m)])
    assert row["global/test_loss"] == pytest.approx(expected, rel=1e-5)
    personal = np.mean([problem.loss(i, vec(sim.personal_params(i))) for i in range(problem.m)])
    assert abs(personal - expected) > 1e-4


def test_fedslr_keep_everything_topk_uplink_leaves_the_iterates_unchanged(problem):
    """The upload is sent as its change from the received GKR; top-k with ratio 1 keeps all of it, so the
    server's GKR equals the uncompressed run's (up to the float rounding of w⁰ + (w_i − w⁰))."""
    kw = dict(steps=K, lr=LR, method__lam=0.1, method__eta=2.0, method__mu=0.01)
    plain = simulator(problem, "fedslr", **kw)
    packed = simulator(problem, "fedslr", compression__uplink={"name": "topk", "ratio": 1.0},
                       compression__min_numel=1, **kw)
    run_rounds(plain, 2)
    run_rounds(packed, 2)
    assert close(vec(packed.method.global_model), vec(plain.method.global_model), 1e-5)


# ---- FedSLR on a BatchNorm model -----------------------------------------------------------------

BN = dict(model__name="cnn_bn", model__params={"channels": [2, 4], "hidden": 8}, data__num_clients=4,
          federation__clients_per_round=2, federation__batch_size=0, federation__local_epochs=1,
          federation__rounds=2, federation__threads=1, federation__cohort="sequential")


def _bn_sim(server):
    from helpers import small_config
    from pfl.federation.simulator import Simulator

    cfg = small_config(**{"method.name": "fedslr", "method.lam": 1e-2, "method.server": server,
                          **{k.replace("__", "."): v for k, v in BN.items()}})
    return Simulator(cfg)


def test_fedslr_bn_model_server_variants_agree_and_p_holds_torchs_statistics():
    """Both servers run a BatchNorm model (integer batch counters included) and give the same GKR; a client's
    P statistics after one full-batch Phase II step are torch's own BatchNorm update of the initial
    statistics for its train split through w⁰ (+ P = 0); its personal model's statistics are P's."""
    import copy

    from pfl.models.functional import buffer_names

    sims = {s: _bn_sim(s) for s in ("algo2", "algo3")}
    w0 = {k: v.clone() for k, v in sims["algo3"].method.global_model.items()}
    init = sims["algo3"].ctx.init_params()
    for s in sims.values():
        run_rounds(s, 1)
    a2, a3 = sims["algo2"].method.global_model, sims["algo3"].method.global_model
    for k in a3:
        assert torch.allclose(a2[k].double(), a3[k].double(), rtol=1e-5, atol=1e-6), k
    sim = sims["algo3"]
    stats = buffer_names(sim.ctx.model)
    assert stats
    trained = [c for c in range(4) if "P" in sim.client_states[c]]
    assert len(trained) == 2
    for c in trained:
        model = copy.deepcopy(sim.ctx.model)
        model.load_state_dict({k: (init[k].clone() if k in stats else w0[k].clone()) for k in w0})
        model.train()
        with torch.no_grad():
            model(sim.client(c).data.x_train)
        want = model.state_dict()
        P = sim.client_states[c]["P"]
        for k in stats:
            if want[k].is_floating_point():
                assert torch.allclose(P[k], want[k], rtol=1e-4, atol=1e-6), k
                assert not torch.allclose(want[k], init[k], atol=1e-3), k  # the update moved them
        personal = sim.personal_params(c)
        for k in stats:
            assert torch.equal(personal[k], P[k]), k
