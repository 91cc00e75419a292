"""One experiment end to end: simulator + MLflow run + progress + artifacts.

Used by ``pfl run`` and by the Ray Tune trainable (which drives the same pieces round by round).
"""

from __future__ import annotations

import csv
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .config import ExperimentConfig
from .federation.simulator import DivergedError, Simulator, simulator_for
from .schema import flatten
from .tracking import Tracker, load_settings

log = logging.getLogger(__name__)


@dataclass
class RunSummary:
    final: dict[str, float]
    history: list[dict[str, float]]
    run_id: str | None
    status: str = "FINISHED"
    reason: str = ""
    extra: dict = field(default_factory=dict)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def progress_line(m: dict[str, float], total_rounds: int) -> str:
    parts = [f"round {int(m['round']) + 1:>4}/{total_rounds}"]
    for key, label in (("test/acc_mean", "test acc"), ("val/acc_mean", "val acc"),
                       ("global/test_acc", "global acc"), ("test/rmse_mean", "test rmse"),
                       ("cluster/num", "clusters"), ("cluster/ari", "ARI"), ("train/loss", "loss")):
        if key in m:
            value = m[key]
            parts.append(f"{label} {value:.0f}" if key == "cluster/num" else f"{label} {value:.4f}")
    parts.append(f"up {format_bytes(m.get('comm/up_bytes', 0))} down {format_bytes(m.get('comm/down_bytes', 0))}")
    parts.append(f"{m.get('time/round_s', 0):.2f} s/round")
    return " | ".join(parts)


def config_params(cfg: ExperimentConfig) -> dict[str, str]:
    """Every resolved config value as a flat MLflow param."""
    return {k: v for k, v in flatten(cfg.to_dict()).items()}


def write_client_table(rows: list[dict], path: Path) -> Path:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def final_model_state(sim: Simulator, max_bytes: int = 256 * 2**20) -> dict:
    """Global model and (when small enough) every client's personalized model."""
    state: dict = {"global": sim.method.global_params(), "clients": None}
    per_client = {}
    size = 0
    for cid in range(sim.num_clients):
        params = sim.method.personal_params(sim.client(cid))
        if params is state["global"]:
            continue
        size += sum(t.numel() * t.element_size() for t in params.values())
        if size > max_bytes:
            per_client = None
            break
        per_client[cid] = params
    state["clients"] = per_client or None
    return state


def log_artifacts(sim: Simulator, tracker: Tracker) -> None:
    if not tracker.enabled:
        return
    from .plots import plot_history

    settings = load_settings()["log"]
    title = f"{sim.cfg.method.name} on {sim.cfg.data.source}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "config.yaml").write_text(sim.cfg.to_yaml())
        tracker.log_artifact(out / "config.yaml")
        if settings.get("client_table", True) and getattr(sim, "last_client_table", None):
            tracker.log_artifact(write_client_table(sim.last_client_table, out / "client_metrics.csv"))
        if settings.get("plots", True) and sim.history:
            tracker.log_artifact(plot_history(sim.history, out / "accuracy_vs_round.png", title=title), "plots")
            tracker.log_artifact(plot_history(sim.history, out / "accuracy_vs_bytes.png",
                                              x_key="comm/total_bytes", title=title), "plots")
        if settings.get("model", True) and sim.cfg.tracking.log_model:
            torch.save(final_model_state(sim), out / "model_state.pt")
            tracker.log_artifact(out / "model_state.pt", "model")
        for path in sim.method.artifacts(str(out)):
            tracker.log_artifact(path, "method")


