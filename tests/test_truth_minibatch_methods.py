"""pFedMe and Per-FedAvg with minibatches, against truths written here in numpy (float64).

The full-batch updates are checked in tests/test_truth_personal.py. Here the clients draw
minibatches, so a test observes which samples each step was handed (the rows given to the inner
problem, the index batches D′, D″ given to the meta-gradient) and checks, independently of pfl:

* the batches themselves: their size, that the batches of one epoch partition the training set,
  that distinct steps and rounds use distinct batches, that the global torch RNG plays no part;
* the number of local iterations / meta-steps the spec's FedAvg minibatch budget gives;
* the parameters: pFedMe's inner steps θ ← θ − η_p(∇f(θ; ξ) + λ(θ − w) + μθ), the outer step
  w ← w − ηλ(w − θ), the server's β-mixing (β = 2) or median; Per-FedAvg's
  w ← w − β(g − αH g) with g = ∇f(w − α∇f(w; D); D′) and H the Hessian on D″, recomputed in numpy
  on the observed batches;
* BatchGradient's gradients and Hessian-vector products on a subset, with parameters the loss does
  not depend on (zeros).
"""

import math

import numpy as np
import pytest
import torch

from truth import close, least_squares, simulator, vec

SIZES = (20, 30, 24, 27)


@pytest.fixture(scope="module")
def problem():
    return least_squares(sizes=SIZES, clusters=[0, 1, 2, 3])


def _grad(p, i, w, idx=None):
    """∇ of mean((x̃·w − y)²) over the samples ``idx`` (all when None) of client i."""
    Z, y = p.design(i), p.y[i]
    if idx is not None:
        Z, y = Z[idx], y[idx]
    return 2.0 / len(Z) * Z.T @ (Z @ w - y)


def _hess(p, i, idx=None):
    Z = p.design(i) if idx is None else p.design(i)[idx]
    return 2.0 / len(Z) * Z.T @ Z


def _loss(p, i, w, idx=None):
    Z, y = p.design(i), p.y[i]
    if idx is not None:
        Z, y = Z[idx], y[idx]
    r = Z @ w - y
    return float(np.mean(r * r))


def _rows(p, i, xb):
    """The indices of the training rows of client i that ``xb`` holds (each row found exactly once)."""
    X = np.asarray(p.X[i], dtype=np.float32)
    xb = xb.detach().cpu().numpy()
    idx = []
    for r in xb:
        hit = np.nonzero(np.all(X == r, axis=1))[0]
        assert len(hit) == 1
        idx.append(int(hit[0]))
    return np.array(idx)


def _weights(p, clients):
    n = np.array([p.n(i) for i in clients], dtype=float)
    return n / n.sum()


# ---- pFedMe --------------------------------------------------------------------------------------

def _pfedme_spy(monkeypatch, p, calls):
    """Record, per client and round, the (x, y) of each inner problem (the minibatch ξ)."""
    from pfl.methods.base import ClientHandle

    orig = ClientHandle.train

    def spy(self, params, rnd, *, x=None, y=None, tag="train", **kw):
        assert x is not None and y is not None  # the inner problem runs on the drawn minibatch
        idx = _rows(p, self.cid, x)
        assert np.allclose(y.detach().cpu().numpy(), np.asarray(p.y[self.cid], dtype=np.float32)[idx])
        calls.setdefault((rnd, self.cid), []).append(idx)
        return orig(self, params, rnd, x=x, y=y, tag=tag, **kw)

    monkeypatch.setattr(ClientHandle, "train", spy)


def _pfedme_sim(p, batch, epochs, **kw):
    return simulator(p, "pfedme", steps=None, lr=0.2, federation__batch_size=batch,
                     federation__local_epochs=epochs, federation__momentum=0.9, **kw)


