"""The table engine: every cell (row × seed) of a table is a Ray Tune trial of the federated
trainable, so a table fills every core here and every node of a cluster.

A cell's trial is the sweeps' trial (:func:`pfl.tune.trainable.run_trial`: the round loop, MLflow
child run, Tune checkpoints every ``checkpoint_every`` rounds); at its end it reports its history
once more, and the driver reads each cell's values from it (:mod:`pfl.tables.read`), aggregates over
the seeds (:mod:`pfl.seeds`) and logs the table on one MLflow parent run. Ctrl-C / SIGTERM stop the
cells as a sweep's trials (exit 130 / 143); ``resume=True`` keeps the finished cells and continues
the cut ones from their checkpoints in their MLflow runs. A table that changed since is refused.

How a table ends: ``FINISHED`` (every cell ran; failed cells are counted apart and never averaged),
``FAILED`` (every cell failed) or ``INTERRUPTED``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..schema import ConfigError
from .cell import table_trainable
from .report import records_of
from .spec import Cell, TableSpec, fingerprint

STATE_FILE = "pfl_table.json"


@dataclass
class TableResult:
    summary: list[dict]
    records: list[dict]
    markdown: str
    parent_run_id: str | None
    experiment_path: str
    wall_s: float
    status: str = "FINISHED"
    exit_code: int = 0
    failures: dict[str, str] = field(default_factory=dict)
    cells: int = 0
    headline: dict[str, float] = field(default_factory=dict)


def check_cells(cells: list[Cell]) -> list:
    """Before Ray starts: the tracking store, every data set (read and partitioned with its first
    seed), each model on its data and each method's server memory; returns one config per distinct
    (data, model, method), what the workers need shipped."""
    from ..data import load_federated
    from ..models import check_model_on
    from ..schema import to_dict
    from ..server_memory import check_server_memory, config_model_size

    if any(c.config.tracking.enabled for c in cells):
        from ..tracking import check_store

        check_store()
    key = lambda *parts: json.dumps([to_dict(p) for p in parts], sort_keys=True, default=str)  # noqa: E731
    by_data: dict[str, dict[str, Any]] = {}
    for cell in cells:
        cfg = cell.config
        by_data.setdefault(key(cfg.data), {}).setdefault(key(cfg.model, cfg.method), cfg)
    distinct = []
    for configs in by_data.values():
        first = next(iter(configs.values()))
        data = load_federated(first.data, first.seed)
        for cfg in configs.values():
            distinct.append(cfg)
            check_model_on(cfg, data)  # a method may name the model's head (FedRep's)
            check_server_memory(cfg, len(data.clients), config_model_size(cfg, data.input_shape, data.num_classes),
                                here=False)
        del data
    return distinct


def run_table(spec: TableSpec, cells: list[Cell], *, address: str | None = None,
              resources: dict[str, float] | None = None, resume: bool = False, storage: str | Path = "ray_results",
              name: str | None = None, progress: Callable[[str], None] | None = print,
              outdir: str | Path | None = None) -> TableResult:
    """Run (or resume) the table's cells on Ray; see the module docstring."""
    from ray import tune

    from ..federation.workers import trial_bundles
    from ..tracking import Tracker, export_environment
    from ..tune.progress import ProgressLines
    from ..tune.ray_session import init_ray
    from ..tune.results import MlflowStatusCallback, kill_unfinished_children, saved_trials
    from ..tune.runtime_env import worker_runtime_env
    from ..tune.sweep import fit_tuner
    from .hooks import get_hook
    from .report import close_parent, summarize

    name = name or spec.name
    exp_path = Path(storage).resolve() / name
    state_path = exp_path / STATE_FILE
    print_fingerprint = fingerprint(cells)
    resuming = resume and tune.Tuner.can_restore(str(exp_path)) and state_path.is_file()
    if resuming:
        state = json.loads(state_path.read_text())
        if state.get("fingerprint") != print_fingerprint:
            raise ConfigError("--resume", f"the table at {exp_path} was run with other rows, seeds or settings; "
                                          "resume it with the same file and flags, or give --name for a new one")
    headline = get_hook(spec, "headline")
    for kind in ("measure", "trial", "records", "report"):   # an unknown name: before any work
        get_hook(spec, kind)
    distinct = check_cells(cells)
    first = cells[0].config
    on_cluster = bool(address or os.environ.get("RAY_ADDRESS"))
    shipped = worker_runtime_env(distinct, ship_data=on_cluster)
    res = {"cpu": spec.resources.cpu, "gpu": spec.resources.gpu, **(resources or {})}
    labels = [c.label for c in cells]
    label = lambda trial: labels[int((getattr(trial, "config", trial) or {}).get("cell", 0))]  # noqa: E731
    where = init_ray(address, runtime_env=shipped.runtime_env)
    if progress:
        progress(f"Ray: {where}; table {spec.path}: {len(cells)} cells ({len(cells) // len({c.seed for c in cells})} "
                 f"rows × {len({c.seed for c in cells})} seeds); experiment {exp_path}")
        for note in shipped.notes:
            progress(f"note: {note}")

    feds = [c.config.federation for c in cells]

    def bind(setup: dict[str, Any]):  # a cell with federation.workers asks for its workers too
        return tune.with_resources(
            tune.with_parameters(table_trainable, setup=setup),
            lambda config: tune.PlacementGroupFactory(trial_bundles(feds[int(config.get("cell", 0))], res["cpu"],
                                                                    res["gpu"])))

    # Tune's own CSV/JSON/TensorBoard files per cell: the cells' MLflow runs hold their metrics, and
    # the records come from the experiment's state
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    callbacks = [MlflowStatusCallback()] + ([ProgressLines(progress, label, spec.metric)] if progress else [])
    run_config = tune.RunConfig(name=name, storage_path=str(exp_path.parent), verbose=0, callbacks=callbacks,
                                failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
                                checkpoint_config=tune.CheckpointConfig(num_to_keep=1))
    if resuming:
        parent = Tracker.resume(state["parent_run_id"]) if state.get("parent_run_id") else Tracker.disabled()
        tuner = tune.Tuner.restore(str(exp_path), trainable=bind(state["setup"]), resume_unfinished=True,
                                   resume_errored=False, restart_errored=False)
        previous_wall = float(state.get("wall_s", 0.0))
        if progress:
            progress(f"resuming {exp_path} (parent MLflow run {parent.run_id}; {previous_wall:.0f} s so far)")
    else:
        if resume and progress:
            progress(f"nothing to resume at {exp_path}; starting the table")
        parent = open_parent(spec, cells, name)
        setup = {"cells": [c.raw for c in cells], "parent_run_id": parent.run_id, "env": export_environment(),
                 "experiment": first.tracking.experiment, "cpus": res["cpu"],
                 "checkpoint_every": spec.checkpoint_every, "trial_hook": spec.trial,
                 # a finished cell reports its record: a resume never continues it, so no last checkpoint
                 "final_checkpoint": False}
        exp_path.mkdir(parents=True, exist_ok=True)
        state = {"parent_run_id": parent.run_id, "fingerprint": print_fingerprint, "setup": setup}
        state_path.write_text(json.dumps(state))
        previous_wall = 0.0
        tuner = tune.Tuner(bind(setup), param_space={"cell": tune.grid_search(list(range(len(cells))))},
                           tune_config=tune.TuneConfig(num_samples=1, reuse_actors=True, trial_name_creator=label,
                                                       max_concurrent_trials=spec.max_concurrent or None),
                           run_config=run_config)
    # the result grid Tune builds at the end looks for the logger files switched off above
    quiet = logging.getLogger("ray.tune.analysis.experiment_analysis")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        grid, received, wall = fit_tuner(tuner, previous_wall)
    finally:
        quiet.setLevel(level)
    state_path.write_text(json.dumps({**state, "wall_s": wall}))
    trials = saved_trials(exp_path) if grid is not None else []
    records, failures, histories = records_of(spec, cells, trials)
    done = sum(r["status"] == "FINISHED" for r in records)
    complete = grid is not None and not received and len(records) == len(cells)
    status = ("FINISHED" if done else "FAILED") if complete else "INTERRUPTED"
    summary, text = summarize(spec, cells, records)
    head = {k: float(v) for k, v in headline(summary).items()} if headline and status == "FINISHED" else {}
    text = close_parent(parent, spec, cells, name, summary, records, text, status, wall, outdir, head, histories)
    if status == "INTERRUPTED":
        kill_unfinished_children(parent.run_id)
    code = {"FINISHED": 0, "FAILED": 1}.get(status, 143 if signal.SIGTERM in received else 130)
    return TableResult(summary, records, text, parent.run_id, str(exp_path), wall, status, code, failures, len(cells),
                       head)


