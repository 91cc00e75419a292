"""Plugin files, model files and file data sets reach Ray workers through runtime_env.

The sweeps run pipelines/sweep.py as a user would: once on a local Ray instance, once against a
separate Ray head on the loopback interface (the session's ``ray_cluster``). The plugin file
records, when a worker imports it, where it was imported from and where that worker reads the
data set: both must be the copies Ray unpacked in its session's runtime_resources, not the
driver's files.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from mlflow.tracking import MlflowClient

from test_own_code import METHOD, MODEL

ROOT = Path(__file__).resolve().parents[1]

PROBE = '''
import json as _json, os as _os
if _os.environ.get("PFL_ORIGIN_CWD") and _os.environ.get("PFL_SHIPPED"):  # a Ray worker of a pfl sweep
    from pfl.tune.runtime_env import shipped_path as _shipped
    _data = _os.path.join(_os.environ["PFL_ORIGIN_CWD"], "data.parquet")
    with open(_os.path.join(_os.environ["PFL_ORIGIN_CWD"], f"probe_{_os.getpid()}.json"), "w") as _fh:
        _json.dump({"plugin": __file__, "data": str(_shipped(_data))}, _fh)
'''


def _project(tmp_path: Path) -> Path:
    """A user's folder: data, model, method and a search space naming them by relative paths."""
    rng = np.random.default_rng(0)
    n = 400
    pq.write_table(pa.table({"label": rng.integers(0, 4, n), "client": rng.integers(0, 5, n),
                             "x": list(rng.normal(size=(n, 16)).astype(np.float32))}), tmp_path / "data.parquet")
    (tmp_path / "my_model.py").write_text(MODEL)
    # its own method name: test_own_code.py registers fedavg_mix in the same test process
    (tmp_path / "my_method.py").write_text(METHOD.replace('"fedavg_mix"', '"mix_probe"') + PROBE)
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({
        "description": "own data, model and method",
        "base": {"data.source": "files", "data.params.path": "data.parquet", "data.num_clients": 5,
                 "federation.rounds": 2, "federation.clients_per_round": 3, "federation.local_epochs": 1},
        "fixed": {"plugins": ["my_method.py"], "method.name": "mix_probe", "model.name": "my_model.py:SmallNet"},
        "search": {"method.alpha": {"type": "grid", "values": [0.0, 1.0]}},
        "searcher": "grid", "num_samples": 1, "metric": "val/acc_mean"}))
    return tmp_path


def _sweep(run, tmp_path, env_extra):
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PFL_CACHE_DIR": str(tmp_path / "cache"),
           **env_extra}
    MlflowClient(env["MLFLOW_TRACKING_URI"]).search_experiments(max_results=1)
    args = [sys.executable, str(ROOT / "pipelines" / "sweep.py"), "--space", "space.yaml",
            "--storage", str(tmp_path / "ray_results")]
    return run(args, env)


def _children(tmp_path):
    mc = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = [r for e in mc.search_experiments() for r in mc.search_runs([e.experiment_id])]
    return [r for r in runs if "mlflow.parentRunId" in r.data.tags]


def _probes(tmp_path):
    return [json.loads(p.read_text()) for p in tmp_path.glob("probe_*.json")]


@pytest.mark.slow
def test_sweep_on_a_loopback_head_gets_plugin_model_and_data_through_runtime_env(ray_cluster, tmp_path):
    project = _project(tmp_path)

    def run(args, env):
        proc = ray_cluster.popen(args, dict(env, RAY_ADDRESS=ray_cluster.address), cwd=project)
        out, _ = proc.communicate(timeout=600)
        return proc.returncode, out

    code, out = _sweep(run, project, {})
    assert code == 0, out[-4000:]
    assert "cluster at" in out and "mix_probe alpha=0" in out
    children = _children(project)
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)
    assert {c.data.params["method.name"] for c in children} == {"mix_probe"}
    assert all(c.data.params["model.head"] == "['out']" for c in children)
    probes = _probes(project)
    assert probes, "no worker imported the plugin"
    for probe in probes:  # imported from, and reading, the copies Ray unpacked on the node
        assert "/runtime_resources/py_modules_files/" in probe["plugin"], probe
        assert not probe["plugin"].startswith(str(project)), probe
        assert "/runtime_resources/py_modules_files/" in probe["data"], probe
        assert Path(probe["data"]).read_bytes() == (project / "data.parquet").read_bytes()


