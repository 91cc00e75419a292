"""The one local-SGD loop every method trains with, and the one evaluation routine.

Parameters are plain ``{name: tensor}`` dicts, so one module serves every client and a client's
state is its tensors. The loop trains a copy of the start tensors: as the module's own parameters'
data (a plain module call) when they are exactly its parameters and the forward is the module's,
through ``torch.func.functional_call`` otherwise; the two give the same bits, the first without
re-binding every parameter at every forward. Variants are configured through hooks, never by
copying the loop:

* ``extra_loss(params)``: a term added to the batch loss (FedProx's proximal term, distillation);
* ``grad_hook(grads, params)``: edits gradients before the step (SCAFFOLD's control variates,
  FPFC's augmented-Lagrangian pull, FedDyn's linear term) — cheaper than autograd through a term;
* ``post_step(params)``: runs after every step under ``no_grad`` (proximal maps: L1 prox-SGD);
* ``forward(params, x)``: a custom forward (FedSLR's w + P, mixed models);
* ``trainable``: which names get gradients (FedRep's head-then-body epochs, frozen GKR).

Running statistics (BatchNorm's, :func:`pfl.models.functional.state_buffers`) are dict entries too, never
trained: training's train-mode forward updates them in the dict, never in the module; evaluation runs in eval mode.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch.func import functional_call

from .models.functional import buffer_names, in_mode, lend_statistics, on_names

Params = dict[str, torch.Tensor]


def per_sample_loss(task: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The task's loss of every sample (no reduction)."""
    if task == "classification":
        return lambda out, y: F.cross_entropy(out, y, reduction="none")
    if task == "regression":
        return lambda out, y: F.mse_loss(out.reshape(y.shape), y, reduction="none").reshape(len(y), -1).mean(1)
    raise ValueError(f"unknown task {task!r}; allowed: classification, regression")


def loss_fn(task: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if task == "classification":
        return F.cross_entropy
    if task == "regression":
        return lambda pred, y: F.mse_loss(pred.reshape(y.shape), y)
    raise ValueError(f"unknown task {task!r}; allowed: classification, regression")


@dataclass
class TrainResult:
    params: Params
    steps: int
    mean_loss: float


def batch_indices(n: int, batch_size: int, epochs: int, steps: int | None,
             generator: torch.Generator | None, device: torch.device) -> Iterable[torch.Tensor | None]:
    """Index slices of a per-epoch permutation; ``None`` means the whole set (full batch)."""
    if n == 0:
        return
    full = batch_size <= 0 or batch_size >= n
    if full:
        count = steps if steps is not None else epochs
        for _ in range(count):
            yield None
        return
    per_epoch = math.ceil(n / batch_size)
    total = steps if steps is not None else epochs * per_epoch
    done = 0
    while done < total:
        perm = torch.randperm(n, generator=generator).to(device)
        for start in range(0, n, batch_size):
            if done >= total:
                return
            yield perm[start:start + batch_size]
            done += 1


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, epochs: int, steps: int | None,
            generator: torch.Generator | None, min_size: int = 1) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """The minibatches of :func:`batch_indices`' order as contiguous slices of each epoch's shuffled
    copy of (x, y): one gather per epoch instead of one per step, the same samples in the same order;
    one of fewer than ``min_size`` samples is skipped, its step used up (BatchNorm needs 2)."""
    n = len(y)
    if n < min_size:
        return
    if batch_size <= 0 or batch_size >= n:
        for _ in range(steps if steps is not None else epochs):
            yield x, y
        return
    total = steps if steps is not None else epochs * math.ceil(n / batch_size)
    done = 0
    while done < total:
        perm = torch.randperm(n, generator=generator).to(x.device)
        xs, ys = x[perm], y[perm]
        for start in range(0, n, batch_size):
            if done >= total:
                return
            if min(batch_size, n - start) >= min_size:
                yield xs[start:start + batch_size], ys[start:start + batch_size]
            done += 1


