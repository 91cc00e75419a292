"""Truths for the survivors of list I (issue 42): FPFC's read-outs (``clusters``, ``readout_params`` and
the ``_full``/``_shared_for`` models they build, ``theta_gap``, ``load_server_state``), FedPD's
evaluation plan and metric, ADIANA's, L2GD's and FedSLR's metrics, and LAG's uplink ``base``. The
read-outs are recomputed in numpy from the run's recorded state: clusters as the connected components
(a union-find written here) of the pairs whose ‖θ_ij‖ is strictly below ν, a device's read-out model
as the n_i-weighted mean of its component's uploads, and with ``stale_body`` the body as the mean of
the bodies uploaded in the last round the device took part in (the uplinks recorded off the wire);
FedPD's plan is the spec's (x_0 as the personal and the global model, the client's x_i as
``fedpd/local``) with x_0 and x_i from a numpy FedPD; the metrics are their documented formulas
(α = 1/(1+ω), p = 1/(2(1+ω)) with natural compression's ω = 1/8; γ = λβ(1−p)/p; the rank kept over
the full rank and 1 − nnz/size of the clients' own P); a resumed FPFC run and LAG with a lossless
downlink are held to the run they must equal bit for bit. Each docstring names the mutants it was
checked to kill."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from truth import BIAS, WEIGHT, Recorder, close, components, least_squares, run_rounds, set_pair_norms, simulator, vec

LR, K = 0.2, 3


# ---- numpy read-outs -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fpfc_run():
    """FPFC on five least-squares clients (two true clusters) after two rounds."""
    problem = least_squares(sizes=(20, 30, 24, 27, 18), clusters=[0, 0, 0, 1, 1])
    sim = simulator(problem, "fpfc", steps=K, lr=LR)
    run_rounds(sim, 2)
    return problem, sim


def test_fpfc_clusters_are_the_components_of_pairs_strictly_below_nu(fpfc_run):
    """Pairs at ‖θ‖ = 0.25, 0.5 (0–1, 1–2) and 0.125 (3–4): at ν = 0.5 the pair at exactly 0.5 is not
    linked ({0,1} {2} {3,4}); without ν the read-out uses hp.nu (0.3 here: the same), and hp.nu = 0.2
    leaves only {3,4}; a given ν wins over hp.nu (kills clusters 1–5, 7)."""
    _, sim = fpfc_run
    meth = sim.method
    saved_theta, saved_hp = meth.theta.clone(), meth.hp
    try:
        dist = set_pair_norms(meth, {(0, 1): 0.25, (1, 2): 0.5, (3, 4): 0.125})
        assert meth.clusters(0.5).tolist() == components(dist < 0.5).tolist() == [0, 0, 1, 2, 2]
        assert meth.clusters(0.75).tolist() == components(dist < 0.75).tolist() == [0, 0, 0, 1, 1]
        meth.hp = dataclasses.replace(saved_hp, nu=0.3)
        assert meth.clusters().tolist() == components(dist < 0.3).tolist()
        meth.hp = dataclasses.replace(saved_hp, nu=0.2)
        assert meth.clusters().tolist() == components(dist < 0.2).tolist() == [0, 1, 2, 3, 3]
        assert meth.clusters(0.75).tolist() == components(dist < 0.75).tolist()
    finally:
        meth.theta.copy_(saved_theta)
        meth.hp = saved_hp


def test_fpfc_theta_gap_is_the_largest_within_and_smallest_between_true_clusters(fpfc_run):
    """True clusters {0,1,2} {3,4}: the largest designed ‖θ_ij‖ inside one and the smallest between
    them, by numpy over the pairs (kills theta_gap 4)."""
    problem, sim = fpfc_run
    meth = sim.method
    saved = meth.theta.clone()
    try:
        dist = set_pair_norms(meth, {(0, 1): 0.25, (1, 2): 0.5, (3, 4): 0.125, (2, 3): 1.5})
        true = problem.clusters
        pairs = [(i, j) for i in range(5) for j in range(i + 1, 5)]
        within = max(dist[i, j] for i, j in pairs if true[i] == true[j])
        between = min(dist[i, j] for i, j in pairs if true[i] != true[j])
        assert meth.theta_gap() == {"fpfc/theta_max_within": within, "fpfc/theta_min_between": between}
        assert (within, between) == (2.0, 1.5)
    finally:
        meth.theta.copy_(saved)


def test_fpfc_readout_model_is_the_sample_weighted_mean_of_the_components_uploads(fpfc_run):
    """For a clustering, each device's read-out model is Σ n_j w_j / Σ n_j over its component, w_j the
    uploads the server holds and n_j the clients' sample counts (kills readout_params 1–9, 11, 12 and
    _full 1)."""
    problem, sim = fpfc_run
    meth = sim.method
    W = meth.W.double().cpu().numpy()
    n = np.array([problem.n(i) for i in range(problem.m)], dtype=float)
    labels = np.array([0, 1, 0, 1, 2])
    model_of = meth.readout_params(labels)
    for cid in range(problem.m):
        group = labels == labels[cid]
        expected = (n[group, None] * W[group]).sum(0) / n[group].sum()
        got = model_of(cid)
        assert list(got) == [WEIGHT, BIAS]
        assert close(vec(got), expected, 1e-6)


def _mlp_sim(**kw):
    from pfl.federation.simulator import Simulator
    from truth import classification_data, config

    data, _ = classification_data(sizes=(12, 15, 10, 14))
    rec = Recorder()
    cfg = config("fpfc", data.num_clients, steps=1, lr=0.1, source="digits", model="mlp",
                 model__params={"hidden": [6]}, method__shared_layers="body", method__stale_body=True, **kw)
    return Simulator(cfg, data=data, stages=[rec]), rec


def test_fpfc_stale_body_readout_is_the_body_average_of_each_devices_last_round():
    """shared_layers: body, stale_body: a device's read-out model is its component's weighted head
    average joined with the body average of the last round it took part in (the mean of the bodies
    uploaded that round, recorded off the wire), the start's body for a device that never trained
    (kills _full 2–5, _shared_for 2, 3, 5, 6, readout_params 5)."""
    sim, rec = _mlp_sim(per_round=2, rounds=3)
    run_rounds(sim, 3)
    meth = sim.method
    head, body = meth.clustered, meth.shared
    assert body and head
    init = {k: v.double().numpy() for k, v in meth.init.items()}
    last_body = {cid: {k: init[k] for k in body} for cid in range(4)}
    heads, n = {}, {}
    for rnd in range(3):
        cids = sorted(c for r, c in rec.up if r == rnd)
        ups = {c: rec.up[rnd, c] for c in cids}
        mean = {k: np.mean([ups[c].params("body")[k].double().numpy() for c in cids], axis=0) for k in body}
        for c in cids:
            last_body[c] = mean
            heads[c] = ups[c].params("w")
            n[c] = float(ups[c].info["n"])
    labels = np.array([0, 0, 1, 1])
    model_of = meth.readout_params(labels)
    for cid in range(4):
        group = [c for c in range(4) if labels[c] == labels[cid]]
        weight = {c: n.get(c, 1.0) for c in group}
        got = model_of(cid)
        assert list(got) == meth.names
        for k in head:
            rows = [(heads[c][k].double().numpy() if c in heads else init[k]) for c in group]
            expected = sum(weight[c] * r for c, r in zip(group, rows)) / sum(weight.values())
            assert np.allclose(got[k].double().numpy(), expected, atol=1e-6), (cid, k)
        for k in body:
            assert np.allclose(got[k].double().numpy(), last_body[cid][k], atol=1e-6), (cid, k)
    # the bodies differ between devices (else the stale body would not be tested)
    assert any(not np.allclose(last_body[0][k], last_body[c][k]) for c in range(1, 4) for k in body)


def test_fpfc_resumed_from_a_checkpoint_is_the_straight_run(tmp_path):
    """A run stopped after round 1, checkpointed and loaded into a fresh simulator ends with the same
    pairwise state and models as the run straight through (kills load_server_state 1)."""
    from helpers import straight_and_resumed
    from pfl.federation.simulator import Simulator
    from truth import config

    problem = least_squares(sizes=(20, 30, 24, 27), clusters=[0, 0, 1, 1])
    cfg = config("fpfc", problem.m, steps=K, lr=LR, rounds=3)
    straight, resumed = straight_and_resumed(cfg, tmp_path, stop_at=1,
                                             simulator=lambda c: Simulator(c, data=problem.federated()))
    for name in ("W", "theta", "v", "n_seen"):
        assert torch.equal(getattr(straight.method, name), getattr(resumed.method, name)), name


# ---- FedPD ---------------------------------------------------------------------------------------------

def _fedpd_numpy(problem, init, rounds, eta, every):
    """FedPD (docs/methods/seminar.md §4.1) with ``schedule: every``: server x_0 and the clients' x_i."""
    m = problem.m
    x = np.tile(init, (m, 1))
    lam = np.zeros_like(x)
    x0 = x.copy()
    server = init.copy()
    fresh = False
    comm = 0
    for rnd in range(rounds):
        if fresh:
            x0[:] = server
        for i in range(m):
            w = x[i]
            for _ in range(K):
                w = w - LR * (problem.grad(i, w) + lam[i] + (w - x0[i]) / eta)
            x[i] = w
            lam[i] = lam[i] + (w - x0[i]) / eta
            x0[i] = w + eta * lam[i]
        fresh = (rnd + 1) % every == 0
        if fresh:
            server = x0.mean(0)
            comm += 1
    return server, x, comm


