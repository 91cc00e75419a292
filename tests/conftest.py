import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from services import processes_of

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_stores(tmp_path, monkeypatch):
    """Every test gets its own MLflow store and partition cache (never the user's)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("PFL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PFL_ARTIFACT_ROOT", raising=False)
    yield


# ---- a private Ray head on the loopback interface (tests/test_tune.py, tests/test_ray_shipping.py) ----

class Cluster:
    def __init__(self, prefix, address, env):
        self.prefix, self.address, self.env = prefix, address, env

    def popen(self, args, env_extra, **kwargs):  # kwargs: e.g. start_new_session for a process group
        env = dict(self.env, **env_extra)
        return subprocess.Popen(self.prefix + args, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, **kwargs)

    def run(self, args, env_extra, timeout=600):
        proc = self.popen(args, env_extra)
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out


def _stop_cluster(temp_dir: str, ns: str | None) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = processes_of(temp_dir, ns)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 15
        while pids and time.time() < deadline and processes_of(temp_dir, ns):
            time.sleep(0.5)


@pytest.fixture(scope="session")
def ray_cluster():
    ns = f"pfltest{os.getpid()}"
    temp_dir = f"/tmp/pflray{os.getpid()}"  # short: Ray's socket paths live below it
    prefix: list[str] = []
    if os.geteuid() == 0 and shutil.which("ip"):
        if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode == 0:
            prefix = ["ip", "netns", "exec", ns]
            subprocess.run(prefix + ["ip", "link", "set", "lo", "up"], check=True)
    port = 20000 + os.getpid() % 20000
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_", "PFL_"))}
    # Ray >= 2.60's `ray start` no longer creates a token: give this cluster a private one (never
    # the user's ~/.ray/auth_token), which the drivers below find through RAY_AUTH_TOKEN_PATH
    os.makedirs(temp_dir, exist_ok=True)
    token_path = Path(temp_dir) / "auth_token"
    token_path.write_text(uuid.uuid4().hex)
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path), PYTHONUNBUFFERED="1")
    ray = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    start = subprocess.run(prefix + [ray, "start", "--head", f"--port={port}", "--num-cpus=2",
                                     f"--temp-dir={temp_dir}", "--include-dashboard=false",
                                     "--disable-usage-stats"],
                           env=env, capture_output=True, text=True, timeout=180)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        yield Cluster(prefix, f"127.0.0.1:{port}", env)
    finally:
        _stop_cluster(temp_dir, ns if prefix else None)
        if prefix:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        shutil.rmtree(temp_dir, ignore_errors=True)


