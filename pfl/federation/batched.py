"""Batched computation of many clients' requests at once (torch.func.vmap): the math behind the
vectorized cohort (:mod:`pfl.federation.cohort` decides what runs together).

A group of training requests that can run together — the same model object, parameter names and
shapes, the same settings, hooks written as :class:`~pfl.training.Term` objects — is computed at
once: parameters and momentum buffers stacked along a client axis, each step's per-client
minibatches gathered into one tensor with a mask for the padding, gradients by ``vmap(grad)`` of
every client's masked mean loss, the hook terms applied to the stacked tensors, clients with fewer
steps masked out of the later steps. Full-batch groups are bucketed by client size so that little
compute goes to padding.

Randomness stays each client's: minibatch orders are drawn from the client's generator exactly as
the one-client loop draws them, so a batched group computes what :func:`~pfl.training.local_sgd`
computes for each client, up to float rounding. Losses are summed on the device and read once per
group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.func import functional_call, grad_and_value, vmap

from ..training import (EvalCall, EvalResult, Params, Term, TrainCall, TrainResult, batch_indices,
                        per_sample_loss)


# ---- terms: stacking and their tensors ---------------------------------------------------------

def _is_tensor_dict(value: Any) -> bool:
    return isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values())


def term_signature(term: Any) -> Any:
    """What must be equal for terms to be stacked: type, scalars, module identities, tensor names
    and shapes."""
    if term is None:
        return None
    if not isinstance(term, Term):
        return ("opaque", id(term))
    parts = [type(term).__name__]
    for f in dataclasses.fields(term):
        value = getattr(term, f.name)
        if isinstance(value, torch.Tensor):
            parts.append((f.name, "tensor", tuple(value.shape), value.dtype))
        elif _is_tensor_dict(value):
            parts.append((f.name, "dict", tuple((k, tuple(v.shape)) for k, v in value.items())))
        elif isinstance(value, list):
            parts.append((f.name, "list", tuple(term_signature(v) for v in value)))
        elif isinstance(value, torch.nn.Module):
            parts.append((f.name, "module", id(value)))
        else:
            parts.append((f.name, value))
    return tuple(parts)


def stack_terms(terms: Sequence[Any]) -> Any:
    """One term whose tensors hold every client's along a leading axis (``cohort=True``)."""
    first = terms[0]
    if first is None:
        return None
    changes = {}
    for f in dataclasses.fields(first):
        values = [getattr(t, f.name) for t in terms]
        v0 = values[0]
        if isinstance(v0, torch.Tensor):
            changes[f.name] = torch.stack(values)
        elif _is_tensor_dict(v0):
            changes[f.name] = {k: torch.stack([v[k] for v in values]) for k in v0}
        elif isinstance(v0, list):
            changes[f.name] = [stack_terms([v[i] for v in values]) for i in range(len(v0))]
    out = dataclasses.replace(first, **changes)
    _mark_cohort(out)
    return out


def _mark_cohort(term: Any) -> None:
    if isinstance(term, Term):
        object.__setattr__(term, "cohort", True)
        for f in dataclasses.fields(term):
            value = getattr(term, f.name)
            if isinstance(value, list):
                for v in value:
                    _mark_cohort(v)


