"""Typed, validated dataclasses built from plain dicts (YAML, --set overrides).

Every config object in pfl (experiment config, method hyperparameters, data-source parameters,
search spaces) is a dataclass whose fields are declared with :func:`hp`. :func:`from_dict` turns a
nested dict into such a dataclass and rejects, before any work starts, unknown keys, values of the
wrong type and values out of range, with a message that names the dotted field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Union


class ConfigError(ValueError):
    """A configuration value is invalid. ``field`` is the dotted path of the offending key."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message  # without the field, for errors that re-raise with more context
        super().__init__(f"{field}: {message}" if field else message)


def hp(default: Any = dataclasses.MISSING, doc: str = "", *, low: float | None = None,
       high: float | None = None, low_open: bool = False, high_open: bool = False,
       choices: typing.Sequence[Any] | None = None, default_factory: Any = dataclasses.MISSING,
       allow_inf: bool = False):
    """A dataclass field with documentation and range/choice constraints.

    ``low``/``high`` bound numbers (inclusive unless ``*_open``); ``choices`` enumerates the allowed
    values of a string (or any) field; ``allow_inf`` admits +inf where it is a meaningful setting
    (the ∞-norm of a quantizer), never nan.
    """
    meta = {"doc": doc, "low": low, "high": high, "low_open": low_open, "high_open": high_open,
            "choices": tuple(choices) if choices is not None else None, "allow_inf": allow_inf}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe_type(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert ``value`` to the annotated type ``tp`` or raise ConfigError naming ``path``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(path, f"expected {_describe_type(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping of {sorted(field_names(tp))}, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (list, tuple, typing.Sequence):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {value!r}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off"):
            return value.lower() in ("true", "yes", "on")
        raise ConfigError(path, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(path, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(path, f"expected a number, got {value!r}")
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(path, f"expected a number, got {value!r}")
        if math.isnan(number):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(path, f"expected a string, got {value!r}")
    return value


def _check_constraints(value: Any, meta: typing.Mapping[str, Any], path: str) -> None:
    if value is None:
        return
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        hint = did_you_mean(value, [str(c) for c in choices])
        raise ConfigError(path, f"{value!r} is not allowed{hint}; allowed values: "
                                f"{', '.join(map(str, choices))}")
    low, high = meta.get("low"), meta.get("high")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if low is not None and (value < low or (meta.get("low_open") and value == low)):
            op = ">" if meta.get("low_open") else ">="
            raise ConfigError(path, f"{value!r} is out of range; must be {op} {low}{_range_tail(meta)}")
        if high is not None and (value > high or (meta.get("high_open") and value == high)):
            op = "<" if meta.get("high_open") else "<="
            raise ConfigError(path, f"{value!r} is out of range; must be {op} {high}{_range_tail(meta)}")


def _range_tail(meta: typing.Mapping[str, Any]) -> str:
    low, high = meta.get("low"), meta.get("high")
    if low is not None and high is not None:
        lb = "(" if meta.get("low_open") else "["
        rb = ")" if meta.get("high_open") else "]"
        return f" (allowed range {lb}{low}, {high}{rb})"
    return ""


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def did_you_mean(name: object, choices: typing.Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to a mistyped ``name``; empty when none is close."""
    close = difflib.get_close_matches(str(name), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_key_error(key: str, allowed: typing.Iterable[str], path: str) -> ConfigError:
    allowed = sorted(allowed)
    hint = did_you_mean(key, allowed)
    return ConfigError(_join(path, key), f"unknown field{hint}; allowed fields: {', '.join(allowed)}")


def from_dict(cls: type, data: typing.Mapping[str, Any] | None, path: str = ""):
    """Build dataclass ``cls`` from ``data``, validating names, types and ranges."""
    if data is not None and not isinstance(data, typing.Mapping):
        raise ConfigError(path or cls.__name__, f"expected a mapping of {', '.join(field_names(cls))}, "
                                                f"got {data!r}")
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise unknown_key_error(key, fields, path)
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            value = _coerce(data[name], hints[name], _join(path, name))
            if isinstance(value, float) and math.isinf(value) and not (value > 0 and f.metadata.get("allow_inf")):
                raise ConfigError(_join(path, name), f"expected a finite number, got {data[name]!r}")
            _check_constraints(value, f.metadata, _join(path, name))
            kwargs[name] = value
    try:
        obj = cls(**kwargs)
    except TypeError as err:  # a required field is missing
        raise ConfigError(path, str(err)) from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate(path)
    return obj


def check(obj: Any, path: str = "") -> None:
    """Re-validate an existing dataclass instance (after programmatic edits)."""
    from_dict(type(obj), to_dict(obj), path)


def to_dict(obj: Any) -> Any:
    """Plain-data view (dicts, lists, scalars) of a dataclass tree, suitable for YAML (an object
    with its own ``to_dict`` gives that)."""
    if callable(getattr(obj, "to_dict", None)) and not isinstance(obj, type):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def flatten(d: typing.Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        path = _join(prefix, key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def describe(cls: type) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, doc + constraints) rows for listing a dataclass's fields."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "(required)"
        doc = f.metadata.get("doc", "")
        extra = []
        if f.metadata.get("choices"):
            extra.append("one of " + ", ".join(map(str, f.metadata["choices"])))
        low, high = f.metadata.get("low"), f.metadata.get("high")
        if low is not None or high is not None:
            extra.append(f"range [{'-inf' if low is None else low}, {'inf' if high is None else high}]")
        if extra:
            doc = f"{doc} ({'; '.join(extra)})" if doc else "; ".join(extra)
        rows.append((f.name, _describe_type(hints[f.name]), default, doc))
    return rows
