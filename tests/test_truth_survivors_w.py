"""Survivors of Ditto (``local_update``, ``personal_kwargs``), FedAvgFT (``personal_params``),
FedBABU (``finetuned``) and FedNova (``update_weight``, ``setup``, ``local_update``, ``aggregate``,
``extra_metrics``). The truths: each method's round or fine-tuning written again in numpy with
minibatches, whose order is the client's own draw (``torch.randperm`` on the generator of
(seed, round, client, tag): ``"train"`` for training, ``"personal"`` for Ditto's personal task,
``"finetune"`` for FedAvgFT's and FedBABU's fine-tuning, as FedBABU's docstring says); a reported
loss as the mean of the batch losses at each step's start; Ditto under an identity uplink (its model
must name the downlink part it was trained from) with the personal task's mean loss kept in
``client.state["personal_loss"]``; FedNova with rand-k on the uplink (entries drawn from the key
(seed, round, client, "compress", "up", "d/<tensor>"), scaled by d/k), uniform weighting, a proximal
pull with ημ > 1 (so ‖a_i‖₁ < 1, the paper's closed form [1 − (1 − ημ)^τ]/(ημ)) and
``fednova/tau_eff`` = Σ p_i ‖a_i‖₁ (0 before any round: an empty sum); ``update_weight`` of no step
is +0 whatever the lr."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from test_truth_new_methods import BODY, HEAD, _sim, backprop, ce_dz, logits
from truth import classification_data, close, least_squares, numpy_params, simulator, vec

LR, BATCH = 0.05, 8


def perms(gen: torch.Generator, n: int, batch: int, total: int) -> list[np.ndarray]:
    """The rows of each of ``total`` minibatch steps: slices of one fresh permutation per epoch."""
    out: list[np.ndarray] = []
    while len(out) < total:
        perm = torch.randperm(n, generator=gen).numpy()
        out.extend(perm[s:s + batch] for s in range(0, n, batch))
    return out[:total]


def ls_sgd(p, i, w, rows_list, lr, pull=None):
    """Least-squares minibatch SGD on client i (+ pull (μ, anchor)); the model and the mean batch loss."""
    Z, y = p.design(i), p.y[i]
    w = np.array(w, dtype=float)
    losses = []
    for rows in rows_list:
        r = Z[rows] @ w - y[rows]
        losses.append(float(np.mean(r * r)))
        g = 2.0 / len(rows) * Z[rows].T @ r
        if pull is not None:
            g = g + pull[0] * (w - pull[1])
        w = w - lr * g
    return w, float(np.mean(losses))


# ---- Ditto ----------------------------------------------------------------------------------------

def test_ditto_round_with_minibatches_an_identity_uplink_and_the_personal_tasks_loss():
    """Round 0 by hand: the global task (3 minibatch steps on the "train" stream) averaged by samples;
    the personal task (one epoch on the "personal" stream, from θ⁰ with the pull λ(v − θ⁰)) kept as
    v_k with its mean batch loss; ``train/loss`` the mean of the global tasks' mean losses."""
    p, lam, steps = least_squares(), 0.5, 3
    sim = simulator(p, "ditto", steps=steps, lr=LR, method__lam=lam, federation__batch_size=BATCH,
                    compression__uplink__name="identity", compression__min_numel=1)
    x0 = vec(sim.method.global_model)
    assert close(vec(sim.method.init), x0)
    trained, losses, personal = [], [], {}
    for i in range(p.m):
        c = sim.client(i)
        w, loss = ls_sgd(p, i, x0, perms(c.generator(0), p.n(i), BATCH, steps), LR)
        trained.append(w)
        losses.append(loss)
        epoch = perms(c.generator(0, "personal"), p.n(i), BATCH, math.ceil(p.n(i) / BATCH))
        personal[i] = ls_sgd(p, i, x0, epoch, LR, pull=(lam, x0))
    sizes = np.array([p.n(i) for i in range(p.m)], dtype=float)
    metrics = sim.run_round(evaluate=False)
    assert close(vec(sim.method.global_model), sum(s * w for s, w in zip(sizes, trained)) / sizes.sum())
    assert metrics["train/loss"] == pytest.approx(float(np.mean(losses)), rel=1e-5)
    for i in range(p.m):
        state = sim.client(i).state
        assert close(vec(state["personal"]), personal[i][0])
        assert state["personal_loss"] == pytest.approx(personal[i][1], rel=1e-5)


# ---- FedAvgFT -------------------------------------------------------------------------------------

def test_fedavg_ft_fine_tunes_on_minibatches_of_the_finetune_stream():
    """Fine-tuning: ft_epochs epochs of minibatch SGD from the global model, the order drawn from the
    client's "finetune" stream of the evaluated round."""
    p, ft = least_squares(), 2
    sim = simulator(p, "fedavg_ft", steps=2, lr=LR, method__ft_epochs=ft, federation__batch_size=BATCH)
    sim.run_round(evaluate=False)
    glob = vec(sim.method.global_model)
    for cid in (0, 1):
        rows = perms(sim.client(cid).generator(0, "finetune"), p.n(cid), BATCH, ft * math.ceil(p.n(cid) / BATCH))
        want, _ = ls_sgd(p, cid, glob, rows, LR)
        assert close(vec(sim.personal_params(cid)), want)