def test_fedpd_is_evaluated_with_x0_as_personal_and_global_and_its_x_i_as_fedpd_local():
    """The spec's evaluation: x_0 on every client (``test/*`` and ``global/*``) and the client's primal
    x_i as ``fedpd/local``; x_0, x_i from FedPD in numpy; the communicating rounds counted by the
    schedule (kills eval_plan 1–8, 10–14, extra_metrics 2–4)."""
    from pfl.federation.wire import Phase

    problem = least_squares()
    eta, every, rounds = 0.5, 2, 5
    sim = simulator(problem, "fedpd", steps=K, lr=LR, method__eta=eta, method__schedule="every",
                    method__every=every)
    run_rounds(sim, rounds)
    server, x, comm = _fedpd_numpy(problem, vec(sim.method.init), rounds, eta, every)
    assert comm == 2
    assert sim.method.extra_metrics(rounds - 1) == {"fedpd/comm_rounds": 2.0}
    for cid in range(problem.m):
        down = sim.exchange.send(Phase("eval", rounds - 1), cid, sim.method.eval_message(rounds - 1, cid))
        plan = sim.method.eval_plan(rounds - 1, sim.client(cid), down)
        assert close(vec(plan.personal), server, 1e-4)
        assert plan.global_model is not None and close(vec(plan.global_model), server, 1e-4)
        assert list(plan.extra) == ["fedpd/local"]
        assert close(vec(plan.extra["fedpd/local"]), x[cid], 1e-4)
    metrics = sim.evaluate()
    assert metrics["fedpd/comm_rounds"] == 2.0
    assert any(k.startswith("fedpd/local_") for k in metrics) and any(k.startswith("global/") for k in metrics)


