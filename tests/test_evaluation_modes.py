"""The ``evaluation`` section (pfl/federation/eval_modes.py) against numpy on the least-squares
federation of tests/truth.py (train = val = test split there, so a client's test MSE is f_i).

Each expected value is computed here from the data and the seeded initial model: the models before
and after a round's local update, each client's last trained model, the pooled test set, the
trained clients' summary, and what an untrained client is evaluated with. Each test also shows the
truth separates a plausible wrong variant (after = before, a mean over clients instead of the
pooled set, every client counted as trained, the personal instead of the global model)."""

import math

import numpy as np
import pytest

from truth import least_squares, run_rounds, simulator, vec

LR, K = 0.1, 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(sizes=(20, 30, 24, 27, 15), clusters=[0, 1, 2, 3, 0])


def _rmse(p, i, w) -> float:
    return math.sqrt(p.loss(i, w))


def test_before_and_after_local_training_are_the_received_and_the_trained_models(problem):
    p = problem
    sim = simulator(p, "fedavg", steps=K, lr=LR, per_round=2, rounds=2, evaluation__when=["before", "after"])
    for r in range(2):
        w = vec(sim.method.global_model)
        sampled = sim.sample(r)
        before = [_rmse(p, i, w) for i in sampled]
        after = [_rmse(p, i, p.gd(i, w, K, LR)) for i in sampled]
        metrics = sim.run_round(evaluate=False)
        assert metrics["fit/clients"] == 2
        assert metrics["fit/before/test_rmse_mean"] == pytest.approx(np.mean(before), rel=1e-5)
        assert metrics["fit/after/test_rmse_mean"] == pytest.approx(np.mean(after), rel=1e-5)
        assert metrics["fit/after/test_loss_mean"] == pytest.approx(np.mean([a * a for a in after]), rel=1e-5)
        assert not np.isclose(np.mean(before), np.mean(after), rtol=1e-3)   # the wrong variant: after = before
    # nothing of this by default
    plain = simulator(p, "fedavg", steps=K, lr=LR, per_round=2)
    assert not any(k.startswith("fit/") for k in plain.run_round(evaluate=False))


def test_local_model_is_each_clients_last_trained_model(problem):
    p = problem
    sim = simulator(p, "fedavg", steps=K, lr=LR, per_round=2, rounds=2, evaluation__local_model=True)
    last: dict[int, np.ndarray] = {}
    for r in range(2):
        w = vec(sim.method.global_model)
        for i in sim.sample(r):
            last[i] = p.gd(i, w, K, LR)
        sim.run_round(evaluate=False)
    metrics = sim.evaluate(final=True)
    expected = np.mean([_rmse(p, i, wi) for i, wi in last.items()])   # over the clients that trained
    assert metrics["local/test_rmse"] == pytest.approx(expected, rel=1e-5)
    assert len(last) < p.m   # some never trained: averaging them in (as the initial model) is the wrong variant
    w0 = vec(sim.ctx.init_params())
    wrong = np.mean([_rmse(p, i, last.get(i, w0)) for i in range(p.m)])
    assert not np.isclose(metrics["local/test_rmse"], wrong, rtol=1e-3)


def test_server_test_is_the_global_model_on_the_pooled_test_splits(problem):
    p = problem
    sim = simulator(p, "fedavg", steps=K, lr=LR, evaluation__server_test=True)
    run_rounds(sim, 1)
    metrics = sim.evaluate(final=True)
    w = vec(sim.method.global_model)
    Z = np.vstack([p.design(i) for i in range(p.m)])
    y = np.concatenate(p.y)
    pooled = float(np.mean((Z @ w - y) ** 2))
    assert metrics["server/test_loss"] == pytest.approx(pooled, rel=1e-5)
    assert metrics["server/test_rmse"] == pytest.approx(math.sqrt(pooled), rel=1e-5)
    per_client = np.mean([p.loss(i, w) for i in range(p.m)])   # the wrong variant: a mean over clients
    assert not np.isclose(pooled, per_client, rtol=1e-3)
    assert "server/test_loss" not in simulator(p, "fedavg", steps=K, lr=LR).evaluate(final=True)


def test_trained_clients_are_reported_apart(problem):
    p = problem
    sim = simulator(p, "local", steps=K, lr=LR, per_round=2, evaluation__trained_apart=True)
    w0 = vec(sim.ctx.init_params())
    sampled = sim.sample(0)
    run_rounds(sim, 1)
    metrics = sim.evaluate(final=True)
    trained = [_rmse(p, i, p.gd(i, w0, K, LR)) for i in sampled]
    everyone = trained + [_rmse(p, i, w0) for i in range(p.m) if i not in sampled]
    assert metrics["test/trained/clients"] == 2
    assert metrics["test/trained/rmse_mean"] == pytest.approx(np.mean(trained), rel=1e-5)
    assert metrics["test/rmse_mean"] == pytest.approx(np.mean(everyone), rel=1e-5)
    assert not np.isclose(np.mean(trained), np.mean(everyone), rtol=1e-3)


