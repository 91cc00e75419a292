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


def _ckt(seed: int = 0, size: int = 100, cache: bool = True):
    from pfl.resolver import load

    return Simulator(load(None, {
        "method.name": "perfed_ckt", "method.architectures": ["softmax_regression"], "method.public_size": size,
        "model.name": "softmax_regression", "data.source": "digits", "data.num_clients": 6,
        "data.max_samples": 600, "data.cache": cache, "federation.batch_size": 0, "federation.local_steps": 1,
        "tracking.enabled": False, "seed": seed}))


def _rows(x: torch.Tensor) -> set[bytes]:
    return {r.tobytes() for r in x.double().cpu().numpy()}


def _client_rows(sim) -> set[bytes]:
    return set().union(*(_rows(torch.cat([c.x_train, c.x_val, c.x_test])) for c in sim.data.clients))


@pytest.mark.parametrize("cache", [True, False])
def test_the_held_out_public_set_is_distinct_digits_rows_no_client_holds(cache):
    """same_heldout on digits with 600 of its 1,797 samples given to clients: 100 distinct rows of
    the source, none of them any client's train, validation or test row (checked by content), the
    overlap 0; the same seed draws the same rows (partition cached or recomputed), another seed others."""
    from pfl.data import source_spec

    sim = _ckt(cache=cache)
    pub = sim.method.public
    src = source_spec("digits").load({}, 6)
    everything = _rows(torch.from_numpy(src.rows(np.arange(len(src.y)))))
    mine, held = _rows(pub.x), _client_rows(sim)
    assert len(pub) == len(mine) == 100 and mine <= everything
    assert len(held) == 600 and not (mine & held) and pub.overlap == 0 and pub.source == "same_heldout"
    assert _rows(_ckt(cache=not cache).method.public.x) == mine
    assert _rows(_ckt(seed=1, cache=cache).method.public.x) != mine


def test_a_public_set_larger_than_the_unused_pool_is_that_pool(caplog):
    """public_size 5,000 > the 1,197 samples no client holds: the set is exactly those samples, said."""
    from pfl.data import source_spec

    with caplog.at_level("WARNING"):
        sim = _ckt(size=5000)
    src = source_spec("digits").load({}, 6)
    everything = _rows(torch.from_numpy(src.rows(np.arange(len(src.y)))))
    pub = sim.method.public
    assert _rows(pub.x) == everything - _client_rows(sim) and len(pub) == 1197 and pub.requested == 5000
    assert "only 1197 samples of digits are held by no client" in caplog.text


def test_a_public_set_of_exactly_the_unused_pool_warns_of_nothing(caplog):
    with caplog.at_level("WARNING"):
        sim = _ckt(size=1197)
    assert len(sim.method.public) == 1197 and "public set" not in caplog.text


@pytest.mark.parametrize("source, hint", [
    ("fpfc_synthetic", "set method.public_source"),                          # generated client by client
    ("digits", "set data.max_samples below the pool size (1797) or method.public_source"),  # pooled, all used
])
def test_a_source_whose_every_sample_is_a_clients_says_so_and_what_helps(caplog, source, hint):
    from pfl.resolver import load

    with caplog.at_level("WARNING"):
        Simulator(load(None, {"method.name": "perfed_ckt", "method.architectures": ["softmax_regression"],
                              "method.public_size": 30, "model.name": "softmax_regression",
                              "data.source": source, "data.num_clients": 6, "federation.batch_size": 0,
                              "federation.local_steps": 1, "tracking.enabled": False, "data.cache": False}))
    assert f"every sample of {source} belongs to a client" in caplog.text
    assert hint in caplog.text and ("max_samples" in hint) == ("max_samples" in caplog.text)


@pytest.mark.parametrize("source, words", [
    ("nope", "unknown public source 'nope'; allowed: same_heldout, digits, fmnist"),
    ("fpfc_synthetic", "'fpfc_synthetic' generates per-device data and has no sample pool; use same_heldout"),
])
def test_a_public_source_that_cannot_be_one_is_refused_naming_the_field(source, words):
    from pfl.methods.public_set import check_public_source

    with pytest.raises(ConfigError) as err:
        check_public_source(source)
    assert err.value.field == "method.public_source" and words in str(err.value)
    check_public_source("same_heldout")
    check_public_source("fmnist")


