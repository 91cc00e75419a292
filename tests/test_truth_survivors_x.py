"""Truths for the survivors of list X (issue 42): FPFC's ``configure``, ``setup``, ``pair_mask`` and
``readout_nu`` (pfl/methods/fpfc.py). ``init_std`` > 0: every parameter is drawn N(0, init_std²)
(sample mean ≈ 0, sample std ≈ init_std over 201 parameters, about 68 % within one std), every device
starts from that model, and a second ``configure`` (another party regenerating the start) gives the
same bits. The simulated clock with no speed spread and no latency: each round adds the slowest
device's c·K·n_i (docstring: the slowest sampled device's τ_i), starting from 0. Newcomers: pairs
that do not exist (a newcomer before it joins, two newcomers) are at +inf in ``distances``, the others
are ‖θ_ij‖ computed in numpy; without newcomers every pair exists. ``nu_select: silhouette`` on two
well separated groups picks ν halfway between the single-linkage merge heights that separate them
(clusters.silhouette_threshold's docstring), on the distances passed in when given, else on the
current ones; with no structure it falls back to ν. Before any evaluation: the cluster assignment is
the components of {‖θ_ij‖ < ν}, there is no read-out to send, and the artifacts are written with ν."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from truth import components, least_squares, run_rounds, same_partition, set_pair_norms, simulator, vec


# ---- configure: the N(0, init_std²) start --------------------------------------------------------------

def _wide(**kw):
    """200 features: the linear model has 201 parameters, enough for the sample moments."""
    p = least_squares(sizes=(12, 15, 10, 11), d=200, betas=[np.zeros(200)])
    return p, simulator(p, "fpfc", steps=1, **kw)


@pytest.mark.parametrize("std", [0.5, 2.5])
def test_fpfc_init_std_draws_every_parameter_normal_with_that_std(std):
    """init_std = 0.5 (below 1) and 2.5: the 201 start values have mean ≈ 0, std ≈ init_std (±20 %,
    ~3 standard errors) and ~68 % of them within one std; the default start (U(±1/√200), std 0.04)
    is far from both (kills configure 4, 14, 19, 20, 22)."""
    _, sim = _wide(method__init_std=std)
    w = vec(sim.method.init)
    assert w.size == 201
    assert abs(w.mean()) < 0.25 * std
    assert 0.8 * std < w.std() < 1.2 * std
    assert 0.58 < np.mean(np.abs(w) < std) < 0.78


def test_fpfc_init_std_start_is_every_devices_start_and_is_regenerated_by_every_party():
    """The start (the server's W rows and every client's w) is the same N(0, σ²) model, and a second
    ``configure`` — another party regenerating it from the run seed — gives the same bits; a second
    simulator with the same seed too (kills configure 5, 21, 23: a draw from the global stream)."""
    p, sim = _wide(method__init_std=0.5)
    meth = sim.method
    w = vec(meth.init)
    assert np.std(w) > 0.3
    for i in range(p.m):
        assert np.array_equal(meth.W[i].double().numpy(), w), i
    first = {k: t.clone() for k, t in meth.init.items()}
    meth.configure()
    for k, t in first.items():
        assert torch.equal(meth.init[k], t), k
    _, twin = _wide(method__init_std=0.5)
    assert np.array_equal(vec(twin.method.init), w)


# ---- configure / setup: the simulated clock ------------------------------------------------------------

def test_fpfc_sim_clock_is_the_sum_of_the_slowest_devices_work_from_zero():
    """clock_speed_sigma = 0 (every speed 1), clock_latency = 0, clock_c = 2: a round of K = 3
    full-batch steps lasts max_i 2·3·n_i = 2·3·30 = 180, and the clock starts at 0: 180 after one
    round, 360 after two (``time/sim_clock``) (kills configure 43, 45, 46: the default clock; setup 64: start at 1;
    setup 66: a clock left to an external simulator)."""
    p = least_squares(sizes=(20, 30, 24, 27))
    sim = simulator(p, "fpfc", steps=3, method__clock_c=2.0, method__clock_speed_sigma=0.0,
                    method__clock_latency=0.0)
    meth = sim.method
    slowest = 2.0 * 3 * max(p.n(i) for i in range(p.m))
    assert meth.sim_clock == 0.0
    run_rounds(sim, 1)
    assert meth.sim_clock == pytest.approx(slowest, rel=1e-12)
    run_rounds(sim, 1)
    assert meth.sim_clock == pytest.approx(2 * slowest, rel=1e-12)


# ---- setup: before any evaluation ----------------------------------------------------------------------

def test_fpfc_before_any_evaluation_the_assignment_is_the_components_below_nu_and_nothing_is_sent(tmp_path):
    """After a round without evaluation, with ‖θ_01‖ = 0.05, ‖θ_23‖ = 0.09 and every other pair 1.0
    (ν = 0.1): ``cluster_assignment`` labels {0, 1}, {2, 3}; ``eval_message`` has neither a body
    (no shared layers) nor a read-out (none computed yet); the artifacts' cluster table lists the same
    components and the θ plot is written (kills setup 68, 69, 71)."""
    p = least_squares(sizes=(20, 30, 24, 27))
    sim = simulator(p, "fpfc", steps=1)
    meth = sim.method
    run_rounds(sim, 1)
    s = np.full((4, 4), 1.0)
    s[0, 1] = s[1, 0] = 0.05
    s[2, 3] = s[3, 2] = 0.09
    set_pair_norms(meth, s)
    expected = components(s < 0.1)
    assert expected.tolist() == [0, 0, 1, 1]  # components {0, 1} and {2, 3}
    got = meth.cluster_assignment()
    assert sorted(got) == [0, 1, 2, 3]
    assert same_partition([got[c] for c in range(4)], expected)
    for cid in range(4):
        assert meth.eval_message(0, cid) is None
    files = meth.artifacts(str(tmp_path))
    assert len(files) == 2 and all(Path(f).is_file() for f in files)
    with open(tmp_path / "fpfc_clusters.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["client"]) for r in rows] == [0, 1, 2, 3]
    assert same_partition([int(r["found_cluster"]) for r in rows], expected)


# ---- pair_mask: the pairs that exist -------------------------------------------------------------------

def test_fpfc_without_newcomers_every_pair_is_at_its_theta_norm():
    """No newcomers: ``distances`` is ‖θ_ij‖ for every pair, computed in numpy (kills pair_mask 1 in
    its other direction: no pair is masked)."""
    p = least_squares(sizes=(20, 30, 24, 27))
    sim = simulator(p, "fpfc", steps=1)
    meth = sim.method
    rs = np.random.RandomState(3)
    s = rs.uniform(0.2, 2.0, (4, 4))
    s = (s + s.T) / 2
    np.fill_diagonal(s, 0.0)
    set_pair_norms(meth, s)
    assert meth.pair_mask() is None
    assert np.allclose(meth.distances().double().numpy(), s, rtol=1e-6, atol=0)


def test_fpfc_pairs_of_newcomers_exist_only_to_members_after_they_joined():
    """Six devices, newcomers 0 and 2 (fraction 0.34), every θ_ij set to a distinct norm: during
    training the members' pairs are at ‖θ_ij‖ and every pair touching a newcomer at +inf; after
    newcomer 0 joins, its pairs to the members are at ‖θ_0j‖ while 0–2 (two newcomers) and 2's pairs
    stay +inf; the diagonal is 0 (kills pair_mask 1, 11, 20, 21, 22, 23, 24)."""
    p = least_squares(sizes=(20, 30, 24, 27, 22, 25), clusters=[0, 0, 0, 1, 1, 1])
    sim = simulator(p, "fpfc", steps=1, newcomers__fraction=0.34)
    meth = sim.method
    new = sorted(sim.ctx.newcomers)
    assert new == [0, 2]
    members = [1, 3, 4, 5]
    s = np.zeros((6, 6))
    iu = np.triu_indices(6, 1)
    s[iu] = 0.5 + 0.1 * np.arange(len(iu[0]))
    s = s + s.T
    set_pair_norms(meth, s)

    def expected(joined):
        present = set(members) | set(joined)
        e = np.full((6, 6), np.inf)
        for i in range(6):
            for j in range(6):
                exists = i in present and j in present and (i in members or j in members)
                if exists:
                    e[i, j] = s[i, j]
        np.fill_diagonal(e, 0.0)
        return e

    got = meth.distances().double().numpy()
    assert np.allclose(got, expected([]), rtol=1e-6, atol=0)
    meth.join_begin(0, [0])
    got = meth.distances().double().numpy()
    e = expected([0])
    assert np.isfinite(e[0, 1]) and np.isinf(e[0, 2]) and np.isinf(e[2, 1])
    assert np.allclose(got, e, rtol=1e-6, atol=0)


# ---- readout_nu: the silhouette choice -----------------------------------------------------------------

def _two_groups():
    """Groups {0, 1, 2} (pair distances 0.3, 0.4, 0.5: single-linkage merges at 0.3, 0.4) and
    {3, 4, 5} (0.2, 0.25, 0.6: merges at 0.2, 0.25), 5.0 between them: the cut into the two groups
    lies between the merge heights 0.4 and 5.0, so ν = 2.7."""
    s = np.full((6, 6), 5.0)
    np.fill_diagonal(s, 0.0)
    for (i, j), d in {(0, 1): 0.3, (1, 2): 0.4, (0, 2): 0.5, (3, 4): 0.2, (4, 5): 0.25, (3, 5): 0.6}.items():
        s[i, j] = s[j, i] = d
    return s


def _silhouette_sim():
    p = least_squares(sizes=(20, 30, 24, 27, 22, 25), clusters=[0, 0, 0, 1, 1, 1])
    return simulator(p, "fpfc", steps=1, method__nu_select="silhouette")


def test_fpfc_silhouette_nu_cuts_the_current_distances_between_the_two_groups():
    """The current distances are two tight groups 5.0 apart: ``readout_nu()`` (no argument: the
    current θ) is 2.7, not the fixed ν = 0.1, and the clusters are the two groups (kills readout_nu 2,
    3, 4, 5, 7, 8, 9, 10, 11)."""
    sim = _silhouette_sim()
    meth = sim.method
    s = _two_groups()
    set_pair_norms(meth, s)
    assert meth.hp.nu == pytest.approx(0.1)
    assert meth.readout_nu() == pytest.approx(2.7, rel=1e-6)
    assert meth.readout_nu(meth.distances()) == pytest.approx(2.7, rel=1e-6)
    assert same_partition(meth.clusters(), [0, 0, 0, 1, 1, 1])


def test_fpfc_silhouette_nu_is_chosen_on_the_distances_passed_in():
    """With θ all zero (every current distance 0: no cut scores, the fixed ν), passing the two-group
    distances chooses ν = 2.7 on them; passing equal distances (no structure) falls back to ν = 0.1
    (kills readout_nu 6, 7)."""
    sim = _silhouette_sim()
    meth = sim.method
    assert float(meth.theta.abs().max()) == 0.0
    s = torch.tensor(_two_groups(), dtype=meth.theta.dtype)
    assert meth.readout_nu(s) == pytest.approx(2.7, rel=1e-6)
    flat = torch.ones(6, 6, dtype=meth.theta.dtype)
    flat.fill_diagonal_(0.0)
    assert meth.readout_nu(flat) == pytest.approx(0.1)