@pytest.mark.parametrize("rule", ["method", "global"])
def test_what_an_untrained_client_is_evaluated_with(problem, rule):
    """Ditto declares "personal" (its untrained personal model, the initial one); ``global`` gives
    the never-sampled clients the global model they receive; trained clients keep their own."""
    p = problem
    sim = simulator(p, "ditto", steps=K, lr=LR, per_round=2, evaluation__untrained_model=rule)
    assert type(sim.method).untrained_model == "personal"
    w0 = vec(sim.ctx.init_params())
    sampled = sim.sample(0)
    run_rounds(sim, 1)
    sim.evaluate(final=True)
    glob = vec(sim.method.global_model)
    rows = {r["client"]: r for r in sim.last_client_table}
    for i in range(p.m):
        if i in sampled:
            assert not np.isclose(rows[i]["test_loss"], p.loss(i, glob), rtol=1e-4)   # its own personal model
        else:
            expected = p.loss(i, glob if rule == "global" else w0)
            wrong = p.loss(i, w0 if rule == "global" else glob)
            assert rows[i]["test_loss"] == pytest.approx(expected, rel=1e-5)
            assert not np.isclose(expected, wrong, rtol=1e-3)


@pytest.mark.parametrize("rule", ["personal", "global"])
def test_a_newcomer_its_join_trained_is_evaluated_with_what_it_trained(rule):
    """A Per-FedAvg newcomer fine-tunes K plain steps from the final global model when it joins: it
    has trained, so ``untrained_model: global`` does not replace its model (it did, before: the rule
    asked only which clients a training round had sampled)."""
    from pfl.federation.loop import RoundLoop

    p = least_squares(sizes=(20, 30, 24, 27, 22, 25))
    sim = simulator(p, "perfedavg", steps=K, lr=0.05, rounds=2, newcomers__fraction=0.17,
                    newcomers__finetune_rounds=1, evaluation__untrained_model=rule)
    for _ in range(2):
        sim.run_round(evaluate=False)
    final = vec(sim.method.global_model)
    RoundLoop(sim, []).run()
    (n,) = sim.ctx.newcomers
    row = next(r for r in sim.last_client_table if r["client"] == n)
    tuned = p.loss(n, p.gd(n, final, K, 0.05))
    assert row["test_loss"] == pytest.approx(tuned, rel=1e-5)
    assert not np.isclose(tuned, p.loss(n, final), rtol=1e-3)   # the global model's loss is another
    assert sim.join_trained == {n}
    # a checkpoint keeps it (implied when the join trained every newcomer: the state's layout is unchanged)
    state = sim.lineage_state()
    assert "trained" not in state["newcomers"]
    again = simulator(p, "perfedavg", steps=K, lr=0.05, rounds=2, newcomers__fraction=0.17,
                      newcomers__finetune_rounds=1, evaluation__untrained_model=rule)
    assert again.join_trained == set()
    again.load_lineage_state(state)
    assert again.join_trained == {n}


def test_bad_evaluation_settings_name_the_field_and_the_allowed_values():
    from helpers import small_config

    from pfl.schema import ConfigError

    with pytest.raises(ConfigError, match=r"evaluation\.when.*allowed.*before, after"):
        small_config(evaluation__when=["pre"])
    with pytest.raises(ConfigError, match=r"evaluation\.untrained_model.*method, personal, global"):
        small_config(evaluation__untrained_model="newest")
    with pytest.raises(ConfigError, match=r"evaluation\.when.*async"):
        small_config(method__name="fpfc", federation__driver="async", evaluation__when=["after"])


def test_the_catalog_lists_every_evaluation_metric_a_run_reports():
    from helpers import small_config

    from pfl.callbacks.divergence import run_rounds as loop_rounds
    from pfl.federation.simulator import Simulator
    from pfl.metric_catalog import metric_known, reported_metrics

    cfg = small_config(method__name="ditto", evaluation__when=["before", "after"], evaluation__local_model=True,
                       evaluation__server_test=True, evaluation__trained_apart=True,
                       federation__clients_per_round=2, federation__rounds=2)
    sim = Simulator(cfg)
    loop_rounds(sim)
    logged = {k for h in sim.history for k in h} - {"round", "step"}
    catalog = reported_metrics(cfg)
    assert [k for k in logged if not metric_known(k, catalog)] == []
    for name in ("fit/before/test_acc_mean", "fit/after/test_acc_mean", "local/test_acc", "server/test_acc",
                 "test/trained/acc_mean", "test/trained/clients"):
        assert name in logged and metric_known(name, catalog)
    default = reported_metrics(small_config(method__name="ditto"))
    assert not any(metric_known(n, default) for n in ("fit/before/test_acc_mean", "server/test_acc", "local/test_acc"))
    assert metric_known("test/trained/acc_mean", default)   # said apart by default, when some never trained


def test_never_trained_clients_are_said_apart_by_default_and_only_then(problem):
    """A default run where some evaluated clients never trained reports test/trained/* beside test/*;
    one where every client trained reports nothing new (its test/* is the trained clients')."""
    partial = simulator(p := problem, "local", steps=K, lr=LR, per_round=2)
    partial.run_round()
    metrics = partial.evaluate()
    assert metrics["test/trained/clients"] == 2 and "test/trained/rmse_mean" in metrics
    everyone = simulator(p, "local", steps=K, lr=LR, per_round=p.m)
    everyone.run_round()
    assert not any(k.startswith("test/trained/") for k in everyone.evaluate())
