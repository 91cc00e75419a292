"""pipelines/bench_scale.py end to end on a small scale: the table it prints, the ratios it derives,
the long run's blocks, and the MLflow run it leaves (issue 27's benchmark)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_scale_measures_both_stores_and_a_long_run(tmp_path):
    # 300 clients fit the 0.1 GiB budget (memory store), 3,000 do not (disk store)
    proc = subprocess.run([sys.executable, str(ROOT / "pipelines" / "bench_scale.py"), "--populations", "300", "3000",
                           "--methods", "fedavg", "ditto", "--rounds", "2", "--repeats", "2", "--budget-gb", "0.1",
                           "--long-rounds", "4"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    main, _, integrity = proc.stdout.partition("What integrity costs")
    lines = main.splitlines()
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): [c.strip() for c in line.split("|")[1:-1]]
            for line in lines if line.startswith("| fedavg") or line.startswith("| ditto")}
    costs = {tuple(c.strip() for c in line.split("|")[1:4]): [c.strip() for c in line.split("|")[1:-1]]
             for line in integrity.splitlines() if line.startswith(("| fedavg", "| ditto")) and line.count("|") == 13}
    assert set(costs) == set(rows)
    assert float(costs[("ditto", "3,000", "disk")][3]) > 0          # Ditto's records are checksummed
    assert float(costs[("fedavg", "300", "memory")][3]) == 0        # FedAvg keeps no client state
    for cells in costs.values():   # timed: the checkpoint's CRC and fsync, a resume's check
        assert all(float(c) >= 0 for c in cells[3:])
    assert float(costs[("ditto", "300", "memory")][9]) > 0     # 300 personal models in the file: CRC'd
    assert rows[("fedavg", "300", "memory")][5] == "1.00 (1.00–1.00)"        # the reference of its own ratio
    assert rows[("ditto", "3,000", "disk")][2] == "disk"
    assert ("ditto", "300", "disk") in rows                                 # both stores on the same clients
    long_rows = [[c.strip() for c in line.split("|")[1:-1]] for line in integrity.splitlines()
                 if line.startswith("| ditto | ") and line.count("|") == 9]
    stored = [int(row[5].replace(",", "")) for row in long_rows]
    assert len(stored) == 4 and stored == sorted(stored) and 0 < stored[0] <= 100   # the store fills
    assert "not run: θ and v need" in proc.stdout                          # FPFC's limit, said

    import mlflow

    client = mlflow.tracking.MlflowClient()
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "bench_scale"
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"bench_scale.csv", "bench_scale.md", "bench_scale.png", "bench_scale_long.png"} <= names
    table = pd.read_csv(client.download_artifacts(run.info.run_id, "bench_scale.csv", str(tmp_path)))
    table = table[table["method"] != "fpfc"]
    for _, r in table.iterrows():   # x 1k: the median of the repeats' ratios to the smallest population's
        ref = table[(table["method"] == r["method"]) & (table["clients"] == 300) & (table["store_choice"] == "auto")]
        runs = [float(x) for x in r["round_s_runs"].split()]
        ref_runs = [float(x) for x in ref["round_s_runs"].iloc[0].split()]
        ratios = [a / b for a, b in zip(runs, ref_runs)]
        assert r["x_1k"] == pytest.approx(sum(ratios) / 2, rel=2e-3)   # two repeats: the median is the mean
    history = client.get_metric_history(run.info.run_id, "ditto_long/round_s")
    assert [m.step for m in history] == [1, 2, 3, 4]
    # x 1k: the block's s/round over the first table's smallest population's, from the unrounded values
    # (the printed s/round has 3 decimals, too few to re-derive a ratio of 20 ms rounds to 0.01)
    reference = float(table[(table["method"] == "ditto") & (table["clients"] == 300)
                            & (table["store_choice"] == "auto")]["round_s"].iloc[0])
    for row, m in zip(long_rows, history):
        assert float(row[2]) == pytest.approx(m.value, abs=5e-4)
        assert float(row[3]) == pytest.approx(m.value / reference, abs=5e-3)
