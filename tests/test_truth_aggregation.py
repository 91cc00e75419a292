"""The aggregation rules against numpy: the weighted mean, the coordinate-wise median, the trimmed
mean and (multi-)Krum written out here, through the dispatcher every method uses, with a subset of
the tensors named (a method that combines only its shared part) and integer tensors."""

import numpy as np
import pytest
import torch

from pfl.aggregation import RobustAggregation, aggregate, krum, weighted_average


def _models(n, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [{"body": scale * torch.randn(3, 2, generator=g, dtype=torch.float64),
             "head": scale * torch.randn(4, generator=g, dtype=torch.float64)} for _ in range(n)]


def _np(models, k):
    return np.stack([m[k].numpy() for m in models])


def _krum_np(flat, f, select):
    n = len(flat)
    d = ((flat[:, None, :] - flat[None, :, :]) ** 2).sum(-1)
    k = max(1, n - f - 2)
    scores = [np.sort(np.delete(d[i], i))[:k].sum() for i in range(n)]
    return sorted(range(n), key=lambda i: (scores[i], i))[:select]


@pytest.mark.parametrize("n", [5, 6])
def test_each_rule_on_the_named_tensors_only(n):
    models = _models(n, seed=n)
    x = _np(models, "body")
    for rule, expected in [
        (RobustAggregation(), x.mean(0)),
        (RobustAggregation(aggregator="median"), np.median(x, axis=0)),
        (RobustAggregation(aggregator="trimmed_mean", trim_fraction=0.2),
         np.sort(x, axis=0)[int(0.2 * n):n - int(0.2 * n)].mean(0)),
    ]:
        out = aggregate(models, None, rule, names=["body"])
        assert set(out) == {"body"}
        np.testing.assert_allclose(out["body"].numpy(), expected, rtol=1e-6)  # uniform weights are float32


def test_krum_scores_only_the_named_tensors_and_takes_f_from_the_rule_or_the_attack():
    models = _models(7, seed=3, scale=0.1)             # distances below 1: nothing may be clipped
    models[2]["head"] = models[2]["head"] + 50.0       # far only in the tensor that is not named
    flat = _np(models, "body").reshape(7, -1)
    for share, attack, f in [(-1.0, 0.3, 2), (0.0, 0.3, 0), (0.45, 0.0, 3)]:
        rule = RobustAggregation(aggregator="krum", byzantine_share=share, krum_select=2)
        out = aggregate(models, None, rule, names=["body"], attack_fraction=attack)
        chosen = _krum_np(flat, f, 2)
        np.testing.assert_allclose(out["body"].numpy(), flat[chosen].mean(0).reshape(3, 2), rtol=1e-12)
        assert set(out) == {"body"}
    # all tensors: the far head now counts
    flat_all = np.concatenate([flat, _np(models, "head")], axis=1)
    picked = krum(models, 1, select=1)[1]
    assert picked == _krum_np(flat_all, 1, 1) and 2 not in picked


def test_krum_with_two_replies_breaks_the_tie_by_position():
    models = _models(2, seed=1)
    out, chosen = krum(models, 0)
    assert chosen == [0] and torch.equal(out["head"], models[0]["head"])


def test_weighted_mean_normalises_any_positive_total_and_refuses_zero():
    models = _models(2, seed=5)
    out = weighted_average(models, [0.2, 0.3])        # a total below 1 is fine
    np.testing.assert_allclose(out["head"].numpy(), (0.2 * _np(models, "head")[0] + 0.3 * _np(models, "head")[1]) / 0.5)
    with pytest.raises(ValueError):
        weighted_average(models, [0.0, 0.0])
    with pytest.raises(ValueError):
        weighted_average([], None)


def test_integer_tensors_stay_integers():
    models = [{"i": torch.tensor([1, 10]), "w": torch.tensor([1.0, 2.0])},
              {"i": torch.tensor([2, 30]), "w": torch.tensor([3.0, 4.0])},
              {"i": torch.tensor([9, 20]), "w": torch.tensor([5.0, 6.0])}]
    mean = weighted_average(models)
    assert mean["i"].dtype == torch.int64 and mean["i"].tolist() == [4, 20]
    trimmed = aggregate(models, None, RobustAggregation(aggregator="trimmed_mean", trim_fraction=0.0))
    assert trimmed["i"].tolist() == [2, 20]          # the middle value of each sorted column
    assert trimmed["w"].tolist() == [3.0, 4.0]
    median = aggregate(models, None, RobustAggregation(aggregator="median"))
    assert median["i"].tolist() == [2, 20]
