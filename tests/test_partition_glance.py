"""The partition at a glance (pfl/data/glance.py): the table of ``pfl datasets --show`` and the
``plots/partition.png`` every run logs to MLflow (a real SQLite store, tests/conftest.py).

The counts are compared with the clients' tensors as a run builds them (``torch.bincount`` of every
client's training labels, a histogram of its targets), so a view that read the source's labels
without the partition's label transform, or counted another split, fails."""

import os

import numpy as np
import pytest
import torch

from pfl.data import load_federated
from pfl.data.glance import partition_view
from pfl.resolver import load


def _data(on_demand: bool, **overrides):
    base = {"data.num_clients": 8, "data.partition.alpha": 0.3, "tracking.enabled": False}
    cfg = load(None, {**base, **overrides})
    return load_federated(cfg.data, cfg.seed, on_demand=on_demand)


@pytest.mark.parametrize("kind", ["dirichlet", "label_swap"])
def test_counts_are_the_built_clients_training_labels(kind):
    extra = {"data.partition.kind": kind} if kind == "dirichlet" else {
        "data.partition.kind": kind, "data.partition.num_clusters": 2, "data.partition.alpha": 0.0}
    view = partition_view(_data(True, **extra))           # on demand: labels only, no features built
    built = _data(False, **extra)
    expected = np.stack([torch.bincount(c.y_train, minlength=built.num_classes).numpy() for c in built.clients])
    assert (view.counts == expected).all()
    sizes = np.array([[c.n_train, c.n_val, c.n_test] for c in built.clients])
    assert (view.sizes == sizes).all()
    if kind == "label_swap":  # the wrong variant: the source's labels without the clients' swap
        lazy = _data(True, **extra).clients
        raw = np.stack([np.bincount(lazy.src.y[lazy.part.train[i]], minlength=built.num_classes)
                        for i in range(built.num_clients)])
        assert not (raw == expected).all()


def test_regression_source_gives_each_clients_target_histogram():
    data = _data(False, **{"data.source": "fpfc_linear", "data.num_clients": 5})
    view = partition_view(data, bins=4)
    every = torch.cat([c.y_train for c in data.clients]).numpy()
    edges = np.linspace(every.min(), every.max(), 5)
    expected = np.stack([np.histogram(c.y_train.numpy(), bins=edges)[0] for c in data.clients])
    assert (view.counts == expected).all() and view.counts.sum() == len(every)
    assert len(view.columns) == 4


def test_datasets_show_prints_the_table(capsys):
    from pfl.cli import main

    assert main(["datasets", "--show", "--set", "data.num_clients=8", "data.partition.alpha=0.3",
                 "--max-clients", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    view = partition_view(_data(True))
    assert out[0].startswith("digits, partition dirichlet: 8 clients")
    rows = {line.split()[0]: [int(v) for v in line.replace("|", " ").split()[1:]] for line in out[2:]
            if line.split()[0].isdigit() or line.startswith(" total")}
    for i in range(3):
        assert rows[str(i)] == [*view.sizes[i], *view.counts[i]]
    assert "3" not in rows and "5 more clients" in out[-2]
    assert rows["total"] == [*view.sizes.sum(0), *view.counts.sum(0)]
    assert main(["datasets", "--set", "data.num_clients=8"]) == 2   # --set without --show: refused


def test_every_run_logs_the_partition_plot_to_mlflow(tmp_path):
    """A real run (``centralized``, the reference row: zero bytes) in a SQLite store."""
    from mlflow.tracking import MlflowClient

    from pfl.runner import run_experiment

    cfg = load(None, {"method.name": "centralized", "data.num_clients": 6, "federation.rounds": 2,
                      "federation.clients_per_round": 3, "tracking.log_model": False})
    summary = run_experiment(cfg)
    assert summary.status == "FINISHED"
    mc = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    plots = {a.path for a in mc.list_artifacts(summary.run_id, "plots")}
    assert "plots/partition.png" in plots
    png = mc.download_artifacts(summary.run_id, "plots/partition.png", str(tmp_path))
    with open(png, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    run = mc.get_run(summary.run_id)
    assert run.data.metrics["comm/total_bytes"] == 0 and run.data.metrics["comm/eval_down_bytes"] == 0
    assert run.data.metrics["centralized/budget"] > 0


def test_a_partition_plot_is_drawn_once_per_partition_in_a_process(tmp_path, monkeypatch):
    """A table's rows of one seed share their data: the plot is drawn for the first and copied for
    the others (the bytes a drawing gives), while another partition gets its own drawing."""
    from pfl import plots
    from pfl.callbacks import tracking
    from pfl.federation.simulator import Simulator

    drawn = []
    real = plots.plot_partition
    monkeypatch.setattr(plots, "plot_partition", lambda view, path, title: drawn.append(title) or
                        real(view, path, title=title))
    monkeypatch.setattr(tracking, "_PARTITION_PNGS", {})
    base = {"data.source": "digits", "data.num_clients": 6, "tracking.enabled": False}
    runs = [Simulator(load(None, {**base, "method.name": "fedavg"})),
            Simulator(load(None, {**base, "method.name": "ditto"})),              # the same data, another row
            Simulator(load(None, {**base, "method.name": "fedavg", "seed": 1}))]  # another partition
    assert runs[0].data.partition_hash == runs[1].data.partition_hash != runs[2].data.partition_hash
    out = []
    for i, sim in enumerate(runs):
        (tmp_path / str(i)).mkdir()
        out.append(tracking.write_partition_plot(sim, tmp_path / str(i)).read_bytes())
    assert len(drawn) == 2
    assert out[1] == out[0] and out[2] != out[0]
    monkeypatch.setattr(tracking, "_PARTITION_PNGS", {})
    (tmp_path / "fresh").mkdir()
    assert tracking.write_partition_plot(runs[1], tmp_path / "fresh").read_bytes() == out[1]
    assert len(drawn) == 3
