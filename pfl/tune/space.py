"""Declarative search spaces (``search_spaces/*.yaml``), validated before Ray starts.

A file looks like::

    description: FedProx's proximal weight on Fashion-MNIST Dirichlet(0.1)
    scenario: fmnist_dir01          # a named scenario from search_spaces/scenarios.yaml, or
    base: {data.source: digits}     # inline dotted config values (applied after the scenario)
    fixed: {method.name: fedprox, federation.rounds: 50}
    search:
      method.mu: {type: loguniform, low: 0.001, high: 1.0}
      federation.lr: {type: choice, values: [0.01, 0.05, 0.1]}
    metric: val/acc_mean
    mode: max
    num_samples: 16
    searcher: optuna                # optuna (TPE) | random | grid
    scheduler: {type: asha, grace_period: 5, reduction_factor: 2}   # or null
    resources: {cpu: 1, gpu: 0}
    max_concurrent: 2
    smoke: {federation.rounds: 3, data.max_samples: 600}            # what --smoke changes
    smoke_samples: 2

Every searched key must be a config field the resolved method accepts: the file is checked by
building a config with each key set to a value from its range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import apply_overrides, load_spec_file, parse_yaml_file
from ..metric_catalog import metric_known, reported_metrics
from ..resolver import resolve
from ..schema import ConfigError, did_you_mean, from_dict, hp

DISTRIBUTIONS = ("choice", "grid", "uniform", "loguniform", "randint", "quniform")
SEARCHERS = ("optuna", "random", "grid")


@dataclass
class Distribution:
    type: str = hp("choice", "distribution kind", choices=DISTRIBUTIONS)
    values: list | None = hp(None, "candidate values (choice, grid)")
    low: float | None = hp(None, "lower bound (uniform, loguniform, randint, quniform)")
    high: float | None = hp(None, "upper bound (inclusive for uniform/loguniform, exclusive for randint)")
    q: float | None = hp(None, "step (quniform)", low=0.0, low_open=True)

    def validate(self, path: str) -> None:
        if self.type in ("choice", "grid"):
            if not self.values:
                raise ConfigError(f"{path}.values", f"{self.type} needs a non-empty list of values")
            return
        if self.low is None or self.high is None:
            raise ConfigError(path, f"{self.type} needs low and high")
        if self.low > self.high:
            raise ConfigError(f"{path}.low", f"low ({self.low}) is greater than high ({self.high})")
        if self.type == "loguniform" and self.low <= 0:
            raise ConfigError(f"{path}.low", "loguniform needs low > 0")
        if self.type == "quniform" and self.q is None:
            raise ConfigError(f"{path}.q", "quniform needs q")

    def examples(self) -> list[Any]:
        """Values from the range, to check that the config accepts them."""
        if self.type in ("choice", "grid"):
            return list(self.values or [])
        if self.type == "randint":
            return [int(self.low), int(self.high) - 1]
        return [self.low, self.high]

    def to_tune(self):
        from ray import tune

        if self.type == "choice":
            return tune.choice(self.values)
        if self.type == "grid":
            return tune.grid_search(self.values)
        if self.type == "uniform":
            return tune.uniform(self.low, self.high)
        if self.type == "loguniform":
            return tune.loguniform(self.low, self.high)
        if self.type == "randint":
            return tune.randint(int(self.low), int(self.high))
        return tune.quniform(self.low, self.high, self.q)


@dataclass
class Scheduler:
    type: str = hp("asha", "early-stopping scheduler", choices=("asha",))
    grace_period: int = hp(5, "rounds every trial runs before it may be stopped", low=1)
    reduction_factor: float = hp(2.0, "ASHA's reduction factor", low=1.0, low_open=True)


@dataclass
class Resources:
    cpu: float = hp(1.0, "CPUs per trial", low=0.0, low_open=True)
    gpu: float = hp(0.0, "GPUs per trial (fractions share a GPU)", low=0.0)


@dataclass
class SearchSpace:
    description: str = hp("", "what this space is for")
    scenario: str | None = hp(None, "named scenario in search_spaces/scenarios.yaml")
    base: dict = hp(default_factory=dict, doc="dotted config values applied after the scenario")
    fixed: dict = hp(default_factory=dict, doc="dotted config values fixed for every trial")
    search: dict = hp(default_factory=dict, doc="dotted key -> distribution")
    metric: str = hp("val/acc_mean", "metric the search optimises")
    mode: str = hp("max", "optimisation direction", choices=("max", "min"))
    num_samples: int = hp(8, "number of trials (per grid point for grid values)", low=1)
    searcher: str = hp("optuna", "search algorithm", choices=SEARCHERS)
    scheduler: Scheduler | None = hp(None, "optional early stopping (ASHA)")
    resources: Resources = hp(default_factory=Resources, doc="resources per trial")
    max_concurrent: int = hp(0, "trials at once (0 = as many as resources allow)", low=0)
    checkpoint_every: int = hp(5, "rounds between trial checkpoints", low=1)
    seed: int = hp(0, "searcher seed", low=0)
    smoke: dict = hp(default_factory=dict, doc="dotted config values applied by --smoke")
    smoke_samples: int = hp(2, "trials in --smoke mode", low=1)
    pipeline: dict = hp(default_factory=dict, doc="settings of the pipeline that runs this space "
                        "(e.g. tune_fpfc.py's λ path), validated by that pipeline")
    presets: dict = hp(default_factory=dict, doc="named presets: {name: {config: {dotted: value}, "
                       "pipeline: {...}, num_samples: N}}")

    # filled by load_space
    path: str = ""
    distributions: dict = field(default_factory=dict)

    def validate(self, path: str) -> None:
        dists = {}
        for key, spec in self.search.items():
            if not isinstance(spec, dict):
                spec = {"type": "choice", "values": spec if isinstance(spec, list) else [spec]}
            dists[key] = from_dict(Distribution, spec, f"{path}.search.{key}" if path else f"search.{key}")
        self.distributions = dists
        if self.searcher == "grid" and any(d.type not in ("grid", "choice") for d in dists.values()):
            raise ConfigError("searcher", "grid search needs grid/choice distributions only")


PROJECT_SCENARIOS = Path(__file__).resolve().parents[2] / "search_spaces" / "scenarios.yaml"


def _read_scenarios(path: Path) -> dict:
    loaded = parse_yaml_file(path, "scenario") or {}
    if not isinstance(loaded, dict):
        raise ConfigError("scenario", f"{path} must map scenario names to dotted config values")
    return loaded


def load_scenario(name: str, space_path: Path | None = None) -> dict:
    """Scenario ``name``: from a ``scenarios.yaml`` beside the space file when that file defines
    it, else from the project's ``search_spaces/scenarios.yaml``."""
    places = [space_path.parent / "scenarios.yaml"] if space_path else []
    places = [p for p in places if p.resolve() != PROJECT_SCENARIOS] + [PROJECT_SCENARIOS]
    known: dict[str, Path] = {}
    for path in places:
        if not path.is_file():
            continue
        scenarios = _read_scenarios(path)
        if name in scenarios:
            value = scenarios[name]
            if not isinstance(value, dict):
                raise ConfigError(f"scenario.{name}", f"{path}: a scenario maps dotted keys to values, "
                                                      f"got {value!r}")
            return dict(value)
        known.update({k: path for k in scenarios if k not in known})
    raise ConfigError("scenario", f"unknown scenario {name!r}; allowed: {', '.join(sorted(known))} "
                                  f"(looked in {', '.join(str(p) for p in places if p.is_file())})")


