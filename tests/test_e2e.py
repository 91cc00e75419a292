"""End to end: the CLI with a real MLflow store; methods learn on real data."""

import os
import subprocess
import sys

import pytest
import yaml
from mlflow.tracking import MlflowClient

from helpers import small_config
from pfl.callbacks.divergence import run_rounds
from pfl.federation.simulator import Simulator
from pfl.resolver import load
from pfl.tracking import tracking_uri


def _runs():
    mc = MlflowClient(tracking_uri=tracking_uri())
    exps = mc.search_experiments()
    return [r for e in exps for r in mc.search_runs([e.experiment_id])], mc


def _cli(*args, timeout=300):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "pfl", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.slow
def test_cli_run_logs_one_finished_mlflow_run_with_measured_comm(tmp_path):
    proc = _cli("run", "--set", "method.name=fedavg", "data.source=digits", "data.num_clients=10",
                "federation.rounds=3")
    assert proc.returncode == 0, proc.stderr
    assert "round    3/3" in proc.stdout and "summary" in proc.stdout
    runs, mc = _runs()
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["method.name"] == "fedavg"
    assert run.data.params["data.source"] == "digits"
    assert "test/acc_mean" in run.data.metrics
    # FedAvg: every round each of the sampled clients downloads and uploads the whole model
    cfg = load(None, ["method.name=fedavg", "data.source=digits", "data.num_clients=10",
                      "federation.rounds=3", "tracking.enabled=false"])
    sim = Simulator(cfg)
    d = sum(v.numel() for v in sim.method.global_params().values())
    per_round = min(cfg.federation.clients_per_round, 10)
    assert run.data.metrics["comm/total_bytes"] == 3 * per_round * 2 * d * 4
    history = mc.get_metric_history(run.info.run_id, "comm/total_bytes")
    assert sorted(m.step for m in history) == [1, 2, 3]  # step = rounds done (the console's round number)
    artifacts = {a.path for a in mc.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "client_metrics.csv", "plots", "model"} <= artifacts
    plots = {a.path for a in mc.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/accuracy_vs_round.png", "plots/accuracy_vs_bytes.png"} <= plots


@pytest.mark.slow
def test_cli_local_logs_zero_communication():
    proc = _cli("run", "--set", "method.name=local", "data.source=digits", "data.num_clients=6",
                "federation.rounds=2")
    assert proc.returncode == 0, proc.stderr
    runs, _ = _runs()
    assert runs[0].data.metrics["comm/total_bytes"] == 0


@pytest.mark.slow
def test_cli_lists_methods_and_datasets():
    methods = _cli("methods")
    assert methods.returncode == 0
    assert "fedprox" in methods.stdout and "mu" in methods.stdout
    datasets = _cli("datasets")
    assert datasets.returncode == 0
    for name in ("digits", "fmnist", "fpfc_synthetic", "dirichlet"):
        assert name in datasets.stdout


@pytest.mark.slow
def test_cli_scenario_then_file_then_set(tmp_path):
    from pfl.tune.space import load_scenario

    (tmp_path / "my.yaml").write_text("federation:\n  rounds: 7\n  lr: 0.3\n")
    proc = _cli("run", str(tmp_path / "my.yaml"), "--scenario", "fpfc_s1", "--set", "federation.lr=0.02",
                "--print-config")
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    s1 = load_scenario("fpfc_s1")
    assert cfg["data"]["source"] == s1["data.source"] and cfg["data"]["num_clients"] == s1["data.num_clients"]
    assert cfg["federation"]["rounds"] == 7 and cfg["federation"]["lr"] == 0.02
    bad = _cli("run", "--scenario", "fpfc_s9", "--print-config")
    assert bad.returncode == 2 and "scenario" in bad.stderr and "fpfc_s1" in bad.stderr


FMNIST = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(FMNIST), reason="dataset-fashion-mnist not installed")
def test_fedavg_learns_fashion_mnist_dirichlet():
    cfg = small_config(data__source="fmnist", data__num_clients=20, data__partition__alpha=0.5,
                       data__max_samples=8000, model__name="cnn_fedavg", federation__rounds=5,
                       federation__clients_per_round=10, federation__lr=0.1, federation__local_epochs=2,
                       federation__eval_every=5)
    sim = Simulator(cfg)
    run_rounds(sim)
    acc = sim.history[-1]["test/acc_mean"]
    assert acc > 0.5, f"FedAvg on Fashion-MNIST reached only {acc:.3f} (chance is 0.1)"


@pytest.mark.slow
def test_local_beats_fedavg_under_two_label_shards():
    common = dict(data__source="fmnist" if os.path.exists(FMNIST) else "digits", data__num_clients=10,
                  data__partition__kind="shards", data__partition__classes_per_client=2,
                  data__max_samples=3000, model__name="mlp", federation__rounds=5,
                  federation__clients_per_round=0, federation__eval_every=5)
    local = Simulator(small_config(method__name="local", **common))
    fedavg = Simulator(small_config(method__name="fedavg", **common))
    run_rounds(local)
    run_rounds(fedavg)
    assert local.history[-1]["test/acc_mean"] > fedavg.history[-1]["test/acc_mean"] + 0.05
