"""A team's setup on one machine: PostgreSQL, an MLflow server on it (login, proxied artifacts), a
two-node Ray cluster, and sweeps against them (pfl/tracking_store.py).

Every component is the real one, on loopback. Where this machine allows it (root with `ip netns`)
all of them run in a private network namespace that has only the loopback interface (Ray otherwise
advertises the machine's network address), and the checks read the server from inside it.
PostgreSQL refuses to run as root: as root it runs as the `postgres` user (else `nobody`). The
tests are skipped only where PostgreSQL's binaries are absent (Debian's `postgresql` package;
`./setup.sh --test` installs it).
"""

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from services import Team, clean_env, free_port, listing, netns_processes, pg_bindir, processes_of
from pfl.tracking_store import (AUTH_VARIABLES, location_warning, redact, run_url, store_kind, view_hint,
                                worker_environment)

ROOT = Path(__file__).resolve().parents[1]
SPACES = ROOT / "search_spaces"


# ---- no server needed ---------------------------------------------------------------------------

def test_store_kinds_and_where_each_sends_artifacts(monkeypatch, tmp_path):
    from pfl.tracking import artifact_root, export_environment

    assert [store_kind(u) for u in ("http://h:5000", "https://h", "sqlite:////x.db", "postgresql://u@h/d",
                                    "postgresql+psycopg://u@h/d", "mysql+pymysql://u@h/d", "databricks")] == \
        ["server", "server", "sqlite", "database", "database", "database", "other"]
    # a server: no location of pfl's own, so the server stores the artifacts (and nothing is exported)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5099")
    assert artifact_root() is None and "PFL_ARTIFACT_ROOT" not in export_environment()
    monkeypatch.setenv("PFL_ARTIFACT_ROOT", "s3://bucket/pfl")   # explicit: kept for every kind
    assert artifact_root() == "s3://bucket/pfl" == export_environment()["PFL_ARTIFACT_ROOT"]
    monkeypatch.delenv("PFL_ARTIFACT_ROOT")
    # a database store: mlartifacts beside an SQLite file named by the environment
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/store/m.db")
    assert artifact_root() == (tmp_path / "store" / "mlartifacts").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql+psycopg://pfl@db:5432/mlflow")
    monkeypatch.chdir(tmp_path)
    assert artifact_root() == (tmp_path / "mlartifacts").as_uri()


def test_hints_and_urls_for_each_kind_of_store():
    run, exp = "0123abcd", "7"
    assert run_url(run, exp, "http://mlflow.lab:5000/") == \
        "http://mlflow.lab:5000/#/experiments/7/runs/0123abcd?workflowType=machine_learning"
    assert view_hint(run, exp, "https://mlflow.lab") == \
        "MLflow run 0123abcd: https://mlflow.lab/#/experiments/7/runs/0123abcd?workflowType=machine_learning"
    assert view_hint(run, None, "sqlite:////w/mlflow.db", "MLflow parent run") == (
        "MLflow parent run 0123abcd; view: mlflow ui --backend-store-uri sqlite:////w/mlflow.db  "
        "(then open http://127.0.0.1:5000/#/runs/0123abcd?workflowType=machine_learning)")
    hint = view_hint(run, exp, "postgresql+psycopg://pfl:s3cret@db:5432/mlflow")
    assert "s3cret" not in hint and "postgresql+psycopg://pfl:***@db:5432/mlflow" in hint
    assert redact("http://h:5000") == "http://h:5000"
    # an experiment whose artifacts bypass the server is named, with the fix; others are not
    text = location_warning("pfl-sweeps", "3", "file:///home/me/mlartifacts/pfl-sweeps", "http://h:5000")
    assert "'pfl-sweeps'" in text and "rename" in text and "\n" not in text
    assert location_warning("pfl-sweeps", "3", "mlflow-artifacts:/3", "http://h:5000") is None
    assert location_warning("pfl-sweeps", "3", "file:///x", "sqlite:////x.db") is None


