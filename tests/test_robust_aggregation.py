"""Byzantine-robust aggregation rules (coordinate median, trimmed mean, Krum) against direct
computations, and where the methods combine their replies through them."""

import numpy as np
import pytest
import torch

from helpers import downlink, small_config, uplink
from pfl.aggregation import (RobustAggregation, aggregate, byzantine_count, coordinate_median, krum,
                             krum_scores, trim_count, trimmed_mean)
from pfl.callbacks.divergence import run_rounds
from pfl.federation.simulator import Simulator
from pfl.schema import ConfigError


# ---- robust aggregators against direct computations ---------------------------------------------------

def _models(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g, dtype=torch.float64)}
            for _ in range(n)]


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_coordinate_median_is_numpys_median(n):
    models = _models(n)
    out = coordinate_median(models)
    for k in ("w", "b"):
        direct = np.median(np.stack([m[k].numpy() for m in models]), axis=0)
        np.testing.assert_allclose(out[k].numpy(), direct, rtol=1e-6)
        assert out[k].dtype == models[0][k].dtype


@pytest.mark.parametrize("n,beta", [(7, 0.2), (10, 0.1), (4, 0.4), (3, 0.45), (5, 0.0)])
def test_trimmed_mean_drops_the_extremes_of_each_coordinate(n, beta):
    models = _models(n, seed=n)
    out = trimmed_mean(models, beta)
    b = min(int(beta * n), (n - 1) // 2)
    assert trim_count(n, beta) == b
    for k in ("w", "b"):
        x = np.sort(np.stack([m[k].numpy() for m in models]), axis=0)
        np.testing.assert_allclose(out[k].numpy(), x[b:n - b].mean(axis=0), rtol=1e-6, atol=1e-7)


def test_krum_picks_the_model_with_the_smallest_neighbourhood_distance():
    models = _models(8, seed=3)
    models[5] = {k: v + 50 for k, v in models[5].items()}      # an outlier is never chosen
    f = 2
    flat = np.stack([np.concatenate([m["w"].numpy().ravel(), m["b"].numpy().ravel()]) for m in models])
    d = ((flat[:, None, :] - flat[None, :, :]) ** 2).sum(-1)
    scores = [np.sort(np.delete(d[i], i))[:8 - f - 2].sum() for i in range(8)]
    np.testing.assert_allclose(krum_scores(torch.as_tensor(flat), f).numpy(), scores, rtol=1e-9)
    out, chosen = krum(models, f)
    assert chosen == [int(np.argmin(scores))] and chosen != [5]
    for k in ("w", "b"):
        assert torch.allclose(out[k], models[chosen[0]][k])
    multi, picked = krum(models, f, select=3)
    assert picked == [int(i) for i in np.argsort(scores, kind="stable")[:3]]
    assert torch.allclose(multi["w"], torch.stack([models[i]["w"] for i in picked]).mean(0))


def test_aggregate_dispatches_and_uses_the_attack_fraction_for_krum():
    models = _models(10, seed=4)
    mean = torch.stack([m["w"] for m in models]).mean(0)
    assert torch.allclose(aggregate(models, None, RobustAggregation())["w"], mean)
    assert byzantine_count(10, 0.4) == 4 and byzantine_count(30, 0.2) == 6 and byzantine_count(5, 0.5) == 3
    rule = RobustAggregation(aggregator="krum")
    assert torch.equal(aggregate(models, None, rule, attack_fraction=0.4)["w"], krum(models, 4)[0]["w"])
    rule = RobustAggregation(aggregator="krum", byzantine_share=0.1)
    assert torch.equal(aggregate(models, None, rule, attack_fraction=0.4)["w"], krum(models, 1)[0]["w"])


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "ditto", "fedadam", "lgfedavg", "fedavg+ala"])
def test_the_methods_with_a_global_model_average_through_the_rule(name):
    sim = Simulator(small_config(method__name=name, method__aggregator="median"))
    replies = {c: uplink(sim, c, downlink(sim, c, 0), 0) for c in range(5)}
    shared = list(replies[0].tensors())
    direct = coordinate_median([r.tensors() for r in replies.values()], shared)
    assert torch.allclose(sim.method.reply_average(replies, shared)[shared[0]], direct[shared[0]])
    if name != "fedadam":
        sim.method.aggregate(0, replies)
        for k in shared:
            assert torch.allclose(sim.method.global_model[k], direct[k], atol=1e-6)


