"""FPFC / FPFC-L1 / asyncFPFC: server math against direct loops, communication, learning, resume."""

import dataclasses

import numpy as np
import pytest
import torch

from helpers import small_config, straight_and_resumed, synthetic_config
from pfl.callbacks.divergence import run_rounds
from pfl.federation.async_clock import AsyncSimulator
from pfl.federation.clock import DelayModel, samples_per_update
from pfl.federation.simulator import Simulator
from pfl.methods.fpfc import pair_update, zeta
from pfl.prox import group_soft_threshold, scad_prox
from pfl.resolver import with_overrides
from pfl.schema import ConfigError


# ---- server math ------------------------------------------------------------------------------

def _random_state(m=6, p=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(m, p, generator=g, dtype=torch.float64)
    theta = torch.randn(m, m, p, generator=g, dtype=torch.float64) * 0.5
    v = torch.randn(m, m, p, generator=g, dtype=torch.float64) * 0.5
    theta = theta - theta.transpose(0, 1)   # antisymmetric, zero diagonal
    v = v - v.transpose(0, 1)
    return W, theta, v


def _loop_reference(W, theta, v, rows, prox, rho, mode):
    """The update of docs/methods/fpfc.md §2.2 step 4 pair by pair in plain Python."""
    theta, v = theta.clone(), v.clone()
    m = W.shape[0]

    def update(i, j):
        delta = W[i] - W[j] + v[i, j] / rho
        t = prox(delta.unsqueeze(0))[0]
        theta[i, j] = t
        v[i, j] = v[i, j] + rho * (W[i] - W[j] - t)
        theta[j, i] = -theta[i, j]
        v[j, i] = -v[i, j]

    if mode == "once":
        for i in range(m):
            for j in range(i + 1, m):
                if i in rows or j in rows:
                    update(i, j)
    else:
        for i in rows:
            for j in range(m):
                if j != i:
                    update(i, j)
    return theta, v


PROXES = {
    "scad": lambda d: scad_prox(d, lam=0.6, rho=1.3, xi=1e-3, a=3.7),
    "l1": lambda d: group_soft_threshold(d, 0.2 / 1.3),
}


@pytest.mark.parametrize("mode", ["once", "official_sequential"])
@pytest.mark.parametrize("penalty", ["scad", "l1"])
def test_vectorised_pair_update_equals_per_pair_loop(mode, penalty):
    W, theta, v = _random_state()
    rows = [1, 3, 4]
    prox = PROXES[penalty]
    # the random δ norms must cover several SCAD regions for the comparison to mean something
    r = torch.linalg.vector_norm(W[1] - W + v[1] / 1.3, dim=-1)
    assert (r < 0.6 + 0.6 / 1.3).any() or (r < 2.22).any()
    assert (r > 3.7 * 0.6).any()
    ref_theta, ref_v = _loop_reference(W, theta, v, rows, prox, 1.3, mode)
    t, vv = theta.clone(), v.clone()
    pair_update(W, t, vv, rows, prox, 1.3, mode)
    torch.testing.assert_close(t, ref_theta)
    torch.testing.assert_close(vv, ref_v)
    # antisymmetry and zero diagonal are kept exactly
    assert torch.equal(t, -t.transpose(0, 1)) and torch.equal(vv, -vv.transpose(0, 1))
    assert not t[range(6), range(6)].any() and not vv[range(6), range(6)].any()
    # pairs with neither end sampled are untouched
    for i, j in [(0, 2), (0, 5), (2, 5), (5, 0)]:
        assert torch.equal(t[i, j], theta[i, j]) and torch.equal(vv[i, j], v[i, j])
    # and pairs touching the sampled set did change
    assert not torch.equal(t[1, 0], theta[1, 0]) and not torch.equal(vv[0, 3], v[0, 3])


def test_sequential_differs_from_once_only_inside_the_sampled_set():
    W, theta, v = _random_state(seed=3)
    a_t, a_v, b_t, b_v = theta.clone(), v.clone(), theta.clone(), v.clone()
    pair_update(W, a_t, a_v, [1, 3], PROXES["scad"], 1.3, "once")
    pair_update(W, b_t, b_v, [1, 3], PROXES["scad"], 1.3, "official_sequential")
    assert not torch.allclose(a_v[1, 3], b_v[1, 3])            # updated twice sequentially
    torch.testing.assert_close(a_v[1, 0], b_v[1, 0])          # (1, 0): once in both


def test_zeta_equals_direct_formula():
    W, theta, v = _random_state(m=7, p=4, seed=1)
    rows = torch.tensor([0, 2, 6])
    got = zeta(W, theta, v, rows, rho=0.7)
    for pos, i in enumerate(rows.tolist()):
        direct = sum(W[j] + theta[i, j] - v[i, j] / 0.7 for j in range(7)) / 7
        torch.testing.assert_close(got[pos], direct)


def test_admm_residuals_equal_a_hand_computation_on_three_devices():
    from pfl.methods.fpfc_admm import Residuals

    W = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    theta, v = torch.zeros(3, 3, 2), torch.zeros(3, 3, 2)
    for (i, j), t, d in [((0, 1), [0.5, -0.5], [1.0, 0.0]), ((0, 2), [-1.0, -1.0], [0.0, 2.0]),
                         ((1, 2), [-2.0, -1.0], [1.0, 1.0])]:
        theta[i, j], theta[j, i] = torch.tensor(t), -torch.tensor(t)
        v[i, j], v[j, i] = torch.tensor(d), -torch.tensor(d)
    out, rowsum = Residuals().report(W, theta, v, rho=2.0, rowsum_before=torch.zeros(3, 2))
    # w_i − w_j − θ_ij: (1,−1) − (0.5,−0.5) = (0.5,−0.5); (−1,−2) − (−1,−1) = (0,−1); (−2,−1) − (−2,−1) = 0
    assert out["fpfc/primal_residual"] == pytest.approx(1.5 ** 0.5)
    # Σ_j θ_ij per device: (−0.5,−1.5), (−0.5,0.5) + (−2,−1) = (−2.5,−0.5), (1,1) + (2,1) = (3,2); from θ = 0
    assert out["fpfc/dual_residual"] == pytest.approx(2.0 * 22 ** 0.5)
    # Σ_{i<j} ‖w_i − w_j‖² = ‖(1,−1)‖² + ‖(−1,−2)‖² + ‖(−2,−1)‖² = 12 beats Σ_{i<j} ‖θ_ij‖² = 0.5 + 2 + 5
    assert out["fpfc/primal_scale"] == pytest.approx(12 ** 0.5)
    # Σ_j v_ij: (1,2), (0,1), (−1,−3) → ‖·‖ = 4 < ρ‖Dᵀθ‖ = 2√22
    assert out["fpfc/dual_scale"] == pytest.approx(2.0 * 22 ** 0.5)
    torch.testing.assert_close(rowsum, torch.tensor([[-0.5, -1.5], [-2.5, -0.5], [3.0, 2.0]]))
    # device 0 moves and its pairs are updated: the cached rows give what a fresh computation gives
    tracker = Residuals()
    tracker.update_rows(W, theta, [0])
    W[0] = torch.tensor([3.0, 1.0])
    theta[0, 1], theta[1, 0] = torch.tensor([2.5, 0.0]), -torch.tensor([2.5, 0.0])
    tracker.update_rows(W, theta, [0])
    again, _ = tracker.report(W, theta, v, rho=2.0, rowsum_before=rowsum)
    # (3,0) − (2.5,0) = (0.5,0); (1,−1) − (−1,−1) = (2,0); the untouched pair (1,2) still 0
    assert again["fpfc/primal_residual"] == pytest.approx(4.25 ** 0.5)
    # only θ_01 changed, by (2,0.5): rows 0 and 1 change by ±(2,0.5)
    assert again["fpfc/dual_residual"] == pytest.approx(2.0 * (2 * (4 + 0.25)) ** 0.5)
    fresh, _ = Residuals().report(W, theta, v, rho=2.0, rowsum_before=rowsum)
    assert fresh == pytest.approx(again)


def test_glued_clusters_count_cluster_pairs_whose_pairs_mostly_sit_inside_the_soft_threshold_region():
    from pfl.methods.fpfc_admm import glued_clusters

    # clusters {0,1,2} and {3,4,5}: 7 of their 9 cross pairs at ‖θ‖ 0.5, two at 2.0; a singleton 6 at
    # 0.3 from everyone (a fragment: never counted)
    dist = torch.full((7, 7), 5.0)
    for i in range(3):
        for j in range(3, 6):
            dist[i, j] = dist[j, i] = 0.5
    dist[0, 3] = dist[3, 0] = dist[1, 4] = dist[4, 1] = 2.0
    dist[6, :] = dist[:, 6] = 0.3
    dist.fill_diagonal_(0.0)
    labels = [0, 0, 0, 1, 1, 1, 2]
    assert glued_clusters(dist, labels, lam=0.8) == 1.0      # 7/9 > 1/2 of the pairs pulled with force λ
    assert glued_clusters(dist, labels, lam=0.4) == 0.0      # 0.5 > λ: none in the region
    dist[2, 5] = dist[5, 2] = dist[0, 4] = dist[4, 0] = dist[1, 3] = dist[3, 1] = 2.0
    assert glued_clusters(dist, labels, lam=0.8) == 0.0      # 4/9: a minority, not glued
    # device 6 read out with the second cluster: 4 + 3 of the 12 pairs are close, a majority again
    assert glued_clusters(dist, [0, 0, 0, 1, 1, 1, 1], lam=0.8) == 1.0


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_fpfc_logs_every_rounds_residuals_as_a_direct_computation_from_its_state(driver):
    cfg = synthetic_config(federation__rounds=5, federation__driver=driver, method__rho=1.7)
    sim = (AsyncSimulator if driver == "async" else Simulator)(cfg)
    previous = np.zeros(tuple(sim.method.W.shape))
    for _ in range(5):
        metrics = sim.run_round()
        W, theta, v = (t.double().numpy() for t in (sim.method.W, sim.method.theta, sim.method.v))
        m = len(W)
        pairs = [(i, j) for i in range(m) for j in range(i + 1, m)]
        primal = sum(float(np.sum((W[i] - W[j] - theta[i, j]) ** 2)) for i, j in pairs) ** 0.5
        rows = np.array([sum(theta[i, j] for j in range(m)) for i in range(m)])
        dual = 1.7 * float(np.linalg.norm(rows - previous))   # over the logged round (async: several arrivals)
        spread = sum(float(np.sum((W[i] - W[j]) ** 2)) for i, j in pairs) ** 0.5
        size = sum(float(np.sum(theta[i, j] ** 2)) for i, j in pairs) ** 0.5
        force = float(np.linalg.norm(np.array([sum(v[i, j] for j in range(m)) for i in range(m)])))
        assert metrics["fpfc/primal_residual"] == pytest.approx(primal, rel=1e-4)
        assert metrics["fpfc/dual_residual"] == pytest.approx(dual, rel=1e-4)
        assert metrics["fpfc/primal_scale"] == pytest.approx(max(spread, size), rel=1e-4)
        assert metrics["fpfc/dual_scale"] == pytest.approx(max(force, 1.7 * float(np.linalg.norm(rows))), rel=1e-4)
        previous = rows
    assert metrics["fpfc/primal_residual"] > 0 and metrics["fpfc/dual_residual"] > 0


# ---- engine integration ------------------------------------------------------------------------

def test_communication_is_one_model_each_way_per_sampled_device():
    sim = Simulator(synthetic_config(federation__rounds=2))
    run_rounds(sim)
    p = 60 * 10 + 10
    assert sim.method.theta.shape == (20, 20, p)
    for up, down in sim.ledger.per_round:
        assert up == down == 6 * p * 4


def test_server_state_antisymmetric_and_untouched_rows_after_a_round():
    sim = Simulator(synthetic_config(federation__rounds=1))
    run_rounds(sim)
    method = sim.method
    sampled = set(sim.sample(0))
    assert torch.equal(method.theta, -method.theta.transpose(0, 1))
    assert torch.equal(method.v, -method.v.transpose(0, 1))
    others = [i for i in range(20) if i not in sampled]
    # pairs between two unsampled devices are still at their initial value (0)
    assert not method.theta[others][:, others].any() and not method.v[others][:, others].any()
    assert method.theta[sorted(sampled)].abs().sum() > 0
    # the server's copy of w is the device's own model
    for cid in range(20):
        own = torch.cat([t.reshape(-1) for t in sim.client(cid).state["w"].values()])
        assert torch.equal(method.W[cid], own)


@pytest.mark.slow
def test_fpfc_finds_the_true_clusters_and_beats_fedavg():
    # 20 devices of S1's generator at 30 % of the sizes: 4 clusters from round ~100 on (FedAvg ~39 %)
    cfg = synthetic_config(**{"data.num_clients": 20, "data.params.size_scale": 0.3,
                              "federation.rounds": 150, "federation.clients_per_round": 10,
                              "federation.eval_every": 150, "method.lam": 0.8})
    sim = Simulator(cfg)
    run_rounds(sim)
    final = sim.history[-1]
    assert final["cluster/num"] == 4
    assert final["cluster/ari"] >= 0.95
    assert final["fpfc/theta_max_within"] < final["fpfc/theta_min_between"]
    assert final["fpfc/nu"] == 0.1
    # the silhouette choice replaces ν in the metrics (here it merges the two closest clusters: on
    # fused structure the fixed ν is the right read-out)
    sim.method.hp = dataclasses.replace(sim.method.hp, nu_select="silhouette")
    chosen = sim.method.extra_metrics(sim.round)
    assert chosen["fpfc/nu"] == sim.method.readout_nu() != 0.1
    assert chosen["cluster/num"] == len(np.unique(sim.method.clusters(chosen["fpfc/nu"]))) >= 2
    fedavg = Simulator(with_overrides(cfg, {"method.name": "fedavg"}))
    run_rounds(fedavg)
    assert final["test/acc_mean"] > fedavg.history[-1]["test/acc_mean"] + 0.1
    assert final["fpfc/readout_acc"] > fedavg.history[-1]["test/acc_mean"] + 0.1


def test_fpfc_l1_runs_and_is_the_l1_configuration():
    sim = Simulator(synthetic_config(method__name="fpfc_l1", federation__rounds=4, federation__eval_every=2))
    assert sim.method.hp.penalty == "l1" and sim.method.hp.lam == 0.2 and sim.method.hp.nu == 4.0
    run_rounds(sim)
    last = sim.history[-1]
    assert np.isfinite(last["test/acc_mean"]) and last["cluster/num"] >= 1
    # the same thing spelled as fpfc with penalty=l1 gives the identical run
    same = Simulator(synthetic_config(method__penalty="l1", method__lam=0.2, method__nu=4.0,
                                      federation__rounds=4, federation__eval_every=2))
    run_rounds(same)
    assert torch.equal(same.method.theta, sim.method.theta)


def test_resume_continues_identically(tmp_path):
    cfg = synthetic_config(federation__rounds=4, federation__eval_every=2)
    straight, resumed = straight_and_resumed(cfg, tmp_path)
    for name in ("W", "theta", "v"):
        assert torch.equal(getattr(straight.method, name), getattr(resumed.method, name))
    for key in ("test/acc_mean", "cluster/num", "comm/total_bytes", "time/sim_clock"):
        assert straight.history[-1][key] == resumed.history[-1][key]


def test_lambda_can_be_changed_between_rounds():
    sim = Simulator(synthetic_config(federation__rounds=4, federation__eval_every=1))
    run_rounds(sim, until=2)
    sim.method.hp = dataclasses.replace(sim.method.hp, lam=0.3)
    delta = torch.tensor([[0.5, 0.0]])   # linear region for λ = 0.3 (1 − λ/r); λ = 0.8 would shrink it to ~0
    torch.testing.assert_close(sim.method.prox()(delta), torch.tensor([[0.2, 0.0]]))
    run_rounds(sim)
    assert sim.history[-1]["fpfc/lambda"] == 0.3 and sim.history[1]["fpfc/lambda"] == 0.8


@pytest.mark.parametrize("overrides, field", [
    ({"method.xi": 0.9, "method.lam": 0.8}, "method.xi"),
    ({"method.xi": 0.8, "method.lam": 0.8}, "method.xi"),
    ({"method.rho": 0.3}, "method.rho"),
    ({"method.a": 2.0}, "method.a"),
    ({"method.penalty": "mcp"}, "method.penalty"),
    ({"method.pair_update": "twice"}, "method.pair_update"),
    ({"method.nu": 0.0}, "method.nu"),
    ({"method.nu_select": "gap"}, "method.nu_select"),
])
def test_bad_hyperparameters_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        synthetic_config(**overrides)
    assert err.value.field == field


def test_l1_ignores_scad_constraints():
    cfg = synthetic_config(method__name="fpfc_l1", method__rho=0.3, method__xi=0.5)
    assert cfg.method.hparams.rho == 0.3


@pytest.mark.parametrize("stale", [False, True])
def test_shared_body_clusters_only_the_head(stale):
    cfg = small_config(method__name="fpfc", method__shared_layers="body", method__stale_body=stale,
                       model__name="mlp", federation__rounds=3, federation__eval_every=3)
    sim = Simulator(cfg)
    run_rounds(sim)
    method = sim.method
    head = sum(method.template[k].numel() for k in method.clustered)
    body = sum(t.numel() for t in method.body.values())
    assert method.theta.shape[-1] == head and body > 0 and method.shared
    for up, down in sim.ledger.per_round:      # ζ_i + body down, the whole model up
        assert up == down == 5 * (head + body) * 4
    # every device is evaluated with the shared body: current average, or its last round's
    params = sim.personal_params(0)
    expected = method.body if not stale else dict(zip(method.shared, [
        t.reshape(method.body[k].shape) for k, t in zip(method.shared, torch.split(
            method.body_of[0], [method.body[k].numel() for k in method.shared]))]))
    for k in method.shared:
        assert torch.equal(params[k], expected[k])
    assert np.isfinite(sim.history[-1]["test/acc_mean"])


def test_artifacts_table_and_plot(tmp_path):
    sim = Simulator(synthetic_config(federation__rounds=2, federation__eval_every=1))
    run_rounds(sim)
    paths = sim.method.artifacts(str(tmp_path))
    rows = (tmp_path / "fpfc_clusters.csv").read_text().strip().splitlines()
    assert rows[0] == "client,true_cluster,found_cluster,n_train" and len(rows) == 21
    assert any(p.endswith(".png") and (tmp_path / "fpfc_theta_norms.png").stat().st_size > 0 for p in paths)


# ---- simulated clock and asyncFPFC --------------------------------------------------------------

def test_sync_clock_is_the_sum_of_slowest_device_per_round():
    cfg = synthetic_config(federation__rounds=3, federation__eval_every=3)
    sim = Simulator(cfg)
    run_rounds(sim)
    delays = DelayModel(sim.ctx)
    expected = sum(max(delays.tau(r, c) for c in sim.sample(r)) for r in range(3))
    assert sim.history[-1]["time/sim_clock"] == pytest.approx(expected)
    n = sim.data.clients[0].n_train
    assert samples_per_update(cfg.federation, n) == 10 * n


def test_async_fpfc_runs_event_driven_and_resumes(tmp_path):
    cfg = synthetic_config(federation__rounds=4, federation__eval_every=2)
    straight, resumed = straight_and_resumed(cfg, tmp_path, simulator=AsyncSimulator)
    clocks = [m["time/sim_clock"] for m in straight.history]
    assert all(b >= a for a, b in zip(clocks, clocks[1:])) and clocks[0] > 0
    assert straight.history[-1]["async/arrivals"] == 4 * 6
    # every arrival sends one message each way; the initial dispatch sends one to every device
    p = 610 * 4
    assert straight.ledger.up_bytes == 24 * p
    assert straight.ledger.down_bytes == (20 + 24) * p
    assert torch.equal(straight.method.theta, -straight.method.theta.transpose(0, 1))
    assert torch.equal(straight.method.theta, resumed.method.theta)
    assert straight.history[-1]["time/sim_clock"] == resumed.history[-1]["time/sim_clock"]
    assert straight.history[-1]["test/acc_mean"] == resumed.history[-1]["test/acc_mean"]


def test_async_driver_is_a_config_value():
    from pfl.runner import run_experiment

    summary = run_experiment(synthetic_config(federation__driver="async", federation__rounds=2,
                                              federation__eval_every=1), progress=None)
    assert summary.final["async/arrivals"] == 2 * 6 and summary.final["time/sim_clock"] > 0
    with pytest.raises(ConfigError) as err:
        synthetic_config(method__name="fedavg", federation__driver="async")
    assert err.value.field == "federation.driver" and "fpfc" in str(err.value)
    with pytest.raises(ConfigError) as err:
        synthetic_config(federation__driver="threads")
    assert err.value.field == "federation.driver"


@pytest.mark.slow
def test_lambda_path_round_budget():
    from pfl.tune.lambda_path import PathSettings, separate_run, warmup_path

    # tolerance 1.0 with a window of one evaluation and no residual rule: every segment converges at its
    # second evaluation
    settings = PathSettings(lambdas=[0.6, 0.2, 0.4], eval_every=2, stage_cap=4, window=1, tolerance=1.0,
                            residual_tol=0.0, patience=5, extend=0, finalists=1, budget=12)
    with pytest.raises(ConfigError) as err:     # no validation split: nothing to select λ by
        warmup_path(Simulator(synthetic_config()), settings)
    assert err.value.field == "data.val_fraction"
    sim = Simulator(synthetic_config(federation__rounds=10**6, data__val_fraction=0.2))
    seen = []
    result = warmup_path(sim, settings, on_stage=lambda i, s: seen.append((s["lambda"], sim.round)))
    assert [lam for lam, _ in seen] == [0.2, 0.4, 0.6]          # ascending by default
    assert [rounds for _, rounds in seen] == [4, 8, 12]
    assert all(s["converged"] == 1 for s in result.stages)
    best_round = dict(seen)[result.best_lambda]
    # the final model continues the best stage until it converges too (4 rounds here): it has had 4 of the
    # budget's 12 rounds at its λ, so it may go past the path's 12 lineage rounds
    final = result.final
    assert sim.method.hp.lam == result.best_lambda and sim.round == best_round + 4
    assert final["rounds"] == sim.round - best_round == 4 and result.total_rounds == 12 + final["rounds"]
    fresh = Simulator(synthetic_config(federation__rounds=10**6, data__val_fraction=0.2))
    stage = separate_run(fresh, 0.4, settings)
    assert stage["rounds"] == 4 == fresh.round and stage["converged"] == 1   # the same rule, not the budget


@pytest.mark.slow
def test_lambda_path_playoff_continues_the_best_stages_to_equal_rounds_from_their_own_states():
    from pfl.tune.lambda_path import PathSettings, warmup_path

    settings = PathSettings(lambdas=[0.2, 0.4, 0.6], eval_every=2, stage_cap=4, window=1, tolerance=1.0,
                            residual_tol=0.0, patience=5, extend=0, finalists=2, playoff_rounds=3, budget=20)
    sim = Simulator(synthetic_config(federation__rounds=10**6, data__val_fraction=0.2))
    stages, rounds_seen = [], []
    result = warmup_path(sim, settings, on_stage=lambda i, s: stages.append((s["val/acc_mean"], s["lambda"])),
                         on_round=lambda m: rounds_seen.append(sim.round))
    end_of = {0.2: 4, 0.4: 8, 0.6: 12}
    finalists = sorted((lam for _, lam in sorted(stages, key=lambda s: -s[0])[:2]), key=lambda lam: -end_of[lam])
    playoff = result.extra["playoff"]
    target = max(end_of[lam] for lam in finalists) + 3
    assert [m["lambda"] for m in playoff] == finalists          # the latest first
    assert all(m["lineage"] == target for m in playoff)          # compared after equal training
    # each finalist restarts from its own path state and trains to the same lineage round
    expected = list(range(1, 13))
    for lam in finalists:
        expected += list(range(end_of[lam] + 1, target + 1))
    winner = max(playoff, key=lambda m: m["val/acc_mean"])["lambda"]
    assert result.best_lambda == winner and sim.method.hp.lam == winner
    expected += list(range(target + 1, target + 5))             # converged after 2 evaluations
    assert rounds_seen == expected and sim.round == target + 4
    assert result.total_rounds == len(expected)


def test_lambda_path_on_a_regression_source_selects_by_rmse_and_ends():
    from pfl.resolver import load
    from pfl.tune.lambda_path import PathSettings, warmup_path

    cfg = load(None, {"data.source": "fpfc_linear", "data.num_clients": 10, "data.val_fraction": 0.2,
                      "data.params.size_scale": 0.1, "method.name": "fpfc", "federation.rounds": 10**6,
                      "federation.clients_per_round": 5, "federation.batch_size": 0, "federation.local_steps": 5,
                      "federation.lr": 0.05, "tracking.enabled": False})
    sim = Simulator(cfg)
    settings = PathSettings(lambdas=[0.2, 0.4], eval_every=2, stage_cap=10, window=1, tolerance=1e-3, extend=1,
                            extension="step", finalists=2, playoff_rounds=2, budget=30)
    result = warmup_path(sim, settings)     # only val/rmse_mean is reported: the path must still end
    rmse = {s["lambda"]: s["val/rmse_mean"] for s in result.stages}
    assert "val/acc_mean" not in result.stages[0]
    # path and playoff within the budget's lineage; the selected model at most the budget's rounds at its λ
    assert max(s["lineage"] for s in result.stages + result.extra["playoff"]) <= settings.budget
    at_lambda = sum(s["rounds"] for s in result.stages + result.extra["playoff"] if s["lambda"] == result.best_lambda)
    assert at_lambda + result.final["rounds"] <= settings.budget
    assert list(rmse) == [0.2, 0.4, 0.6] and rmse[0.6] < rmse[0.4]   # RMSE still falling: the grid extended
    finalists = sorted(rmse, key=rmse.get)[:2]             # the lowest validation RMSE, not the highest
    assert {m["lambda"] for m in result.extra["playoff"]} == set(finalists)
    assert result.best_lambda == min(result.extra["playoff"], key=lambda m: m["val/rmse_mean"])["lambda"]


@pytest.mark.slow
def test_reproduce_pipeline_runs_the_label_swap_scenario_with_its_fpfc_setting(ray_cluster, tmp_path):
    """pipelines/reproduce_fpfc.py --scenario fmnist_labelswap: tables/fpfc_labelswap.yaml's FPFC
    setting (λ 0.4, silhouette read-out, body shared) on the label-swap partition."""
    import subprocess
    import sys
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    script = Path(__file__).resolve().parents[1] / "pipelines" / "reproduce_fpfc.py"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mc = MlflowClient(tracking_uri=uri)
    mc.search_experiments(max_results=1)
    tiny = ["data.max_samples=1000", "federation.local_epochs=1", "federation.clients_per_round=4"]
    code, out = ray_cluster.run([sys.executable, str(script), "--scenario", "fmnist_labelswap", "--rounds", "2",
                                 "--methods", "fpfc", "fedavg", "--seeds", "0", "--quiet",
                                 "--storage", str(tmp_path / "ray_results"), "--set", *tiny],
                                {"MLFLOW_TRACKING_URI": uri, "PFL_CACHE_DIR": str(tmp_path / "cache"),
                                 "RAY_ADDRESS": ray_cluster.address})
    assert code == 0, out[-4000:]
    runs = {r.info.run_name: r for e in mc.search_experiments() for r in mc.search_runs([e.experiment_id])}
    assert {"fpfc_labelswap", "fpfc [seed 0]", "fedavg [seed 0]"} <= set(runs)
    fpfc = runs["fpfc [seed 0]"].data.params
    assert (fpfc["method.lam"], fpfc["method.nu_select"], fpfc["method.shared_layers"]) == ("0.4", "silhouette", "body")
    assert fpfc["federation.rounds"] == "2" and fpfc["data.max_samples"] == "1000"
    assert "fpfc/nu" in runs["fpfc [seed 0]"].data.metrics and "cluster/ari" in runs["fpfc [seed 0]"].data.metrics
    assert runs["fedavg [seed 0]"].data.params["data.partition.kind"] == "label_swap"
    refused = subprocess.run([sys.executable, str(script), "--scenario", "fmnist_labelswap", "--size-scale", "0.5"],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "--size-scale" in refused.stderr


def test_silhouette_threshold_reads_out_blobs_and_declines_noise():
    from pfl.clusters import connected_components, silhouette_threshold
    from sklearn.metrics import adjusted_rand_score

    rng = np.random.default_rng(0)
    truth = np.repeat(np.arange(4), 5)
    # four blobs ~4 apart whose within-blob distances (~0.4) leave every device alone at ν = 0.1
    points = rng.normal(size=(4, 8))[truth] + 0.1 * rng.normal(size=(20, 8))
    dist = np.linalg.norm(points[:, None] - points[None], axis=-1)
    nu = silhouette_threshold(dist)
    assert nu is not None
    assert adjusted_rand_score(truth, connected_components(dist < nu)) == 1.0
    assert len(np.unique(connected_components(dist < 0.1))) == 20
    # no structure: distances of i.i.d. Gaussian points in 50 dimensions
    noise = rng.normal(size=(20, 50))
    assert silhouette_threshold(np.linalg.norm(noise[:, None] - noise[None], axis=-1)) is None
    # fused devices (zero distances) are links, not missing edges
    fused = np.where(np.equal.outer(truth, truth), 0.0, 3.0)
    assert adjusted_rand_score(truth, connected_components(fused < silhouette_threshold(fused))) == 1.0
