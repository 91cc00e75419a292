"""A comparison table as a YAML file: its scenario, rows (or grids of rows), seeds and columns.

A table file is validated like a search space before anything runs: an unknown key is refused
with a "did you mean", and every problem is one line naming the file and the key. ``cells``
turns a table into its cells (row × seed), each a resolved config, every config error first.

Layering of one cell's config: the scenario (the row's, else the table's), the table's ``set``, its
preset's values (``--preset NAME``; ``--quick`` is ``--preset quick``), the command line's ``--set``
of ``method.*`` keys, the row's ``set`` and its preset's values, the rest of ``--set``, ``--row-set``,
the seed and the tracking switch. A row's method values come after the shared ones because a row is
what the table compares (FedSLR's tuned Ditto λ beats a shared ``method.lam``; ``--row-set`` changes
one row's); every other ``--set`` value is the user's last word for every row (rounds, data, device).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import apply_overrides, load_spec_file
from ..schema import ConfigError, did_you_mean, hp
from ..tune.space import Resources, load_scenario

READS = ("last_mean", "final", "best", "mean", "sum", "per_round")
TEXT_KINDS = ("tag", "config", "bytes", "values")
TEMPLATE = re.compile(r"\{([^{}]+)\}")


@dataclass
class Column:
    name: str = hp(doc="the column's key in the records (and the CSV)")
    metric: str = hp("", "a run metric; empty when the table's measure hook gives the column")
    read: str = hp("final", "how the metric is read from a run's history", choices=READS)
    title: str = hp("", "the column's heading (default: the name)")
    scale: float = hp(1.0, "printed value = value × scale")
    digits: int = hp(2, "decimals printed", low=0)
    show: bool = hp(True, "a column of the printed table (false: only in the CSV, for a text column or a plot)")


@dataclass
class TextColumn:
    title: str = hp(doc="the column's heading")
    kind: str = hp("tag", "tag: a row's tag; config: a config value; bytes: a column's mean as bytes; "
                          "values: a fixed text per row", choices=TEXT_KINDS)
    key: str = hp("", "the tag, dotted config key or column it shows")
    values: dict = hp(default_factory=dict, doc="ROW (or GROUP/ROW in a group) → text (kind values)")


@dataclass
class Plot:
    x: str = hp(doc="summary: a column or config:<dotted key> (a row parameter); curve: a run metric")
    y: str = hp("value", "summary: a column ('value': the table's metric); curve: a run metric")
    kind: str = hp("summary", "summary: mean ± std over seeds per row; curve: every round of the first seed's runs",
                   choices=("summary", "curve"))
    series: str = hp("group", "one line per group or per row", choices=("group", "row"))
    facet: str = hp("", "one figure per group, or per value of config:<dotted key>; empty: one figure")
    title: str = hp("", "the plot's title")
    logx: bool = hp(False, "a logarithmic x axis")


@dataclass
class RowEntry:
    name: str = hp("", "the row's name; in a grid a template such as '{method.name} λ={method.lam}'")
    scenario: str | None = hp(None, "the row's named scenario, in place of the table's")
    group: str = hp("", "the row's group (a template in a grid); the reference is chosen per group")
    set: dict = hp(default_factory=dict, doc="dotted config values of the row")
    grid: dict = hp(default_factory=dict, doc="dotted key → values, or axis → {label: {dotted: value}}: one row "
                                              "per combination")
    presets: dict = hp(default_factory=dict, doc="preset name → the row's dotted values under it")
    tags: dict = hp(default_factory=dict, doc="text shown by 'tag' columns (templates allowed)")
    optional: bool = hp(False, "run only when --rows or --only names it")


@dataclass
class TableSpec:
    description: str = hp("", "what the table compares")
    name: str = hp("", "the MLflow parent run and the artifacts' name (default: the file's stem)")
    scenario: str | None = hp(None, "named scenario in search_spaces/scenarios.yaml")
    set: dict = hp(default_factory=dict, doc="dotted config values of every row")
    presets: dict = hp(default_factory=dict, doc="preset name → dotted values (--preset NAME; --quick: quick)")
    rows: list[RowEntry] = hp(default_factory=list, doc="the rows, or grids that expand into rows")
    seeds: list[int] = hp(default_factory=lambda: [0, 1, 2], doc="every row runs once per seed")
    metric: str = hp("test/acc_mean", "the table's metric")
    read: str = hp("last_mean", "how the metric is read; column: the metric is a column a hook gives",
                   choices=("last_mean", "final", "best", "column"))
    last: int = hp(3, "evaluations averaged by last_mean", low=1)
    title: str = hp("acc %", "the metric column's heading")
    scale: float = hp(100.0, "printed metric = value × scale")
    reference: Any = hp(None, "null, best, a row name, or {group: row name}")
    columns: list[Column] = hp(default_factory=list, doc="metric columns beside the table's metric")
    text_columns: list[TextColumn] = hp(default_factory=list, doc="text columns")
    measure: str = hp("", "a table hook: a run's summary → extra columns of its record (in the driver)")
    trial: str = hp("", "a table hook: the finished run's loop → extra columns (in the cell's worker)")
    records: str = hp("", "a table hook: all records → records (columns that compare cells)")
    headline: str = hp("", "a table hook: the summary rows → numbers printed and logged on the parent run")
    report: str = hp("", "a table hook: the summary rows → Markdown and figures added after the table")
    notes: list[str] = hp(default_factory=list, doc="lines under the table")
    plots: list[Plot] = hp(default_factory=list, doc="plots logged with the table")
    resources: Resources = hp(default_factory=Resources, doc="resources per cell (a Ray Tune trial)")
    max_concurrent: int = hp(0, "cells at once (0: as many as the resources allow)", low=0)
    checkpoint_every: int = hp(5, "rounds between a cell's checkpoints (what a resume continues from)", low=1)

    path: str = ""

    @property
    def key(self) -> str:
        """The record column the table compares."""
        return self.metric if self.read == "column" else self.read

    def validate(self, path: str) -> None:
        if not self.rows:
            raise ConfigError("rows", "a table needs at least one row")
        for i, entry in enumerate(self.rows):
            if not entry.name and not entry.grid:
                raise ConfigError(f"rows[{i}].name", "a row needs a name (a grid may use a template)")
        if self.reference is not None and not isinstance(self.reference, (str, dict)):
            raise ConfigError("reference", f"expected null, best, a row name or {{group: row}}, got {self.reference!r}")


@dataclass
class Row:
    name: str
    group: str
    set: dict
    presets: dict
    tags: dict = field(default_factory=dict)
    optional: bool = False
    scenario: str | None = None


@dataclass
class Cell:
    index: int
    row: Row
    seed: int
    raw: dict
    config: Any = None

    @property
    def label(self) -> str:
        return f"{self.row.group + ': ' if self.row.group else ''}{self.row.name} [seed {self.seed}]"


def load_table(path: str | Path) -> TableSpec:
    spec = load_spec_file(path, TableSpec, "table")
    spec.name = spec.name or Path(path).stem
    return spec


def _fill(template: str, values: dict[str, Any]) -> str:
    def one(m: re.Match) -> str:
        if m.group(1) not in values:
            raise KeyError(m.group(1))
        v = values[m.group(1)]
        return f"{v:g}" if isinstance(v, float) else str(v)

    return TEMPLATE.sub(one, template)


def expand(spec: TableSpec) -> list[Row]:
    """The table's rows, grids expanded in the order of their axes (the last axis varies fastest)."""
    rows: list[Row] = []
    for i, entry in enumerate(spec.rows):
        if not entry.grid:
            rows.append(Row(entry.name, entry.group, dict(entry.set), dict(entry.presets), dict(entry.tags),
                            entry.optional, entry.scenario))
            continue
        axes = []
        for axis, values in entry.grid.items():
            if isinstance(values, dict):    # label -> dotted values
                bad = [k for k, v in values.items() if not isinstance(v, dict)]
                if bad:
                    raise ConfigError(f"rows[{i}].grid.{axis}.{bad[0]}", "a labelled axis maps labels to "
                                                                          "{dotted: value} (in " + spec.path + ")")
                axes.append([(axis, label, dict(v)) for label, v in values.items()])  # a label may hold presets
            elif isinstance(values, list) and values:
                axes.append([(axis, v, {axis: v}) for v in values])
            else:
                raise ConfigError(f"rows[{i}].grid.{axis}", f"expected a non-empty list of values or "
                                                            f"{{label: {{dotted: value}}}} (in {spec.path})")
        for combo in itertools.product(*axes):
            names = {axis: label for axis, label, _ in combo}
            values = {k: v for _, _, over in combo for k, v in over.items() if k != "presets"}
            presets = {name: dict(v) for name, v in entry.presets.items()}
            for _, _, over in combo:
                for name, v in (over.get("presets") or {}).items():
                    presets[name] = {**presets.get(name, {}), **v}
            try:
                name = _fill(entry.name, names) if entry.name else " ".join(str(lab) for _, lab, _ in combo)
                group = _fill(entry.group, names)
                tags = {k: _fill(str(v), names) for k, v in entry.tags.items()}
            except KeyError as err:
                raise ConfigError(f"rows[{i}].name", f"the template names {{{err.args[0]}}}, which is not an axis "
                                                     f"of the grid{did_you_mean(err.args[0], names)}; axes: "
                                                     f"{', '.join(names)} (in {spec.path})") from None
            rows.append(Row(name, group, {**entry.set, **values}, presets, tags, entry.optional, entry.scenario))
    seen: set[tuple[str, str]] = set()
    for row in rows:
        if (row.group, row.name) in seen:
            raise ConfigError("rows", f"two rows are named {row.name!r}{' in group ' + repr(row.group) if row.group else ''}"
                                      f"; names must differ (in {spec.path})")
        seen.add((row.group, row.name))
    return rows


