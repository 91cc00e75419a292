"""Reference rows against truths computed another way (tests/truth.py): ``centralized``.

``centralized`` trains one model on the members' pooled training data with the budget in samples
the federated round would process (pfl/methods/centralized.py). The expected models are written
here in numpy: full-batch gradient steps on the pooled least-squares objective, and minibatch SGD
over the pool's shuffled passes; the only things read from the simulator are its inputs (the data,
the seeded initial model, the round's sample and the round's seeded generator). Each test also
shows that its truth separates a plausible wrong variant: training on one client's data, or
spending another budget (K steps a round whoever was sampled; every client's samples a round).
"""

import math

import numpy as np
import pytest

from truth import close, least_squares, run_rounds, simulator, vec

LR, K = 0.1, 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(clusters=[0, 1, 2, 3])  # every client its own β: the pool is not any client


def _pooled(p, clients=None):
    clients = range(p.m) if clients is None else clients
    return np.vstack([p.design(i) for i in clients]), np.concatenate([p.y[i] for i in clients])


def _gd(Z, y, w, steps, lr):
    """``steps`` full-batch steps on mean((Zw − y)²)."""
    for _ in range(steps):
        w = w - lr * (2.0 / len(y)) * Z.T @ (Z @ w - y)
    return w


def test_centralized_full_batch_is_gd_on_the_pooled_objective_with_the_federated_budget(problem):
    p = problem
    Z, y = _pooled(p)
    N = len(y)
    sim = simulator(p, "centralized", steps=K, lr=LR, per_round=2, rounds=3)
    w = vec(sim.method.global_model)
    wrong_one_client, wrong_k_steps = w.copy(), w.copy()
    budget = 0
    for r in range(3):
        sampled = sim.sample(r)
        # the federated round: K full-batch steps on each sampled client's n_i samples
        samples = K * sum(p.n(i) for i in sampled)
        budget += samples
        steps = math.ceil(samples / N)   # full-pool steps that cover that many samples
        w = _gd(Z, y, w, steps, LR)
        wrong_one_client = _gd(p.design(0), p.y[0], wrong_one_client, steps, LR)
        wrong_k_steps = _gd(Z, y, wrong_k_steps, K, LR)
        sim.run_round(evaluate=False)
        assert close(vec(sim.method.global_model), w)
        assert sim.history[-1]["centralized/budget"] == budget
    # the truths tell the right model from the wrong variants
    assert not close(w, wrong_one_client, 1e-3)
    assert not close(w, wrong_k_steps, 1e-3)
    # nothing was sent, training or evaluation
    metrics = sim.evaluate(final=True)
    assert all(v == 0 for k, v in sim.ledger.metrics().items())
    # evaluated as a global model on every client's test split: its RMSE per client, averaged
    rmse = np.mean([math.sqrt(p.loss(i, vec(sim.method.global_model))) for i in range(p.m)])
    assert metrics["test/rmse_mean"] == pytest.approx(rmse, rel=1e-5)
    assert metrics["global/test_rmse"] == pytest.approx(rmse, rel=1e-5)


def _sgd_pool(Z, y, w, steps, lr, batch, generator):
    """Minibatch SGD over shuffled passes of the pool, written without pfl's loop: ``steps`` slices
    of ``batch`` rows of each pass's permutation (a pass's last slice may be shorter)."""
    import torch

    n, done = len(y), 0
    while done < steps:
        perm = torch.randperm(n, generator=generator).numpy()
        for start in range(0, n, batch):
            if done >= steps:
                break
            idx = perm[start:start + batch]
            w = w - lr * (2.0 / len(idx)) * Z[idx].T @ (Z[idx] @ w - y[idx])
            done += 1
    return w