@pytest.mark.slow
def test_sweep_on_a_local_ray_instance_runs_own_method_and_model(tmp_path):
    import subprocess

    project = _project(tmp_path)

    def run(args, env):
        full = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_", "PFL_"))}
        proc = subprocess.run(args, env={**full, **env}, cwd=project, capture_output=True, text=True, timeout=600)
        return proc.returncode, proc.stdout + proc.stderr

    code, out = _sweep(run, project, {})
    assert code == 0, out[-4000:]
    assert "local Ray instance" in out
    children = _children(project)
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)
    # a local instance shares the disk: code is shipped, the data is read where it is
    probes = _probes(project)
    assert probes and all("/runtime_resources/py_modules_files/" in p["plugin"] for p in probes)
    assert all(p["data"] == str(project / "data.parquet") for p in probes)


def test_runtime_env_stages_what_a_config_reads(tmp_path, monkeypatch):
    from pfl.resolver import load
    from pfl.tune.runtime_env import ORIGIN_ENV, SHIPPED_ENV, shipped_path, worker_runtime_env

    project = _project(tmp_path)
    (project / "mypkg").mkdir()
    (project / "mypkg" / "__init__.py").write_text("")
    (project / "mypkg" / "extra.py").write_text("X = 1\n")
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    cfg = load(None, ["data.source=files", "data.params.path=data.parquet", "data.num_clients=5",
                      "method.name=mix_probe", "model.name=my_model.py:SmallNet"],
               plugins=["my_method.py", "mypkg.extra", "json"])
    env = worker_runtime_env([cfg]).runtime_env
    mapping = json.loads(env["env_vars"][SHIPPED_ENV])
    assert set(mapping) == {str(project / f) for f in ("data.parquet", "my_method.py", "my_model.py")}
    assert env["env_vars"][ORIGIN_ENV] == str(project)
    staged = {Path(m).name.split("_")[2] for m in env["py_modules"] if "pfl_ship" in m}
    assert staged == {"code", "data"}                       # code and data in separate packages
    assert str(project / "mypkg") in env["py_modules"]      # a local package, as it is
    assert not any("json" in m for m in env["py_modules"])  # the standard library is never shipped
    for origin, target in mapping.items():                  # the staged files are the originals
        package, _, entry = target.partition("/")
        folder = next(m for m in env["py_modules"] if m.endswith(package))
        assert (Path(folder) / entry).read_bytes() == Path(origin).read_bytes()
    # too large to ship: a note, and the data stays where it is
    small = worker_runtime_env([cfg], limit=100)
    assert "data.parquet" not in small.runtime_env["env_vars"][SHIPPED_ENV] and "shared disk" in small.notes[0]
    # what a worker does with the map: the unpacked copy, found on sys.path
    folder = Path(next(m for m in env["py_modules"] if "pfl_ship_data" in m))
    monkeypatch.syspath_prepend(str(folder.parent))
    monkeypatch.setenv(SHIPPED_ENV, env["env_vars"][SHIPPED_ENV])
    monkeypatch.setenv(ORIGIN_ENV, str(project))
    monkeypatch.chdir(tmp_path.parent)  # a trial's own directory: relative paths still mean the driver's
    assert shipped_path("data.parquet").parent == folder


@pytest.mark.parametrize("fixed, field, words", [
    ({"model.name": "my_model.py:WrongOutput"}, "model.name", ["returns (8, 3)"]),
    ({"model.name": "my_model.py:RunningMean"}, "model.name", ["buffer 'seen' changes"]),
    ({"plugins": ["missing_method.py"]}, "plugins[0]", ["no such file"]),
    ({"data.params.path": "nope.parquet"}, "data.params.path", ["no such file"]),
])
def test_a_sweep_with_bad_own_code_or_data_stops_before_ray_and_mlflow(tmp_path, monkeypatch, fixed, field, words):
    import ray

    from pfl.schema import ConfigError
    from pfl.tune.space import load_space
    from pfl.tune.sweep import run_sweep

    project = _project(tmp_path)
    space = yaml.safe_load((project / "space.yaml").read_text())
    space["fixed"].update(fixed)
    (project / "space.yaml").write_text(yaml.safe_dump(space))
    monkeypatch.chdir(project)
    with pytest.raises(ConfigError) as err:
        run_sweep(load_space("space.yaml"), storage=tmp_path / "ray_results", progress=None)
    assert err.value.field.endswith(field) and all(w in str(err.value) for w in words), str(err.value)
    assert not ray.is_initialized() and not (tmp_path / "ray_results").exists()
    mc = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    assert not [r for e in mc.search_experiments() for r in mc.search_runs([e.experiment_id])]