def parse_row_sets(items: list[str]) -> dict[str, dict[str, Any]]:
    """``ROW:key=value`` items (``--row-set ditto:method.lam=0.5``)."""
    from ..config import parse_value

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        row, sep, rest = item.partition(":")
        if not sep or "=" not in rest:
            raise ConfigError("--row-set", f"expected ROW:key=value, got {item!r}")
        key, value = rest.split("=", 1)
        out.setdefault(row, {})[key.strip()] = parse_value(value)
    return out


def select_rows(rows: list[Row], names: list[str] | None, only: list[str] | None) -> list[Row]:
    """``--rows`` (exact names) and ``--only`` (regular expressions searched in ``GROUP/ROW``); without
    either, the rows that are not optional."""
    if not names and not only:
        return [r for r in rows if not r.optional]
    if names:
        known = [r.name for r in rows]
        for n in names:
            if n not in known:
                raise ConfigError("--rows", f"no row {n!r}{did_you_mean(n, known)}; rows: {', '.join(known)}")
        rows = [r for r in rows if r.name in names]
    if only:
        try:
            patterns = [re.compile(t) for t in only]
        except re.error as err:
            raise ConfigError("--only", f"not a regular expression: {err}") from None
        rows = [r for r in rows if any(p.search(f"{r.group}/{r.name}" if r.group else r.name) for p in patterns)]
        if not rows:
            raise ConfigError("--only", f"no row's GROUP/ROW matches {' or '.join(map(repr, only))}")
    return rows