# ---- FedBABU --------------------------------------------------------------------------------------

def mlp_sgd(q, X, y, rows_list, names, lr):
    for rows in rows_list:
        g = backprop(q, X[rows], ce_dz(logits(q, X[rows]), y[rows]))
        q = {k: (v - lr * g[k] if k in names else v) for k, v in q.items()}
    return q


@pytest.mark.parametrize("part, ft, ft_lr", [("body", 1, 0.0), ("full", 1, 0.7), ("head", 2, 0.4)])
def test_fedbabu_fine_tunes_the_part_on_minibatches_of_the_finetune_stream(part, ft, ft_lr):
    """The personal model: ``finetune_epochs`` epochs (one too) of minibatch SGD on ``finetune_part``
    at ``finetune_lr`` (0: the client lr), from the model the evaluation received, in the order of the
    client's "finetune" stream."""
    data, arrays = classification_data()
    batch = 4
    sim = _sim(data, "fedbabu", method__finetune_epochs=ft, method__finetune_part=part,
               method__finetune_lr=ft_lr, federation__batch_size=batch)
    sim.run_round(evaluate=False)
    names = {"full": BODY + HEAD, "head": HEAD, "body": BODY}[part]
    lr = ft_lr or sim.ctx.lr(0)
    for i in (0, 2):
        X, y = arrays[i]
        plan = sim.client_role.eval_plan(0, sim.client(i), sim.method.eval_message(0, i))
        start = numpy_params(plan.global_model)
        rows = perms(sim.client(i).generator(0, "finetune"), len(y), batch, ft * math.ceil(len(y) / batch))
        want = mlp_sgd(start, X, y, rows, names, lr)
        got = numpy_params(plan.personal)
        for k in BODY + HEAD:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5)
        assert max(float(np.max(np.abs(want[k] - start[k]))) for k in names) > 1e-3


# ---- FedNova --------------------------------------------------------------------------------------

def test_update_weight_of_no_step_is_positive_zero_whatever_the_lr():
    """No local step: the update weighs nothing, +0 (and no division by a zero lr)."""
    from pfl.methods.fednova import update_weight

    for lr in (0.1, 0.0):
        a = update_weight(0, lr, momentum=0.5, mu=1.0)
        assert a == 0.0 and math.copysign(1.0, a) == 1.0


def test_fednova_tau_eff_is_zero_before_any_round():
    """τ_eff = Σ_i p_i ‖a_i‖₁ over no replies yet: the empty sum 0."""
    p = least_squares()
    sim = simulator(p, "fednova", steps=2, lr=LR)
    metrics = sim.evaluate()
    assert metrics["fednova/tau_eff"] == 0.0


def test_fednova_rand_k_uplink_uniform_weights_and_a_strong_pull():
    """A round by hand: minibatch local SGD with the pull μ(w − x) (ημ = 1.5, so ‖a_i‖₁ =
    [1 − (1 − ημ)^τ_i]/(ημ) < 1 and unequal τ_i), d_i = (x − y_i)/‖a_i‖₁ sent through rand-k 50 %
    (d = 4 weights: 2 kept, scaled by 2, drawn from the key "d/fc.weight"; the bias whole), uniform
    p_i = 1/m, x ← x − η_g τ_eff mean_i C(d_i); ``fednova/tau_eff`` = mean ‖a_i‖₁ and ``train/loss``
    the mean of the clients' mean batch losses."""
    from pfl.federation.context import derive_seed

    p, mu, eta_g = least_squares(d=4), 15.0, 0.8
    lr = 0.1
    sim = simulator(p, "fednova", lr=lr, steps=0, federation__local_steps=None, federation__local_epochs=1,
                    federation__batch_size=BATCH, method__mu=mu, method__server_lr=eta_g,
                    method__weighting="uniform", compression__uplink__name="randk",
                    compression__uplink__ratio=0.5, compression__min_numel=1)
    x = vec(sim.method.global_model)
    sent, a, losses = [], [], []
    for i in range(p.m):
        tau = math.ceil(p.n(i) / BATCH)
        w, loss = ls_sgd(p, i, x, perms(sim.client(i).generator(0), p.n(i), BATCH, tau), lr, pull=(mu, x))
        a_i = (1 - (1 - lr * mu) ** tau) / (lr * mu)
        assert a_i < 1.0
        d = (x - w) / a_i
        g = torch.Generator()
        g.manual_seed(derive_seed(sim.ctx.seed, 0, i, "compress", "up", "d/fc.weight"))
        idx = torch.randperm(4, generator=g)[:2].numpy()
        c = np.zeros(5)
        c[idx] = 2.0 * d[idx]
        c[4] = d[4]
        sent.append(c)
        a.append(a_i)
        losses.append(loss)
    assert len(set(a)) > 1
    tau_eff = float(np.mean(a))
    metrics = sim.run_round(evaluate=True)
    assert close(vec(sim.method.global_model), x - eta_g * tau_eff * np.mean(sent, axis=0))
    assert metrics["fednova/tau_eff"] == pytest.approx(tau_eff, rel=1e-9)
    assert metrics["train/loss"] == pytest.approx(float(np.mean(losses)), rel=1e-5)
