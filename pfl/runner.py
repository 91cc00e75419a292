"""One experiment end to end: the round loop with the standard callbacks.

Used by ``pfl run``; the Ray Tune trainables (sweeps, the cells of a table) build the same loop
with a Tune reporter instead of the progress printer. :func:`write_table` logs a table's CSV and
Markdown on an MLflow run (pfl.tables, the benchmarks).
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from .callbacks import Checkpointer, MLflowLogger, ProgressPrinter, StopOnDivergence
from .callbacks.progress import format_bytes, progress_line  # noqa: F401  (re-exported for pipelines)
from .callbacks.tracking import config_params  # noqa: F401
from .config import ExperimentConfig
from .federation.loop import Callback, RoundLoop
from .federation.drivers import simulator_for
from .markdown import as_markdown
from .tracking import Tracker

log = logging.getLogger(__name__)


@dataclass
class RunSummary:
    final: dict[str, float]
    history: list[dict[str, float]]
    run_id: str | None
    status: str = "FINISHED"
    reason: str = ""
    extra: dict = field(default_factory=dict)


def tracker_opener(cfg: ExperimentConfig, tracker: Tracker | None = None) -> Callable[[str | None], Tracker]:
    """How a run's MLflow run is opened: the given tracker, the checkpoint's run, or a new one."""
    def open_run(run_id: str | None) -> Tracker:
        if tracker is not None:
            return tracker
        if not cfg.tracking.enabled:
            return Tracker.disabled()
        if run_id:
            return Tracker.resume(run_id)
        return Tracker.start(cfg.tracking.experiment, cfg.tracking.run_name or f"{cfg.method.name}@{cfg.data.source}")

    return open_run


def run_experiment(cfg: ExperimentConfig, *, progress: Callable[[str], None] | None = print,
                   tracker: Tracker | None = None, checkpoint: str | Path | None = None,
                   resume: bool | str = False, data=None, callbacks: Sequence[Callback] = ()) -> RunSummary:
    """Train one experiment, logging to MLflow unless ``cfg.tracking.enabled`` is false.

    With ``checkpoint`` set, the state is saved there every ``federation.checkpoint_every`` rounds
    and at the end; ``resume=True`` continues from it (and from its MLflow run) and refuses a
    checkpoint that does not exist, ``resume="if-exists"`` starts a new run then. ``callbacks`` run
    after the divergence check and before tracking. The round driver is the one
    ``federation.driver`` names.
    """
    sim = simulator_for(cfg)(cfg, data=data)
    logger = MLflowLogger(tracker_opener(cfg, tracker), announce=progress)
    chain: list[Callback] = [StopOnDivergence(), *callbacks, logger]
    if progress:
        chain.append(ProgressPrinter(progress))
    ckpt = Path(checkpoint) if checkpoint else None
    if ckpt is not None:
        chain.append(Checkpointer(ckpt, cfg.federation.checkpoint_every))
    loop = RoundLoop(sim, chain)
    if resume and ckpt is not None and (ckpt.exists() or resume != "if-exists"):
        loop.load(ckpt)   # a missing or damaged checkpoint: CheckpointError naming it
        if progress:
            progress(f"resumed from {ckpt} at round {sim.round}")
    elif resume and ckpt is not None and progress:
        progress(f"no checkpoint at {ckpt}: a new run")
    result = loop.run()
    close = getattr(sim.exchange.runner, "close", None)
    if close is not None:  # a worker pool gives its processes back (a later exchange starts them again)
        close()
    final: dict[str, float] = {}
    for row in sim.history:
        final.update(row)
    final.update(loop.summary)
    final["time/data_load_s"] = sim.data_load_s
    return RunSummary(final=final, history=sim.history, run_id=logger.run_id, status=result.status,
                      reason=result.reason, extra={"simulator": sim})


def write_table(tracker: Tracker, rows: list[dict], name: str, text: str | None, out: Path,
                runs: list[dict] | None = None) -> None:
    """Log ``rows`` as ``<name>.csv``, ``text`` as ``<name>.md`` and, when given, every single run of
    a comparison over seeds as ``<name>_runs.csv`` (pfl.seeds), written into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for table, suffix in ((rows, ""), (runs or [], "_runs")):
        if not table:
            continue
        fields = list(dict.fromkeys(k for row in table for k in row))
        with (out / f"{name}{suffix}.csv").open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=fields)
            writer.writeheader()
            writer.writerows(table)
        tracker.log_artifact(out / f"{name}{suffix}.csv")
    if text is not None:
        (out / f"{name}.md").write_text(as_markdown(text) + "\n")  # rendered by MLflow
        tracker.log_artifact(out / f"{name}.md")