def method_rows(rows: list[Row], methods: list[str]) -> list[Row]:
    """The rows of ``methods`` (their ``method.name``): a method's ungrouped rows, or its grouped ones
    when it has none (the baselines table's FedAvg, not also its BatchNorm group's); a registered
    method without a row becomes one of its own, with its defaults (``--methods fedslr``)."""
    from ..methods import METHODS

    out = []
    for m in methods:
        mine = [r for r in rows if r.set.get("method.name") == m]
        mine = [r for r in mine if not r.group] or mine
        if not mine and "+" not in m and m not in METHODS:   # fedprox+ala: the resolver checks it
            raise METHODS.unknown(m, "--methods")
        out += mine or [Row(m, "", {"method.name": m}, {})]
    return out


def cells(spec: TableSpec, *, preset: str | None = None, overrides: list[str] | None = None,
          seeds: list[int] | None = None, row_sets: dict[str, dict] | None = None, rows: list[Row] | None = None,
          track: bool = True) -> list[Cell]:
    """Every (row, seed) of the table (``rows``: default all) with its resolved config; every error
    before any work."""
    from ..resolver import resolve

    rows = expand(spec) if rows is None else rows
    row_sets = row_sets or {}
    known_rows = [r.name for r in expand(spec)] + [r.name for r in rows]   # a row-set for an unselected row: fine
    for name in row_sets:
        if name not in known_rows:
            raise ConfigError("--row-set", f"no row {name!r}{did_you_mean(name, known_rows)}")
    known = set(spec.presets) | {p for r in rows for p in r.presets}
    if preset is not None and preset not in known:
        raise ConfigError("--preset", f"the table has no preset {preset!r}{did_you_mean(preset, known)}; "
                                      f"presets: {', '.join(sorted(known)) or 'none'} (in {spec.path})")
    def shared(scenario: str | None) -> dict:
        base: dict = {}
        if scenario:
            base = apply_overrides(base, load_scenario(scenario, Path(spec.path) if spec.path else None))
        for what, values in (("set", spec.set), (f"presets.{preset}", spec.presets.get(preset) or {})):
            try:
                base = apply_overrides(base, values)
            except ConfigError as err:
                raise ConfigError(f"{what}.{err.field}", f"{err.message} (in {spec.path})") from None
        return apply_overrides(base, methods)

    # --set: a method's hyperparameters before the rows (a row's method and its own values stay, and
    # a shared method.lam must not reach a row of another method), everything else after them
    given = [o if isinstance(o, str) else f"{o[0]}={o[1]}" for o in overrides or []]
    methods = [o for o in given if o.startswith("method.")]
    others = [o for o in given if not o.startswith("method.")]
    bases = {name: shared(name) for name in dict.fromkeys(r.scenario or spec.scenario for r in rows)}
    out: list[Cell] = []
    for seed in seeds if seeds is not None else spec.seeds:
        for row in rows:
            raw = apply_overrides(bases[row.scenario or spec.scenario], row.set)
            raw = apply_overrides(raw, row.presets.get(preset) or {})
            raw = apply_overrides(raw, others)
            raw = apply_overrides(raw, row_sets.get(row.name, {}))
            raw = apply_overrides(raw, {"seed": seed, "tracking.enabled": track})
            try:
                cfg = resolve(raw)
            except ConfigError as err:
                raise ConfigError(err.field, f"{err.message} (row {row.name!r} of {spec.path})") from None
            out.append(Cell(len(out), row, seed, raw, cfg))
    return out


def dotted(raw: dict, key: str) -> Any:
    value: Any = raw
    for part in key.split("."):
        value = value.get(part, "") if isinstance(value, dict) else ""
    return value


def fingerprint(table_cells: list[Cell]) -> str:
    """What a resume must find unchanged: every cell's label and config."""
    return json.dumps([[c.label, c.raw] for c in table_cells], sort_keys=True, default=str)


__all__ = ["Cell", "Column", "dotted", "Plot", "READS", "Row", "RowEntry", "TEXT_KINDS", "TableSpec", "TextColumn", "cells",
           "expand", "fingerprint", "load_table", "method_rows", "parse_row_sets", "select_rows"]