@pytest.mark.parametrize("batch, epochs", [(7, 2), (1, 1), (0, 2)])
def test_pfedme_minibatches_iterations_and_updates(problem, monkeypatch, batch, epochs):
    """R = epochs × ceil(n/b) minibatches (1 per epoch when full batch); each epoch's batches
    partition the training set; rounds differ; the parameters follow the pFedMe formulas on the
    observed batches (the inner problem is plain full-batch GD on ξ: no momentum, though the
    federation's is 0.9); the server mixes with β = 2; the round's loss is the mean over clients of
    the mean inner-step loss."""
    p = problem
    lam, eta, eta_p, inner, mu, beta = 3.0, 0.2, 0.05, 3, 1e-3, 2.0
    calls = {}
    _pfedme_spy(monkeypatch, p, calls)
    sim = _pfedme_sim(p, batch, epochs, method__lam=lam, method__personal_lr=eta_p, method__inner_steps=inner,
                      method__inner_weight_decay=mu, method__beta=beta, method__local_iters=0)
    theta = vec(sim.method.global_model)
    for r in range(2):
        loss = sim.run_round(evaluate=False)["train/loss"]
        batches_of = {}
        for i in range(p.m):
            n = p.n(i)
            per_epoch = 1 if batch <= 0 or batch >= n else math.ceil(n / batch)
            got = calls[(r, i)]  # one inner problem per minibatch
            assert len(got) == epochs * per_epoch
            for e in range(epochs):  # each epoch's batches partition the training set
                ep = got[e * per_epoch:(e + 1) * per_epoch]
                assert sorted(np.concatenate(ep).tolist()) == list(range(n))
                if per_epoch > 1:
                    assert all(len(b) == batch for b in ep[:-1])
            batches_of[i] = got
            if r == 1 and per_epoch > 1:  # a fresh draw each round
                assert any(not np.array_equal(a, b) for a, b in zip(got, calls[(0, i)]))
        ws, th_of, mean_loss = _pfedme_truth_round(p, theta, batches_of, lam, eta, eta_p, inner, mu)
        theta = (1 - beta) * theta + beta * sum(wt * w for wt, w in zip(_weights(p, range(p.m)), ws))
        assert close(vec(sim.method.global_model), theta, 1e-4)
        assert abs(loss - mean_loss) <= 1e-4 * max(1.0, abs(mean_loss))
    for i in range(p.m):
        assert close(vec(sim.personal_params(i)), th_of[i], 1e-4)


def _pfedme_truth_round(p, theta, batches_of, lam, eta, eta_p, inner, mu):
    ws, th_of, losses = [], {}, []
    for i in range(p.m):
        w, th = theta.copy(), theta.copy()
        steps_losses = []
        for idx in batches_of[i]:
            ls = []
            for _ in range(inner):
                ls.append(_loss(p, i, th, idx))
                th = th - eta_p * (_grad(p, i, th, idx) + lam * (th - w) + mu * th)
            steps_losses.append(np.mean(ls))
            w = w - eta * lam * (w - th)
        ws.append(w)
        th_of[i] = th
        losses.append(np.mean(steps_losses))
    return ws, th_of, float(np.mean(losses))


def test_pfedme_minibatches_come_from_the_seeded_client_stream(problem, monkeypatch):
    """Same config ⇒ the same minibatches and model, whatever the global torch RNG did before."""
    p = problem
    runs = []
    for seed in (1, 2):
        calls = {}
        monkeypatch.undo()
        _pfedme_spy(monkeypatch, p, calls)
        sim = _pfedme_sim(p, 7, 1, method__lam=3.0, method__personal_lr=0.05, method__inner_steps=2)
        torch.manual_seed(seed)
        sim.run_round(evaluate=False)
        runs.append((calls, vec(sim.method.global_model)))
    (c1, g1), (c2, g2) = runs
    assert c1.keys() == c2.keys()
    assert all(np.array_equal(a, b) for k in c1 for a, b in zip(c1[k], c2[k]))
    assert np.array_equal(g1, g2)