def run_experiment(cfg: ExperimentConfig, *, progress: Callable[[str], None] | None = print,
                   tracker: Tracker | None = None, checkpoint: str | Path | None = None,
                   resume: bool = False, data=None) -> RunSummary:
    """Train one experiment, logging to MLflow unless ``cfg.tracking.enabled`` is false.

    With ``checkpoint`` set, the state is saved there every ``federation.checkpoint_every`` rounds
    and at the end; ``resume=True`` continues from it (and from its MLflow run).
    The round driver is the one ``federation.driver`` names.
    """
    sim = simulator_for(cfg)(cfg, data=data)
    ckpt = Path(checkpoint) if checkpoint else None
    run_id = None
    if resume and ckpt is not None and ckpt.is_file():
        sim.load(ckpt)
        meta = ckpt.with_suffix(".run_id")
        run_id = meta.read_text().strip() if meta.is_file() else None
        if progress:
            progress(f"resumed from {ckpt} at round {sim.round}")
    if tracker is None:
        if not cfg.tracking.enabled:
            tracker = Tracker.disabled()
        elif run_id:
            tracker = Tracker.resume(run_id)
        else:
            tracker = Tracker.start(cfg.tracking.experiment,
                                    cfg.tracking.run_name or f"{cfg.method.name}@{cfg.data.source}")
    if ckpt is not None and tracker.run_id:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        ckpt.with_suffix(".run_id").write_text(tracker.run_id)
    tracker.log_params(config_params(cfg))
    tracker.set_tags({"pfl.method": cfg.method.name, "pfl.source": cfg.data.source})
    if progress and tracker.run_id:
        progress(f"MLflow run {tracker.run_id} ({cfg.method.name} on {cfg.data.source}, "
                 f"{sim.num_clients} clients, {cfg.federation.rounds} rounds)")
    fed = cfg.federation
    status, reason = "FINISHED", ""
    try:
        for metrics in sim.rounds():
            tracker.log_metrics({k: v for k, v in metrics.items() if k != "round"}, step=int(metrics["round"]))
            if progress and sim.is_eval_round(int(metrics["round"])):
                progress(progress_line(metrics, fed.rounds))
            if ckpt is not None and fed.checkpoint_every and sim.round % fed.checkpoint_every == 0:
                sim.save(ckpt)
    except DivergedError as err:
        status, reason = "FAILED", str(err)
        tracker.set_tags({"pfl.failure": reason})
        if progress:
            progress(f"diverged: {reason}")
    except BaseException as err:
        tracker.set_tags({"pfl.failure": f"{type(err).__name__}: {err}"})
        tracker.end("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED")
        raise
    if ckpt is not None:
        sim.save(ckpt)
    if status == "FINISHED":
        log_artifacts(sim, tracker)
    tracker.end(status)
    final = {}
    for row in sim.history:
        final.update(row)
    return RunSummary(final=final, history=sim.history, run_id=tracker.run_id, status=status,
                      reason=reason, extra={"simulator": sim})


class TableRun:
    """A pipeline that compares configurations: one MLflow parent run, one child run per row.

    ``run(label, cfg)`` trains one row as a child run; ``finish(rows, name)`` logs the table on the
    parent as CSV (and Markdown when given) and ends it. With ``track=False`` nothing is logged.
    """

    def __init__(self, name: str, *, experiment: str | None = None, track: bool = True,
                 params: dict | None = None, tags: dict | None = None):
        self.experiment = experiment
        self.track = track
        self.parent = (Tracker.start(experiment, name, sweep=experiment is None,
                                     tags={"pfl.pipeline": name, **(tags or {})})
                       if track else Tracker.disabled())
        self.parent.log_params(params or {})

    def run(self, label: str, cfg: ExperimentConfig, **kwargs) -> RunSummary:
        child = (Tracker.start(self.experiment, label, parent_run_id=self.parent.run_id,
                               sweep=self.experiment is None) if self.track else Tracker.disabled())
        kwargs.setdefault("progress", None)
        return run_experiment(cfg, tracker=child, **kwargs)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.parent.log_metrics(metrics, step=step)

    def finish(self, rows: list[dict], name: str, text: str | None = None,
               outdir: str | Path | None = None) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(outdir) if outdir else Path(tmp)
            out.mkdir(parents=True, exist_ok=True)
            if rows:
                fields = list(dict.fromkeys(k for row in rows for k in row))
                with (out / f"{name}.csv").open("w", newline="") as fh:
                    writer = csv.DictWriter(fh, fieldnames=fields)
                    writer.writeheader()
                    writer.writerows(rows)
                self.parent.log_artifact(out / f"{name}.csv")
            if text is not None:
                (out / f"{name}.md").write_text(text + "\n")
                self.parent.log_artifact(out / f"{name}.md")
        self.parent.end("FINISHED")

    @property
    def run_id(self) -> str | None:
        return self.parent.run_id
