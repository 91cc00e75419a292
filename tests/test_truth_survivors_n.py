"""Survivors of CFL (aggregate's split criterion, weighting, clusters without participants, the
partial-participation placement; bipartition's labels), ADIANA's parameters and validation, APFL's
mixed model and FineTuneNewcomers (triage list N). Truths: CFL's strict split criterion
mean_norm < ε1, max_norm > ε2, |c| > min_size evaluated on hand-made updates whose norms are exact
(3-4-5 vectors), the cluster step θ_c + mean update recomputed in numpy (uniform or by sample count),
the cosine side of a non-participant computed from its last update; the spec's closed forms of
ADIANA's parameters; APFL's α·v + (1−α)·w recomputed in numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from truth import close, least_squares, params_of, simulator, vec
from pfl.federation.messages import Message, Update


@pytest.fixture(scope="module")
def problem():
    return least_squares()


def _cfl(problem, **kw):
    base = dict(method__start_round=0, method__eps1=100.0, method__eps2=0.0, method__min_size=1)
    base.update({f"method__{k}": v for k, v in kw.items()})
    return simulator(problem, "cfl", **base)


def _reply(sim, u, n=10):
    like = sim.method.models[0]
    return Message.of({"delta": Update(params_of(np.asarray(u, float), like))}, train_loss=0.0, n=n)


def _aggregate(sim, rnd, ups, ns=None):
    sim.method.aggregate(rnd, {cid: _reply(sim, u, (ns or {}).get(cid, 10)) for cid, u in ups.items()})


E1, E2 = np.array([1.0, 0.0, 0.0]), np.array([0.0, 1.0, 0.0])


def test_cfl_does_not_split_when_the_mean_update_norm_equals_eps1():
    p = least_squares()
    sim = _cfl(p, eps1=5.0, eps2=1.0)
    theta = vec(sim.method.models[0])
    _aggregate(sim, 0, {0: [6.0, 8.0, 0.0], 1: [0.0, 0.0, 0.0]})  # mean (3, 4, 0): norm exactly 5
    assert len(sim.method.clusters) == 1
    assert close(vec(sim.method.models[0]), theta + np.array([3.0, 4.0, 0.0]))


def test_cfl_does_not_split_when_the_largest_update_norm_equals_eps2():
    p = least_squares()
    sim = _cfl(p, eps1=1.0, eps2=5.0)
    _aggregate(sim, 0, {0: [3.0, 4.0, 0.0], 1: [-3.0, -4.0, 0.0]})  # mean 0, max norm exactly 5
    assert len(sim.method.clusters) == 1
    sim2 = _cfl(p, eps1=1.0, eps2=4.99)
    _aggregate(sim2, 0, {0: [3.0, 4.0, 0.0], 1: [-3.0, -4.0, 0.0]})
    assert len(sim2.method.clusters) == 2


def test_cfl_does_not_split_a_cluster_of_exactly_min_size_members():
    p = least_squares()
    sim = _cfl(p, eps1=1.0, eps2=1.0, min_size=4)  # 4 members: |c| > 4 is false
    _aggregate(sim, 0, {0: [3.0, 4.0, 0.0], 1: [-3.0, -4.0, 0.0]})
    assert len(sim.method.clusters) == 1
    sim2 = _cfl(p, eps1=1.0, eps2=1.0, min_size=3)
    _aggregate(sim2, 0, {0: [3.0, 4.0, 0.0], 1: [-3.0, -4.0, 0.0]})
    assert len(sim2.method.clusters) == 2


def test_cfl_samples_weighting_moves_the_cluster_by_the_sample_weighted_mean_update():
    p = least_squares()
    sim = _cfl(p, eps1=0.0, weighting="samples")
    theta = vec(sim.method.models[0])
    _aggregate(sim, 0, {0: [4.0, 0.0, 0.0], 1: [0.0, 4.0, 0.0]}, ns={0: 1, 1: 3})
    assert close(vec(sim.method.models[0]), theta + np.array([1.0, 3.0, 0.0]))


def test_cfl_logs_the_mean_and_largest_update_norms_even_of_a_single_participant():
    p = least_squares()
    sim = _cfl(p, eps1=0.0)
    _aggregate(sim, 0, {2: [3.0, 4.0, 0.0]})
    m = sim.method.extra_metrics(0)
    assert m["cfl/mean_norm"] == pytest.approx(5.0) and m["cfl/max_norm"] == pytest.approx(5.0)
    ups = {0: [3.0, 4.0, 0.0], 1: [0.0, 0.0, 1.0]}
    _aggregate(sim, 1, ups)
    u = np.array(list(ups.values()))
    m = sim.method.extra_metrics(1)
    assert m["cfl/max_norm"] == pytest.approx(np.linalg.norm(u, axis=1).max())
    assert m["cfl/mean_norm"] == pytest.approx(np.linalg.norm(u.mean(0)))


def test_cfl_a_cluster_without_participants_keeps_its_model_and_the_others_still_step():
    p = least_squares()
    sim = _cfl(p)
    theta = vec(sim.method.models[0])
    _aggregate(sim, 0, {0: E1, 1: E1, 2: E2, 3: E2})  # split {0,1} | {2,3}
    assert sorted(map(sorted, sim.method.clusters)) == [[0, 1], [2, 3]]
    _aggregate(sim, 1, {2: [0.0, 0.0, 2.0]})  # only a member of {2,3} participates
    got = {tuple(sorted(c)): vec(m) for c, m in zip(sim.method.clusters, sim.method.models)}
    assert set(got) == {(0, 1), (2, 3)}
    assert close(got[(0, 1)], theta + E1)
    assert close(got[(2, 3)], theta + E2 + np.array([0.0, 0.0, 2.0]))


def test_cfl_a_member_absent_at_the_split_goes_to_the_side_closest_to_its_last_update():
    p = least_squares()
    sim = _cfl(p, start_round=1)
    _aggregate(sim, 0, {0: E1, 1: E1, 2: E2, 3: E2})  # round 0: no split yet, last updates kept
    assert len(sim.method.clusters) == 1
    _aggregate(sim, 1, {0: E1, 1: E1, 2: E2})  # client 3 absent; its last update points along e2
    assert sorted(map(sorted, sim.method.clusters)) == [[0, 1], [2, 3]]


def test_bipartition_labels_are_integers_zero_on_the_side_of_row_zero():
    from pfl.methods.cfl import bipartition

    rs = np.random.RandomState(0)
    truth = np.array([0, 1, 0, 1, 1])
    dirs = np.stack([E1, E2])[truth] * 5 + 0.1 * rs.normal(size=(5, 3))
    labels = bipartition(torch.tensor(dirs, dtype=torch.float32))
    assert labels.dtype.kind == "i"
    assert labels.tolist() == truth.tolist()


LR, K = 0.2, 2


def test_cfl_samples_weighting_end_to_end_uses_each_clients_training_set_size():
    """A real round: the clients' replies carry n = training-set size, the cluster moves by the
    n-weighted mean of the numpy gradient-descent updates, and the train loss is reported."""
    p = least_squares()
    sim = simulator(p, "cfl", steps=K, lr=LR, method__eps1=0.0, method__weighting="samples")
    theta = vec(sim.method.models[0])
    out = sim.run_round(evaluate=False)
    deltas = np.array([p.gd(i, theta, K, LR) - theta for i in range(p.m)])
    n = np.array([len(y) for y in p.y], float)
    assert close(vec(sim.method.models[0]), theta + (n[:, None] * deltas).sum(0) / n.sum())
    losses = [k for k in out if "loss" in k and "train" in k]
    assert losses and all(np.isfinite(out[k]) for k in losses)


def test_cfl_server_bytes_are_one_update_per_training_client():
    from pfl.methods.base import ModelSize
    from pfl.methods.cfl import CFL
    from truth import config

    cfg = config("cfl", 10, newcomers__fraction=0.2)
    size = ModelSize(params=7, head=7, features=3, classes=2)
    assert CFL.server_bytes(10, size, cfg) == 4 * 8 * 7


TRUE6 = [0, 0, 0, 1, 1, 1]


def _cfl_newcomers(fraction, **kw):
    p = least_squares(sizes=(20, 30, 24, 27, 22, 25), clusters=TRUE6)
    base = dict(method__start_round=0, method__eps1=100.0, method__eps2=0.0, method__min_size=1,
                newcomers__fraction=fraction)
    base.update({f"method__{k}": v for k, v in kw.items()})
    sim = simulator(p, "cfl", **base)
    return sim, sorted(sim.ctx.newcomers)


def test_cfl_metrics_before_any_round_and_newcomers_are_in_no_cluster_before_joining():
    sim, new = _cfl_newcomers(0.17)
    assert len(new) == 1
    m = sim.method.extra_metrics(0)
    assert "cfl/mean_norm" not in m and m["cluster/num"] == 1
    assert new[0] not in sim.method.cluster_assignment()
    members = [c for c in range(6) if c not in new]
    _aggregate(sim, 0, {c: (E1 if TRUE6[c] == 0 else E2) for c in members})
    found = sim.method.cluster_assignment()
    assert sorted(found) == members
    assert sim.method.extra_metrics(1)["cluster/ari"] == pytest.approx(1.0)


def test_cfl_newcomers_descend_the_tree_one_at_a_time():
    """Two newcomers at the root; only the larger id answers: it reaches the leaf of its side (the one
    whose mean unit update its own update is closest to in cosine) while the other stays at the root."""
    sim, new = _cfl_newcomers(0.34)
    assert len(new) == 2
    members = [c for c in range(6) if c not in new]
    _aggregate(sim, 0, {c: (E1 if TRUE6[c] == 0 else E2) for c in members})
    m = sim.method
    m.join_begin(1, new)
    assert sorted(m.join_active(0)) == new
    a, b = new
    m.join_aggregate(1, 0, {b: _reply(sim, 0.3 * E2 + 0.1 * E1)})
    found = m.cluster_assignment()
    assert a not in found
    side = [c for c in members if TRUE6[c] == 1]
    assert sorted(c for c, lab in found.items() if lab == found[b] and c != b) == side


def test_cfl_newcomer_joins_the_largest_cluster_when_the_partition_was_set_from_outside():
    sim, new = _cfl_newcomers(0.17, eps1=0.0)
    members = [c for c in range(6) if c not in new]
    m = sim.method
    big, small = members[:3], members[3:]  # lexicographically the smaller list is the larger cluster
    expected = sorted(big)
    m.clusters = [list(small), list(big)]
    m.models = [dict(m.models[0]), dict(m.models[0])]
    _aggregate(sim, 0, {members[0]: E1})
    m.join_begin(1, new)
    assert not m.join_active(0)
    found = m.cluster_assignment()
    assert sorted(c for c, lab in found.items() if lab == found[new[0]] and c != new[0]) == expected


# ---- DIANA / ADIANA ------------------------------------------------------------------------------

@pytest.mark.parametrize("eta, theta1, mu", [(0.3, 0.25, 0.5), (0.1, 0.4, 2.0), (0.3, 0.25, 0.0)])
def test_adiana_parameters_follow_the_closed_forms(eta, theta1, mu):
    from pfl.methods.diana import adiana_parameters

    beta, gamma = adiana_parameters(eta, theta1, mu)
    want_gamma = eta / (2 * theta1) if mu == 0 else eta / (2 * (theta1 + eta * mu))
    assert gamma == pytest.approx(want_gamma, rel=1e-12)
    assert beta == pytest.approx(1.0 - want_gamma * mu, rel=1e-12)


def test_adiana_validate_allows_theta1_plus_theta2_equal_to_one_and_names_theta2_otherwise():
    from pfl.methods.diana import AdianaHparams
    from pfl.schema import ConfigError

    AdianaHparams(theta1=0.5, theta2=0.5).validate("method")
    with pytest.raises(ConfigError) as err:
        AdianaHparams(theta1=0.8, theta2=0.3).validate("method")
    assert err.value.field == "method.theta2"
    assert "θ1 + θ2" in err.value.message and "0.8" in err.value.message and "0.3" in err.value.message
    with pytest.raises(ConfigError):
        AdianaHparams(theta1=1.0, theta2=0.9).validate("method")


@pytest.mark.parametrize("coin", [True, False])
def test_adiana_step_matches_the_server_update_in_numpy(coin):
    from pfl.methods.diana import adiana_step

    rs = np.random.RandomState(1)
    names = ("a", "b")
    mk = lambda: {k: rs.normal(size=3) + 2.0 for k in names}  # noqa: E731
    x, y, z, w, h, am, bm = (mk() for _ in range(7))
    t = lambda d: {k: torch.tensor(v, dtype=torch.float64) for k, v in d.items()}  # noqa: E731
    eta, gamma, beta, alpha = 0.3, 0.2, 0.7, 0.4
    yn, zn, wn, hn = adiana_step(t(x), t(y), t(z), t(w), t(h), t(am), t(bm), eta=eta, gamma=gamma, beta=beta,
                                 alpha=alpha, coin=coin)
    for k in names:
        y_new = x[k] - eta * (h[k] + am[k])
        assert np.allclose(yn[k].numpy(), y_new)
        assert np.allclose(hn[k].numpy(), h[k] + alpha * bm[k])
        assert np.allclose(zn[k].numpy(), beta * z[k] + (1 - beta) * x[k] + gamma / eta * (y_new - x[k]))
        assert np.allclose(wn[k].numpy(), y[k] if coin else w[k])


def test_reply_weights_by_samples_count_a_reply_without_n_as_one_sample():
    from pfl.methods.diana import reply_weights

    got = reply_weights({0: Message.of({}, n=3), 1: Message.of({})}, "samples")
    assert got == pytest.approx({0: 0.75, 1: 0.25})
    assert reply_weights({0: Message.of({}, n=3), 1: Message.of({})}, "uniform") == pytest.approx({0: 0.5, 1: 0.5})


def test_weighted_sum_of_a_single_client_is_its_weighted_params():
    from pfl.methods.diana import weighted_sum

    got = weighted_sum({5: {"u": torch.tensor([1.0, 2.0])}}, {5: 0.5})
    assert torch.equal(got["u"], torch.tensor([0.5, 1.0]))


def test_adiana_w_follows_y_exactly_in_the_rounds_whose_shared_coin_is_heads():
    p = least_squares()
    sim = simulator(p, "adiana", steps=1, lr=0.1, method__prob=0.5)
    m = sim.method
    heads = 0
    for rnd in range(8):
        y_before = vec(m.y)
        w_before = vec(m.w)
        sim.run_round(evaluate=False)
        coin = bool(sim.ctx.rng(rnd, "adiana").random() < 0.5)
        heads += coin
        assert m.w_changed is coin
        assert close(vec(m.w), y_before if coin else w_before, 0.0)
    assert 0 < heads < 8


# ---- APFL ----------------------------------------------------------------------------------------

def test_apfl_mixed_params_mix_every_tensor_and_hold_alpha_constant_for_running_statistics():
    from pfl.methods.apfl import mixed_params

    v = {"w": torch.tensor([1.0, 2.0]), "bn": torch.tensor([4.0, -1.0])}
    w = {"w": torch.tensor([3.0, 0.0]), "bn": torch.tensor([2.0, 5.0])}
    want = {k: 0.25 * v[k].numpy() + 0.75 * w[k].numpy() for k in v}
    for alpha in (0.25, torch.tensor(0.25, requires_grad=True)):
        for stats in (frozenset(), frozenset({"bn"})):
            got = mixed_params(v, w, alpha, stats)
            assert all(np.allclose(got[k].detach().numpy(), want[k]) for k in v)
    alpha = torch.tensor(0.25, requires_grad=True)
    got = mixed_params(v, w, alpha, frozenset({"bn"}))
    assert got["w"].requires_grad and not got["bn"].requires_grad


def test_apfl_mixed_output_mixes_parameters_or_logits_as_asked():
    from pfl.methods.apfl import mixed_output

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    names = [k for k, _ in model.named_parameters()]
    v = {k: torch.randn_like(t) for k, t in model.named_parameters()}
    w = {k: torch.randn_like(t) for k, t in model.named_parameters()}
    x = torch.randn(5, 2)
    a = 0.3

    def f(p):  # the MLP in numpy
        p = {k: t.detach().double().numpy() for k, t in p.items()}
        h = np.maximum(x.double().numpy() @ p[names[0]].T + p[names[1]], 0.0)
        return h @ p[names[2]].T + p[names[3]]

    mixed = {k: a * v[k] + (1 - a) * w[k] for k in v}
    by_params = mixed_output(model, "params", v, w, torch.tensor(a), x).detach().double().numpy()
    by_logits = mixed_output(model, "logits", v, w, torch.tensor(a), x).detach().double().numpy()
    assert np.allclose(by_params, f(mixed), atol=1e-5)
    assert np.allclose(by_logits, a * f(v) + (1 - a) * f(w), atol=1e-5)
    assert not np.allclose(by_params, by_logits, atol=1e-3)


def test_apfl_alpha_gradient_is_scaled_with_its_l2_and_undoes_the_weight_decay():
    from pfl.methods.apfl import AlphaGradient

    g = AlphaGradient(scale=2.0, l2=0.5, weight_decay=0.1)(
        {"alpha": torch.tensor(0.4), "w.x": torch.tensor(1.0)}, {"alpha": torch.tensor(0.6)})
    assert float(g["alpha"]) == pytest.approx(2.0 * (0.4 + 0.5 * 0.6) - 0.1 * 0.6)
    assert float(g["w.x"]) == 1.0


def test_apfl_personal_model_of_a_client_that_never_trained_mixes_the_common_start():
    p = least_squares()
    sim = simulator(p, "apfl", steps=1, lr=0.1, method__alpha=0.25, method__mix="params")
    glob = vec(sim.method.global_params())
    init = vec(sim.method.init)
    assert close(vec(sim.personal_params(0)), 0.25 * init + 0.75 * glob)


# ---- compressed methods: the uplink's bit ratio and its random streams -------------------------------

def _randk_bits(d, ratio):
    """Rand-k with explicit indices: k fp32 values and min(k⌈log2 d⌉, d) index bits, padded to bytes."""
    k = min(d, max(1, int(np.ceil(ratio * d))))
    idx = int(np.ceil(np.log2(d))) if d > 1 else 0
    return 8 * int(np.ceil((32 * k + min(k * idx, d)) / 8))


@pytest.mark.parametrize("min_numel", [1, 2, 5])
def test_model_bits_ratio_is_compressed_over_dense_bits_of_the_model(min_numel):
    from pfl.methods.compressed import model_bits_ratio

    p = least_squares(d=4)
    sim = simulator(p, "marina", compression__uplink={"name": "randk", "ratio": 0.4, "indices": "explicit"},
                    compression__min_numel=min_numel)
    sizes = [int(t.numel()) for t in sim.ctx.init_params().values()]
    bits = sum(32 * d if d < min_numel else _randk_bits(d, 0.4) for d in sizes)
    assert model_bits_ratio(sim.ctx) == pytest.approx(bits / (32 * sum(sizes)))
    assert (model_bits_ratio(sim.ctx) < 1.0) == any(d >= min_numel for d in sizes)


def test_compression_generators_of_the_two_adiana_uploads_draw_independently():
    from pfl.methods.compressed import generators

    p = least_squares()
    sim = simulator(p, "adiana", steps=1, lr=0.1)
    draw = lambda tag: torch.rand(8, generator=generators(sim.ctx, 3, 1, tag)("t"))  # noqa: E731
    assert torch.equal(draw("a"), draw("a"))
    assert not torch.equal(draw("a"), draw("b"))
    assert not torch.equal(draw(""), draw("a"))


# ---- base: newcomers that fine-tune, the server-work default, samples_everyone --------------------

def _ft_joined(finetune_rounds):
    from pfl.federation.loop import RoundLoop

    p = least_squares(sizes=(20, 30, 24, 27, 22, 25), clusters=TRUE6)
    sim = simulator(p, "lgfedavg", steps=K, lr=LR, rounds=2, newcomers__fraction=0.17,
                    newcomers__finetune_rounds=finetune_rounds)
    for _ in range(2):
        sim.run_round(evaluate=False)
    final = vec(sim.method.global_model)
    RoundLoop(sim, []).run()
    n = sim.ctx.newcomers[0]
    return p, sim, n, final


@pytest.mark.parametrize("finetune_rounds", [0, 1])
def test_fine_tune_newcomer_trains_the_final_global_model_exactly_finetune_rounds_times(finetune_rounds):
    p, sim, n, final = _ft_joined(finetune_rounds)
    expected = p.gd(n, final, finetune_rounds * K, LR) if finetune_rounds else final
    assert close(vec(sim.personal_params(n)), expected)


def test_methods_without_large_server_temporaries_report_zero_work_bytes():
    from pfl.methods.base import ModelSize
    from truth import config

    sim = simulator(least_squares(), "fedavg")
    size = ModelSize(params=7, head=7, features=3, classes=2)
    assert type(sim.method).server_work_bytes(4, size, config("fedavg", 4)) == 0


@pytest.mark.parametrize("per_round, everyone", [(0, True), (3, False), (4, True), (5, True)])
def test_samples_everyone_when_every_training_client_is_sampled(per_round, everyone):
    from pfl.methods.base import samples_everyone
    from truth import config

    assert samples_everyone(4, config("fedavg", 4, per_round=per_round)) is everyone


@pytest.mark.parametrize("mix", ["params", "logits"])
def test_apfl_loss_is_the_own_loss_plus_the_loss_of_the_configured_mixture(mix):
    """Regression: per sample (f_w(x) − y)² + (f_mix(x) − y)², f_mix the MLP at α v + (1 − α) w
    (params) or α f_v + (1 − α) f_w (logits), written in numpy."""
    from pfl.methods.apfl import APFLLoss

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    names = [k for k, _ in model.named_parameters()]
    v = {k: torch.randn_like(t) for k, t in model.named_parameters()}
    w = {k: torch.randn_like(t) for k, t in model.named_parameters()}
    x, y, a = torch.randn(6, 2), torch.randn(6), 0.35
    params = {**{"w." + k: t for k, t in w.items()}, **{"v." + k: t for k, t in v.items()}, "alpha": torch.tensor(a)}
    got = APFLLoss(model, mix, "regression")(params, x, y).detach().double().numpy()

    def f(p):
        p = {k: t.detach().double().numpy() for k, t in p.items()}
        h = np.maximum(x.double().numpy() @ p[names[0]].T + p[names[1]], 0.0)
        return (h @ p[names[2]].T + p[names[3]]).ravel()

    yn = y.double().numpy()
    mixed = f({k: a * v[k] + (1 - a) * w[k] for k in v}) if mix == "params" else a * f(v) + (1 - a) * f(w)
    assert np.allclose(got, (f(w) - yn) ** 2 + (mixed - yn) ** 2, atol=1e-5)


def _apfl_mlp(mix):
    from pfl.federation.simulator import Simulator
    from truth import classification_data, config

    data, _ = classification_data()
    cfg = config("apfl", data.num_clients, steps=2, lr=0.3, source="digits", model="mlp",
                 model__params={"hidden": [5]}, method__mix=mix, method__alpha=0.5)
    return Simulator(cfg, data=data)


def test_apfl_parameter_mixture_is_an_ordinary_model_and_trains_unlike_the_logit_mixture():
    """mix = params: the personal model is α v + (1 − α) w, evaluated by the model's own forward
    (eval_forward None); on a nonlinear model its training loss, hence v, differs from mix = logits."""
    sims = {mix: _apfl_mlp(mix) for mix in ("params", "logits")}
    assert sims["params"].client_role.eval_forward(sims["params"].client(0)) is None
    assert sims["logits"].client_role.eval_forward(sims["logits"].client(0)) is not None
    for sim in sims.values():
        sim.run_round(evaluate=False)
    vp = sims["params"].client(0).state["v"]
    vl = sims["logits"].client(0).state["v"]
    assert not all(torch.allclose(vp[k], vl[k], atol=1e-6) for k in vp)


def test_apfl_reports_the_clients_training_loss():
    sim = simulator(least_squares(), "apfl", steps=1, lr=0.1)
    out = sim.run_round(evaluate=False)
    losses = [k for k in out if "loss" in k and "train" in k]
    assert losses and all(np.isfinite(out[k]) for k in losses)
