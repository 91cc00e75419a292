"""Search spaces, sweeps on a real Ray head node (through RAY_ADDRESS), MLflow lineage, resume.

One Ray head serves the whole test session. Where this machine allows it (root with `ip netns`),
the head and every driver run in a private network namespace that has only the loopback
interface, so all of Ray's traffic stays on 127.0.0.1.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

from pfl.schema import ConfigError
from pfl.tune.space import base_config, check_space, load_space

ROOT = Path(__file__).resolve().parents[1]
SPACES = ROOT / "search_spaces"


def _store(tmp_path):
    """A fresh SQLite store, created here: the tests poll it while a sweep writes, and two processes
    creating the same new database race in MLflow's schema set-up."""
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    return {"MLFLOW_TRACKING_URI": uri, "PFL_CACHE_DIR": str(tmp_path / "cache")}, db


def _sweep_args(space, tmp_path, *extra):
    return [sys.executable, str(ROOT / "pipelines" / "sweep.py"), "--space", str(space),
            "--storage", str(tmp_path / "ray_results"), *extra]


def _runs(uri):
    mc = MlflowClient(tracking_uri=uri)
    runs = [r for e in mc.search_experiments() for r in mc.search_runs([e.experiment_id])]
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return parents, children, mc


# ---- search-space validation (no Ray) -----------------------------------------------------------

def _write(tmp_path, body):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.mark.parametrize("body, field", [
    ({"fixed": {"method.name": "fedavg"}, "serch": {}}, "serch"),
    ({"fixed": {"method.name": "fedavg"}, "search": {"federation.lr": {"type": "gaussian", "low": 0.1, "high": 1}}},
     "search.federation.lr.type"),
    ({"fixed": {"method.name": "fedavg"}, "search": {"federation.lr": {"type": "uniform", "low": 1, "high": 0.1}}},
     "search.federation.lr.low"),
    ({"fixed": {"method.name": "fedprox"}, "search": {"method.muu": {"type": "choice", "values": [0.1]}}},
     "search.method.muu"),
    ({"fixed": {"method.name": "fedavg"}, "search": {"federation.lr": {"type": "loguniform", "low": 0, "high": 1}}},
     "search.federation.lr.low"),
    ({"fixed": {"method.name": "fedavgg"}}, "method.name"),
])
def test_malformed_space_is_rejected_naming_the_key(tmp_path, body, field):
    import ray

    path = _write(tmp_path, {"base": {"data.source": "digits"}, **body})
    with pytest.raises(ConfigError) as info:
        space = load_space(path)
        check_space(space, base_config(space))
    assert info.value.field == field, str(info.value)
    assert not ray.is_initialized()