def open_parent(spec: TableSpec, cells: list[Cell], name: str):
    """The table's MLflow parent run: what it compares, its rows, seeds and shared settings."""
    from ..schema import flatten
    from ..tracking import Tracker

    first = cells[0].config
    if not first.tracking.enabled:
        return Tracker.disabled()
    rows = list(dict.fromkeys(f"{c.row.group + ': ' if c.row.group else ''}{c.row.name}" for c in cells))
    seeds = list(dict.fromkeys(c.seed for c in cells))
    note = (f"{spec.description.strip().rstrip('.')}. " if spec.description else "") + \
        f"Table file {spec.path}: {len(rows)} rows × {len(seeds)} seeds, metric {spec.metric} ({spec.read})."
    parent = Tracker.start(first.tracking.experiment, run_name=name, sweep=True,
                           tags={"pfl.pipeline": name, "pfl.kind": "table", "pfl.table": spec.path,
                                 "mlflow.note.content": note})
    others = [flatten(c.config.to_dict()) for c in cells[1:len(rows)]]   # the first seed's rows
    shared = {k: v for k, v in flatten(first.to_dict()).items() if k != "seed" and all(o.get(k) == v for o in others)}
    parent.log_params({**{f"base.{k}": v for k, v in shared.items()}, "table": spec.path, "metric": spec.metric,
                       "rows": " | ".join(rows)[:6000], "seeds": " ".join(map(str, seeds))})
    return parent


__all__ = ["STATE_FILE", "TableResult", "check_cells", "open_parent", "run_table", "table_trainable"]