def test_pfedme_median_aggregation_of_the_returned_models(problem):
    """aggregator = median: θ ← (1 − β)θ + β·median_k w_k (coordinate-wise, numpy's even-count median)."""
    p = problem
    lam, eta, eta_p, inner, mu, beta, iters = 2.0, 0.2, 0.05, 4, 1e-3, 0.5, 2
    sim = simulator(p, "pfedme", steps=3, lr=eta, method__lam=lam, method__personal_lr=eta_p,
                    method__inner_steps=inner, method__inner_weight_decay=mu, method__beta=beta,
                    method__local_iters=iters, method__aggregator="median")
    theta = vec(sim.method.global_model)
    ws, _, _ = _pfedme_truth_round(p, theta, {i: [None] * iters for i in range(p.m)}, lam, eta, eta_p, inner, mu)
    sim.run_round(evaluate=False)
    expected = (1 - beta) * theta + beta * np.median(np.stack(ws), axis=0)
    assert close(vec(sim.method.global_model), expected, 1e-5)
    assert not close(expected, (1 - beta) * theta + beta * sum(w * q for w, q in zip(_weights(p, range(p.m)), ws)),
                     1e-3)


def test_pfedme_unsampled_client_is_evaluated_with_the_global_model(problem, monkeypatch):
    """Partial participation: a client that never trained has no personal θ; it uses the global model."""
    p = problem
    calls = {}
    _pfedme_spy(monkeypatch, p, calls)
    sim = simulator(p, "pfedme", steps=2, lr=0.2, per_round=2, method__lam=3.0, method__inner_steps=2)
    sim.run_round(evaluate=False)
    trained = {cid for (_, cid) in calls}
    assert len(trained) == 2
    glob = vec(sim.method.global_model)
    for i in set(range(p.m)) - trained:
        assert close(vec(sim.personal_params(i)), glob, 1e-7)
    for i in trained:
        assert not close(vec(sim.personal_params(i)), glob, 1e-3)


# ---- Per-FedAvg ----------------------------------------------------------------------------------

def _perfedavg_spy(monkeypatch, calls):
    """Record each meta-gradient call: (client size, w, ∇f(w; D), the index batches D′[, D″])."""
    import pfl.methods.perfedavg as pf

    orig = pf.meta_gradient

    def spy(grad_fn, w, grad_d, batches, *args, **kw):
        n = len(grad_fn.y)
        calls.setdefault(n, []).append((vec(w), vec(grad_d),
                                        [None if b is None else b.detach().cpu().numpy() for b in batches]))
        return orig(grad_fn, w, grad_d, batches, *args, **kw)

    monkeypatch.setattr(pf, "meta_gradient", spy)


def _perfedavg_sim(p, variant, batch, epochs, alpha, beta, delta=1e-2):
    return simulator(p, "perfedavg", steps=None, lr=0.3, federation__batch_size=batch,
                     federation__local_epochs=epochs, method__variant=variant, method__alpha=alpha,
                     method__beta=beta, method__delta=delta, method__steps=0)


def _meta(p, i, w, grad_d, batches, alpha, variant):
    g = _grad(p, i, w - alpha * grad_d, batches[0])
    if variant == "fo":
        return g
    return g - alpha * _hess(p, i, batches[1]) @ g


