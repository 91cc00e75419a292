"""Comparison tables (pfl/tables): the YAML file validated before Ray, cells as Ray Tune trials with
the numbers of in-process runs, MLflow's parent and children, an interrupted table resumed."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

from pfl.schema import ConfigError
from pfl.tables.spec import cells, expand, load_table, parse_row_sets, select_rows

ROOT = Path(__file__).resolve().parents[1]
TABLES = ROOT / "tables"
SMALL = {"data.source": "digits", "data.num_clients": 6, "federation.rounds": 4, "federation.clients_per_round": 3,
         "federation.eval_every": 2, "federation.local_epochs": 1}


def _write(tmp_path, body, name="t.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


# ---- the file, before anything runs --------------------------------------------------------------

@pytest.mark.parametrize("body, field, words", [
    ({"set": SMALL, "rows": [{"name": "a", "set": {"method.name": "fedavg"}}], "seeds": [0], "metirc": "x"},
     "metirc", "did you mean 'metric'"),
    ({"set": SMALL, "rows": [{"name": "a", "sett": {}}]}, "rows[0].sett", "did you mean 'set'"),
    ({"set": SMALL, "rows": [{"name": "a", "set": {"method.name": "fedavgg"}}]}, "method.name", "fedavg"),
    ({"set": SMALL, "rows": [{"name": "a", "set": {"method.name": "ditto", "method.lamm": 1}}]}, "method.lamm",
     "did you mean 'lam'"),
    ({"set": SMALL, "rows": [{"grid": {"method.name": ["fedavg"]}, "name": "{method.nme}"}]}, "rows[0].name",
     "not an axis"),
    ({"set": SMALL, "rows": [{"name": "a"}, {"name": "a"}]}, "rows", "two rows are named 'a'"),
    ({"set": SMALL, "rows": []}, "rows", "at least one row"),
    ({"set": SMALL, "read": "median", "rows": [{"name": "a"}]}, "read", "allowed values"),
    ({"set": SMALL, "rows": [{"name": "a"}], "columns": [{"name": "b", "metric": "x", "read": "last"}]},
     "columns[0].read", "did you mean 'last_mean'"),
    ({"set": {**SMALL, "federation.rouns": 3}, "rows": [{"name": "a"}]}, "federation.rouns", "did you mean"),
])
def test_a_bad_table_is_one_line_naming_the_key(tmp_path, body, field, words):
    import ray

    path = _write(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        cells(load_table(path), track=False)
    assert info.value.field == field, str(info.value)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert str(path) in str(info.value) or field.startswith(("method.", "federation."))
    assert not ray.is_initialized()


def test_grids_expand_in_axis_order_with_labelled_axes_and_templates(tmp_path):
    path = _write(tmp_path, {"set": SMALL, "rows": [
        {"name": "fedavg", "set": {"method.name": "fedavg"}},
        {"grid": {"attack": {"clean": {"attack.kind": "none"}, "flip": {"attack.kind": "sign_flip",
                                                                           "attack.fraction": 0.2}},
                  "method.name": ["fedavg", "ditto"]},
         "name": "{method.name}", "group": "{attack}", "tags": {"kind": "{attack} attack"}}]})
    spec = load_table(path)
    rows = expand(spec)
    assert [(r.group, r.name) for r in rows] == [("", "fedavg"), ("clean", "fedavg"), ("clean", "ditto"),
                                                 ("flip", "fedavg"), ("flip", "ditto")]
    assert rows[3].set == {"attack.kind": "sign_flip", "attack.fraction": 0.2, "method.name": "fedavg"}
    assert rows[4].tags == {"kind": "flip attack"}
    table = cells(spec, seeds=[3, 4], track=False)
    assert len(table) == 10 and [c.seed for c in table[:5]] == [3] * 5   # seed-major: rows share a seed's data
    assert table[3].config.attack.fraction == 0.2 and table[3].config.seed == 3
    assert table[3].label == "flip: fedavg [seed 3]"


def test_layering_rows_over_shared_values_and_the_command_line(tmp_path):
    path = _write(tmp_path, {"set": {**SMALL, "method.name": "ditto", "method.lam": 0.5},
                             "presets": {"quick": {"federation.rounds": 2}},
                             "rows": [{"name": "a", "set": {"method.lam": 0.1, "federation.rounds": 7},
                                       "presets": {"quick": {"federation.lr": 0.3}}},
                                      {"name": "b"}, {"name": "c", "set": {"method.name": "fedavg"}}]})
    spec = load_table(path)
    a, b, c = cells(spec, preset="quick", overrides=["method.lam=2", "federation.rounds=3"], seeds=[0], track=False,
                    row_sets=parse_row_sets(["b:federation.lr=0.01"]))
    assert a.config.method.hparams.lam == 0.1 and b.config.method.hparams.lam == 2.0   # the row's method value wins
    assert not hasattr(c.config.method.hparams, "lam")        # a shared method value never reaches another method
    assert a.config.federation.rounds == b.config.federation.rounds == 3               # --set: the last word
    assert cells(spec, preset="quick", seeds=[0], track=False)[0].config.federation.rounds == 7   # the row's
    assert a.config.federation.lr == 0.3 and b.config.federation.lr == 0.01
    with pytest.raises(ConfigError, match="no preset 'paper'"):
        cells(spec, preset="paper", seeds=[0], track=False)
    with pytest.raises(ConfigError, match="no row 'd'"):
        cells(spec, seeds=[0], row_sets=parse_row_sets(["d:federation.lr=1"]), track=False)
    with pytest.raises(ConfigError, match="did you mean 'b'"):
        select_rows(expand(spec), ["bb"], None)
    assert [r.name for r in select_rows(expand(spec), None, ["b"])] == ["b"]


@pytest.mark.parametrize("path", sorted(TABLES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_table_file_resolves(path):
    spec = load_table(path)
    for preset in (None, *spec.presets, *{p for r in spec.rows for p in r.presets}):
        table = cells(spec, preset=preset, seeds=spec.seeds[:1], track=False)
        assert table and len({c.label for c in table}) == len(table)


# ---- the engine, on a real Ray head ---------------------------------------------------------------

def _store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    return {"MLFLOW_TRACKING_URI": uri, "PFL_CACHE_DIR": str(tmp_path / "cache")}


def _table_args(table, tmp_path, *extra):
    return [sys.executable, str(ROOT / "pipelines" / "table.py"), str(table), "--storage",
            str(tmp_path / "ray_results"), *extra]


@pytest.mark.slow
@pytest.mark.parametrize("owner, name, module", [("pfl.tables.engine", "table_trainable", "pfl.tables.cell"),
                                                  ("pfl.tune.sweep", "federated_trainable", "pfl.tune.entry")])
def test_a_trial_actor_starts_without_torch_or_the_round_loop(owner, name, module):
    """Tune unpickles a trial's trainable when it creates the actor, importing its module. If that
    import pulled in torch and the round loop (seconds), a table of short cells would run on one
    actor: Tune hands each waiting cell to the actor that just finished one and stops the actor still
    importing (pfl/tables/cell.py). So the trainables the engine and the sweeps bind live in modules
    that import neither; their heavy imports happen inside the trial."""
    import importlib
    import pickle

    import cloudpickle

    fn = getattr(importlib.import_module(owner), name)
    code = ("import pickle, sys; fn = pickle.loads(sys.stdin.buffer.read()); "
            "heavy = sorted(m for m in ('torch', 'pfl.federation', 'pfl.tables.engine', 'pfl.tune.trainable', "
            "'mlflow') if m in sys.modules); print(fn.__module__, heavy)")
    out = subprocess.run([sys.executable, "-c", code], input=cloudpickle.dumps(fn), capture_output=True, check=True,
                         cwd=ROOT).stdout.decode().split(maxsplit=1)
    assert out[0] == module and out[1].strip() == "[]", out
    assert pickle.loads(cloudpickle.dumps(fn)) is fn


def test_cells_give_the_numbers_of_in_process_runs_and_log_a_parent_with_children(ray_cluster, tmp_path):
    from pfl.runner import run_experiment
    from pfl.seeds import last_mean

    path = _write(tmp_path, {
        "name": "small", "set": SMALL, "seeds": [0, 1], "reference": "fedavg",
        "rows": [{"name": "fedavg", "set": {"method.name": "fedavg"}, "tags": {"kind": "global"}},
                 {"grid": {"method.lam": [0.1, 1.0]}, "name": "ditto λ={method.lam}",
                  "set": {"method.name": "ditto"}, "tags": {"kind": "personal"}}],
        "columns": [{"name": "bytes", "metric": "comm/total_bytes", "show": False},
                    {"name": "global", "metric": "global/test_acc", "title": "global %", "scale": 100}],
        "text_columns": [{"title": "kind", "kind": "tag", "key": "kind"},
                         {"title": "traffic", "kind": "bytes", "key": "bytes"},
                         {"title": "λ", "kind": "config", "key": "method.lam"}],
        "plots": [{"x": "config:method.lam", "logx": True}, {"x": "bytes"}]})
    env = _store(tmp_path)
    code, out = ray_cluster.run(_table_args(path, tmp_path, "--out", str(tmp_path / "out")),
                                {**env, "RAY_ADDRESS": ray_cluster.address})
    assert code == 0, out[-4000:]
    assert "finished: 6 of 6 cells finished" in out
    assert "Failed to fetch metrics" not in out   # Tune's result grid looking for the logger files we switch off
    runs = pd.read_csv(tmp_path / "out" / "small_runs.csv")
    assert len(runs) == 6 and set(runs["status"]) == {"FINISHED"}
    # every cell against the same config run here, in this process, without Ray
    for c in cells(load_table(path), track=False):
        here = run_experiment(c.config, progress=None)
        rec = runs[(runs["row"] == c.row.name) & (runs["seed"] == c.seed)].iloc[0]
        assert rec["last_mean"] == pytest.approx(last_mean(here.history, "test/acc_mean"), abs=1e-12)
        assert rec["final"] == pytest.approx(here.final["test/acc_mean"], abs=1e-12)
        assert rec["bytes"] == here.final["comm/total_bytes"]
    summary = pd.read_csv(tmp_path / "out" / "small.csv")
    ditto = summary[summary["row"] == "ditto λ=0.1"].iloc[0]
    mine = runs[runs["row"] == "ditto λ=0.1"]["last_mean"]
    assert ditto["last_mean_mean"] == pytest.approx(mine.mean()) and ditto["last_mean_std"] == pytest.approx(mine.std())
    md = (tmp_path / "out" / "small.md").read_text()
    assert "| ditto λ=0.1 | 2 |" in md and "| personal |" in md and "| 0.1 |" in md and "5.1 MiB" in md, md
    assert "| bytes |" not in md.split("\n")[0]                       # show: false
    mc = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    found = [r for e in mc.search_experiments() for r in mc.search_runs([e.experiment_id])]
    parents = [r for r in found if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in found if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED" and parents[0].info.run_name == "small"
    assert sorted(c.info.run_name for c in children) == sorted(c.label for c in cells(load_table(path), track=False))
    assert all(c.info.status == "FINISHED" for c in children)
    names = {a.path for a in mc.list_artifacts(parents[0].info.run_id)} | \
        {a.path for a in mc.list_artifacts(parents[0].info.run_id, "plots")}
    assert {"small.csv", "small.md", "small_runs.csv", "small_runs.parquet", "plots/small_plot1.png",
            "plots/small_plot2.png"} <= names
    assert parents[0].data.metrics["table/finished"] == 6


@pytest.mark.slow
def test_a_table_interrupted_after_half_its_cells_resumes_only_the_other_half(ray_cluster, tmp_path):
    import time

    rounds = 30
    path = _write(tmp_path, {
        "name": "resumable", "set": {**SMALL, "federation.rounds": rounds, "federation.eval_every": 2},
        "seeds": [0, 1], "max_concurrent": 1, "checkpoint_every": 4,
        "rows": [{"name": "a", "set": {"federation.lr": 0.05}}, {"name": "b", "set": {"federation.lr": 0.1}}]})
    env = {**_store(tmp_path), "RAY_ADDRESS": ray_cluster.address}
    uri = env["MLFLOW_TRACKING_URI"]
    mc = MlflowClient(tracking_uri=uri)

    def children():
        return [r for e in mc.search_experiments() for r in mc.search_runs([e.experiment_id])
                if "mlflow.parentRunId" in r.data.tags]

    proc = ray_cluster.popen(_table_args(path, tmp_path), env, start_new_session=True)
    deadline = time.time() + 400
    while proc.poll() is None and time.time() < deadline:
        time.sleep(1)
        try:
            if sum(c.info.status == "FINISHED" for c in children()) >= 2:
                break
        except Exception:
            continue
    assert proc.poll() is None, proc.stdout.read()[-4000:]
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "resume with:" in out
    # the cells Tune saved as done (what a resume skips), as the interrupted table reports them; a
    # cell whose MLflow run closed a moment before the interrupt reached Tune's state may be among
    # the rest, continued from its checkpoint in its own run
    done = int(re.search(r"interrupted: (\d) of 4 cells finished", out).group(1))
    before = children()
    finished = {c.info.run_id for c in before if c.info.status == "FINISHED"}
    assert 2 <= len(finished) and 1 <= done <= len(finished) and done < 4
    code, out = ray_cluster.run(_table_args(path, tmp_path, "--resume"), env)
    assert code == 0, out[-4000:]
    started = [ln for ln in out.splitlines() if ln.rstrip().endswith(": started")]
    assert len(started) == 4 - done, out                               # only the other half ran
    after = children()
    assert len(after) == 4 and finished <= {c.info.run_id for c in after}
    assert all(c.info.status == "FINISHED" for c in after)
    for child in after:   # every cell ran to its last round, each round logged once
        steps = [m.step for m in mc.get_metric_history(child.info.run_id, "comm/total_bytes")]
        assert sorted(steps) == list(range(1, rounds + 1)), (child.info.run_name, sorted(steps))
    assert "finished: 4 of 4 cells finished" in out
    changed = _write(tmp_path, {**yaml.safe_load(path.read_text()), "seeds": [0, 1, 2]})
    code, out = ray_cluster.run(_table_args(changed, tmp_path, "--resume"), env)
    assert code == 2 and "other rows, seeds or settings" in out


def _block(doc: Path, after: str, lang: str) -> str:
    text = doc.read_text()
    start = text.index(f"```{lang}\n", text.index(after)) + len(lang) + 4
    return text[start:text.index("```", start)]


@pytest.mark.slow
def test_the_documented_own_table_runs(ray_cluster, tmp_path):
    """docs/tables.md §1 on the files of docs/your-data.md (examples 1 and 3), as a user runs it."""
    docs = ROOT / "docs"
    (tmp_path / "make_clients.py").write_text(_block(docs / "your-data.md", "### Example 1", "python"))
    (tmp_path / "my_method.py").write_text(_block(docs / "your-data.md", "### Example 3", "python"))
    (tmp_path / "my_table.yaml").write_text(_block(docs / "tables.md", "## 1. Your own table", "yaml"))
    made = subprocess.run([sys.executable, "make_clients.py"], cwd=tmp_path, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    env = {**_store(tmp_path), "RAY_ADDRESS": ray_cluster.address}
    args = [sys.executable, "-m", "pfl", "table", "my_table.yaml", "--set", "federation.rounds=3",
            "federation.eval_every=1", "--out", "out"]
    proc = ray_cluster.popen(args, env, cwd=tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert "finished: 12 of 12 cells finished" in out
    table = pd.read_csv(tmp_path / "out" / "my_table.csv")
    assert list(table["row"]) == ["FedAvg", "Ditto", "mix α=0.5", "mix α=0.9"] and (table["seeds"] == 3).all()
    assert table.set_index("row").loc["FedAvg", "mark"] == "ref"
    runs = pd.read_csv(tmp_path / "out" / "my_table_runs.csv")
    assert runs.groupby("row")["last_mean"].nunique().min() > 1          # three seeds, three draws
    by = runs.set_index(["row", "seed"])["last_mean"]
    assert all(by[("mix α=0.5", s)] != by[("FedAvg", s)] for s in (0, 1, 2))   # the plugin's own evaluation ran
