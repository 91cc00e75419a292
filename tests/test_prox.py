"""Proximal operators against direct evaluation (docs/methods/fpfc.md §1.4 test vectors, SVT closed form)."""

import pytest
import torch

from pfl.prox import (group_soft_threshold, scad, scad_derivative, scad_prox, smoothed_scad,
                      soft_threshold, svt)


def test_soft_threshold():
    x = torch.tensor([-3.0, -0.5, 0.0, 0.2, 2.0])
    torch.testing.assert_close(soft_threshold(x, 1.0), torch.tensor([-2.0, 0.0, 0.0, 0.0, 1.0]))


def test_scad_three_regions_and_derivative():
    lam, a = 0.6, 3.7
    t = torch.tensor([0.3, 0.6, 1.0, 2.22, 3.0], dtype=torch.float64)
    expected = []
    for v in t.tolist():
        if v <= lam:
            expected.append(lam * v)
        elif v <= a * lam:
            expected.append((2 * a * lam * v - v * v - lam * lam) / (2 * (a - 1)))
        else:
            expected.append((a + 1) * lam * lam / 2)
    torch.testing.assert_close(scad(t, lam, a), torch.tensor(expected, dtype=torch.float64))
    # derivative by finite differences in each region
    tt = torch.tensor([0.3, 1.0, 3.0], dtype=torch.float64)
    h = 1e-6
    fd = (scad(tt + h, lam, a) - scad(tt - h, lam, a)) / (2 * h)
    torch.testing.assert_close(scad_derivative(tt, lam, a), fd, rtol=1e-5, atol=1e-7)
    # continuity at region edges
    for edge in (lam, a * lam):
        lo, hi = scad(torch.tensor([edge - 1e-9], dtype=torch.float64), lam, a), scad(torch.tensor([edge + 1e-9], dtype=torch.float64), lam, a)
        assert abs(float(lo - hi)) < 1e-7
    xi = 1e-3
    s = smoothed_scad(torch.tensor([xi - 1e-12, xi + 1e-12], dtype=torch.float64), lam, xi, a)
    assert abs(float(s[0] - s[1])) < 1e-9


@pytest.mark.parametrize("r, c", [(0.3, 0.00166389), (1.0, 0.4), (1.2, 0.5), (1.8, 0.86274510),
                                  (2.22, 1.0), (3.0, 1.0)])
def test_scad_prox_spec_vectors(r, c):
    gen = torch.Generator().manual_seed(1)
    direction = torch.randn(7, generator=gen, dtype=torch.float64)
    delta = direction / direction.norm() * r
    theta = scad_prox(delta[None], lam=0.6, rho=1.0, xi=1e-3, a=3.7)[0]
    torch.testing.assert_close(theta, c * delta, rtol=1e-6, atol=1e-9)


def test_scad_prox_edge_0601_gives_norm_xi():
    delta = torch.tensor([[0.601, 0.0]], dtype=torch.float64)
    theta = scad_prox(delta, lam=0.6, rho=1.0, xi=1e-3)
    assert abs(float(theta.norm()) - 1e-3) < 1e-9


def test_scad_prox_minimises_the_objective():
    """θ* beats random perturbations of itself on P̃(‖θ‖) + ρ/2‖θ − δ‖²."""
    gen = torch.Generator().manual_seed(0)
    lam, rho, xi, a = 0.6, 1.5, 1e-3, 3.7
    deltas = torch.randn(200, 5, generator=gen, dtype=torch.float64) * torch.linspace(0.05, 1.0, 200, dtype=torch.float64)[:, None] * 3
    theta = scad_prox(deltas, lam, rho, xi, a)

    def objective(th):
        return smoothed_scad(th.norm(dim=-1), lam, xi, a) + rho / 2 * ((th - deltas) ** 2).sum(-1)

    best = objective(theta)
    for _ in range(20):
        noise = torch.randn(theta.shape, generator=gen, dtype=torch.float64) * 0.01
        assert torch.all(objective(theta + noise) >= best - 1e-12)


def test_l1_group_threshold_vectors():
    for r, c in [(0.1, 0.0), (0.5, 0.6), (1.0, 0.8)]:
        delta = torch.tensor([[r, 0.0, 0.0]])
        torch.testing.assert_close(group_soft_threshold(delta, 0.2), c * delta)


def test_svt_closed_form_rank_and_optimality():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(12, 7, generator=gen, dtype=torch.float64)
    tau = 1.5
    x, u, s, vh = svt(z, tau)
    uu, ss, vv = torch.linalg.svd(z, full_matrices=False)
    direct = uu @ torch.diag(torch.clamp(ss - tau, min=0)) @ vv
    torch.testing.assert_close(x, direct)
    assert u.shape[1] == int((ss > tau).sum()) == s.numel()

    def objective(m):
        return 0.5 * ((m - z) ** 2).sum() + tau * torch.linalg.svdvals(m).sum()

    best = objective(x)
    for _ in range(20):
        assert objective(x + 1e-3 * torch.randn(x.shape, generator=gen, dtype=torch.float64)) >= best - 1e-12
