"""Vectorized cohorts compute what sequential clients compute (up to float rounding)."""

import math

import pytest
import torch

from helpers import small_config
from pfl.federation.cohort import Cohort, TrainCall, train_cohort
from pfl.federation.simulator import Simulator
from pfl.methods import get_method, list_methods
from pfl.training import ClipNorm, PullTo, Shift, SoftThreshold, Terms, local_sgd

SMALL_ARCHS = [{"name": "mlp", "params": {"hidden": [16]}}, "cnn_fpfc"]
SETTINGS = {
    "cfl": {"method__start_round": 1, "method__eps1": 100.0, "method__eps2": 0.0},
    "fedslr": {"method__lam": 1e-2},
    "perfed_ckt": {"method__architectures": SMALL_ARCHS, "method__public_size": 40},
    "lgfedavg": {"method__warmup_rounds": 1},
    "feddyn": {"method__max_grad_norm": 5.0},
    # every client in every round
    "fedpd": {"federation__clients_per_round": 0},
    "adiana": {"federation__clients_per_round": 0},
    "marina": {"federation__clients_per_round": 0},
    # compression at the delivery boundary around a batched cohort (client memories, replicas)
    "fedavg~compressed": {"compression__uplink": {"name": "topk", "ratio": 0.1},
                          "compression__error_feedback": True,
                          "compression__downlink": {"name": "fp16"}},
}
VECTORIZED = sorted(m.name for m in list_methods() if m.cohort == "vectorized") + ["fedavg+ala", "ditto+ala",
                                                                                          "fedavg~compressed"]


def _close(a: float, b: float, tol: float = 1e-4) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return abs(a - b) <= tol * max(1.0, abs(a))


@pytest.mark.parametrize("name", VECTORIZED)
def test_vectorized_cohort_matches_sequential_clients(name):
    kw = dict(method__name=name.split("~")[0], federation__rounds=3, federation__momentum=0.5,
              **SETTINGS.get(name, SETTINGS.get(name.split("+")[0], {})))
    seq = Simulator(small_config(federation__cohort="sequential", **kw))
    vec = Simulator(small_config(federation__cohort="vectorized", **kw))
    assert not seq.vectorized and vec.vectorized
    seq.run()
    vec.run()
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

    class Handle:  # the two entry points a cohort redirects
        run_training = None
        run_evaluation = None

    handles = [Handle(), Handle()]

    def step(h, i):
        x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
        first = h.run_training(model, params, x, y, lr=0.1, epochs=1, steps=2, batch_size=0,
                               task="classification", grad_hook=lambda g, p: g)
        seen.append(i)
        second = h.run_training(model, first.params, x, y, lr=0.1, epochs=1, steps=1, batch_size=0,
                                task="classification")
        return second.steps

    cohort = Cohort()
    assert cohort.run(handles, [lambda: step(handles[0], 0), lambda: step(handles[1], 1)]) == [1, 1]
    assert seen == [0, 1]
    assert cohort.stats["train_alone"] == 2 and cohort.stats["train_batched"] == 2