@pytest.mark.parametrize("text, problem", [
    # MLflow's messages once its retries are spent (seen against a killed server, a server without
    # its database, a server with logins)
    ("API request to http://h:5099/api/2.0/mlflow/runs/log-batch failed with exception HTTPConnectionPool("
     "host='h', port=5099): Max retries exceeded with url: /api/2.0/mlflow/runs/log-batch (Caused by "
     "NewConnectionError(\"HTTPConnection(host='h', port=5099): Failed to establish a new connection: [Errno 111] "
     "Connection refused\"))", "the MLflow server stopped answering (connection refused)"),
    ("API request to http://h:5099/api/2.0/mlflow/runs/log-batch failed with exception HTTPConnectionPool("
     "host='h', port=5099): Max retries exceeded with url: /x (Caused by ProtocolError('Connection aborted.', "
     "RemoteDisconnected('Remote end closed connection without response')))",
     "the MLflow server stopped answering (connection lost)"),
    ("API request to http://h:5099/api/2.0/mlflow/runs/get failed with exception HTTPConnectionPool(host='h', "
     "port=5099): Max retries exceeded with url: /x (Caused by ResponseError('too many 503 error responses'))",
     "the MLflow server failed (HTTP 503; its database may be down)"),
], ids=["refused", "lost", "http503"])
def test_a_store_that_goes_away_is_one_line_naming_the_variable(text, problem):
    from mlflow.exceptions import MlflowException

    from pfl.tracking_store import store_error

    err = store_error("http://h:5099", MlflowException(text))
    assert str(err) == f"MLFLOW_TRACKING_URI: http://h:5099: {problem}"
    assert store_error("http://h:5099", ValueError("a bug")) is None  # not every error is the store's


def test_trials_get_the_drivers_mlflow_client_settings():
    env = {"MLFLOW_TRACKING_USERNAME": "u", "MLFLOW_TRACKING_PASSWORD": "p", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
           "MLFLOW_TRACKING_URI": "http://elsewhere", "HOME": "/root"}
    got = worker_environment({"MLFLOW_TRACKING_URI": "http://h:5000"}, env)
    assert got == {"MLFLOW_TRACKING_USERNAME": "u", "MLFLOW_TRACKING_PASSWORD": "p",
                   "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_TRACKING_URI": "http://h:5000"}


def _sweep_args(space, storage, *extra):
    return [sys.executable, str(ROOT / "pipelines" / "sweep.py"), "--space", str(space),
            "--storage", str(storage), *extra]