@pytest.mark.parametrize("path", sorted(SPACES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_space_is_valid(path):
    if path.name == "scenarios.yaml":
        return
    space = load_space(path)
    check_space(space, base_config(space))
    check_space(space, base_config(space, smoke=True))


def test_tune_fpfc_presets_apply_and_validate():
    sys.path.insert(0, str(ROOT / "pipelines"))
    from tune_fpfc import apply_preset

    from pfl.resolver import resolve
    from pfl.schema import from_dict
    from pfl.tune.lambda_path import PathSettings

    space = load_space(SPACES / "fpfc.yaml")
    for name in space.presets:
        preset = apply_preset(space, name)
        check_space(preset, base_config(preset))
        from_dict(PathSettings, preset.pipeline, "pipeline")
    paper = apply_preset(space, "paper")
    assert paper.search == {} and paper.fixed["method.rho"] == 1.0 and space.search  # the file keeps its own
    assert resolve(base_config(paper)).method.hparams.init_std == 1.0  # the preset's start reaches the trials
    with pytest.raises(ConfigError) as err:
        apply_preset(space, "nope")
    assert err.value.field == "--preset"
    space.presets["bad"] = {"search": {"method.rho": {"type": "uniform", "low": 2, "high": 1}}}
    with pytest.raises(ConfigError) as err:
        apply_preset(space, "bad")
    assert err.value.field == "presets.bad.search.method.rho.low"


def test_tune_fpfc_refuses_a_direction_twice_and_an_unknown_one_before_ray(capsys):
    sys.path.insert(0, str(ROOT / "pipelines"))
    from tune_fpfc import main

    assert main(["--smoke", "--direction", "descending", "ascending", "descending"]) == 2
    assert "--direction" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:       # argparse: not one of the orders
        main(["--smoke", "--direction", "sideways"])
    assert err.value.code == 2


def test_resources_parse_and_reject():
    from pfl.tune.sweep import parse_resources

    assert parse_resources("cpu=1,gpu=0.25") == {"cpu": 1.0, "gpu": 0.25}
    with pytest.raises(ConfigError):
        parse_resources("tpu=1")


# ---- sweeps on the session's Ray head ----------------------------------------------------------

@pytest.mark.slow
def test_smoke_sweep_on_cluster_logs_parent_children_and_table(ray_cluster, tmp_path):
    env, db = _store(tmp_path)
    env["RAY_ADDRESS"] = ray_cluster.address
    code, out = ray_cluster.run(_sweep_args(SPACES / "fedavg.yaml", tmp_path, "--smoke"), env)
    assert code == 0, out[-4000:]
    assert "cluster at" in out and "== best ==" in out
    parents, children, mc = _runs(env["MLFLOW_TRACKING_URI"])
    assert len(parents) == 1 and len(children) >= 2
    parent = parents[0]
    assert all(c.data.tags["mlflow.parentRunId"] == parent.info.run_id for c in children)
    assert all(c.info.status == "FINISHED" for c in children)
    assert all("val/acc_mean" in c.data.metrics for c in children)
    artifacts = {a.path for a in mc.list_artifacts(parent.info.run_id)}
    assert {"trials.parquet", "trials.csv", "trials.html"} <= artifacts
    assert "plots/trials_val_acc_mean.png" in {a.path for a in mc.list_artifacts(parent.info.run_id, "plots")}
    table = pd.read_parquet(tmp_path / "ray_results" / "fedavg-smoke" / "trials.parquet")
    assert len(table) == len(children) and set(table["mlflow_run_id"]) == {c.info.run_id for c in children}
    best = table.sort_values("val/acc_mean", ascending=False).iloc[0]
    assert parent.data.params["best.federation.lr"] == str(best["federation.lr"])
    # runs named by what they try; the experiment says what it holds
    assert all(c.info.run_name.startswith("fedavg lr=") for c in children), [c.info.run_name for c in children]
    experiment = mc.get_experiment(parent.info.experiment_id)
    assert "sweep" in experiment.tags.get("mlflow.note.content", "").lower()
    # one line per trial event, not Tune's status table
    assert "Trial status" not in out and "[" in out and "fedavg lr=" in out


@pytest.mark.slow
def test_diverging_trial_fails_alone(ray_cluster, tmp_path):
    env, db = _store(tmp_path)
    env["RAY_ADDRESS"] = ray_cluster.address
    space = _write(tmp_path, {
        "base": {"data.source": "digits", "data.num_clients": 6, "federation.rounds": 3,
                 "federation.clients_per_round": 3, "federation.local_epochs": 1},
        "fixed": {"method.name": "fedavg"},
        "search": {"federation.lr": {"type": "grid", "values": [0.1, 1.0e12]}},
        "searcher": "grid", "num_samples": 1, "metric": "val/acc_mean",
    })
    code, out = ray_cluster.run(_sweep_args(space, tmp_path), env)
    assert code == 0, out[-4000:]
    _, children, _ = _runs(env["MLFLOW_TRACKING_URI"])
    status = sorted(c.info.status for c in children)
    assert status == ["FAILED", "FINISHED"], status
    failed = [c for c in children if c.info.status == "FAILED"][0]
    assert "loss" in failed.data.tags.get("pfl.failure", "")
    assert "failed: fedavg lr=1e+12: round 1: training loss is nan" in out


@pytest.mark.slow
def test_sweep_whose_trials_all_fail_exits_nonzero_with_each_reason(ray_cluster, tmp_path):
    env, db = _store(tmp_path)
    env["RAY_ADDRESS"] = ray_cluster.address
    space = _write(tmp_path, {
        "base": {"data.source": "digits", "data.num_clients": 6, "federation.rounds": 3,
                 "federation.clients_per_round": 3, "federation.local_epochs": 1},
        "fixed": {"method.name": "fedavg"},
        "search": {"federation.lr": {"type": "grid", "values": [1.0e12, 1.0e13]}},
        "searcher": "grid", "num_samples": 1,
    })
    code, out = ray_cluster.run(_sweep_args(space, tmp_path), env)
    assert code == 1, out[-4000:]
    failures = [ln for ln in out.splitlines() if ln.startswith("failed: ")]
    assert len(failures) == 2 and all("training loss is nan" in ln for ln in failures), failures
    assert "\x1b[" not in out and "pid=" not in out
    parents, _, _ = _runs(env["MLFLOW_TRACKING_URI"])
    assert parents[0].info.status == "FAILED"


@pytest.mark.slow
def test_bad_metric_name_exits_2_before_ray_starts(tmp_path):
    env, db = _store(tmp_path)
    space = _write(tmp_path, {"base": {"data.source": "digits"}, "fixed": {"method.name": "fedavg"},
                              "search": {"federation.lr": [0.1]}, "metric": "val/acc_meen"})
    started = time.time()
    proc = subprocess.run(_sweep_args(space, tmp_path), capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=120)
    assert proc.returncode == 2 and "val/acc_meen" in proc.stderr and "did you mean 'val/acc_mean'" in proc.stderr
    assert "Traceback" not in proc.stderr and "Ray:" not in proc.stdout
    assert not _runs(env["MLFLOW_TRACKING_URI"])[0] and not (tmp_path / "ray_results").exists()
    assert time.time() - started < 60


@pytest.mark.slow
@pytest.mark.parametrize("address, words", [("127.0.0.1:1", ["no Ray cluster answers", "127.0.0.1:1"]),
                                            ("ray://127.0.0.1:10001", ["Ray Client", "RAY_ADDRESS"])])
def test_unreachable_or_ray_client_address_fails_fast_and_clearly(tmp_path, address, words):
    env, db = _store(tmp_path)
    started = time.time()
    proc = subprocess.run(_sweep_args(SPACES / "fedavg.yaml", tmp_path, "--smoke", "--address", address),
                          capture_output=True, text=True, env=dict(os.environ, **env), timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert all(w in proc.stderr for w in words), proc.stderr
    assert time.time() - started < 30 + 15  # the address check, plus loading the smoke data


@pytest.mark.slow
def test_driver_without_token_mode_connects_with_the_token_it_finds(ray_cluster, tmp_path):
    env, db = _store(tmp_path)
    env["RAY_ADDRESS"] = ray_cluster.address
    env_no_mode = {k: v for k, v in ray_cluster.env.items() if k != "RAY_AUTH_MODE"}
    cluster = type(ray_cluster)(ray_cluster.prefix, ray_cluster.address, env_no_mode)
    code, out = cluster.run(_sweep_args(SPACES / "fedavg.yaml", tmp_path, "--smoke", "--num-samples", "1"), env)
    assert code == 0, out[-4000:]
    assert "cluster at" in out


def _wait_for_children(proc, db, uri, finished_at_least=1, started_at_least=2, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        time.sleep(2)
        if db.exists():
            try:
                _, children, _ = _runs(uri)
            except Exception:
                continue
            finished = sum(c.info.status == "FINISHED" for c in children)
            if finished >= finished_at_least and len(children) >= started_at_least:
                return
    if proc.poll() is not None:
        out = proc.stdout.read() if proc.stdout else ""
        raise AssertionError(f"the sweep ended (exit {proc.returncode}) before it could be interrupted:\n"
                             + out[-4000:])
    raise AssertionError(f"no trial run appeared in MLflow within {timeout} s")


@pytest.mark.slow
def test_interrupted_sweep_resumes_without_losing_or_duplicating_runs(ray_cluster, tmp_path):
    env, db = _store(tmp_path)
    env["RAY_ADDRESS"] = ray_cluster.address
    space = _write(tmp_path, {
        "base": {"data.source": "digits", "data.num_clients": 6, "federation.rounds": 30,
                 "federation.clients_per_round": 3, "federation.eval_every": 2, "federation.local_epochs": 1},
        "fixed": {"method.name": "fedavg"},
        "search": {"federation.lr": {"type": "grid", "values": [0.02, 0.05, 0.1, 0.2]}},
        "searcher": "grid", "num_samples": 1, "max_concurrent": 1, "checkpoint_every": 4,
    })
    args = _sweep_args(space, tmp_path, "--name", "resumable")
    proc = ray_cluster.popen(args, env, start_new_session=True)
    uri = env["MLFLOW_TRACKING_URI"]
    _wait_for_children(proc, db, uri)
    os.killpg(proc.pid, signal.SIGINT)        # Ctrl-C: the whole process group
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    assert proc.returncode == 130, out[-3000:]
    assert "resume with:" in out and "--resume" in out and "== best ==" not in out
    parents, before, mc = _runs(uri)
    assert parents[0].info.status == "KILLED" and not any(k.startswith("best") for k in parents[0].data.params)
    assert 1 <= sum(c.info.status == "FINISHED" for c in before) < 4
    assert all(c.info.status in ("FINISHED", "KILLED") for c in before), [c.info.status for c in before]
    first_wall = parents[0].data.metrics["sweep/wall_s"]
    finished_ids = {c.info.run_id for c in before if c.info.status == "FINISHED"}
    code, out = ray_cluster.run(args + ["--resume"], env)
    assert code == 0, out[-4000:]
    parents, after, mc = _runs(uri)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(after) == 4, [(c.info.run_name, c.info.status) for c in after]
    assert all(c.info.status == "FINISHED" for c in after)
    assert finished_ids <= {c.info.run_id for c in after}
    assert {c.info.run_name for c in after} == {f"fedavg lr={v:g}" for v in (0.02, 0.05, 0.1, 0.2)}
    table = pd.read_csv(tmp_path / "ray_results" / "resumable" / "trials.csv")
    best = table.sort_values("val/acc_mean", ascending=False).iloc[0]
    assert parents[0].data.params["best.federation.lr"] == str(best["federation.lr"])
    assert parents[0].data.metrics["sweep/wall_s"] > first_wall
    for child in after:  # every trial ran to its last round, each round logged once
        steps = [m.step for m in mc.get_metric_history(child.info.run_id, "comm/total_bytes")]
        assert sorted(steps) == list(range(1, 31)), sorted(steps)


@pytest.mark.slow
def test_sigterm_stops_a_sweep_like_ctrl_c(ray_cluster, tmp_path):
    env, db = _store(tmp_path)
    env["RAY_ADDRESS"] = ray_cluster.address
    space = _write(tmp_path, {
        "base": {"data.source": "digits", "data.num_clients": 6, "federation.rounds": 40,
                 "federation.clients_per_round": 3, "federation.eval_every": 4, "federation.local_epochs": 1},
        "fixed": {"method.name": "fedavg"},
        "search": {"federation.lr": {"type": "grid", "values": [0.05, 0.1, 0.2]}},
        "searcher": "grid", "num_samples": 1, "max_concurrent": 1,
    })
    proc = ray_cluster.popen(_sweep_args(space, tmp_path), env)
    _wait_for_children(proc, db, env["MLFLOW_TRACKING_URI"], finished_at_least=0, started_at_least=1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out[-3000:]
    parents, children, _ = _runs(env["MLFLOW_TRACKING_URI"])
    assert parents[0].info.status == "KILLED"
    assert all(c.info.status in ("FINISHED", "KILLED") for c in children)


@pytest.mark.slow
def test_tune_fpfc_smoke_logs_path_table_and_best_lambda(ray_cluster, tmp_path):
    import re

    env, db = _store(tmp_path)
    env["RAY_ADDRESS"] = ray_cluster.address
    code, out = ray_cluster.run([sys.executable, str(ROOT / "pipelines" / "tune_fpfc.py"), "--smoke",
                                 "--storage", str(tmp_path / "ray_results")], env, timeout=900)
    assert code == 0, out[-4000:]
    flat = " ".join(out.split())  # the explanation is wrapped to the terminal
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (warmup|separate) \| ([0-9., ]+) \|", out, re.M)}
    assert set(rows) == {"warmup", "separate"}, out[-3000:]
    assert "counting: rounds = every round one side computed" in flat and "Trial status" not in out
    assert re.search(r"warmup vs separate: λ [0-9./]+ vs [0-9./]+, test acc [+-][0-9.]+ pt \(", flat)
    # progress: trials identified by what they try, stage ends announced
    assert re.search(r"\] λ-path [^:]*: round \d+ .*stage λ=[0-9.]+ ended", out), out[-3000:]
    mc = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    runs = [r for e in mc.search_experiments() for r in mc.search_runs([e.experiment_id])]
    top = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(top) == 1
    top = top[0]
    assert float(top.data.tags["selected_lambda.warmup"]) == float(rows["warmup"])
    assert float(top.data.tags["selected_lambda.separate"]) == float(rows["separate"])
    sweeps = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == top.info.run_id]
    assert {r.data.tags["pfl.strategy"] for r in sweeps} == {"warmup", "separate"}
    trials = [r for r in runs if r.data.tags.get("mlflow.parentRunId") in {s.info.run_id for s in sweeps}]
    warm_trials = [t for t in trials if t.data.tags.get("pfl.strategy") == "warmup"]
    separate = [t for t in trials if t.data.tags.get("pfl.strategy") == "separate"]
    assert warm_trials and all(t.info.status == "FINISHED" for t in trials)
    history = sorted(mc.get_metric_history(warm_trials[0].info.run_id, "stage/lambda"), key=lambda m: m.step)
    lambdas = [m.value for m in history]
    assert len(lambdas) >= 2 and lambdas == sorted(lambdas, reverse=True)  # the default path descends
    path = sorted(mc.get_metric_history(top.info.run_id, "stage/lambda"), key=lambda m: m.step)
    assert [m.value for m in path] == lambdas  # the smoke preset has one warmup trial: the best
    # every λ the path visited was also trained from scratch, and all of it counted: the separate
    # side's rounds are its runs' rounds summed
    assert sorted(float(t.data.params["method.lam"]) for t in separate) == sorted(set(lambdas) | {0.6, 0.8, 1.0})
    summed = sum(t.data.metrics["fpfc/total_rounds"] for t in separate)
    assert top.data.metrics["separate/rounds"] == summed
    assert top.data.metrics["warmup/rounds"] == warm_trials[0].data.metrics["fpfc/total_rounds"]
    # the smoke preset has a 2-finalist playoff at equal lineage rounds; the selected λ is its best, or
    # the finalist with fewer clusters when the two are within 2 standard errors of their difference
    def history(name):
        return {m.step: m.value for m in mc.get_metric_history(warm_trials[0].info.run_id, "playoff/" + name)}

    playoff, played, se, clusters = history("lambda"), history("val_acc"), history("val_acc_se"), history("clusters")
    lineage = set(history("lineage_rounds").values())
    assert len(playoff) == 2 and set(playoff.values()) <= set(lambdas) and len(lineage) == 1
    best = max(played, key=played.get)
    close = [k for k in played if played[best] - played[k] <= 2 * (se[k] ** 2 + se[best] ** 2) ** 0.5]
    chosen = min(close, key=lambda k: (clusters[k], -played[k]))
    assert playoff[chosen] == float(rows["warmup"])
    top_artifacts = {a.path for a in mc.list_artifacts(top.info.run_id)}
    assert {"strategies.parquet", "strategies.md", "per_lambda.csv"} <= top_artifacts
    assert "plots/lambda_path.png" in {a.path for a in mc.list_artifacts(top.info.run_id, "plots")}
    for sweep in sweeps:
        assert "trials.parquet" in {a.path for a in mc.list_artifacts(sweep.info.run_id)}
    assert "plots" in {a.path for a in mc.list_artifacts(warm_trials[0].info.run_id)}
    _check_what_a_person_sees(mc, out, top, sweeps, warm_trials, separate, rows, tmp_path)


def _check_what_a_person_sees(mc, out, top, sweeps, warm_trials, separate, rows, tmp_path):
    """Issue 28: the tuning result at a glance in the tracking store."""
    import re

    from PIL import Image

    from pfl.tracking_store import MODEL_TRAINING_VIEW

    # the closing line: the pipeline run's page in the model-training view
    assert re.search(rf"#/experiments/\d+/runs/{top.info.run_id}\?{MODEL_TRAINING_VIEW}", out)
    # short names, what tells runs apart first
    by_strategy = {s.data.tags["pfl.strategy"]: s for s in sweeps}
    assert {by_strategy["warmup"].info.run_name, by_strategy["separate"].info.run_name} == \
        {"λ-path sweep", "separate λ grid"}
    assert all(t.info.run_name.startswith("λ-path ρ=") for t in warm_trials), [t.info.run_name for t in warm_trials]
    assert all(re.fullmatch(r"λ=[0-9.]+ separate", t.info.run_name) for t in separate), \
        [t.info.run_name for t in separate]
    # selected_lambda only where a selection happened, and the same value at every level
    assert all("pfl.selected_lambda" not in t.data.tags and "fpfc/selected_lambda" not in t.data.metrics
               for t in separate)
    assert all(float(t.data.tags["pfl.selected_lambda"]) == t.data.metrics["fpfc/selected_lambda"]
               for t in warm_trials)
    assert float(by_strategy["warmup"].data.tags["pfl.selected_lambda"]) == float(rows["warmup"])
    assert float(by_strategy["separate"].data.tags["pfl.selected_lambda"]) == float(rows["separate"])
    assert float(top.data.tags["pfl.selected_lambda"]) == float(rows["warmup"])
    # one name per quantity: the selected trial's val/acc_mean on its sweep, the recommended model's on the
    # pipeline run (the best validated of everything trained, or within the noise the most fused)
    chosen = mc.get_run(top.data.tags["pfl.selected_run_id"])
    assert top.data.tags["pfl.selected_trial"] == chosen.info.run_name == by_strategy["warmup"].data.tags["pfl.best_trial"]
    recommended = mc.get_run(top.data.tags["pfl.recommended_run_id"])
    assert recommended.info.run_id in {t.info.run_id for t in warm_trials + separate}
    assert top.data.tags["pfl.recommended_strategy"] == recommended.data.tags["pfl.strategy"]
    assert float(top.data.tags["pfl.recommended_lambda"]) == float(recommended.data.params["method.lam"])
    assert "recommended: λ " in " ".join(out.split())
    for key in ("val/acc_mean", "test/acc_mean", "cluster/num"):
        assert by_strategy["warmup"].data.metrics[key] == chosen.data.metrics[key]
        assert top.data.metrics[key] == recommended.data.metrics[key] == top.data.metrics["recommended/" + {
            "val/acc_mean": "val", "test/acc_mean": "test", "cluster/num": "clusters"}[key]]
    best_separate = max(separate, key=lambda t: t.data.metrics["val/acc_mean"])
    assert by_strategy["separate"].data.metrics["val/acc_mean"] == best_separate.data.metrics["val/acc_mean"]
    assert top.data.metrics["warmup/val/acc_mean"] == chosen.data.metrics["val/acc_mean"]  # one seed, one path
    # descriptions say what each sweep searches; params are what the trials ran
    separate_note = by_strategy["separate"].data.tags["mlflow.note.content"]
    assert "grid over λ" in separate_note and "method.lam ∈ {" in separate_note and "optuna" not in separate_note.lower()
    assert "method.rho ∈ {" in by_strategy["warmup"].data.tags["mlflow.note.content"]
    for sweep in sweeps:
        params = sweep.data.params
        assert params["base.federation.eval_every"] == params["path.eval_every"] == \
            warm_trials[0].data.params["federation.eval_every"]
        assert "base.federation.rounds" not in params and "base.method.lam" not in params
    # speedup: like for like, and the search reported apart
    assert top.data.metrics["speedup/rounds"] == pytest.approx(
        top.data.metrics["separate/rounds"] / top.data.metrics["warmup/rounds"])
    assert top.data.metrics["search/rounds"] == sum(t.data.metrics["fpfc/total_rounds"] for t in warm_trials)
    # trials.csv best first, the metric and the searched values first, rounded; the Parquet exact
    for sweep in sweeps:
        folder = mc.download_artifacts(sweep.info.run_id, "", str(tmp_path / sweep.info.run_id))
        shown = pd.read_csv(f"{folder}/trials.csv")
        exact = pd.read_parquet(f"{folder}/trials.parquet")
        searched = [k[len("search."):] for k in sweep.data.params if k.startswith("search.")]
        assert list(shown.columns[:2]) == ["trial", "val/acc_mean"] and searched
        assert set(shown.columns[2:2 + len(searched)]) == set(searched)
        assert list(shown["val/acc_mean"]) == sorted(shown["val/acc_mean"], reverse=True)
        assert list(shown["trial"]) == list(exact["trial"])
        assert all(len(f"{v:g}".lstrip("0.").replace(".", "")) <= 4 for v in shown["val/acc_mean"])
        title = Image.open(f"{folder}/plots/trials_val_acc_mean.png").text["Title"]
        assert title == f"{sweep.info.run_name}: val/acc_mean of every trial"
    # strategies.md is Markdown: a heading, pipe tables (header, delimiter, one row per strategy)
    folder = mc.download_artifacts(top.info.run_id, "", str(tmp_path / "top"))
    md = open(f"{folder}/strategies.md").read().splitlines()
    assert md[0].startswith("# ") and "## How each figure was counted" in md
    head = md.index(next(ln for ln in md if ln.startswith("| strategy |")))
    assert md[head - 1] == "" and re.fullmatch(r"(\|---)+\|", md[head + 1])
    assert [ln.split(" | ")[0] for ln in md[head + 2:head + 4]] == ["| warmup", "| separate"]
    assert all(ln.count("|") == md[head].count("|") for ln in md[head:head + 4])
    # the λ selection plot and the best path's plot on the pipeline run
    assert {"plots/lambda_selection.png", "plots/lambda_path.png"} <= \
        {a.path for a in mc.list_artifacts(top.info.run_id, "plots")}
    assert Image.open(f"{folder}/plots/lambda_selection.png").text["Title"].startswith("λ selection")
