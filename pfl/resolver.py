"""The resolver: a raw config (YAML, dotted overrides) checked against the registries and across sections.

:mod:`pfl.config` is plain typed data; this module sits above it and above the registries of data
sources (:mod:`pfl.data`), models (:mod:`pfl.models`), methods (:mod:`pfl.methods`) and
compressors (:mod:`pfl.compression`), and builds every :class:`~pfl.config.ExperimentConfig` a run
uses. :func:`resolve` validates each section (unknown fields, types, ranges), completes what the
registries decide (the data source's parameters and partition, the model ``auto`` stands for, the
method's hyperparameter dataclass, the compressors' full parameter sets), then checks what one
section requires of another (attacks, newcomers, compression, the asynchronous driver). Anything
wrong is a :class:`~pfl.schema.ConfigError` naming the dotted field and what is allowed, before any
data is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .compression.checks import check_method_compression, resolve_compression
from .config import (SECTIONS, AttackConfig, CompressionConfig, DataConfig, EvaluationConfig, ExperimentConfig,
                     FederationConfig, ModelConfig, NewcomersConfig, TrackingConfig, apply_overrides, read_yaml,
                     round_share)
from .data import resolve_data_config
from .federation import attacks  # noqa: F401  (registers the attack stage)
from .federation.wire import stage_names
from .methods import get_method, list_methods, resolve_method_config
from .models import resolve_model_config
from .plugins import load_plugins
from .schema import ConfigError, flatten, from_dict, unknown_key_error


def resolve(raw: dict | None) -> ExperimentConfig:
    """Validate a nested dict into an :class:`ExperimentConfig` (registries included)."""
    raw = dict(raw or {})
    for key in raw:
        if key not in SECTIONS:
            raise unknown_key_error(key, SECTIONS, "")
        if key not in ("seed", "plugins") and raw[key] is not None and not isinstance(raw[key], dict):
            raise ConfigError(key, f"expected a mapping of {key} settings, got {raw[key]!r}")
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError("seed", f"expected a non-negative integer, got {seed!r}")
    plugins = load_plugins(raw.get("plugins"))  # first: they may register methods, models, sources
    data = from_dict(DataConfig, raw.get("data"), "data")
    resolve_data_config(data)
    model = from_dict(ModelConfig, raw.get("model"), "model")
    method_raw = dict(raw.get("method") or {})
    if not isinstance(raw.get("method", {}), (dict, type(None))):
        raise ConfigError("method", "expected a mapping with at least 'name'")
    name = method_raw.pop("name", "fedavg")
    method = resolve_method_config(name, method_raw)
    federation = from_dict(FederationConfig, raw.get("federation"), "federation")
    tracking = from_dict(TrackingConfig, raw.get("tracking"), "tracking")
    compression = from_dict(CompressionConfig, raw.get("compression"), "compression")
    resolve_compression(compression)
    attack = from_dict(AttackConfig, raw.get("attack"), "attack")
    newcomers = from_dict(NewcomersConfig, raw.get("newcomers"), "newcomers")
    evaluation = from_dict(EvaluationConfig, raw.get("evaluation"), "evaluation")
    cfg = ExperimentConfig(seed=seed, plugins=plugins, data=data, model=model, method=method, federation=federation,
                           tracking=tracking, compression=compression, attack=attack, newcomers=newcomers,
                           evaluation=evaluation)
    resolve_model_config(cfg)
    names = stage_names()
    if sorted(federation.stages) != sorted(names):
        raise ConfigError("federation.stages", f"must name each of {', '.join(names)} once, in the order the "
                                               f"sender runs them; got {federation.stages}")
    check_method_compression(cfg, get_method(name))
    _check_attack_and_newcomers(cfg)
    if federation.driver == "async" and not get_method(name).supports_async:
        able = ", ".join(m.name for m in list_methods() if m.supports_async)
        raise ConfigError("federation.driver", f"method {name!r} has no asynchronous form; "
                                               f"'async' is allowed for: {able}")
    if federation.driver == "async" and "trained_apart" not in (raw.get("evaluation") or {}):
        evaluation.trained_apart = False  # the default's: an asynchronous run has no rounds of sampled clients
    if federation.driver == "async" and (evaluation.when or evaluation.local_model or evaluation.trained_apart):
        key = "when" if evaluation.when else "local_model" if evaluation.local_model else "trained_apart"
        raise ConfigError(f"evaluation.{key}", "evaluates around synchronous rounds; with federation.driver=async "
                                               "allowed: evaluation.when=[], local_model=false, trained_apart=false")
    return cfg


def _check_attack_and_newcomers(cfg: ExperimentConfig) -> None:
    """What the ``attack`` and ``newcomers`` sections need from the rest of the config."""
    m = cfg.data.num_clients
    cls = get_method(cfg.method.name)
    if cfg.attack.kind != "none":
        if not cls.attackable_uplink:
            raise ConfigError("attack.kind", f"method {cfg.method.name!r} uploads no model ({cls.uplink_note}); "
                                             "the attacks rewrite model uploads, so use attack.kind=none")
    if getattr(cfg.method.hparams, "aggregator", "mean") != "mean" and cls.compresses_uplink:
        # DIANA, LAG inherit FedAvg's keys but combine their own encoded updates, not through reply_average
        raise ConfigError("method.aggregator", f"method {cfg.method.name!r} combines the encoded updates of its "
                                               "own protocol; the robust rules do not apply to it: use "
                                               "aggregator=mean")
    newcomers = round_share(m, cfg.newcomers.fraction)
    if newcomers and newcomers >= m:
        raise ConfigError("newcomers.fraction", f"{cfg.newcomers.fraction} of {m} clients leaves none to train")


def with_overrides(cfg: ExperimentConfig, overrides: dict[str, Any] | list[str]) -> ExperimentConfig:
    """A new, validated config: ``cfg`` with dotted overrides applied."""
    return resolve(apply_overrides(cfg.to_dict(), overrides))


def load(path: str | Path | None = None, overrides: list[str] | dict | None = None,
         scenario: dict[str, Any] | None = None, plugins: list[str] | None = None) -> ExperimentConfig:
    """Read a YAML file (or start from the defaults), apply overrides, validate.

    ``scenario`` ({dotted key: value}) comes first; the file and then the overrides change it;
    ``plugins`` (``--plugin``) are added to the config's."""
    raw = read_yaml(path) if path is not None else {}
    if scenario:
        raw = apply_overrides(apply_overrides({}, scenario), flatten(raw))
    raw = apply_overrides(raw, overrides)
    if plugins:
        raw["plugins"] = list(raw.get("plugins") or []) + list(plugins)
    return resolve(raw)


__all__ = ["load", "resolve", "with_overrides"]
