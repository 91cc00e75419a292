"""Run state as plain data: what a checkpoint may hold, and moving state between devices.

A checkpoint is loaded with ``torch.load(weights_only=True)``, which accepts only tensors and plain
containers (dict, list, tuple, set, str, int, float, bool, None). :func:`encode` turns a state into
exactly that, so any server or client state can be saved without a hand-kept list of what to save:

* numpy arrays become tensors (tagged, so :func:`decode` gives arrays back) and numpy scalars
  Python numbers;
* instances of dataclasses registered with :func:`checkpointable` (messages, low-rank layers,
  ALA results) become tagged dicts of their fields; decoding looks the class up in that registry
  and never imports anything, so a checkpoint cannot name code to run;
* anything else (a module, a generator, an unregistered object) is refused with a TypeError that
  names where it sits, e.g. ``server state 'models'[2]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import torch

_CLASSES: dict[str, type] = {}
_TAG_CLASS, _TAG_ARRAY = "__pfl_dataclass__", "__pfl_ndarray__"


def checkpointable(cls: type) -> type:
    """Register a dataclass so that its instances can be part of a checkpoint."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    _CLASSES[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return cls


PLAIN = (str, int, float, bool, type(None), bytes, complex)


def encode(obj: Any, where: str = "state") -> Any:
    """``obj`` as tensors and plain containers (see the module docstring)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, PLAIN):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return {_TAG_ARRAY: torch.from_numpy(np.ascontiguousarray(obj))}
    if isinstance(obj, dict):
        return {k: encode(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(encode(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if isinstance(obj, (set, frozenset)):
        return {encode(v, f"{where}{{}}") for v in obj}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        key = f"{type(obj).__module__}.{type(obj).__qualname__}"
        if key not in _CLASSES:
            raise TypeError(f"{where}: a {type(obj).__name__} cannot be checkpointed; register the "
                            "dataclass with pfl.federation.state.checkpointable")
        fields = {f.name: encode(getattr(obj, f.name), f"{where}.{f.name}") for f in dataclasses.fields(obj)}
        return {_TAG_CLASS: key, "fields": fields}
    raise TypeError(f"{where}: a {type(obj).__name__} cannot be checkpointed (only tensors, numbers, "
                    "strings and containers of them); keep it out of the state (a name starting with _ "
                    "on a method, recomputed in configure/setup)")


def decode(obj: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(obj, dict):
        if _TAG_ARRAY in obj and len(obj) == 1:
            return obj[_TAG_ARRAY].numpy()
        if _TAG_CLASS in obj and set(obj) == {_TAG_CLASS, "fields"}:
            cls = _CLASSES.get(obj[_TAG_CLASS])
            if cls is None:
                raise ValueError(f"checkpoint names an unknown state class {obj[_TAG_CLASS]!r}")
            return cls(**{k: decode(v) for k, v in obj["fields"].items()})
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(decode(v) for v in obj)
    if isinstance(obj, (set, frozenset)):
        return {decode(v) for v in obj}
    return obj


def tree_map(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor inside it; containers are rebuilt only when a
    tensor in them changed, so mapping the identity costs nothing."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = {k: tree_map(fn, v) for k, v in obj.items()}
        return obj if all(out[k] is obj[k] for k in obj) else out
    if isinstance(obj, list):
        out_list = [tree_map(fn, v) for v in obj]
        return obj if all(a is b for a, b in zip(out_list, obj)) else out_list
    if isinstance(obj, tuple):
        out_tuple = tuple(tree_map(fn, v) for v in obj)
        return obj if all(a is b for a, b in zip(out_tuple, obj)) else out_tuple
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: tree_map(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if all(changes[k] is getattr(obj, k) for k in changes):
            return obj
        return dataclasses.replace(obj, **changes)
    return obj


def to_device(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with its tensors on ``device`` (the same object when they already are)."""
    device = torch.device(device)
    return tree_map(lambda t: t if t.device == device else t.to(device), obj)


def clone(obj: Any) -> Any:
    """A copy of ``obj`` that shares no tensor storage with it."""
    return tree_map(lambda t: t.detach().clone(), _rebuild(obj))


def _rebuild(obj: Any) -> Any:
    """New containers all the way down (so a clone never shares a dict with its source)."""
    if isinstance(obj, dict):
        return {k: _rebuild(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(v) for v in obj)
    if isinstance(obj, set):
        return set(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _rebuild(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    return obj


def nbytes(obj: Any) -> int:
    """Bytes of the tensors inside ``obj`` (each storage counted once)."""
    seen: set[int] = set()
    total = 0

    def visit(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    tree_map(visit, obj)
    return total


def storages(obj: Any) -> set[int]:
    """The storages (data pointers) of the tensors inside ``obj``."""
    out: set[int] = set()
    tree_map(lambda t: out.add(t.untyped_storage().data_ptr()) or t, obj)
    return out


__all__ = ["checkpointable", "clone", "decode", "encode", "nbytes", "storages", "to_device", "tree_map"]