def test_centralized_minibatches_spend_epochs_times_the_sampled_clients_samples(problem):
    p = problem
    Z, y = _pooled(p)
    B, E = 8, 2
    sim = simulator(p, "centralized", lr=0.05, per_round=3, rounds=2, federation__batch_size=B,
                    federation__local_steps=None, federation__local_epochs=E)
    w = vec(sim.method.global_model)
    wrong_all = w.copy()
    seen = 0
    for r in range(2):
        samples = E * sum(p.n(i) for i in sim.sample(r))   # epochs × the sampled clients' samples
        steps = math.ceil(samples / B)
        w = _sgd_pool(Z, y, w, steps, 0.05, B, sim.ctx.generator(r, "centralized"))
        # the wrong budget: every client's samples every round, whoever the round sampled
        wrong_all = _sgd_pool(Z, y, wrong_all, math.ceil(E * len(y) / B), 0.05, B, sim.ctx.generator(r, "centralized"))
        passes, rest = divmod(steps, math.ceil(len(y) / B))
        seen += passes * len(y) + rest * B
        sim.run_round(evaluate=False)
        assert close(vec(sim.method.global_model), w, 1e-4)
        assert sim.history[-1]["centralized/samples"] == seen
    assert not close(w, wrong_all, 1e-3)


def test_centralized_round_samples_follow_the_shared_loop():
    """The federated count per client is what pfl.training.batches yields, for every schedule."""
    import torch

    from pfl.methods.centralized import pool_steps, round_samples
    from pfl.training import batches
    from truth import config

    for steps, batch, epochs, n in [(None, 8, 2, 21), (5, 8, 1, 21), (7, 8, 1, 21), (3, 0, 1, 21), (3, 40, 1, 21),
                                    (None, 0, 3, 10), (4, 5, 1, 0)]:
        fed = config("centralized", 4, steps=steps, federation__batch_size=batch,
                     federation__local_epochs=epochs).federation
        x = torch.zeros(n, 1)
        expected = sum(len(yb) for _, yb in batches(x, torch.zeros(n), batch, epochs, steps, torch.Generator()))
        assert round_samples(n, fed) == expected, (steps, batch, epochs, n)
    for budget, pool, batch in [(171, 101, 0), (171, 101, 8), (50, 101, 200), (0, 101, 8)]:
        steps, seen = pool_steps(budget, pool, batch)
        x = torch.zeros(pool, 1)
        fed_batches = list(batches(x, torch.zeros(pool), batch, 1, steps, torch.Generator())) if steps else []
        assert (len(fed_batches), sum(len(yb) for _, yb in fed_batches)) == (steps, seen)
        assert seen >= budget or batch > 0  # full-pool steps never fall short


def test_centralized_is_a_row_of_any_comparison_and_refuses_what_it_cannot_be(tmp_path):
    """A method name like any other: a digits run with the default model, resumable, MLflow-logged
    with zero communication; attacks and the asynchronous driver are refused by name."""
    from helpers import small_config

    from pfl.callbacks.divergence import run_rounds as loop_rounds
    from pfl.federation.simulator import Simulator
    from pfl.schema import ConfigError

    sim = Simulator(small_config(method__name="centralized", federation__rounds=2))
    loop_rounds(sim)
    final = sim.history[-1]
    assert final["test/acc_mean"] > 0.3 and final["comm/total_bytes"] == 0 and final["comm/eval_down_bytes"] == 0
    assert final["global/test_acc"] == final["test/acc_mean"]
    with pytest.raises(ConfigError, match="attack"):
        small_config(method__name="centralized", attack__kind="sign_flip", attack__fraction=0.2)
    with pytest.raises(ConfigError, match="driver"):
        small_config(method__name="centralized", federation__driver="async")


def test_centralized_resumes_exactly():
    from helpers import small_config

    from pfl.federation.simulator import Simulator

    cfg = small_config(method__name="centralized", federation__rounds=3)
    straight = Simulator(cfg)
    run_rounds(straight, 3)
    first = Simulator(cfg)
    run_rounds(first, 1)
    snap = first.snapshot()
    resumed = Simulator(cfg)
    resumed.restore(snap)
    run_rounds(resumed, 2)
    for k, v in straight.method.global_model.items():
        assert (resumed.method.global_model[k] == v).all()


def test_centralized_search_space_loads_and_checks():
    from pathlib import Path

    from pfl.tune.space import base_config, check_space, load_space

    space = load_space(Path(__file__).resolve().parents[1] / "search_spaces" / "centralized.yaml")
    for smoke in (False, True):
        check_space(space, base_config(space, smoke=smoke))
    assert space.fixed["method.name"] == "centralized"
