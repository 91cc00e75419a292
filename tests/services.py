"""Real services for the team-setup tests, on loopback: PostgreSQL (initdb + pg_ctl in a temporary
folder, as an unprivileged user when run as root), an `mlflow server` with basic-auth logins and
proxied artifacts on it, and a way to read every run through the server's API."""

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

PASSWORD = "pfl-" + uuid.uuid4().hex[:12]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_", "PFL_"))}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def pg_bindir() -> Path | None:
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).resolve().parent
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                   key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0)
    return found[-1].parent if found else None


def netns_processes(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split() if int(pid) != os.getpid()]


def _kill_group(proc: subprocess.Popen | None, sig=signal.SIGTERM, wait: float = 20) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=wait)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=wait)


class Team:
    """PostgreSQL and an `mlflow server --app-name basic-auth` on it with proxied artifacts."""

    def __init__(self, tmp: Path, prefix: list[str], ns: str | None):
        self.tmp, self.prefix, self.ns = tmp, prefix, ns
        self.pg_bin = pg_bindir()
        self.pg_user = [] if os.geteuid() != 0 else \
            ["runuser", "-u", "postgres" if _has_user("postgres") else "nobody", "--"]
        self.pg_port = 25432 if ns else free_port()
        self.port = 25099 if ns else free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.artifacts = tmp / "server-artifacts"
        self.pg = tmp / "pg"
        self.server: subprocess.Popen | None = None

    # PostgreSQL, in a folder its user owns (data, log, socket)
    def _pg(self, *args, check=True):
        done = subprocess.run(self.prefix + self.pg_user + [str(self.pg_bin / "pg_ctl"), "-D", str(self.pg / "data"),
                                                            *args], capture_output=True, text=True, timeout=120)
        log = self.pg / "log"
        assert done.returncode == 0 or not check, done.stdout + done.stderr + (log.read_text() if log.exists() else "")

    def init_db(self) -> None:
        self.pg.mkdir()
        if self.pg_user:
            entry = pwd.getpwnam(self.pg_user[2])
            os.chown(self.pg, entry.pw_uid, entry.pw_gid)
        done = subprocess.run(self.pg_user + [str(self.pg_bin / "initdb"), "-D", str(self.pg / "data"), "-U", "pfl",
                                              "--auth=trust", "-E", "UTF8", "--no-instructions"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        self.start_db()

    def start_db(self) -> None:
        self._pg("-l", str(self.pg / "log"), "-w", "-o", f"-h 127.0.0.1 -p {self.pg_port} -k {self.pg}", "start")

    def stop_db(self, check=True) -> None:
        self._pg("-m", "fast", "-w", "stop", check=check)

    @property
    def backend(self) -> str:
        return f"postgresql+psycopg://pfl@127.0.0.1:{self.pg_port}/postgres"

    # the MLflow server
    def start_server(self) -> None:
        auth = self.tmp / "auth.ini"
        auth.write_text(f"[mlflow]\ndefault_permission = NO_PERMISSIONS\ndatabase_uri = sqlite:///{self.tmp}/auth.db\n"
                        f"admin_username = admin\nadmin_password = {PASSWORD}\n"
                        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                        "grant_default_workspace_access = false\nauth_cache_ttl_seconds = 600\n")
        env = clean_env(MLFLOW_AUTH_CONFIG_PATH=str(auth), MLFLOW_FLASK_SERVER_SECRET_KEY=uuid.uuid4().hex,
                         MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")  # no GenAI job workers (2 GB)
        log = open(self.tmp / "server.log", "a")
        self.server = subprocess.Popen(
            self.prefix + [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth",
                           "--backend-store-uri", self.backend, "--artifacts-destination", str(self.artifacts),
                           "--serve-artifacts", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
            env=env, cwd=self.tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        # up, and past its first use of the database (the server opens its store then)
        code = ("import time, urllib.request\nfor _ in range(360):\n    try:\n"
                f"        urllib.request.urlopen('{self.uri}/health', timeout=2).close(); break\n"
                "    except Exception: time.sleep(0.5)\nelse: raise SystemExit(1)\n"
                "from mlflow.tracking import MlflowClient\nMlflowClient().search_experiments(max_results=1)")
        up = subprocess.run(self.prefix + [sys.executable, "-c", code], capture_output=True, timeout=240,
                            env=self.env())
        assert up.returncode == 0, (self.tmp / "server.log").read_text()[-3000:]

    def kill_server(self) -> None:
        _kill_group(self.server, signal.SIGKILL)

    # drivers and checks, inside the namespace
    def env(self, **extra) -> dict:
        return clean_env(MLFLOW_TRACKING_URI=self.uri, MLFLOW_TRACKING_USERNAME="admin",
                          MLFLOW_TRACKING_PASSWORD=PASSWORD, **extra)

    def python(self, code: str, env: dict, timeout=120) -> subprocess.CompletedProcess:
        return subprocess.run(self.prefix + [sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=timeout)

    def run(self, args, env, cwd, timeout=300) -> subprocess.CompletedProcess:
        return subprocess.run(self.prefix + args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


DUMP = """
import json, tempfile, yaml
from mlflow.tracking import MlflowClient
mc = MlflowClient()
def files(run, path=None):
    found = []
    for a in mc.list_artifacts(run, path):
        found += files(run, a.path) if a.is_dir else [a.path]
    return found
runs = []
for e in mc.search_experiments():
    for r in mc.search_runs([e.experiment_id]):
        rid = r.info.run_id
        names = files(rid)
        config = None
        if "config.yaml" in names:
            with tempfile.TemporaryDirectory() as d:
                config = yaml.safe_load(open(mc.download_artifacts(rid, "config.yaml", d)))
        runs.append({"id": rid, "experiment": e.name, "experiment_id": e.experiment_id,
                     "location": e.artifact_location, "name": r.info.run_name, "status": r.info.status,
                     "parent": r.data.tags.get("mlflow.parentRunId"), "artifact_uri": r.info.artifact_uri,
                     "params": r.data.params, "metrics": r.data.metrics,
                     "steps": [m.step for m in mc.get_metric_history(rid, "comm/total_bytes")],
                     "artifacts": names, "config": config})
print(json.dumps(runs))
"""

def listing(team, env: dict | None = None) -> list[dict]:
    """Every run with its metrics' steps and artifacts, read through the server's API (or the store
    that ``env`` names)."""
    listing = team.python(DUMP, env or team.env())
    assert listing.returncode == 0, listing.stderr[-3000:]
    runs = json.loads(listing.stdout)
    for run in runs:
        print(f"  {run['experiment']:<10} {run['name']:<15} {run['status']:<8} {run['id']} {run['artifact_uri']} "
              f"{len(run['steps'])} steps: {', '.join(sorted(run['artifacts']))}")
    return runs


def processes_of(temp_dir: str, ns: str | None) -> list[int]:
    """PIDs of this test cluster only: the processes in its network namespace, those whose command
    line names its private temp dir, and their descendants (workers rename themselves ``ray::...``).
    ``ray stop`` would kill every Ray process of the machine, a user's running sweep included."""
    parent, roots = {}, set()
    if ns:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        roots |= {int(pid) for pid in out.split()}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        pid = int(proc.name)
        parent[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        if temp_dir.encode() in cmdline:
            roots.add(pid)
    found, changed = set(roots), True
    while changed:
        kids = {pid for pid, ppid in parent.items() if ppid in found} - found
        found |= kids
        changed = bool(kids)
    mine, pid = set(), os.getpid()
    while pid > 1 and pid not in mine:  # never this process or the ones that started it
        mine.add(pid)
        pid = parent.get(pid, 1)
    return sorted(found - mine)
