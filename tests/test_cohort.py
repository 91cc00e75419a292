"""Vectorized cohorts compute what sequential clients compute (up to float rounding)."""

import math

import pytest
import torch

from helpers import matrix, method_config, method_names, small_config
from pfl.callbacks.divergence import run_rounds
from pfl.federation.batched import train_cohort
from pfl.federation.cohort import Cohort
from pfl.federation.simulator import Simulator
from pfl.methods import get_method
from pfl.training import ClipNorm, PullTo, Shift, SoftThreshold, Terms, TrainCall, local_sgd

#: compression at the delivery boundary around a batched cohort (client memories, replicas)
COMPRESSED = {"compression__uplink": {"name": "topk", "ratio": 0.1}, "compression__error_feedback": True,
              "compression__downlink": {"name": "fp16"}}
VECTORIZED = method_names(cohort="vectorized") + ["fedavg+ala", "ditto+ala", "fedavg~compressed"]
FAST = ("fedavg", "scaffold", "fpfc", "fedavg~compressed")


def _close(a: float, b: float, tol: float = 1e-4) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return abs(a - b) <= tol * max(1.0, abs(a))


@pytest.mark.parametrize("name", matrix(VECTORIZED, FAST))
def test_vectorized_cohort_matches_sequential_clients(name):
    method, _, variant = name.partition("~")
    kw = dict(federation__rounds=3, federation__momentum=0.5, **(COMPRESSED if variant else {}))
    seq = Simulator(method_config(method, federation__cohort="sequential", **kw))
    vec = Simulator(method_config(method, federation__cohort="vectorized", **kw))
    assert not seq.vectorized and vec.vectorized
    run_rounds(seq)
    run_rounds(vec)
    for a, b in zip(seq.history, vec.history):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if "time" not in key:
                assert _close(value, b[key]), (name, a["round"], key, value, b[key])
    assert seq.ledger.state_dict() == vec.ledger.state_dict()


def test_auto_cohort_follows_the_method_and_the_device():
    auto = Simulator(small_config(method__name="fedavg"))
    assert auto.vectorized == (auto.device.type == "cuda")
    assert get_method("perfedavg").cohort == "sequential"
    fallback = Simulator(small_config(method__name="perfedavg"))
    assert not fallback.vectorized
    forced = Simulator(small_config(method__name="fedavg", federation__cohort="vectorized"))
    assert forced.vectorized
    plain = Simulator(small_config(method__name="fedavg", federation__cohort="sequential"))
    assert not plain.vectorized


def test_batched_steps_equal_one_client_loops_with_hooks_masks_and_unequal_sizes():
    """Clients of different sizes (padding, fewer steps), momentum, weight decay and every kind of
    term: each client's result equals its own local_sgd."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    calls = []
    for i, n in enumerate((3, 17, 40, 9)):
        x, y = torch.randn(n, 5), torch.randint(0, 3, (n,))
        anchor = {k: v + 0.1 * i for k, v in base.items()}
        hook = Terms([PullTo(anchor, 0.3), Shift({k: torch.full_like(v, 0.01 * i) for k, v in base.items()}),
                      ClipNorm(2.0)])
        kwargs = dict(lr=0.05, epochs=2, steps=None, batch_size=8, momentum=0.9, weight_decay=1e-3,
                      task="classification", generator=torch.Generator().manual_seed(i), grad_hook=hook,
                      post_step=SoftThreshold(1e-3))
        calls.append(TrainCall(model, {k: v + 0.01 * i for k, v in base.items()}, x, y, kwargs))
    batched = train_cohort(calls)
    for i, (call, got) in enumerate(zip(calls, batched)):
        kwargs = dict(call.kwargs, generator=torch.Generator().manual_seed(i))
        want = local_sgd(call.model, call.params, call.x, call.y, **kwargs)
        assert got.steps == want.steps
        assert _close(got.mean_loss, want.mean_loss, 1e-5)
        for k in want.params:
            torch.testing.assert_close(got.params[k], want.params[k], rtol=1e-5, atol=1e-6)


def test_full_batch_groups_are_bucketed_and_exact():
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    calls = [TrainCall(model, dict(base), torch.randn(n, 4), torch.randint(0, 3, (n,)),
                       dict(lr=0.1, epochs=1, steps=5, batch_size=0, task="classification", generator=None))
             for n in (5, 6, 200, 210, 1000)]
    for call, got in zip(calls, train_cohort(calls)):
        want = local_sgd(call.model, call.params, call.x, call.y, **call.kwargs)
        for k in want.params:
            torch.testing.assert_close(got.params[k], want.params[k], rtol=1e-5, atol=1e-6)


def test_closure_hooks_run_alone_and_steps_resume_in_order():
    model = torch.nn.Linear(3, 2)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    seen = []

    def step(compute, i):
        x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
        kw = dict(lr=0.1, epochs=1, steps=2, batch_size=0, task="classification")
        first = compute.train(TrainCall(model, params, x, y, dict(kw, grad_hook=lambda g, p: g)))
        seen.append(i)
        second = compute.train(TrainCall(model, first.params, x, y, dict(kw, steps=1)))
        return second.steps

    cohort = Cohort()
    assert cohort.run({7: lambda c: step(c, 0), 3: lambda c: step(c, 1)}) == {7: 1, 3: 1}
    assert seen == [0, 1]
    assert cohort.stats["train_alone"] == 2 and cohort.stats["train_batched"] == 2
    assert cohort.take_sequential() == {7, 3} and cohort.take_sequential() == set()


def test_a_cohort_that_cannot_batch_says_so_once(caplog):
    model = torch.nn.Linear(3, 2)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    closure = TrainCall(model, params, x, y, dict(lr=0.1, steps=1, batch_size=0, grad_hook=lambda g, p: g))
    declared = Cohort(vectorizable=True, method="m")
    with caplog.at_level("WARNING", logger="pfl.federation.cohort"):
        declared.run({0: lambda c: c.train(closure), 1: lambda c: c.train(closure)})
        declared.run({2: lambda c: c.train(closure)})
    assert declared.take_sequential() == {0, 1, 2}
    assert len(caplog.records) == 1 and "method m declares cohort='vectorized'" in caplog.records[0].message
    caplog.clear()
    undeclared = Cohort(vectorizable=False)
    with caplog.at_level("WARNING", logger="pfl.federation.cohort"):
        undeclared.run({0: lambda c: c.train(closure)})
    assert undeclared.take_sequential() == {0} and not caplog.records


def test_clients_a_batched_cohort_runs_alone_are_counted_in_the_round_metrics():
    # Per-FedAvg's extra minibatch steps are closures: forced into a batched cohort, every sampled
    # client's training runs alone (its evaluation is batched)
    sim = Simulator(small_config(method__name="perfedavg", federation__cohort="vectorized", federation__rounds=2))
    run_rounds(sim)
    assert [row.get("cohort/sequential_clients") for row in sim.history] == [5.0, 5.0]
    plain = Simulator(small_config(method__name="fedavg", federation__cohort="vectorized", federation__rounds=1))
    assert "cohort/sequential_clients" not in run_rounds(plain)[-1]