def load_space(path: str | Path) -> SearchSpace:
    return load_spec_file(path, SearchSpace, "space", "search-space")


def base_config(space: SearchSpace, overrides: list[str] | None = None, smoke: bool = False) -> dict:
    """The raw (dotted-applied) config every trial starts from."""
    raw: dict = {}
    space_path = Path(space.path) if space.path else None
    if space.scenario:
        raw = apply_overrides(raw, load_scenario(space.scenario, space_path))
    raw = apply_overrides(raw, space.base)
    raw = apply_overrides(raw, space.fixed)
    if smoke:
        raw = apply_overrides(raw, space.smoke)
    raw = apply_overrides(raw, overrides or [])
    return raw


def check_space(space: SearchSpace, raw: dict, extra_metrics: tuple[str, ...] = ()) -> None:
    """Resolve the base config and, for each searched key, a config with that key set (per value);
    the space's ``metric`` must be one the trials report (``extra_metrics``: a pipeline's own)."""
    try:
        base = resolve(raw)
    except ConfigError as err:
        raise ConfigError(err.field, f"{err.message} (in the scenario/base/fixed values of {space.path})") from None
    catalog = list(reported_metrics(base)) + list(extra_metrics)
    for key, dist in space.distributions.items():
        for value in dist.examples():
            try:
                cfg = resolve(apply_overrides(raw, {key: value}))
            except ConfigError as err:
                raise ConfigError(f"search.{key}", f"{err}") from None
            catalog += [m for m in reported_metrics(cfg) if m not in catalog]
    if not metric_known(space.metric, catalog):
        hint = did_you_mean(space.metric, [m for m in catalog if "*" not in m])
        raise ConfigError("metric", f"{space.metric!r} in {space.path} is not a metric the trials report{hint}; "
                                    f"reported: {', '.join(catalog)}")


def grid_size(space: SearchSpace) -> int:
    return math.prod(len(d.values or []) for d in space.distributions.values() if d.type == "grid") or 1


def describe_search(space: SearchSpace) -> str:
    """What a sweep searches, in words: ``method.rho ∈ {1, 1.5} (optuna)``."""
    def values(dist: Distribution) -> str:
        if dist.type in ("choice", "grid"):
            return "{" + ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in dist.values or []) + "}"
        return f"{dist.type}[{dist.low:g}, {dist.high:g}]"

    if not space.distributions:
        return "nothing (one setting)"
    parts = ", ".join(f"{k} ∈ {values(d)}" for k, d in space.distributions.items())
    grid = space.searcher == "grid" or all(d.type == "grid" for d in space.distributions.values())
    how = "a grid" if grid else space.searcher
    return f"{parts} ({how})"