def select_terms(term: Any, rows: torch.Tensor) -> Any:
    """The stacked term restricted to some clients (rows of the leading axis)."""
    if term is None:
        return None
    changes = {}
    for f in dataclasses.fields(term):
        value = getattr(term, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = value.index_select(0, rows)
        elif _is_tensor_dict(value):
            changes[f.name] = {k: v.index_select(0, rows) for k, v in value.items()}
        elif isinstance(value, list):
            changes[f.name] = [select_terms(v, rows) for v in value]
    out = dataclasses.replace(term, **changes)
    _mark_cohort(out)
    return out


def term_tensors(term: Any) -> dict:
    """A term's tensors as a pytree (vmap maps over their leading axis)."""
    if term is None:
        return {}
    out = {}
    for f in dataclasses.fields(term):
        value = getattr(term, f.name)
        if isinstance(value, torch.Tensor) or _is_tensor_dict(value):
            out[f.name] = value
        elif isinstance(value, list):
            out[f.name] = [term_tensors(v) for v in value]
    return out


def with_tensors(term: Any, tree: dict) -> Any:
    """``term`` holding the tensors of ``tree`` (one client's, inside vmap)."""
    if term is None:
        return None
    changes = {}
    for name, value in tree.items():
        if isinstance(value, list):
            changes[name] = [with_tensors(t, v) for t, v in zip(getattr(term, name), value)]
        else:
            changes[name] = value
    out = dataclasses.replace(term, **changes)
    object.__setattr__(out, "cohort", False)
    return out


# ---- batched training --------------------------------------------------------------------------

HOOKS = ("grad_hook", "post_step", "forward", "loss")


def train_batchable(call: TrainCall) -> bool:
    kw = call.kwargs
    return kw.get("extra_loss") is None and all(kw.get(h) is None or isinstance(kw.get(h), Term) for h in HOOKS)


def train_key(call: TrainCall) -> tuple:
    kw = call.kwargs
    trainable = kw.get("trainable")
    return (id(call.model), tuple((k, tuple(v.shape), v.dtype) for k, v in call.params.items()),
            None if trainable is None else tuple(sorted(trainable)),
            tuple(kw.get(k) for k in ("lr", "epochs", "steps", "batch_size", "task", "momentum", "weight_decay")),
            tuple(term_signature(kw.get(h)) for h in HOOKS),
            tuple(call.x.shape[1:]), call.x.dtype, call.y.dtype, tuple(call.y.shape[1:]), call.x.device)


def _buckets(sizes: list[int], waste: float = 1.3) -> list[list[int]]:
    """Positions grouped by size so that a group's padded size is at most ``waste`` × its data."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            g = groups[-1]
            if sizes[i] * (len(g) + 1) <= waste * (sum(sizes[j] for j in g) + sizes[i]):
                g.append(i)
                continue
        groups.append([i])
    return groups


@dataclass
class _Schedule:
    steps: list  # per step: an index tensor (minibatch) or None (full batch)

    @property
    def count(self) -> int:
        return len(self.steps)


def train_cohort(calls: Sequence[TrainCall]) -> list[TrainResult]:
    """Local SGD for many clients at once; the same results as :func:`local_sgd` on each call."""
    kw = calls[0].kwargs
    scheds = [_Schedule(list(batch_indices(len(c.y), kw["batch_size"], kw["epochs"], kw["steps"],
                                           c.kwargs.get("generator"), c.x.device))) for c in calls]
    full = all(s is None for sch in scheds for s in sch.steps)
    if not full:  # a client no larger than the batch takes full-batch steps: its whole set, in order
        for c, sch in zip(calls, scheds):
            sch.steps = [torch.arange(len(c.y), device=c.x.device) if s is None else s for s in sch.steps]
    results: list[TrainResult | None] = [None] * len(calls)
    groups = _buckets([len(c.y) for c in calls]) if full else [list(range(len(calls)))]
    for group in groups:
        for pos, res in zip(group, _train_group([calls[i] for i in group], [scheds[i] for i in group], full)):
            results[pos] = res
    return results  # type: ignore[return-value]


def _train_group(calls: Sequence[TrainCall], scheds: Sequence[_Schedule], full: bool) -> list[TrainResult]:
    kw = calls[0].kwargs
    model, device = calls[0].model, calls[0].x.device
    names = list(calls[0].params)
    trainable = kw.get("trainable")
    train_names = names if trainable is None else [n for n in names if n in set(trainable)]
    fixed_names = [n for n in names if n not in set(train_names)]
    C = len(calls)
    P = {k: torch.stack([c.params[k].detach() for c in calls]).clone() for k in names}
    hook = stack_terms([c.kwargs.get("grad_hook") for c in calls])
    post = stack_terms([c.kwargs.get("post_step") for c in calls])
    fwd = stack_terms([c.kwargs.get("forward") for c in calls])
    custom = stack_terms([c.kwargs.get("loss") for c in calls])
    per_sample = per_sample_loss(kw["task"])
    lr, momentum, wd = kw["lr"], kw.get("momentum", 0.0), kw.get("weight_decay", 0.0)

    def client_loss(p_train, p_fixed, xb, yb, mb, fwd_tree, loss_tree):
        params = {**p_fixed, **p_train}
        if custom is not None:
            per = with_tensors(custom, loss_tree)(params, xb, yb)
        else:
            out = (with_tensors(fwd, fwd_tree)(params, xb) if fwd is not None
                   else functional_call(model, params, (xb,)))
            per = per_sample(out, yb)
        return (per * mb).sum() / mb.sum().clamp_min(1.0)

    grad_fn = vmap(grad_and_value(client_loss))
    counts = torch.tensor([s.count for s in scheds], device=device)
    steps = int(counts.max()) if C else 0
    # the data every step reads: all of a client's samples (full batch), or gathered minibatches
    if full:
        n_max = max(len(c.y) for c in calls)
        X = calls[0].x.new_zeros((C, n_max, *calls[0].x.shape[1:]))
        Y = calls[0].y.new_zeros((C, n_max, *calls[0].y.shape[1:]))
        M = torch.zeros(C, n_max, device=device)
        for i, c in enumerate(calls):
            X[i, :len(c.y)], Y[i, :len(c.y)], M[i, :len(c.y)] = c.x, c.y, 1.0
    else:
        offsets = torch.tensor([0] + [len(c.y) for c in calls[:-1]], device=device).cumsum(0)
        Xcat = torch.cat([c.x for c in calls])
        Ycat = torch.cat([c.y for c in calls])
        width = max((len(s) for sch in scheds for s in sch.steps), default=1)
        G = torch.zeros(C, max(steps, 1), width, dtype=torch.long, device=device)
        GM = torch.zeros(C, max(steps, 1), width, device=device)
        for i, sch in enumerate(scheds):
            for t, idx in enumerate(sch.steps):
                G[i, t, :len(idx)] = idx + offsets[i]
                GM[i, t, :len(idx)] = 1.0
    velocity: Params = {}
    total = torch.zeros(C, device=device)
    all_rows = torch.arange(C, device=device)
    for t in range(steps):
        active = counts > t
        every = bool(active.all())
        rows = all_rows if every else all_rows[active]
        sub = (lambda v: v) if every else (lambda v: v.index_select(0, rows))
        if full:
            xb, yb, mb = sub(X), sub(Y), sub(M)
        else:
            g_idx, mb = sub(G[:, t]), sub(GM[:, t])
            xb, yb = Xcat[g_idx], Ycat[g_idx]
        p_train = {k: sub(P[k]) for k in train_names}
        p_fixed = {k: sub(P[k]) for k in fixed_names}
        hook_t = hook if every or hook is None else select_terms(hook, rows)
        fwd_t = fwd if every or fwd is None else select_terms(fwd, rows)
        custom_t = custom if every or custom is None else select_terms(custom, rows)
        grads, losses = grad_fn(p_train, p_fixed, xb, yb, mb, term_tensors(fwd_t), term_tensors(custom_t))
        total.index_add_(0, rows, losses.detach())
        if hook_t is not None:
            grads = hook_t(grads, {**p_fixed, **p_train})
        with torch.no_grad():
            for k in train_names:
                g = grads[k]
                if wd:
                    g = g + wd * p_train[k]
                if momentum:  # a zero buffer makes the first step's buffer g itself, as in local_sgd
                    if k not in velocity:
                        velocity[k] = torch.zeros_like(P[k])
                    buf = sub(velocity[k]).mul_(momentum).add_(g)
                    if not every:
                        velocity[k].index_copy_(0, rows, buf)
                    g = buf
                new = p_train[k] - lr * g
                if every:
                    P[k] = new
                else:
                    P[k].index_copy_(0, rows, new)
            if post is not None:
                post_t = post if every else select_terms(post, rows)
                current = {k: sub(P[k]) for k in names}
                post_t(current)
                if not every:
                    for k in names:
                        P[k].index_copy_(0, rows, current[k])
    means = (total / counts.clamp_min(1)).tolist()
    return [TrainResult({k: P[k][i].clone() for k in names}, int(counts[i]), means[i]) for i in range(C)]


# ---- batched evaluation ------------------------------------------------------------------------

def eval_key(call: EvalCall) -> tuple | None:
    if call.forward is not None and not isinstance(call.forward, Term):
        return None
    return (id(call.model), tuple((k, tuple(v.shape), v.dtype) for k, v in call.params.items()), call.task,
            term_signature(call.forward), tuple(call.x.shape[1:]), call.x.dtype, call.y.dtype, call.x.device)


def evaluate_cohort(calls: Sequence[EvalCall]) -> list[EvalResult]:
    """:func:`evaluate` for many clients at once (bucketed by split size)."""
    results: list[EvalResult | None] = [None] * len(calls)
    sizes = [len(c.y) for c in calls]
    for i, n in enumerate(sizes):
        if n == 0:
            results[i] = EvalResult(float("nan"), float("nan"), 0)
    live = [i for i, n in enumerate(sizes) if n > 0]
    for group in _buckets([sizes[i] for i in live]):
        idx = [live[j] for j in group]
        for pos, res in zip(idx, _evaluate_group([calls[i] for i in idx])):
            results[pos] = res
    return results  # type: ignore[return-value]


@torch.no_grad()
def _evaluate_group(calls: Sequence[EvalCall]) -> list[EvalResult]:
    model, task, device = calls[0].model, calls[0].task, calls[0].x.device
    C = len(calls)
    n_max = max(len(c.y) for c in calls)
    P = {k: torch.stack([c.params[k] for c in calls]) for k in calls[0].params}
    fwd = stack_terms([c.forward for c in calls])
    X = calls[0].x.new_zeros((C, n_max, *calls[0].x.shape[1:]))
    Y = calls[0].y.new_zeros((C, n_max, *calls[0].y.shape[1:]))
    M = torch.zeros(C, n_max, device=device)
    for i, c in enumerate(calls):
        X[i, :len(c.y)], Y[i, :len(c.y)], M[i, :len(c.y)] = c.x, c.y, 1.0
    per_sample = per_sample_loss(task)

    def one(params, x, y, m, fwd_tree):
        out = with_tensors(fwd, fwd_tree)(params, x) if fwd is not None else functional_call(model, params, (x,))
        loss = (per_sample(out, y) * m).sum()
        correct = ((out.argmax(-1) == y).float() * m).sum() if task == "classification" else torch.zeros(())
        return loss, correct

    losses, correct = vmap(one)(P, X, Y, M, term_tensors(fwd))
    n = M.sum(1)
    loss_l, correct_l, n_l = (losses / n).tolist(), (correct / n).tolist(), n.tolist()
    return [EvalResult(loss_l[i], correct_l[i] if task == "classification" else float("nan"), int(n_l[i]))
            for i in range(C)]


__all__ = ["HOOKS", "eval_key", "evaluate_cohort", "stack_terms", "term_signature", "train_batchable", "train_cohort",
           "train_key"]