def test_robust_rules_keep_fedavg_learning_where_the_mean_collapses():
    # digits, 10 clients Dir(0.5), all participating, 8 rounds: clean 58 %, attacked mean 10 %,
    # median 26 %, Krum 25 % (the robust rules ignore the outliers but learn slower on non-IID data)
    base = dict(method__name="fedavg", federation__rounds=8, federation__clients_per_round=0)
    clean = Simulator(small_config(**base))
    run_rounds(clean)
    attacked = {}
    for rule in ("mean", "median", "krum"):
        sim = Simulator(small_config(attack__kind="gaussian", attack__fraction=0.2, method__aggregator=rule, **base))
        run_rounds(sim)
        attacked[rule] = sim.history[-1]["test/acc_mean"]
    acc = clean.history[-1]["test/acc_mean"]
    assert attacked["mean"] < acc - 0.3
    assert attacked["median"] > attacked["mean"] + 0.1 and attacked["krum"] > attacked["mean"] + 0.1


def test_fpfc_combines_its_shared_body_by_the_robust_rule():
    cfg = small_config(method__name="fpfc", method__shared_layers="body", method__aggregator="median",
                       federation__clients_per_round=5, federation__rounds=1)
    sim = Simulator(cfg)
    sampled = sim.sample(0)
    sim.method.begin_round(0, sampled)
    replies = {c: uplink(sim, c, downlink(sim, c, 0), 0) for c in sampled}
    sim.method.aggregate(0, replies)
    direct = coordinate_median([r.tensors("body") for r in replies.values()], sim.method.shared)
    assert sim.method.shared and all(torch.allclose(sim.method.body[k], direct[k]) for k in sim.method.shared)


def test_fpfc_refuses_a_robust_rule_with_nothing_shared_and_checks_the_rule():
    with pytest.raises(ConfigError, match="method.aggregator.*shared_layers"):
        small_config(method__name="fpfc", method__aggregator="median")
    with pytest.raises(ConfigError, match="method.byzantine_share"):
        small_config(method__name="fpfc_l1", method__shared_layers="body", method__aggregator="krum",
                     method__byzantine_share=-0.5)
    with pytest.raises(ConfigError, match="method.byzantine_share"):
        small_config(method__name="fedavg", method__aggregator="krum", method__byzantine_share=-0.5)
    assert small_config(method__name="fpfc", method__shared_layers="body",
                        method__aggregator="trimmed_mean").method.hparams.aggregator == "trimmed_mean"


def test_krum_breaks_the_tie_of_mutually_nearest_replies_by_position():
    # n − f − 2 = 1: a reply's score is the distance to its nearest neighbour, so the closest pair ties
    g = torch.Generator().manual_seed(11)
    base = torch.randn(6, 50, generator=g, dtype=torch.float64) * 3
    base[4] = base[1] + 1e-3 * torch.randn(50, generator=g, dtype=torch.float64)   # 1 and 4: the closest pair
    for perturb in (0.0, 1e-13):      # rounding-sized noise must not change the pick
        x = base.clone()
        x[4] += perturb
        scores = krum_scores(x, 3)
        assert scores[1] == scores[4] and int(torch.argmin(scores)) == 1
        models = [{"w": r.float()} for r in x]
        assert krum(models, 3)[1] == [1]


@pytest.mark.parametrize("name", ["diana", "lag"])
def test_methods_with_their_own_encoded_aggregation_refuse_a_robust_rule(name):
    with pytest.raises(ConfigError, match="method.aggregator"):
        small_config(method__name=name, method__aggregator="median")
    assert small_config(method__name=name).method.hparams.aggregator == "mean"