def test_unreachable_server_exits_2_within_seconds_before_ray(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"
    started = time.time()
    proc = subprocess.run(_sweep_args(SPACES / "fedavg.yaml", tmp_path / "ray_results", "--smoke"),
                          env=clean_env(MLFLOW_TRACKING_URI=uri, PFL_CACHE_DIR=str(tmp_path / "cache")),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    took = time.time() - started
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1] == f"config error: MLFLOW_TRACKING_URI: {uri}: no MLflow server answers (connection refused)"
    assert "Ray:" not in proc.stdout and not (tmp_path / "ray_results").exists()
    assert took < 45, took  # importing torch, Ray and MLflow, then one refused connection (retries: a minute)


# ---- PostgreSQL + an MLflow server (one for the session) -----------------------------------------

@pytest.fixture(scope="session")
def team():
    if pg_bindir() is None:
        pytest.skip("PostgreSQL's initdb and pg_ctl were not found (Debian's postgresql package; "
                    "./setup.sh --test installs it)")
    tmp = Path(tempfile.mkdtemp(prefix="pfl-team-"))
    tmp.chmod(0o755)  # PostgreSQL's user must reach its data folder
    ns = None
    prefix: list[str] = []
    if os.geteuid() == 0 and shutil.which("ip"):
        name = f"pflteam{os.getpid()}"
        if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0:
            ns, prefix = name, ["ip", "netns", "exec", name]
            subprocess.run(prefix + ["ip", "link", "set", "lo", "up"], check=True)
    setup = Team(tmp, prefix, ns)
    try:
        setup.init_db()
        setup.start_server()
        yield setup
    finally:
        setup.kill_server()
        setup.stop_db(check=False)
        if ns:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for pid in netns_processes(ns):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                time.sleep(1)
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def _config_error(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return lines[-1]


LOGIN_CHECKS = """
import os
from pfl.tracking import check_store
from pfl.tracking_store import TrackingStoreError
for user, password in ((None, None), ("admin", "wrong")):
    for key, value in (("MLFLOW_TRACKING_USERNAME", user), ("MLFLOW_TRACKING_PASSWORD", password)):
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    try:
        check_store()
        print("accepted")
    except TrackingStoreError as err:
        print(err)
"""


@pytest.mark.slow
def test_login_refused_or_database_down_exits_2_with_one_line(team, tmp_path):
    # the login: the check a pipeline runs before anything else (as below), without and with a wrong password
    proc = team.python(LOGIN_CHECKS, team.env())
    missing, wrong = proc.stdout.splitlines()
    assert missing.startswith(f"MLFLOW_TRACKING_URI: {team.uri}: the MLflow server requires a login (HTTP 401); "), \
        proc.stdout + proc.stderr[-2000:]
    assert all(v in missing for v in AUTH_VARIABLES)
    assert "refused the credentials from MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD (HTTP 401)" in wrong
    # the server up, its database down: the pipeline stops in seconds, before Ray
    args = _sweep_args(SPACES / "fedavg.yaml", tmp_path / "ray_results", "--smoke")
    team.stop_db()
    try:
        started = time.time()
        proc = team.run(args, team.env(PFL_CACHE_DIR=str(tmp_path / "cache")), tmp_path)
        took = time.time() - started
    finally:
        team.start_db()
    line = _config_error(proc)
    assert line.startswith(f"config error: MLFLOW_TRACKING_URI: {team.uri}: the MLflow server answers but cannot "
                           "use its database (HTTP 503"), line
    assert "Ray:" not in proc.stdout and not (tmp_path / "ray_results").exists() and took < 45, took


@pytest.mark.slow
def test_an_experiment_with_local_artifacts_on_a_server_is_named_once(team, tmp_path):
    code = (f"from mlflow.tracking import MlflowClient\n"
            f"MlflowClient().create_experiment('old-local', artifact_location='{(tmp_path / 'old').as_uri()}')\n"
            "from pfl.tracking import experiment_id\n"
            "first = experiment_id('old-local'); second = experiment_id('old-local')\n"
            "fresh = experiment_id('fresh')\n"
            "print(first == second, MlflowClient().get_experiment(fresh).artifact_location)")
    proc = team.python(code, team.env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    same, location = proc.stdout.split()
    assert same == "True" and location.startswith("mlflow-artifacts:/"), proc.stdout  # the server's own store
    warnings = [ln for ln in proc.stderr.splitlines() if "old-local" in ln]
    assert len(warnings) == 1 and "rename" in warnings[0] and (tmp_path / "old").as_uri() in warnings[0], \
        proc.stderr[-3000:]


# ---- a sweep on a two-node Ray cluster, through the server --------------------------------------

@pytest.fixture(scope="module")
def two_nodes(team):
    """A Ray head and a second node (`ray start --address`), one CPU each, with a private token."""

    temp = Path(tempfile.mkdtemp(prefix="pflteam", dir="/tmp"))  # short: Ray's socket paths live below it
    token = temp / "auth_token"
    token.write_text(uuid.uuid4().hex)
    env = clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    port = 26379 if team.ns else free_port()
    ray = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    common = ["--num-cpus=1", f"--temp-dir={temp}", "--disable-usage-stats"]
    try:
        for args in ([ray, "start", "--head", f"--port={port}", "--include-dashboard=false", *common],
                     [ray, "start", f"--address=127.0.0.1:{port}", *common]):
            started = subprocess.run(team.prefix + args, env=env, capture_output=True, text=True, timeout=180)
            assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        wait = (f"import ray, time\nray.init(address='127.0.0.1:{port}', log_to_driver=False)\n"
                "for _ in range(120):\n    if sum(n['Alive'] for n in ray.nodes()) == 2: break\n    time.sleep(0.5)\n"
                "else: raise SystemExit('the second node did not join')")
        joined = team.python(wait, env)
        assert joined.returncode == 0, joined.stderr[-2000:]
        yield f"127.0.0.1:{port}", {k: v for k, v in env.items() if k.startswith("RAY_AUTH")}
    finally:  # a test cluster holds nothing worth a graceful stop
        for _ in range(20):
            pids = processes_of(str(temp), None)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        shutil.rmtree(temp, ignore_errors=True)


CHILD_ARTIFACTS = {"config.yaml", "client_metrics.csv", "plots/accuracy_vs_round.png", "plots/accuracy_vs_bytes.png",
                   "model/model_state.pt"}
PARENT_ARTIFACTS = {"trials.csv", "trials.html", "trials.parquet", "plots/trials_val_acc_mean.png"}


@pytest.mark.slow
def test_sweep_on_two_nodes_tracks_through_the_server_and_survives_its_restart(team, two_nodes, tmp_path):
    import yaml

    address, ray_auth = two_nodes
    rates, rounds = (0.03, 0.1, 0.3), 24
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({
        "base": {"data.source": "digits", "data.num_clients": 6, "federation.rounds": rounds,
                 "federation.clients_per_round": 3, "federation.eval_every": 2, "federation.local_epochs": 1},
        "fixed": {"method.name": "fedavg"},
        "search": {"federation.lr": {"type": "grid", "values": list(rates)}},
        "searcher": "grid", "num_samples": 1, "max_concurrent": 2, "checkpoint_every": 4,
        "resources": {"cpu": 1},
    }))
    work = tmp_path / "work"  # the driver's working directory: no artifact may land here
    work.mkdir()
    # MLflow's client retries a refused connection for about a minute by default; the trials get
    # these settings from the driver's environment, as they get its login
    env = {**team.env(PFL_CACHE_DIR=str(tmp_path / "cache"), RAY_ADDRESS=address,
                      MLFLOW_HTTP_REQUEST_MAX_RETRIES="1", MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="1"), **ray_auth}
    args = _sweep_args(space, tmp_path / "ray_results", "--name", "team")
    proc = subprocess.Popen(team.prefix + args, env=env, cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: [lines.append(ln) for ln in proc.stdout], daemon=True)
    reader.start()
    # kill the server once the last trial (started when an earlier one ended) holds a checkpoint and
    # has not finished: it is cut off mid-run, after rounds it logged past its checkpoint
    experiment, killed = tmp_path / "ray_results" / "team", False
    deadline = time.time() + 400
    while proc.poll() is None and not killed and time.time() < deadline:
        seen = list(lines)
        started = [ln.split("] ", 1)[1].rsplit(": started", 1)[0] for ln in seen if ln.rstrip().endswith(": started")]
        if len(started) == len(rates) and not any(f"{started[-1]}: finished" in ln for ln in seen) \
                and list(experiment.glob(f"{glob.escape(started[-1])}_*/checkpoint_*")):
            team.kill_server()
            killed = True
        time.sleep(0.2)
    proc.wait(timeout=300)
    reader.join(timeout=30)
    out = "".join(lines)
    print(out)
    assert killed, out[-4000:]
    # two trials ran at once on one CPU per node: both nodes took trials
    starts = [i for i, ln in enumerate(lines) if ln.rstrip().endswith(": started")]
    assert starts[1] < min(i for i, ln in enumerate(lines) if ": finished" in ln), out
    assert proc.returncode == 1, out[-4000:]
    failed = [ln for ln in lines if ln.startswith("failed: ")]
    # a trial cut off while it logged, or one that started just then
    reason = re.compile(f"TrackingStoreError: MLFLOW_TRACKING_URI: {re.escape(team.uri)}: (the MLflow server "
                        r"stopped answering|no MLflow server answers) \(connection (refused|lost)\)$")
    assert failed and all(reason.search(ln.rstrip()) for ln in failed), failed
    assert "stopped: the MLflow tracking store stopped answering" in out and "--resume" in out
    assert "== best ==" not in out

    team.start_server()
    before = listing(team)
    resumed = team.run(args + ["--resume"], env, work, timeout=600)
    print(resumed.stdout)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-3000:]
    assert f"{team.uri}/#/experiments/" in resumed.stdout  # the closing hint is the server's page

    runs = listing(team)
    counts = {when: {s: sum(r["status"] == s for r in rs if r["parent"]) for s in ("FINISHED", "RUNNING", "FAILED")}
              for when, rs in (("before --resume", before), ("after", runs))}
    print("child runs", counts)
    # the run cut off mid-sweep held rounds beyond its checkpoint; it is the one that finished
    cut = [r for r in before if r["parent"] and r["status"] == "RUNNING"]
    assert any(4 <= len(r["steps"]) < rounds for r in cut), before
    assert {r["id"] for r in before} <= {r["id"] for r in runs}  # resumed, not duplicated
    parents = [r for r in runs if r["parent"] is None]
    children = [r for r in runs if r["parent"] is not None]
    assert len(parents) == 1 and parents[0]["status"] == "FINISHED", runs
    parent = parents[0]
    assert parent["location"].startswith("mlflow-artifacts:/") and parent["artifact_uri"].startswith("mlflow-artifacts:")
    assert PARENT_ARTIFACTS <= set(parent["artifacts"]) and "best.federation.lr" in parent["params"]
    # no lost or duplicated runs: one per grid point, each round logged once
    assert sorted(c["name"] for c in children) == sorted(f"fedavg lr={v:g}" for v in rates), children
    for child in children:
        assert child["status"] == "FINISHED" and child["parent"] == parent["id"]
        assert child["steps"] == list(range(1, rounds + 1)), (child["name"], child["steps"])
        assert CHILD_ARTIFACTS <= set(child["artifacts"]), child["artifacts"]
        assert float(child["config"]["federation"]["lr"]) == float(child["params"]["federation.lr"]) \
            == float(child["name"].split("=")[1])
        # the files are on the server's side, where --artifacts-destination puts them
        stored = team.artifacts / child["experiment_id"] / child["id"] / "artifacts"
        assert {str(p.relative_to(stored)) for p in stored.rglob("*") if p.is_file()} >= CHILD_ARTIFACTS
    assert not (work / "mlartifacts").exists() and not list(work.iterdir()), list(work.iterdir())


@pytest.mark.slow
def test_concurrent_trials_on_two_nodes_write_to_postgresql_directly(team, two_nodes, tmp_path):
    """A database URI instead of a server: every trial writes to PostgreSQL itself (no file lock, as
    SQLite needs); artifacts go to the configured root, here beside the driver."""
    import yaml

    address, ray_auth = two_nodes
    made = team.run([str(team.pg_bin / "createdb"), "-h", "127.0.0.1", "-p", str(team.pg_port), "-U", "pfl",
                     "direct"], clean_env(), tmp_path)
    assert made.returncode == 0, made.stderr
    uri = f"postgresql+psycopg://pfl@127.0.0.1:{team.pg_port}/direct"
    rates, rounds = (0.05, 0.1, 0.2, 0.4), 6
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({
        "base": {"data.source": "digits", "data.num_clients": 6, "federation.rounds": rounds,
                 "federation.clients_per_round": 3, "federation.eval_every": 2, "federation.local_epochs": 1},
        "fixed": {"method.name": "fedavg"}, "search": {"federation.lr": {"type": "grid", "values": list(rates)}},
        "searcher": "grid", "num_samples": 1, "max_concurrent": 2, "resources": {"cpu": 1},
    }))
    env = {**clean_env(MLFLOW_TRACKING_URI=uri, PFL_CACHE_DIR=str(tmp_path / "cache"), RAY_ADDRESS=address),
           **ray_auth}
    done = team.run(_sweep_args(space, tmp_path / "ray_results"), env, tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"--backend-store-uri {uri}" in done.stdout  # the closing hint: mlflow ui on the database
    runs = listing(team, env)
    children = [r for r in runs if r["parent"]]
    assert sorted(c["name"] for c in children) == sorted(f"fedavg lr={v:g}" for v in rates)
    assert all(c["status"] == "FINISHED" and c["steps"] == list(range(1, rounds + 1)) for c in children)
    assert all(CHILD_ARTIFACTS <= set(c["artifacts"]) for c in children)
    assert all(c["artifact_uri"].startswith((tmp_path / "mlartifacts").as_uri()) for c in children)


@pytest.mark.slow
def test_a_table_runs_its_cells_on_both_nodes(team, two_nodes, tmp_path):
    """pfl table on the two-node cluster: one CPU a node, so both nodes take cells, each cell's
    record names the node that ran it, and the table lands on the MLflow server."""
    import pandas as pd
    import yaml

    address, ray_auth = two_nodes
    table = tmp_path / "two_nodes.yaml"
    table.write_text(yaml.safe_dump({
        "set": {"data.source": "digits", "data.num_clients": 6, "federation.rounds": 6,
                "federation.clients_per_round": 3, "federation.eval_every": 2, "federation.local_epochs": 1},
        "rows": [{"name": "fedavg", "set": {"method.name": "fedavg"}},
                 {"name": "ditto", "set": {"method.name": "ditto"}}],
        "seeds": [0, 1], "reference": "fedavg"}))
    env = {**team.env(PFL_CACHE_DIR=str(tmp_path / "cache"), RAY_ADDRESS=address), **ray_auth}
    done = team.run([sys.executable, "-m", "pfl", "table", str(table), "--storage", str(tmp_path / "ray_results"),
                     "--out", str(tmp_path / "out")], env, tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "cluster at 127.0.0.1" in done.stdout and "finished: 4 of 4 cells finished" in done.stdout
    runs = pd.read_csv(tmp_path / "out" / "two_nodes_runs.csv")
    assert len(runs) == 4 and runs["node"].nunique() == 2, runs[["row", "seed", "node"]]
    parents = [r for r in listing(team, env) if r["parent"] is None and r["name"] == "two_nodes"]
    assert len(parents) == 1 and parents[0]["status"] == "FINISHED"


def test_a_cells_workers_sit_in_its_placement_group_across_both_nodes(team, two_nodes, tmp_path):
    """A cell with 2 workers of 0.5 CPU and its own 0.5: 1.5 CPUs, more than a node's one, so the
    trial's placement group spans the two nodes and so do its workers (workers/nodes = 2)."""
    import pandas as pd
    import yaml

    address, ray_auth = two_nodes
    table = tmp_path / "spread.yaml"
    table.write_text(yaml.safe_dump({
        "set": {"data.source": "digits", "data.num_clients": 6, "federation.rounds": 2, "federation.clients_per_round": 4,
                "federation.eval_every": 2, "federation.local_epochs": 1, "federation.workers": 2,
                "federation.worker_resources.cpu": 0.5},
        "rows": [{"name": "fedavg", "set": {"method.name": "fedavg"}}], "seeds": [0], "reference": "fedavg",
        "columns": [{"name": "worker_nodes", "metric": "workers/nodes", "read": "best"}]}))
    env = {**team.env(PFL_CACHE_DIR=str(tmp_path / "cache"), RAY_ADDRESS=address), **ray_auth}
    done = team.run([sys.executable, "-m", "pfl", "table", str(table), "--resources", "cpu=0.5", "--storage",
                     str(tmp_path / "ray_results"), "--out", str(tmp_path / "out"), "--no-track"], env, tmp_path,
                    timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    runs = pd.read_csv(tmp_path / "out" / "spread_runs.csv")
    assert runs["worker_nodes"].tolist() == [2.0], runs
