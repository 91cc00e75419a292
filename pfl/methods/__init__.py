"""Registry of federated methods by name.

A method module defines a :class:`~pfl.methods.base.Method` subclass with a ``name``, a
hyperparameter dataclass ``Hparams`` and the round hooks, and decorates it with :func:`register`.
Method modules are imported here so that registering is a side effect of importing ``pfl.methods``.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..config import MethodConfig
from ..registry import Registry
from ..schema import ConfigError, from_dict
from .base import GLOBAL, ClientHandle, EvalPlan, Method, NoHparams

#: plugins compose with a base method by name: ``method.name=fedprox+ala`` is FedProx with ALA.
#: A plugin is a function (base class) -> composed class (with merged Hparams).
PLUGINS: Registry = Registry("method plug-in", "method.name", sort=True)


def _load_all() -> None:
    """Import every module of this package once (each registers its methods)."""
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("base",):
            importlib.import_module(f"{__name__}.{info.name}")


def _compose(name: str) -> type[Method] | None:
    """Build ``base+plugin`` method classes on demand (the registry caches them)."""
    if "+" not in name:
        return None
    base_name, _, plugin = name.partition("+")
    if base_name not in METHODS:
        raise ConfigError("method.name", f"unknown base method {base_name!r} in {name!r}; "
                                         f"allowed: {', '.join(METHODS.names())}")
    if plugin not in PLUGINS:
        raise ConfigError("method.name", f"unknown plugin {plugin!r} in {name!r}; "
                                         f"allowed: {', '.join(PLUGINS.names()) or '(none)'}")
    cls = PLUGINS.get(plugin)(METHODS.get(base_name))
    cls.name = name
    return cls


METHODS: Registry[type[Method]] = Registry("method", "method.name", sort=True, load=_load_all, missing=_compose)


def register_plugin(name: str, compose) -> None:
    """Register ``compose(base_cls) -> cls`` so that ``<base>+<name>`` is a method name."""
    PLUGINS.register(name, compose, replace=True)


def register(cls: type[Method]) -> type[Method]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    return METHODS.register(cls.name, cls)


def get_method(name: str) -> type[Method]:
    return METHODS.get(name)


def list_methods() -> list[type[Method]]:
    """Every registered method (composed ``base+plugin`` ones once built), sorted by name."""
    return METHODS.values()


def resolve_method_config(name: object, raw: dict) -> MethodConfig:
    if not isinstance(name, str):
        raise ConfigError("method.name", f"expected a method name, got {name!r}")
    cls = METHODS.get(name)
    return MethodConfig(name=name, hparams=from_dict(cls.Hparams, raw, "method"))


__all__ = ["GLOBAL", "METHODS", "ClientHandle", "EvalPlan", "Method", "NoHparams", "get_method", "list_methods",
           "register", "register_plugin", "resolve_method_config"]
