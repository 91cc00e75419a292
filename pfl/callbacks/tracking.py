"""The MLflow run of one federated run: params, per-round metrics, artifacts, final status.

``step`` of every metric is the number of rounds computed so far (round 20 on the console is step
20). On resume the run continues the same MLflow run (its id is part of the checkpoint) and rounds
whose step is already logged are not logged again. At the start of a new run:
``plots/partition.png`` (clients × classes and client sizes, :mod:`pfl.data.glance`). At the end
of a finished run: ``config.yaml``, ``client_metrics.csv``, ``plots/accuracy_vs_round.png``,
``plots/accuracy_vs_bytes.png``, ``model/model_state.pt``, the method's artifacts, the run's
``attack_malicious.csv`` / ``newcomers.csv`` (when it has malicious clients / newcomers), the other
callbacks' artifacts and the loop's summary metrics (the newcomers' ``newcomer/*`` among them); a run that did not finish
gets its reason as the tag ``pfl.failure``.
"""

from __future__ import annotations

import csv
import tempfile
from pathlib import Path
from typing import Callable

import torch

from ..federation.loop import Callback, LoopResult
from ..schema import flatten
from ..tracking import Tracker, load_settings


def config_params(cfg) -> dict[str, str]:
    """Every resolved config value as a flat MLflow param."""
    return dict(flatten(cfg.to_dict()))


def write_client_table(rows: list[dict], path: Path) -> Path:
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def final_model_state(sim, max_bytes: int = 256 * 2**20) -> dict:
    """Global model and (when small enough) every client's personalized model."""
    glob = sim.method.global_params()
    per_client: dict | None = {}
    size = 0

    def keep(cid: int, params: dict) -> None:  # streamed: a large population never sits in memory
        nonlocal per_client, size
        if per_client is None or (glob is not None and all(k in glob and torch.equal(params[k], glob[k])
                                                           for k in params)):
            return
        size += sum(t.numel() * t.element_size() for t in params.values())
        if size > max_bytes:
            per_client = None
        else:
            per_client[cid] = params

    sim.personal_models(receive=keep)
    return {"global": glob, "clients": per_client or None}


def write_run_artifacts(sim, outdir: Path) -> list[tuple[Path, str | None]]:
    from ..plots import plot_history

    settings = load_settings()["log"]
    title = f"{sim.cfg.method.name} on {sim.cfg.data.source}"
    files: list[tuple[Path, str | None]] = []
    (outdir / "config.yaml").write_text(sim.cfg.to_yaml())
    files.append((outdir / "config.yaml", None))
    if settings.get("client_table", True) and sim.last_client_table:
        files.append((write_client_table(sim.last_client_table, outdir / "client_metrics.csv"), None))
    if settings.get("plots", True) and sim.history:
        files.append((plot_history(sim.history, outdir / "accuracy_vs_round.png", title=title), "plots"))
        files.append((plot_history(sim.history, outdir / "accuracy_vs_bytes.png", x_key="comm/total_bytes",
                                   title=title), "plots"))
    if settings.get("model", True) and sim.cfg.tracking.log_model:
        torch.save(final_model_state(sim), outdir / "model_state.pt")
        files.append((outdir / "model_state.pt", "model"))
    files.extend((Path(p), "method") for p in sim.method.artifacts(str(outdir)))
    files.extend((Path(p), None) for p in sim.artifacts(outdir))  # malicious / newcomer ids
    return files


#: partition plots this process drew, by partition: a table's rows of one seed (a sweep's trials)
#: share their data, and drawing one costs about a second on a small machine
_PARTITION_PNGS: dict[tuple, bytes] = {}


