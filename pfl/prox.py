"""Proximal operators and penalties, shared by every method that needs one.

* :func:`soft_threshold` — prox of κ‖x‖₁ (element-wise; FedSLR's sparse part, L1 prox-SGD).
* :func:`group_soft_threshold` — prox of κ‖x‖₂ on whole rows (FPFC-L1's fusion of a pair).
* :func:`scad`, :func:`smoothed_scad` and :func:`scad_prox` — FPFC's nonconvex fusion penalty and
  the closed-form minimiser of  P̃(‖θ‖) + (ρ/2)‖θ − δ‖²  per row (docs/methods/fpfc.md §1.3–1.4).
* :func:`svt` — prox of τ‖X‖_* (singular-value soft-thresholding; FedSLR's server step).

Row-wise operators take a (..., p) tensor and treat each trailing vector as one group, so all
pairs of FPFC are thresholded in one call.
"""

from __future__ import annotations

import torch


def soft_threshold(x: torch.Tensor, kappa: float) -> torch.Tensor:
    """sign(x)·max(|x| − κ, 0)."""
    return torch.sign(x) * torch.clamp(x.abs() - kappa, min=0.0)


def group_soft_threshold(delta: torch.Tensor, kappa: float | torch.Tensor) -> torch.Tensor:
    """max(0, 1 − κ/‖δ‖)·δ for every row δ (the last dimension is the group)."""
    norm = torch.linalg.vector_norm(delta, dim=-1, keepdim=True)
    factor = torch.clamp(1.0 - kappa / norm.clamp_min(torch.finfo(delta.dtype).tiny), min=0.0)
    return factor * delta


def scad(t: torch.Tensor, lam: float, a: float = 3.7) -> torch.Tensor:
    """SCAD penalty P_λ(t) for t ≥ 0 (Fan & Li 2001): linear, then quadratic, then flat."""
    t = t.abs()
    linear = lam * t
    quad = (2 * a * lam * t - t**2 - lam**2) / (2 * (a - 1))
    flat = torch.full_like(t, (a + 1) * lam**2 / 2)
    return torch.where(t <= lam, linear, torch.where(t <= a * lam, quad, flat))


def scad_derivative(t: torch.Tensor, lam: float, a: float = 3.7) -> torch.Tensor:
    t = t.abs()
    return torch.where(t <= lam, torch.full_like(t, lam),
                       torch.where(t <= a * lam, (a * lam - t) / (a - 1), torch.zeros_like(t)))


def smoothed_scad(t: torch.Tensor, lam: float, xi: float, a: float = 3.7) -> torch.Tensor:
    """SCAD with its kink at 0 replaced by λt²/(2ξ) on [0, ξ] (continuous; ξ < λ)."""
    t = t.abs()
    return torch.where(t <= xi, lam * t**2 / (2 * xi), scad(t, lam, a) - lam * xi / 2)


def check_scad_params(lam: float, rho: float, xi: float, a: float) -> None:
    if a <= 2:
        raise ValueError(f"SCAD needs a > 2, got a={a}")
    if (a - 1) * rho <= 1:
        raise ValueError(f"the SCAD proximal map needs (a-1)·ρ > 1, got a={a}, ρ={rho}")
    if not 0 <= xi < lam:
        raise ValueError(f"the smoothing parameter must satisfy 0 <= ξ < λ, got ξ={xi}, λ={lam}")


def scad_prox(delta: torch.Tensor, lam: float, rho: float, xi: float = 0.0, a: float = 3.7) -> torch.Tensor:
    """argmin_θ P̃_{λ,ξ}(‖θ‖) + (ρ/2)‖θ − δ‖² for every row δ of ``delta``.

    With r = ‖δ‖ the minimiser is a multiple of δ whose factor depends on the region of r:
    shrink towards 0 (quadratic piece), group soft-threshold by λ/ρ (linear piece), a rescaled
    soft-threshold by aλ/((a−1)ρ) (concave piece), identity (flat piece). ξ = 0 is plain SCAD.
    """
    check_scad_params(lam, rho, xi, a)
    r = torch.linalg.vector_norm(delta, dim=-1, keepdim=True)
    safe = r.clamp_min(torch.finfo(delta.dtype).tiny)
    quad = xi * rho / (lam + xi * rho) if xi > 0 else 0.0
    linear = torch.clamp(1 - lam / (rho * safe), min=0.0)
    concave = torch.clamp(1 - a * lam / ((a - 1) * rho * safe), min=0.0) / (1 - 1 / ((a - 1) * rho))
    factor = torch.where(r <= xi + lam / rho, torch.full_like(r, quad),
                         torch.where(r <= lam + lam / rho, linear,
                                     torch.where(r <= a * lam, concave, torch.ones_like(r))))
    return factor * delta


def svt(matrix: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Singular-value soft-thresholding of a 2-D tensor.

    Returns ``(X, U_r, s_r, Vh_r)`` with X = U diag(max(σ − τ, 0)) Vᵀ and the factors restricted to
    the r = #{σ > τ} kept singular values (so a factorized message can be built without another SVD).
    """
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    shrunk = torch.clamp(s - tau, min=0.0)
    r = int((shrunk > 0).sum())
    u_r, s_r, vh_r = u[:, :r], shrunk[:r], vh[:r, :]
    return (u_r * s_r) @ vh_r, u_r, s_r, vh_r