# ---- the metrics of ADIANA, L2GD, FedSLR -----------------------------------------------------------------

def test_adiana_reports_alpha_prob_and_omega_of_natural_compression():
    """Natural compression has ω = 1/8, so the defaults are α = 1/(1+ω) = 8/9 and p = 1/(2(1+ω)) = 4/9
    (kills Adiana.extra_metrics 2–7)."""
    sim = simulator(least_squares(), "adiana", steps=1, lr=0.1, compression__uplink={"name": "natural"},
                    compression__min_numel=1)
    omega = 1 / 8
    got = sim.method.extra_metrics(0)
    assert set(got) == {"adiana/alpha", "adiana/prob", "adiana/omega"}
    assert got["adiana/omega"] == omega
    assert got["adiana/alpha"] == pytest.approx(1 / (1 + omega), rel=1e-12)
    assert got["adiana/prob"] == pytest.approx(1 / (2 * (1 + omega)), rel=1e-12)


def test_l2gd_reports_gamma_lambda_beta_one_minus_p_over_p():
    """γ = λβ(1 − p)/p with β the client lr (kills L2GD.extra_metrics 8, 9)."""
    lam, p, lr = 0.3, 0.4, 0.05
    sim = simulator(least_squares(), "l2gd", steps=1, lr=lr, method__lam=lam, method__p=p)
    got = sim.method.extra_metrics(0)
    assert set(got) == {"l2gd/iterations", "l2gd/local_steps", "l2gd/gamma"}
    assert got["l2gd/gamma"] == pytest.approx(lam * lr * (1 - p) / p, rel=1e-12)


