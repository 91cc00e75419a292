"""The method authors' guide (docs/design.md §16) is true: its FedNova runs as written.

The code block is read from the document, registered for the test and removed afterwards. FedNova
with equal local steps is FedAvg (its update algebra collapses: x − τ Σ p_i (x − y_i)/τ = Σ p_i y_i);
with unequal steps its server step is checked against the formula computed by hand from every
client's own local SGD; it resumes exactly and its batched cohort matches the sequential one.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

from helpers import small_config, straight_and_resumed
from pfl.callbacks.divergence import run_rounds
from pfl.federation.simulator import Simulator
from pfl.methods import METHODS
from pfl.training import local_sgd

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


@pytest.fixture(scope="module")
def fednova():
    text = DESIGN.read_text()
    section = text[text.index("## 16."):]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    code = next(b for b in blocks if "class FedNova" in b)
    assert len(code.strip().splitlines()) <= 60, "the worked example is meant to stay about 50 lines"
    module = types.ModuleType("fednova_from_design_doc")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    # pfl registers its own FedNova (pfl/methods/fednova.py) under the doc's name: the doc's class
    # stands in for it during these tests, and the registry is put back as it was afterwards
    registered = METHODS.snapshot()
    METHODS.remove("fednova")
    try:
        exec(compile(code, str(DESIGN), "exec"), module.__dict__)
        yield module.FedNova
    finally:
        METHODS.restore(registered)
        del sys.modules[module.__name__]


def _config(**extra):
    return small_config(method__name="fednova", **extra)


def test_with_equal_local_steps_fednova_is_fedavg(fednova):
    equal = dict(federation__local_steps=3, federation__batch_size=0, federation__rounds=3)
    nova, avg = Simulator(_config(**equal)), Simulator(small_config(method__name="fedavg", **equal))
    run_rounds(nova)
    run_rounds(avg)
    for k, v in avg.method.global_model.items():
        torch.testing.assert_close(nova.method.global_model[k], v, rtol=1e-5, atol=1e-6)
    assert nova.history[-1]["fednova/tau_eff"] == 3.0


def test_with_unequal_local_steps_the_server_step_is_the_normalised_average(fednova):
    sim = Simulator(_config(federation__rounds=1, federation__clients_per_round=4, federation__batch_size=16,
                            method__server_lr=0.7))
    x = {k: v.clone() for k, v in sim.method.global_model.items()}
    sampled = sim.sample(0)
    fed = sim.cfg.federation
    trained, n = {}, {}
    for cid in sampled:                       # each client's local SGD, run on its own
        client = sim.client(cid)
        res = local_sgd(sim.ctx.model, x, client.data.x_train, client.data.y_train, lr=sim.ctx.lr(0),
                        epochs=fed.local_epochs, batch_size=fed.batch_size, generator=client.generator(0))
        trained[cid], n[cid] = res, client.n_train
    taus = {c: trained[c].steps for c in sampled}
    assert len(set(taus.values())) > 1, "the test needs clients with different numbers of steps"
    total = sum(n.values())
    tau_eff = sum(n[c] * taus[c] for c in sampled) / total
    run_rounds(sim)
    for k in x:
        d = sum(n[c] / total * (x[k] - trained[c].params[k]) / taus[c] for c in sampled)
        torch.testing.assert_close(sim.method.global_model[k], x[k] - 0.7 * tau_eff * d, rtol=1e-5, atol=1e-6)
    assert sim.history[-1]["fednova/tau_eff"] == pytest.approx(tau_eff)


def test_fednova_resumes_exactly_and_batches_like_the_sequential_cohort(fednova, tmp_path):
    straight, resumed = straight_and_resumed(_config(federation__rounds=3), tmp_path)
    assert [r["test/acc_mean"] for r in resumed.history] == [r["test/acc_mean"] for r in straight.history]
    seq = Simulator(_config(federation__cohort="sequential"))
    vec = Simulator(_config(federation__cohort="vectorized"))
    run_rounds(seq)
    run_rounds(vec)
    assert "cohort/sequential_clients" not in vec.history[-1]   # its requests were batched
    for k, v in seq.method.global_model.items():
        torch.testing.assert_close(vec.method.global_model[k], v, rtol=1e-4, atol=1e-5)