def test_another_sources_public_rows_must_have_the_tasks_shape():
    """fmnist's 28×28 images for the 8×8 digits task: refused on method.public_source, both shapes named."""
    from pfl.resolver import load

    cfg = load(None, {"method.name": "perfed_ckt", "method.architectures": ["softmax_regression"],
                      "method.public_size": 50, "method.public_source": "fmnist", "model.name": "softmax_regression",
                      "data.source": "digits", "data.num_clients": 6, "federation.batch_size": 0,
                      "tracking.enabled": False})
    with pytest.raises(ConfigError) as err:
        Simulator(cfg)
    assert err.value.field == "method.public_source"
    assert "public source 'fmnist' has samples of shape" in str(err.value) and "'digits' needs (64,)" in str(err.value)


def test_fedslr_read_outs_are_the_ranks_counts_and_sparsity_of_what_it_holds():
    """FedSLR's model/* metrics against numpy: each matrix's rank from its singular values (the GKR
    after SVT is exactly low rank), the stored scalars as min((m + n)·r, m·n) per matrix plus every
    other tensor's size, and the sparsity / mixed size from the clients' own P (counted here)."""
    from helpers import small_config

    sim = Simulator(small_config(method__name="fedslr", method__lam=3e-2, federation__rounds=3,
                                 federation__clients_per_round=10, federation__eval_every=3))
    run_rounds(sim)
    method = sim.method
    metrics = method.extra_metrics(sim.round)
    ranks, params = {}, 0
    for name, value in method.global_model.items():
        if name in method.low_rank_names:
            m = value.double().reshape(value.shape[0], -1).numpy()
            s = np.linalg.svd(m, compute_uv=False)
            r = int((s > s.max() * 1e-6).sum()) if s.max() > 0 else 0
            ranks[name] = (r, min(m.shape))
            params += min((m.shape[0] + m.shape[1]) * r, m.size)
        else:
            params += value.numel()
    assert any(r < full for r, full in ranks.values())          # λ cut some rank: the read-outs are not trivial
    assert metrics["model/params"] == params
    assert metrics["model/rank_mean"] == pytest.approx(np.mean([r for r, _ in ranks.values()]))
    assert metrics["model/rank_kept_ratio"] == pytest.approx(sum(r for r, _ in ranks.values())
                                                             / sum(f for _, f in ranks.values()))
    assert all(metrics[f"model/rank/{n}"] == r for n, (r, _) in ranks.items())
    ps = [sim.client(c).state["P"] for c in range(10) if "P" in sim.client(c).state]
    assert len(ps) == 10
    nnz = [sum(int((v != 0).sum()) for v in p.values()) for p in ps]
    size = [sum(v.numel() for v in p.values()) for p in ps]
    assert metrics["model/sparsity"] == pytest.approx(np.mean([1 - z / n for z, n in zip(nnz, size)]))
    assert metrics["model/mixed_params"] == pytest.approx(params + np.mean(nnz))


@pytest.mark.parametrize("size, params, head", [
    ((1000, 100), 500, 50),      # the head keeps its tenth
    ((1000, 100), 30, 3),
    ((1000, 250), 10, 2),        # 2.5 rounds to the even 2 (Python's round)
    ((1000, 350), 10, 4),        # 3.5 rounds to the even 4
    ((10, 10), 4, 4),            # a model that is all head stays all head
    ((0, 0), 7, 0),              # no parameters: no share to keep
])
def test_a_smaller_models_size_keeps_the_heads_share(size, params, head):
    """ModelSize.with_params (the server-memory check's "a smaller model" option) by hand: the head's
    share of the parameters rounded, never more than the model; the other fields unchanged."""
    from pfl.methods.base import ModelSize

    out = ModelSize(params=size[0], head=size[1], features=12, classes=3, itemsize=2).with_params(params)
    assert (out.params, out.head, out.features, out.classes, out.itemsize) == (params, head, 12, 3, 2)