SCALAR_MODEL = '''
import torch
from torch import nn


class Scalar(nn.Module):
    """y = w·x: one parameter, a 1×1 matrix."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(1, 1, bias=False)

    def forward(self, x):
        return self.fc(x).squeeze(-1)
'''


def test_fedslr_readouts_of_a_one_parameter_model(tmp_path):
    """A model of one parameter (a 1×1 weight, full rank 1, P of one entry): the kept-rank ratio is the
    GKR's rank over 1, the sparsity the mean of 1 − nnz(P_i)/1 over the clients, both recomputed from
    the run's state (kills FedSLR.extra_metrics 18, 48)."""
    from pfl.federation.simulator import Simulator
    from truth import config

    (tmp_path / "scalar.py").write_text(SCALAR_MODEL)
    problem = least_squares(d=1)
    cfg = config("fedslr", problem.m, steps=K, lr=LR, model=f"{tmp_path}/scalar.py:Scalar", rounds=2)
    sim = Simulator(cfg, data=problem.federated())
    run_rounds(sim, 2)
    meth = sim.method
    got = meth.extra_metrics(1)
    weight = meth.global_model["fc.weight"].double().numpy()
    rank = int(np.linalg.matrix_rank(weight))
    assert rank == 1 and got["model/rank_kept_ratio"] == rank / 1
    ps = [sim.client(c).state["P"] for c in range(problem.m)]
    assert all(sum(v.numel() for v in p.values()) == 1 for p in ps)
    nnz = [sum(int((v != 0).sum()) for v in p.values()) for p in ps]
    assert any(nnz)  # a P that is not all zero (else 1 − nnz/size does not read size)
    assert got["model/sparsity"] == pytest.approx(np.mean([1.0 - z / 1 for z in nnz]), rel=1e-12)


# ---- LAG's uplink base -----------------------------------------------------------------------------------

def test_lag_server_adds_the_clients_change_to_the_model_it_meant_to_send():
    """LAG with a dense uplink (``compression.uplink: none``) under the identity downlink, every tensor
    above min_numel. A client's first trip carries the model as it is (no replica yet): the server
    takes the upload v. Every later trip carries it as a change to the client's replica, which the
    client decodes as r = mirror + (x − mirror), possibly not x in the last bit; then the codec's
    documented rebase gives the server x + (v − r), the client's change Δ = v − r (LAG keeps it as its
    Δ̂_i) applied to the model x the server meant to send. One client a round, uniform weights and
    ξ = 0 make the new global model exactly that, checked bit for bit in float32 (kills local_update
    81, 83, 84, 85, which drop or misname the uplink's base and so take v on every trip)."""
    from pfl.federation.simulator import Simulator
    from truth import config

    problem = least_squares()
    rec = Recorder()
    cfg = config("lag", problem.m, steps=K, lr=LR, per_round=1, method__xi=0.0, method__weighting="uniform",
                 compression__min_numel=1, compression__uplink={"name": "none"},
                 compression__downlink__name="identity")
    sim = Simulator(cfg, data=problem.federated(), stages=[rec])
    f32 = lambda params: np.concatenate([params[k].detach().cpu().numpy().ravel() for k in (WEIGHT, BIAS)])  # noqa: E731
    seen, rebased = set(), 0
    for rnd in range(10):
        x = f32(sim.method.global_model)
        sim.run_round(evaluate=False)
        (cid,) = [c for r, c in rec.up if r == rnd]
        upload = f32(rec.up[rnd, cid].params("model"))
        if cid in seen:
            expected = x + f32(sim.client(cid).state["last"])    # float32 + float32, as IEEE rounds it
            rebased += not np.array_equal(expected, upload)
        else:
            expected = upload
        seen.add(cid)
        assert np.array_equal(f32(sim.method.global_model), expected), rnd
    assert rebased > 0   # some replica was not x bit for bit: the rebase mattered
