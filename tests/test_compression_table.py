"""pipelines/compression_table.py (tables/compression.yaml): the entries as the pipeline named them,
the cross-cell columns of its records hook, and a small run on Ray with the table on one parent."""

import math
import sys
from pathlib import Path

import pytest

from pfl.tables.builtin.compression import bytes_to_target, compression
from pfl.tables.spec import expand, load_table, select_rows

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tables" / "compression.yaml"


def _selected(*only):
    return [f"{r.name}" for r in select_rows(expand(load_table(TABLE)), None, list(only))]


def test_the_table_holds_the_pipelines_68_entries_and_its_documented_selections():
    rows = expand(load_table(TABLE))
    assert len(rows) == 68 and len({r.name for r in rows}) == 68
    assert _selected("diana") == ["diana/qsgd_s1"]
    assert _selected("fedavg/")[:2] == ["fedavg/none", "fedavg/fp16"] and len(_selected("fedavg/")) == 20
    assert _selected("fedavg/none$", "lag/") == ["fedavg/none", "lag/none", "lag/qsgd_s7"]
    assert _selected("fpfc/qsgd_s1$") == ["fpfc/qsgd_s1"]
    assert _selected(r"fpfc/topk_1_ef\+") == ["fpfc/topk_1_ef+down_sign", "fpfc/topk_1_ef+down_qsgd_s7",
                                              "fpfc/topk_1_ef+down_topk_10"]


def _rec(group, row, seed, final, up, total, curve, status="FINISHED"):
    return {"group": group, "row": row, "seed": seed, "status": status, "final": final, "up_bytes": up,
            "total_bytes": total, "curve": curve}


def test_records_hook_pairs_each_seed_with_its_reference_and_target(monkeypatch):
    monkeypatch.delenv("PFL_COMPRESSION_TARGET", raising=False)
    records = [_rec("fmnist_dir05", "fedavg/none", 0, 0.8, 100.0, 200.0, [[50, 0.5], [100, 0.77], [200, 0.8]]),
               _rec("fmnist_dir05", "fedavg/none", 1, 0.6, 100.0, 200.0, [[100, 0.6]]),
               _rec("fmnist_dir05 scaffold", "scaffold/none", 0, 0.9, 200.0, 400.0, [[10, 0.76], [20, 0.9]]),
               _rec("fmnist_dir05", "diana/qsgd_s1", 0, 0.7, 10.0, 50.0, [[20, 0.7]]),
               _rec("fmnist_dir05", "diana/qsgd_s1", 1, math.nan, 0, 0, [], status="FAILED")]
    out = {(r["row"], r["seed"]): r for r in compression(records)}
    assert all("curve" not in r for r in out.values())
    assert out["diana/qsgd_s1", 0]["total_ratio"] == 0.25 and out["diana/qsgd_s1", 0]["total_factor"] == 4.0
    assert out["diana/qsgd_s1", 0]["up_ratio"] == 0.1 and out["fedavg/none", 0]["total_ratio"] == 1.0
    assert out["fedavg/none", 0]["target"] == pytest.approx(0.76) and out["fedavg/none", 0]["to_target"] == 100
    assert out["fedavg/none", 1]["target"] == pytest.approx(0.57)   # per seed, from that seed's reference
    assert out["scaffold/none", 0]["to_target"] == 10 and math.isnan(out["diana/qsgd_s1", 0]["to_target"])
    assert "to_target" not in out["diana/qsgd_s1", 1]
    monkeypatch.setenv("PFL_COMPRESSION_TARGET", "0.7")
    assert compression([_rec("fpfc_s1", "fpfc/fp16", 0, 0.8, 1.0, 2.0, [[5, 0.69], [9, 0.71]])])[0]["to_target"] == 9
    assert math.isnan(bytes_to_target([], 0.5))


@pytest.mark.slow
def test_compression_table_pipeline_logs_parent_table_plot_and_children(ray_cluster, tmp_path):
    """The wrapper on the session's Ray head: four entries of one seed, the table on one parent."""
    import pandas as pd
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    code, out = ray_cluster.run(
        [sys.executable, str(ROOT / "pipelines" / "compression_table.py"), "--quick", "--seeds", "0",
         "--only", "fedavg/none$", "fedavg/qsgd_s7$", r"fedavg/qsgd_s1\+", "diana/", "--out", str(tmp_path),
         "--storage", str(tmp_path / "ray_results"), "--quiet",
         "--set", "data.source=digits", "data.max_samples=null", "data.num_clients=6", "federation.rounds=2",
         "federation.clients_per_round=3", "federation.eval_every=1"],
        {"MLFLOW_TRACKING_URI": uri, "PFL_CACHE_DIR": str(tmp_path / "cache"), "RAY_ADDRESS": ray_cluster.address})
    assert code == 0, out[-4000:]
    table = pd.read_csv(tmp_path / "compression_table-quick.csv").set_index("row")
    assert list(table.index) == ["fedavg/none", "fedavg/qsgd_s7", "fedavg/qsgd_s1+down_qsgd_s7", "diana/qsgd_s1"]
    assert (table["seeds"] == 1).all() and (table["failed"] == 0).all()
    assert table.loc["fedavg/none", "up_ratio_mean"] == 1.0 and table.loc["fedavg/none", "mark"] == "ref"
    assert table.loc["fedavg/qsgd_s7", "up_ratio_mean"] < 1 / 6
    assert table.loc["diana/qsgd_s1", "reference"] == "fedavg/none"
    assert table.loc["diana/qsgd_s1", "up_bytes_mean"] < table.loc["fedavg/qsgd_s7", "up_bytes_mean"]
    assert table.loc["diana/qsgd_s1", "delta_mean"] == pytest.approx(
        table.loc["diana/qsgd_s1", "final_mean"] - table.loc["fedavg/none", "final_mean"])
    assert table["target_mean"].to_numpy() == pytest.approx(0.95 * table.loc["fedavg/none", "final_mean"])
    runs = pd.read_csv(tmp_path / "compression_table-quick_runs.csv")
    assert len(runs) == 4 and (runs["status"] == "FINISHED").all() and "curve" not in runs
    text = (tmp_path / "compression_table-quick.md").read_text()
    assert sum(ln.startswith("|") for ln in text.splitlines()) == 6 and "total to target" in text
    assert (tmp_path / "compression_table_plot1_1.png").stat().st_size > 0
    mc = MlflowClient(tracking_uri=uri)
    parent = next(r for e in mc.search_experiments() for r in mc.search_runs([e.experiment_id])
                  if "mlflow.parentRunId" not in r.data.tags)
    artifacts = {a.path for a in mc.list_artifacts(parent.info.run_id)}
    assert {"compression_table-quick.csv", "compression_table-quick.md", "plots"} <= artifacts
    assert "plots/compression_table_plot1_1.png" in {a.path for a in mc.list_artifacts(parent.info.run_id, "plots")}
    children = mc.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.info.run_name for r in children) == sorted(
        f"fmnist_dir05: {e} [seed 0]" for e in ("fedavg/none", "fedavg/qsgd_s7", "fedavg/qsgd_s1+down_qsgd_s7",
                                                "diana/qsgd_s1"))
    assert all("comm/up_bytes" in r.data.metrics for r in children)
    assert "fmnist_dir05/fedavg/qsgd_s1_plus_down_qsgd_s7/final_mean" in parent.data.metrics
