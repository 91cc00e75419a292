"""Registry of federated methods by name.

A method module defines a :class:`~pfl.methods.base.Method` subclass with a ``name``, a
hyperparameter dataclass ``Hparams`` and the round hooks, and decorates it with :func:`register`.
Method modules are imported here so that registering is a side effect of importing ``pfl.methods``.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..config import MethodConfig
from ..schema import ConfigError, from_dict
from .base import GLOBAL, ClientHandle, EvalPlan, Method, NoHparams

_REGISTRY: dict[str, type[Method]] = {}
#: plugins compose with a base method by name: ``method.name=fedprox+ala`` is FedProx with ALA.
#: A plugin is a function (base class) -> composed class (with merged Hparams).
_PLUGINS: dict[str, object] = {}
_LOADED = False


def register_plugin(name: str, compose) -> None:
    """Register ``compose(base_cls) -> cls`` so that ``<base>+<name>`` is a method name."""
    _PLUGINS[name] = compose


def _compose(name: str) -> type[Method] | None:
    """Build (and cache) ``base+plugin`` method classes on demand."""
    if "+" not in name:
        return None
    base_name, _, plugin = name.partition("+")
    if base_name not in _REGISTRY:
        raise ConfigError("method.name", f"unknown base method {base_name!r} in {name!r}; "
                                         f"allowed: {', '.join(sorted(_REGISTRY))}")
    if plugin not in _PLUGINS:
        raise ConfigError("method.name", f"unknown plugin {plugin!r} in {name!r}; "
                                         f"allowed: {', '.join(sorted(_PLUGINS)) or '(none)'}")
    cls = _PLUGINS[plugin](_REGISTRY[base_name])
    cls.name = name
    _REGISTRY[name] = cls
    return cls


def register(cls: type[Method]) -> type[Method]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    """Import every module of this package once (each registers its methods)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("base",):
            importlib.import_module(f"{__name__}.{info.name}")


def get_method(name: str) -> type[Method]:
    _load_all()
    if name not in _REGISTRY:
        _compose(name)
    if name not in _REGISTRY:
        raise ConfigError("method.name", f"unknown method {name!r}; allowed: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def list_methods() -> list[type[Method]]:
    _load_all()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def resolve_method_config(name: object, raw: dict) -> MethodConfig:
    if not isinstance(name, str):
        raise ConfigError("method.name", f"expected a method name, got {name!r}")
    import difflib

    _load_all()
    if name not in _REGISTRY:
        _compose(name)
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError("method.name", f"unknown method {name!r}{hint}; allowed: {', '.join(sorted(_REGISTRY))}")
    cls = _REGISTRY[name]
    return MethodConfig(name=name, hparams=from_dict(cls.Hparams, raw, "method"))


__all__ = ["GLOBAL", "ClientHandle", "EvalPlan", "Method", "NoHparams", "get_method", "list_methods", "register",
           "register_plugin", "resolve_method_config"]