def write_partition_plot(sim, outdir: Path) -> Path:
    """``partition.png``: the run's clients × classes (a regression source: target histograms) and
    client sizes (:mod:`pfl.data.glance`)."""
    from ..data.glance import partition_view
    from ..plots import plot_partition

    cfg = sim.cfg
    title = f"{cfg.data.source}: {cfg.data.partition.kind} partition, {sim.num_clients} clients"
    path = outdir / "partition.png"
    partition = getattr(sim.data, "partition_hash", None)   # data a caller built itself has none: drawn
    if (partition, title) in _PARTITION_PNGS:
        path.write_bytes(_PARTITION_PNGS[partition, title])
        return path
    plot_partition(partition_view(sim.data), path, title=title)
    if partition is not None:
        if len(_PARTITION_PNGS) >= 8:
            _PARTITION_PNGS.pop(next(iter(_PARTITION_PNGS)))
        _PARTITION_PNGS[partition, title] = path.read_bytes()
    return path


class MLflowLogger(Callback):
    """``open_run(run_id or None)`` opens the MLflow run (a new one, or the checkpoint's)."""

    key = "mlflow"

    def __init__(self, open_run: Callable[[str | None], Tracker], announce: Callable[[str], None] | None = None):
        self.open_run = open_run
        self.announce = announce
        self.run_id: str | None = None
        self.tracker: Tracker = Tracker.disabled()
        self.logged_until = 0

    def on_start(self, loop) -> None:
        sim = loop.sim
        self.tracker = self.open_run(self.run_id)
        self.run_id = self.tracker.run_id
        if not self.tracker.enabled:
            return
        steered = self._steered(loop)
        self.tracker.log_params({k: v for k, v in config_params(sim.cfg).items() if k not in steered})
        self.tracker.set_tags({"pfl.method": sim.cfg.method.name, "pfl.source": sim.cfg.data.source})
        # a reopened run holds the rounds logged before the interruption; a restart recomputes them
        # identically (from its checkpoint, or from scratch when it had none), so they are skipped
        self.logged_until = self.tracker.last_step("time/elapsed_s") if self.tracker.resumed else 0
        if hasattr(sim, "data_load_s"):  # this process's loading of the data, before its first round
            self.tracker.log_metrics({"time/data_load_s": sim.data_load_s}, step=sim.executed)
        if not self.tracker.resumed and hasattr(sim, "data") and load_settings()["log"].get("plots", True):
            with tempfile.TemporaryDirectory() as tmp:  # the partition at a glance, before the first round
                self.tracker.log_artifact(write_partition_plot(sim, Path(tmp)), "plots")
        if self.announce:
            self.announce(f"MLflow run {self.run_id} ({sim.cfg.method.name} on {sim.cfg.data.source}, "
                          f"{sim.num_clients} clients, {sim.cfg.federation.rounds} rounds)")

    @staticmethod
    def _steered(loop) -> set[str]:
        """Config keys a callback changes during the run (the λ path's λ and round count): logged
        at the end with the values the run finished with, so every param is one the run used."""
        return {k for cb in loop.callbacks for k in getattr(cb, "steered_keys", ())}

    def on_round(self, loop, metrics: dict[str, float]) -> None:
        step = int(metrics["step"])
        if step <= self.logged_until:
            return  # logged before an interruption, recomputed identically after the resume
        self.tracker.log_metrics({k: v for k, v in metrics.items() if k not in ("round", "step")}, step=step)

    def on_end(self, loop, result: LoopResult) -> None:
        if not self.tracker.enabled:
            return
        if result.status == "FINISHED" and result.clean:
            config = config_params(loop.sim.cfg)
            reported = {k: v for cb in loop.callbacks for k, v in getattr(cb, "final_params", dict)().items()}
            self.tracker.log_params({**{k: config[k] for k in self._steered(loop) if k in config}, **reported})
            self.tracker.log_metrics(loop.summary, step=loop.sim.executed)
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp)
                files = write_run_artifacts(loop.sim, out)
                for cb in loop.callbacks:
                    files.extend(cb.write_artifacts(loop, out))
                for path, folder in files:
                    self.tracker.log_artifact(path, folder)
        elif result.reason:
            self.tracker.set_tags({"pfl.failure": result.reason})
        self.tracker.end(result.status)

    def state_dict(self) -> dict:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict) -> None:
        self.run_id = state.get("run_id")