@pytest.mark.parametrize("variant, batch, epochs", [("fo", 7, 2), ("hf", 7, 3), ("exact", 5, 2), ("fo", 1, 1)])
def test_perfedavg_minibatch_meta_steps(problem, monkeypatch, variant, batch, epochs):
    """Steps = max(1, epochs·ceil(n/b) // (2 fo, 3 hf/exact)); each step gets fresh batches D′ (D″)
    of b distinct samples, none equal to another of the round, D′ ≠ D; w follows
    w ← w − β(g − αH_{D″}g), g = ∇f(w − α∇f(w; D); D′) on those batches; the server averages by
    samples; a second round draws other batches."""
    p, alpha, beta = problem, 0.1, 0.15
    per_step = 2 if variant == "fo" else 3
    tol = 1e-3 if variant == "hf" else 1e-4
    calls = {}
    _perfedavg_spy(monkeypatch, calls)
    sim = _perfedavg_sim(p, variant, batch, epochs, alpha, beta)
    theta = vec(sim.method.global_model)
    seen = {}
    for r in range(2):
        calls.clear()
        sim.run_round(evaluate=False)
        replies = []
        for i in range(p.m):
            n = p.n(i)
            got = calls[n]
            assert len(got) == max(1, epochs * math.ceil(n / batch) // per_step)
            drawn = []
            w = theta.copy()
            for k, (w_seen, grad_d, batches) in enumerate(got):
                assert len(batches) == per_step - 1
                for b in batches:
                    assert b is not None and len(b) == batch and len(set(b.tolist())) == batch
                    assert b.min() >= 0 and b.max() < n
                    drawn.append(tuple(sorted(b.tolist())))
                assert close(w_seen, w, tol)
                if batch > 1:  # D′ is not the loop's batch D
                    assert not close(grad_d, _grad(p, i, w, batches[0]), 1e-3)
                w = w - beta * _meta(p, i, w, grad_d, batches, alpha, variant)
            if batch > 1:
                assert len(set(drawn)) == len(drawn)  # distinct batches within the round
            if r == 1 and batch > 1:
                assert set(drawn) != seen[i]
            seen[i] = set(drawn)
            replies.append(w)
        theta = sum(wt * w for wt, w in zip(_weights(p, range(p.m)), replies))
        assert close(vec(sim.method.global_model), theta, tol)


def test_perfedavg_batches_come_from_the_seeded_client_stream(problem, monkeypatch):
    p = problem
    runs = []
    for seed in (1, 2):
        calls = {}
        monkeypatch.undo()
        _perfedavg_spy(monkeypatch, calls)
        sim = _perfedavg_sim(p, "hf", 7, 2, 0.1, 0.15)
        torch.manual_seed(seed)
        sim.run_round(evaluate=False)
        runs.append(calls)
    c1, c2 = runs
    assert c1.keys() == c2.keys()
    for n in c1:
        for (_, _, b1), (_, _, b2) in zip(c1[n], c2[n]):
            assert all(np.array_equal(x, y) for x, y in zip(b1, b2))


@pytest.mark.parametrize("variant, epochs", [("fo", 2), ("hf", 1), ("exact", 4)])
def test_perfedavg_full_batch_budget_and_round_loss(problem, variant, epochs):
    """Full batches, no local_steps: budget = epochs (one batch per epoch), steps = max(1, budget //
    batches per step); the round's loss is the mean over clients of the mean f(w) before each step."""
    p, alpha, beta = problem, 0.1, 0.15
    per_step = 2 if variant == "fo" else 3
    steps = max(1, epochs // per_step)
    sim = _perfedavg_sim(p, variant, 0, epochs, alpha, beta)
    theta = vec(sim.method.global_model)
    replies, losses = [], []
    for i in range(p.m):
        w, ls = theta.copy(), []
        for _ in range(steps):
            ls.append(_loss(p, i, w))
            w = w - beta * _meta(p, i, w, _grad(p, i, w), [None, None], alpha, variant)
        replies.append(w)
        losses.append(np.mean(ls))
    loss = sim.run_round(evaluate=False)["train/loss"]
    tol = 1e-3 if variant == "hf" else 1e-5
    assert close(vec(sim.method.global_model), sum(wt * w for wt, w in zip(_weights(p, range(p.m)), replies)), tol)
    assert abs(loss - np.mean(losses)) <= 1e-4 * max(1.0, abs(np.mean(losses)))


def test_perfedavg_unknown_variant_names_the_allowed_ones():
    from pfl.methods.perfedavg import meta_gradient

    w = {"a": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"unknown Per-FedAvg variant 'bogus'; allowed: fo, hf, exact"):
        meta_gradient(lambda params, batch: {"a": torch.ones(2)}, w, {"a": torch.ones(2)}, [None, None], 0.1,
                      "bogus", 1e-3)


class _Quantised(torch.nn.Module):
    """A linear model plus a rounded offset (zero gradient, and a gradient that depends on nothing)
    and a parameter the forward never reads."""

    def __init__(self, d):
        super().__init__()
        self.fc = torch.nn.Linear(d, 1)
        self.offset = torch.nn.Parameter(torch.tensor([0.3]))
        self.unused = torch.nn.Parameter(torch.ones(2))

    def forward(self, x):
        return self.fc(x) + torch.round(self.offset)


def test_batch_gradient_and_hvp_on_a_subset_with_constant_and_unused_parameters(problem):
    """∇ of the MSE on the samples idx only; 0 for a parameter the loss does not read; the
    Hessian-vector product H_idx v on the linear part, 0 for the offset whose gradient is constant."""
    from pfl.methods.perfedavg import BatchGradient

    p, i = problem, 1
    torch.manual_seed(0)
    model = _Quantised(p.dim - 1)
    x = torch.tensor(p.X[i], dtype=torch.float64)
    y = torch.tensor(p.y[i], dtype=torch.float64)
    model = model.double()
    bg = BatchGradient(model, x, y, "regression")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    w = np.concatenate([params["fc.weight"].numpy().ravel(), params["fc.bias"].numpy()])
    idx = torch.tensor([3, 0, 11, 7, 25, 14])
    # the offset rounds to 0, so the model is linear in [weight, bias]
    g = bg(params, idx)
    expected = _grad(p, i, w, idx.numpy())
    assert g["unused"] is not None and torch.equal(g["unused"], torch.zeros(2, dtype=torch.float64))
    assert close(vec(g), expected, 1e-10)
    assert not close(expected, _grad(p, i, w), 1e-3)
    v = {"fc.weight": torch.tensor([[0.5, -1.0]], dtype=torch.float64), "fc.bias": torch.tensor([2.0], dtype=torch.float64),
         "offset": torch.tensor([1.5], dtype=torch.float64), "unused": torch.ones(2, dtype=torch.float64)}
    params_used = {k: t for k, t in params.items() if k != "unused"}
    bg_used = BatchGradient(model, x, y, "regression")
    h = bg_used.hvp(params_used, v, idx)
    assert h["offset"] is not None and torch.equal(h["offset"], torch.zeros(1, dtype=torch.float64))
    assert close(vec(h), _hess(p, i, idx.numpy()) @ np.array([0.5, -1.0, 2.0]), 1e-10)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_pfedme_plain_average_keeps_the_integer_batch_counter():
    """β = 1 is plain averaging: the server's model is the clients' average, entry by entry, so a
    BatchNorm model's integer batch counter stays an integer (a float mix (1−β)θ + β·avg would not)."""
    from helpers import method_config
    from pfl.federation.simulator import Simulator

    cfg = method_config("pfedme", model__name="cnn_bn", model__params={"channels": [4, 8], "hidden": 16},
                        data__num_clients=2, federation__clients_per_round=2, federation__batch_size=8,
                        federation__rounds=1, federation__local_steps=1, federation__threads=1,
                        federation__cohort="sequential", method__inner_steps=1, method__beta=1.0)
    sim = Simulator(cfg)
    before = {k: v.dtype for k, v in sim.method.global_model.items()}
    sim.run_round(evaluate=False)
    counters = [k for k in before if k.endswith("num_batches_tracked")]
    assert counters
    for k, dt in before.items():
        assert sim.method.global_model[k].dtype == dt
