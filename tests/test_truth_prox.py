"""Proximal operators: the regions the spec vectors leave out (ρ ≠ 1 with smoothing, the defaults,
the parameter checks' boundaries), each against the stationarity condition written out by hand."""

import pytest
import torch

from pfl.prox import check_scad_params, scad, scad_derivative, scad_prox, smoothed_scad


@pytest.mark.parametrize("rho", [1.5, 2.5])
def test_smoothed_region_is_the_stationary_point_of_the_quadratic_piece(rho):
    """For ‖θ‖ ≤ ξ the penalty is λ‖θ‖²/(2ξ): λθ/ξ + ρ(θ − δ) = 0 gives θ = ξρ/(λ + ξρ)·δ."""
    lam, xi, a = 0.6, 0.05, 3.7
    for r in (0.05, 0.2, xi + lam / rho - 1e-6):
        delta = torch.tensor([[0.6 * r, 0.8 * r]], dtype=torch.float64)
        expected = rho * delta / (lam / xi + rho)
        torch.testing.assert_close(scad_prox(delta, lam, rho, xi, a), expected)
        assert float(expected.norm()) <= xi + 1e-9  # the stationary point lies in that piece


@pytest.mark.parametrize("rho", [0.5, 2.5])
def test_linear_and_concave_regions_with_rho_not_one(rho):
    """Linear piece: λu + ρ(θ − δ) = 0; concave piece: (aλ − s)/(a − 1)·u + ρ(θ − δ) = 0 (u = δ/‖δ‖)."""
    lam, a = 0.6, 3.7
    for r, piece in ((lam / rho + 0.5 * lam, "linear"), (0.5 * (lam + lam / rho + a * lam), "concave")):
        if piece == "concave" and r <= lam + lam / rho:
            continue
        delta = torch.tensor([[r, 0.0, 0.0]], dtype=torch.float64)
        s = float(scad_prox(delta, lam, rho, 0.0, a).norm())
        force = lam if piece == "linear" else (a * lam - s) / (a - 1)
        assert force + rho * (s - r) == pytest.approx(0.0, abs=1e-10)


def test_the_defaults_are_the_specs():
    t = torch.linspace(0.0, 3.0, 31, dtype=torch.float64)
    torch.testing.assert_close(scad(t, 0.6), scad(t, 0.6, 3.7))
    torch.testing.assert_close(scad_derivative(t, 0.6), scad_derivative(t, 0.6, 3.7))
    torch.testing.assert_close(smoothed_scad(t, 0.6, 1e-3), smoothed_scad(t, 0.6, 1e-3, 3.7))
    delta = torch.stack([t, -t], dim=1)
    torch.testing.assert_close(scad_prox(delta, 0.6, 1.0), scad_prox(delta, 0.6, 1.0, 0.0, 3.7))
    # smoothed SCAD passes its own a on to SCAD's pieces
    assert float(smoothed_scad(torch.tensor(1.5), 0.6, 1e-3, 5.0)) == pytest.approx(
        float(scad(torch.tensor(1.5), 0.6, 5.0)) - 0.6 * 1e-3 / 2)


@pytest.mark.parametrize("lam, rho, xi, a, ok", [
    (0.6, 1.0, 0.0, 2.0, False),       # a must exceed 2
    (0.6, 0.5, 0.0, 3.0, False),       # (a − 1)ρ = 1 exactly: must exceed 1
    (0.6, 1.0, 0.6, 3.7, False),       # ξ < λ, strictly
    (0.6, 1.0, -1e-9, 3.7, False),
    (0.6, 1.0, 0.0, 3.7, True),
    (0.6, 0.5, 0.1, 3.7, True),        # (a − 1)ρ = 1.35
    (0.6, 0.37, 0.1, 3.7, False),      # (a − 1)ρ = 0.999
])
def test_parameter_checks_at_their_boundaries(lam, rho, xi, a, ok):
    if ok:
        check_scad_params(lam, rho, xi, a)
    else:
        with pytest.raises(ValueError):
            check_scad_params(lam, rho, xi, a)
