"""Gap tests from the full mutation run (docs/verification.md, "Mutation score"): each separates the
right answer, computed another way, from what a surviving mutant computes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from helpers import synthetic_config
from pfl.callbacks.divergence import run_rounds
from pfl.federation.messages import Message, Model
from pfl.federation.simulator import Simulator
from pfl.methods import resolve_method_config
from pfl.prox import check_scad_params
from pfl.schema import ConfigError


@pytest.mark.parametrize("params, words", [
    (dict(lam=1.0, rho=1.0, xi=0.0, a=2.0), "SCAD needs a > 2, got a=2.0"),          # a = 2 is refused
    (dict(lam=1.0, rho=0.5, xi=0.0, a=3.0), "(a-1)·ρ > 1, got a=3.0, ρ=0.5"),        # (a−1)ρ = 1
    (dict(lam=1.0, rho=1.0, xi=1.0, a=3.7), "0 <= ξ < λ, got ξ=1.0, λ=1.0"),         # ξ = λ
])
def test_scad_parameters_at_each_bound_are_refused_with_the_bound_named(params, words):
    with pytest.raises(ValueError) as err:
        check_scad_params(**params)
    assert words in str(err.value)


def test_scad_parameters_inside_the_bounds_pass():
    check_scad_params(lam=1.0, rho=0.6, xi=0.0, a=3.0)     # (a−1)ρ = 1.2, a > 2, ξ = 0 allowed
    check_scad_params(lam=1.0, rho=1.0, xi=0.99, a=2.01)


def test_a_method_name_that_is_no_string_names_the_field():
    with pytest.raises(ConfigError) as err:
        resolve_method_config(3, {})
    assert err.value.field == "method.name" and "got 3" in str(err.value)


def test_a_message_part_that_is_no_part_names_its_type():
    with pytest.raises(TypeError, match=r"part 'w' must be a Part .* got Tensor"):
        Message({"w": torch.zeros(2)})
    Message({"w": Model({"x": torch.zeros(2)})})   # a Part passes


def test_fpfc_theta_gap_is_the_largest_within_and_smallest_between_true_cluster_distance():
    """FPFC's ‖θ_ij‖ read-out against a loop over the pairs of the server's distance matrix."""
    sim = Simulator(synthetic_config(federation__rounds=3))
    run_rounds(sim)
    method = sim.method
    true = np.asarray(method.ctx.meta.true_clusters)
    dist = method.distances().cpu().numpy()
    within, between = -np.inf, np.inf
    for i, j in itertools.permutations(range(len(true)), 2):
        if not np.isfinite(dist[i, j]):
            continue
        if true[i] == true[j]:
            within = max(within, dist[i, j])
        else:
            between = min(between, dist[i, j])
    gap = method.theta_gap()
    assert gap == {"fpfc/theta_max_within": pytest.approx(within), "fpfc/theta_min_between": pytest.approx(between)}
    assert np.isfinite(within) and np.isfinite(between)
