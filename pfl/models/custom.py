"""Your own model: ``model.name: path/to/file.py:ClassName`` or ``package.module:factory``.

The target is a ``torch.nn.Module`` class or a function returning one, called as
``target(input_shape, num_classes, **model.params)`` (``num_classes`` is 1 for regression, whose
output must then be (N,) or (N, 1)). ``model.params`` are checked against the target's keyword
arguments (names, and the types they are annotated with) when the config is resolved.

The engine's conventions (see :mod:`pfl.models`) become checks with one-line errors before any
training (:func:`prepare_model`):

* **Buffers.** One module object serves every client. The running statistics of a normalisation
  layer (BatchNorm, InstanceNorm with ``track_running_stats``) are state, like the parameters: they
  are entries of every model dict, travel in messages, are averaged or kept local as the method
  says (FedBN), stored and checkpointed (:mod:`pfl.models.functional`). Other buffers are allowed
  when a forward pass leaves them unchanged (constants such as a normalisation mean: one copy in
  the module serves everyone); one that changes is refused by name, since it is neither a
  parameter nor a statistic pfl knows how to combine.
* **Output.** One forward pass on a batch of the first client's training data must give
  (batch, num_classes) logits, or (batch,) / (batch, 1) for regression.
* **Head.** Methods that split body and head read ``model.head`` (parameter-name prefixes). For
  your own model it defaults to its last ``nn.Linear`` (else its last child module holding
  parameters) and is filled in when the config is resolved, so the run's params say which it is.
  The body's units are the model's direct children in order (its ``layer_units()`` if it has one).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import typing
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..schema import ConfigError
from .spec import ModelSpec

KEY = "model.name"
_SIMPLE = (int, float, str, bool, list, dict, list[int], list[float], list[str], tuple[int, ...])


def is_custom(name: str) -> bool:
    return ":" in str(name)


def _target(name: str) -> tuple[Callable, str]:
    """The class or factory ``name`` points to, and a short description of where it is."""
    from ..plugins import import_file, import_module, is_file_entry
    from ..paths import absolute_path

    where, _, attr = name.rpartition(":")
    if not where or not attr:
        raise ConfigError(KEY, f"{name!r}: expected 'path/to/file.py:ClassName' or 'package.module:factory'")
    if is_file_entry(where):
        module = import_file(absolute_path(where), KEY)
    else:
        module = import_module(where, KEY)
    target = getattr(module, attr, None)
    if target is None:
        found = sorted(k for k, v in vars(module).items()
                       if not k.startswith("_") and (isinstance(v, type) and issubclass(v, nn.Module)))
        raise ConfigError(KEY, f"{where} has no {attr!r}; its nn.Module classes: {', '.join(found) or '(none)'}")
    if isinstance(target, type) and not issubclass(target, nn.Module):
        raise ConfigError(KEY, f"{name}: {attr} is a class but not a torch.nn.Module")
    if not callable(target):
        raise ConfigError(KEY, f"{name}: {attr} is a {type(target).__name__}, not an nn.Module class or a factory")
    return target, where


def _keywords(target: Callable, name: str) -> list[inspect.Parameter]:
    """The target's parameters after (input_shape, num_classes): what model.params may set."""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ConfigError(KEY, f"{name} is called as f(input_shape, num_classes, **model.params), but its "
                               f"signature is {sig}")
    skip = {p.name for p in positional[:2]}
    return [p for p in params if p.name not in skip and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _annotation(hints: dict, p: inspect.Parameter) -> Any:
    tp = hints.get(p.name, Any)
    if tp in _SIMPLE:
        return tp
    args = typing.get_args(tp)
    if args and type(None) in args and all(a in _SIMPLE or a is type(None) for a in args):
        return tp
    return Any


@functools.lru_cache(maxsize=64)
def params_class(name: str) -> type:
    """A dataclass of the target's keyword arguments (validated like every params dataclass)."""
    target, _ = _target(name)
    init = target.__init__ if isinstance(target, type) else target
    try:
        hints = typing.get_type_hints(init)
    except Exception:  # annotations that do not evaluate: accept any value
        hints = {}
    fields = []
    for p in sorted(_keywords(target, name), key=lambda p: p.default is not p.empty):
        tp = _annotation(hints, p)
        if p.default is p.empty:
            fields.append((p.name, tp))
        elif isinstance(p.default, (list, dict, set)):
            fields.append((p.name, tp, dataclasses.field(default_factory=functools.partial(copy.deepcopy, p.default))))
        else:
            fields.append((p.name, tp, dataclasses.field(default=p.default)))
    cls_name = "".join(c if c.isalnum() else "_" for c in name.rsplit(":", 1)[-1]) + "Params"
    return dataclasses.make_dataclass(cls_name, fields)


def build(name: str, params: Any, input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """Instantiate your model; without ``layer_units`` it gets the default units (head last)."""
    target, _ = _target(name)
    kwargs = dataclasses.asdict(params) if dataclasses.is_dataclass(params) else dict(params or {})
    try:
        model = target(tuple(input_shape), int(num_classes), **kwargs)
    except ConfigError:
        raise
    except Exception as err:
        text = f"{type(err).__name__}: {err}".splitlines()[0]
        raise ConfigError(KEY, f"{name}({tuple(input_shape)}, {num_classes}, **{kwargs}) failed: {text}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(KEY, f"{name} returned a {type(model).__name__}, not a torch.nn.Module")
    if not hasattr(model, "layer_units"):
        set_head(model, default_head(model), key=KEY)
    return model


def model_spec_for(name: str):
    """A :class:`pfl.models.ModelSpec` for your model (what ``pfl.models.model_spec`` returns for it)."""

    return ModelSpec(name, f"your model {name}", params_class(name), functools.partial(build, name),
                     "whatever it accepts")


# ---- head, buffers, output ----------------------------------------------------------------------

def default_head(model: nn.Module) -> list[str]:
    """The module name of the last nn.Linear, else of the last direct child holding parameters."""
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n]
    if linear:
        return [linear[-1]]
    children = [n for n, c in model.named_children() if any(True for _ in c.parameters())]
    if children:
        return [children[-1]]
    return [n for n, _ in model.named_parameters()][-1:]


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def set_head(model: nn.Module, head: Sequence[str], key: str = "model.head") -> None:
    """Make the parameters under ``head`` the model's last unit (what layer_groups calls the head)."""
    names = [n for n, _ in model.named_parameters()]
    for prefix in head:
        if not any(_matches(n, prefix) for n in names):
            raise ConfigError(key, f"{prefix!r} matches no parameter of {type(model).__name__}; parameters: "
                                   f"{', '.join(names)}")
    in_head = [n for n in names if any(_matches(n, p) for p in head)]
    from .groups import _default_units

    units = model.layer_units() if hasattr(model, "layer_units") else _default_units(model)
    body = [[n for n in unit if n not in in_head] for unit in units]
    units = [u for u in body if u] + [in_head]
    object.__setattr__(model, "layer_units", lambda: [list(u) for u in units])


def check_buffers(model: nn.Module, name: str) -> None:
    """Nothing to refuse before a forward pass: running statistics are state (module docstring);
    a buffer that a forward pass changes is refused by :func:`check_forward`. Kept so that callers
    (the resolver's head check, a sweep's model check) keep one place to call."""


def check_forward(model: nn.Module, x: torch.Tensor, num_classes: int, task: str, name: str) -> None:
    """One forward pass on ``x``, as training runs it (train mode): output shape, and buffers other
    than running statistics left unchanged."""
    from torch.func import functional_call

    from .functional import buffer_names

    stats = buffer_names(model)
    # the statistics as copies: the forward pass updates those, never the module's
    params = {**{k: v.detach() for k, v in model.named_parameters()},
              **{k: model.get_buffer(k).detach().clone() for k in stats}}
    before = {k: b.detach().clone() for k, b in model.named_buffers() if k not in stats}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = functional_call(model, params, (x,))
    except Exception as err:
        text = f"{type(err).__name__}: {err}".splitlines()[0]
        raise ConfigError(KEY, f"{name} fails on a batch of shape {tuple(x.shape)}: {text}") from None
    changed = [k for k, b in model.named_buffers() if k in before and not torch.equal(before[k], b)]
    for k in changed:
        model.get_buffer(k).copy_(before[k])
    if changed:
        raise ConfigError(KEY, f"{name}: buffer {changed[0]!r} changes in the forward pass; pfl keeps a client's "
                               "state as its parameters and its normalisation layers' running statistics, so it "
                               "would be shared by every client (make it an nn.Parameter, or a BatchNorm/"
                               "InstanceNorm statistic)")
    b = len(x)
    want = [(b, num_classes)] if task == "classification" else [(b,), (b, 1)]
    got = tuple(getattr(out, "shape", ()))
    if not isinstance(out, torch.Tensor) or got not in want:
        raise ConfigError(KEY, f"{name} returns {got if isinstance(out, torch.Tensor) else type(out).__name__} "
                               f"for a batch of {b} samples of shape {tuple(x.shape[1:])}; the task needs "
                               f"{' or '.join(map(str, want))}")


def prepare_model(model: nn.Module, cfg, data) -> nn.Module:
    """The run's model checked against the engine's conventions (module docstring), head applied."""
    name = cfg.model.name
    check_buffers(model, name)
    if cfg.model.head:
        set_head(model, cfg.model.head)
    # two samples at least: BatchNorm in train mode cannot normalise a batch of one
    sample = next((c.x_train for c in data.clients if c.n_train >= 2), None)
    if sample is not None:
        check_forward(model, sample[:8], max(1, data.num_classes), data.task, name)
    return model


def resolve_head(cfg, input_shape: Sequence[int], num_classes: int, build_model: Callable[..., nn.Module]) -> None:
    """Check your model's layers and fill ``cfg.model.head`` with its default head (the model is
    built with ``build_model`` on the meta device: no memory, no initialisation)."""

    if not is_custom(cfg.model.name):
        return
    try:
        with torch.device("meta"):
            model = build_model(cfg.model.name, cfg.model.params, input_shape, num_classes)
    except ConfigError:
        model = build_model(cfg.model.name, cfg.model.params, input_shape, num_classes)
    check_buffers(model, cfg.model.name)
    if cfg.model.head:
        set_head(model, cfg.model.head)
        return
    cfg.model.head = _prefixes(model, model.layer_units()[-1] if hasattr(model, "layer_units") else [])


def _prefixes(model: nn.Module, names: list[str]) -> list[str]:
    """The shortest module prefixes covering exactly ``names``."""
    for mname, module in model.named_modules():
        own = [f"{mname}.{n}" if mname else n for n, _ in module.named_parameters()]
        if mname and sorted(own) == sorted(names):
            return [mname]
    return list(names)


__all__ = ["build", "check_buffers", "check_forward", "default_head", "is_custom", "model_spec_for",
           "params_class", "prepare_model", "resolve_head", "set_head"]