def local_sgd(
    model: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    lr: float,
    epochs: int = 1,
    steps: int | None = None,
    batch_size: int = 32,
    task: str = "classification",
    generator: torch.Generator | None = None,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    trainable: Iterable[str] | None = None,
    extra_loss: Callable[[Params], torch.Tensor] | None = None,
    grad_hook: Callable[[Params, Params], Params] | None = None,
    post_step: Callable[[Params], None] | None = None,
    forward: Callable[[Params, torch.Tensor], torch.Tensor] | None = None,
    loss: Callable[[Params, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> TrainResult:
    """Minibatch SGD on ``mean loss + extra_loss`` from ``params``; returns new tensors.

    ``loss(params, xb, yb)``, when given, replaces the task loss of the forward pass: it returns
    every sample's loss (APFL's two-model objective); the step minimises their mean.

    The input dict is not modified. Untrainable entries are carried over unchanged. With
    ``batch_size <= 0`` every step is a full-batch gradient step (FPFC's synthetic setting). The
    losses are summed on the device and read once at the end (no host synchronisation per step).
    """
    names = list(params)
    buffers = buffer_names(model)
    train_names = [n for n in names if n not in buffers and (trainable is None or n in set(trainable))]
    state: Params = {k: v.detach().clone() for k, v in params.items()}
    live = lend_statistics(model, state) if buffers else state
    if buffers and post_step is not None:  # a proximal map acts on parameters, never on statistics
        post_step = functools.partial(on_names, post_step, [k for k in names if k not in buffers])
    # statistics: never the bound module call, whose forward would write the module's own buffers
    own = _own_parameters(model, state) if forward is None and loss is None and not buffers else None
    with in_mode(model, train=True):
        if own is None:  # parameters the module does not hold, or a custom forward: the functional call
            for k in train_names:
                state[k].requires_grad_(True)
            fwd = forward or (lambda p, xb: functional_call(model, p, (xb,)))
            count, total_loss = _sgd(live, fwd, x, y, train_names, lr, epochs, steps, batch_size, task, generator,
                                     momentum, weight_decay, extra_loss, grad_hook, post_step, loss,
                                     2 if buffers else 1)
        else:
            # the module's own parameters train on ``state``'s storage: a plain module call, no
            # re-binding of every parameter at every forward (what functional_call does)
            with _bound(own, state, train_names) as live:
                count, total_loss = _sgd(live, lambda p, xb: model(xb), x, y, train_names, lr, epochs, steps,
                                         batch_size, task, generator, momentum, weight_decay, extra_loss,
                                         grad_hook, post_step, None)
    out = {k: handed_over(v.detach()) for k, v in state.items()}
    return TrainResult(out, count, float(total_loss) / max(count, 1))


#: attribute of a tensor that its producer made for the caller and holds no reference to
HANDED_OVER = "_pfl_handed_over"


def handed_over(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as new and held by nobody but the caller (local_sgd's results): a message that
    carries it away needs no copy unless the sender kept it (:meth:`pfl.federation.messages.Message.copy`)."""
    setattr(t, HANDED_OVER, True)
    return t


def _own_parameters(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> dict | None:
    """``model``'s parameters by name when ``state`` names exactly them, with their shapes, dtypes and
    devices (None otherwise)."""
    own = dict(model.named_parameters())
    if len(own) != len(state):
        return None
    for k, t in state.items():
        p = own.get(k)
        if p is None or p.shape != t.shape or p.dtype != t.dtype or p.device != t.device:
            return None
    return own


@contextmanager
def _bound(own: dict, state: Params, train_names: list[str]):
    """The module's parameters with ``state``'s tensors as their data (only ``train_names`` get
    gradients) for the duration of a local loop; the module is left as it was."""
    saved = {k: (p.data, p.requires_grad) for k, p in own.items()}
    trainable = set(train_names)
    try:
        for k, p in own.items():
            p.data = state[k]
            p.requires_grad_(k in trainable)
        yield {k: own[k] for k in state}
    finally:
        for k, p in own.items():
            p.data, grad = saved[k]
            p.requires_grad_(grad)
            p.grad = None


def _sgd(state: Params, fwd, x, y, train_names, lr, epochs, steps, batch_size, task, generator, momentum,
         weight_decay, extra_loss, grad_hook, post_step, loss, min_size=1) -> tuple[int, torch.Tensor]:
    """The loop of :func:`local_sgd` on the leaf tensors ``state`` (updated in place); returns the
    step count and the summed batch losses (``min_size``: see :func:`batches`)."""
    criterion = loss_fn(task)
    velocity: Params = {}
    leaves = [state[k] for k in train_names]
    total_loss, count = torch.zeros((), device=x.device), 0
    for xb, yb in batches(x, y, batch_size, epochs, steps, generator, min_size):
        value = loss(state, xb, yb).mean() if loss is not None else criterion(fwd(state, xb), yb)
        total_loss += value.detach()
        if extra_loss is not None:
            value = value + extra_loss(state)
        grads_list = torch.autograd.grad(value, leaves, allow_unused=True)
        grads = {k: (g if g is not None else torch.zeros_like(state[k]))
                 for k, g in zip(train_names, grads_list)}
        if grad_hook is not None:
            grads = grad_hook(grads, state)
        with torch.no_grad():
            if not weight_decay and not momentum:
                # w ← w − lr·g for every tensor in one fused pass, as torch.optim.SGD's foreach step does
                # (one rounding of w + (−lr)·g instead of two: the step is memory-bound at small batches)
                torch._foreach_add_(leaves, [grads[k] for k in train_names], alpha=-lr)
            else:
                for k in train_names:
                    g = grads[k]
                    if weight_decay:
                        g = g + weight_decay * state[k]
                    if momentum:
                        buf = velocity.get(k)
                        buf = g.clone() if buf is None else buf.mul_(momentum).add_(g)
                        velocity[k] = buf
                        g = buf
                    state[k].sub_(lr * g)
            if post_step is not None:
                post_step(state)
        count += 1
    return count, total_loss


# ---- declarative hooks ---------------------------------------------------------------------------
# A hook written as one of these terms (rather than a closure) is a function of tensors it holds:
# the batched cohort (pfl.federation.batched) stacks the tensors of many clients' terms and applies
# the same formula to all of them at once. Each is an ordinary callable for the one-client loop.

class Term:
    """A ``grad_hook`` (``__call__(grads, params) -> grads``) or a ``post_step`` (``apply(params)``)
    whose tensors can be stacked along a leading client axis. ``cohort`` is True on a stacked term:
    per-client reductions then keep that axis."""

    cohort: bool = False


@dataclass
class PullTo(Term):
    """Gradient of (weight/2)‖w − anchor‖² on the names of ``anchor``: weight·(w − anchor).

    FedProx's proximal term, Ditto's personal task, pFedMe's Moreau envelope, FPFC's augmented-
    Lagrangian pull, FedSLR's proximal step; ``anchor=None`` pulls every trainable name to 0 (weight
    decay). The anchor is read at every step, so an anchor updated in place moves the pull with it.
    """
    anchor: Params | None
    weight: float

    @torch.no_grad()  # arithmetic on gradients: nothing for autograd to record
    def __call__(self, grads: Params, params: Params) -> Params:
        w = self.weight
        if self.anchor is None:
            return {k: g + w * params[k] for k, g in grads.items()}
        if not self.cohort:  # the same roundings in one new tensor per name (g + x and x + g agree)
            return {k: (torch.sub(params[k], self.anchor[k]).mul_(w).add_(g) if k in self.anchor else g)
                    for k, g in grads.items()}
        return {k: (g + w * (params[k] - self.anchor[k]) if k in self.anchor else g) for k, g in grads.items()}


@dataclass
class ProxPull(Term):
    """Gradient of ‖w − anchor‖²/(2·step) on the names of ``anchor``: (w − anchor)/step (the local
    proximal problems of FedSplit and FedPD, written as their papers divide by the step)."""
    anchor: Params
    step: float

    @torch.no_grad()  # arithmetic on gradients: nothing for autograd to record
    def __call__(self, grads: Params, params: Params) -> Params:
        return {k: (g + (params[k] - self.anchor[k]) / self.step if k in self.anchor else g) for k, g in grads.items()}


@dataclass
class Shift(Term):
    """A constant added to the gradient: scale·shift (SCAFFOLD's c − c_k, FedDyn's −g_k, FedSLR's γ)."""
    shift: Params
    scale: float = 1.0

    @torch.no_grad()  # arithmetic on gradients: nothing for autograd to record
    def __call__(self, grads: Params, params: Params) -> Params:
        return {k: (g + self.scale * self.shift[k] if k in self.shift else g) for k, g in grads.items()}


@dataclass
class ClipNorm(Term):
    """Scale the gradient down to global L2 norm ``max_norm`` (over all its tensors, per client)."""
    max_norm: float

    def __call__(self, grads: Params, params: Params) -> Params:
        if not self.cohort:
            norm = torch.sqrt(sum((v.float() ** 2).sum() for v in grads.values()))
            return {k: v * (self.max_norm / norm) for k, v in grads.items()} if norm > self.max_norm else grads
        norm = torch.sqrt(sum((v.float() ** 2).flatten(1).sum(1) for v in grads.values()))
        factor = torch.clamp(self.max_norm / norm.clamp_min(1e-30), max=1.0)
        return {k: v * factor.to(v.dtype).view(-1, *([1] * (v.dim() - 1))) for k, v in grads.items()}


@dataclass
class Terms(Term):
    """Several gradient terms applied in order."""
    terms: list

    def __call__(self, grads: Params, params: Params) -> Params:
        for term in self.terms:
            grads = term(grads, params)
        return grads


@dataclass
class SoftThreshold(Term):
    """``post_step``: every parameter ← sign(p)·max(|p| − kappa, 0) (the L1 proximal map)."""
    kappa: float

    def __call__(self, params: Params) -> None:
        from .prox import soft_threshold

        for v in params.values():
            v.copy_(soft_threshold(v, self.kappa))


@dataclass
class Clamp(Term):
    """``post_step``: the named parameters clipped to [low, high] (APFL's mixing weight)."""
    names: tuple
    low: float
    high: float

    def __call__(self, params: Params) -> None:
        for k in self.names:
            params[k].clamp_(self.low, self.high)


@dataclass
class AddToParams(Term):
    """``forward``: the model evaluated at ``params + offset`` (FedSLR's personal part P trained on
    top of the frozen global model: the forward pass sees w + P; statistics do not add: P's own)."""
    model: torch.nn.Module
    offset: Params

    def __call__(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        stats = buffer_names(self.model)
        return functional_call(self.model, {k: (params[k] if k in stats else self.offset[k] + params[k])
                                            for k in self.offset}, (x,))


def proximal_pull(anchor: Mapping[str, torch.Tensor], weight: float) -> PullTo:
    """A ``grad_hook`` adding the gradient of (weight/2)‖w − anchor‖²: weight·(w − anchor)."""
    return PullTo(anchor, weight)


@dataclass
class TrainCall:
    """A request to train: :func:`local_sgd`'s arguments (``kwargs`` its keywords)."""
    model: torch.nn.Module
    params: Params
    x: torch.Tensor
    y: torch.Tensor
    kwargs: dict


@dataclass
class EvalCall:
    """A request to evaluate: :func:`evaluate`'s arguments."""
    model: torch.nn.Module
    params: Params
    x: torch.Tensor
    y: torch.Tensor
    task: str
    forward: Callable[[Params, torch.Tensor], torch.Tensor] | None = None


@dataclass
class EvalResult:
    loss: float       # mean loss
    acc: float        # accuracy (classification) or nan
    n: int

    @property
    def rmse(self) -> float:
        return math.sqrt(self.loss)


@torch.no_grad()
def evaluate(model: torch.nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor,
             y: torch.Tensor, task: str = "classification", batch_size: int = 4096,
             forward: Callable[[Params, torch.Tensor], torch.Tensor] | None = None) -> EvalResult:
    n = len(y)
    if n == 0:
        return EvalResult(float("nan"), float("nan"), 0)
    fwd = forward or (lambda p, xb: functional_call(model, p, (xb,)))
    loss_sum, correct = 0.0, 0
    with in_mode(model, train=False):  # BatchNorm by the dict's statistics, writing nothing
        for start in range(0, n, batch_size):
            xb, yb = x[start:start + batch_size], y[start:start + batch_size]
            out = fwd(dict(params), xb)
            if task == "classification":
                loss_sum += float(F.cross_entropy(out, yb, reduction="sum"))
                correct += int((out.argmax(dim=1) == yb).sum())
            else:
                loss_sum += float(F.mse_loss(out.reshape(yb.shape), yb, reduction="sum"))
    acc = correct / n if task == "classification" else float("nan")
    return EvalResult(loss_sum / n, acc, n)


def batch_gradient(model: torch.nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                   *, task: str = "classification", batch_size: int = 0, generator: torch.Generator | None = None,
                   weight_decay: float = 0.0) -> tuple[Params, float]:
    """∇ of the mean loss (+ (weight_decay/2)‖w‖²) at ``params`` on one minibatch of ``batch_size``
    samples drawn without replacement from ``generator`` (0 or ≥ n: the whole set), and the loss.

    The gradient oracle of the methods that exchange gradients (ADIANA, MARINA): two calls with the
    same generator seed use the same minibatch."""
    n = len(y)
    if 0 < batch_size < n:
        idx = torch.randperm(n, generator=generator)[:batch_size].to(x.device)
        x, y = x[idx], y[idx]
    stats = buffer_names(model)  # updated by the forward pass, never differentiated: a zero "gradient"
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items() if k not in stats}
    loss = loss_fn(task)(functional_call(model, {**params, **leaves}, (x,)), y)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    out = {k: (g if g is not None else torch.zeros_like(leaves[k])).detach() for k, g in zip(leaves, grads)}
    out = {k: out.get(k, torch.zeros_like(v)) for k, v in params.items()}
    if weight_decay:
        out = {k: g + weight_decay * params[k].detach() for k, g in out.items()}
    return out, float(loss.detach())
