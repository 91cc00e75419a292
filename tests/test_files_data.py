"""data.source: files (and hf): every format gives the federation its arrays describe.

The files are written here from one set of arrays (x, y, client ids, true clusters); each format
must give the same clients, in sorted-id order, holding exactly the rows with their id, and the
same splits. Nothing is downloaded; the hf tests run where the optional `datasets` is installed.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from pfl.callbacks.divergence import run_rounds
import torch

from pfl.config import DataConfig
from pfl.data import load_federated
from pfl.schema import ConfigError, from_dict

N, D, C = 240, 6, 3
IDS = np.array([2, 10, 100, 7, 33, 5])  # numbers: sorted numerically, 2 < 5 < ... < 100


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(1)
    client = IDS[rng.integers(0, len(IDS), N)]
    cluster_of = {cid: k % 2 for k, cid in enumerate(sorted(IDS))}
    return {"x": rng.normal(size=(N, D)).astype(np.float32), "y": rng.integers(0, C, N),
            "client": client, "cluster": np.array([cluster_of[c] for c in client])}


def cfg_for(path, **extra):
    data = {"source": "files", "num_clients": len(IDS), "params": {"path": str(path), **extra.pop("params", {})}}
    data.update(extra)
    return from_dict(DataConfig, data, "data")


def write_all(a, tmp):
    """The arrays in every format; returns {name: path}."""
    out = {}
    np.savez(tmp / "d.npz", **a)
    out["npz"] = tmp / "d.npz"
    cols = {"label": a["y"], "client": a["client"], "cluster": a["cluster"],
            **{f"f{j}": a["x"][:, j] for j in range(D)}}
    pq.write_table(pa.table(cols), tmp / "cols.parquet", row_group_size=50)
    out["parquet columns"] = tmp / "cols.parquet"
    pq.write_table(pa.table({"label": a["y"], "client": a["client"], "cluster": a["cluster"],
                             "x": pa.array(list(a["x"]), type=pa.list_(pa.float32()))}), tmp / "list.parquet",
                   row_group_size=64)
    out["parquet list"] = tmp / "list.parquet"
    pcsv.write_csv(pa.table(cols), tmp / "d.csv")
    out["csv"] = tmp / "d.csv"
    for kind in ("npz", "parquet"):
        folder = tmp / f"per_client_{kind}"
        folder.mkdir()
        for cid in IDS:
            rows = a["client"] == cid
            if kind == "npz":
                np.savez(folder / f"{cid}.npz", x=a["x"][rows], y=a["y"][rows], cluster=a["cluster"][rows])
            else:
                pq.write_table(pa.table({"label": a["y"][rows], "cluster": a["cluster"][rows],
                                         **{f"f{j}": a["x"][rows, j] for j in range(D)}}), folder / f"{cid}.parquet")
        out[f"folder {kind}"] = folder
    return out


def client_rows(fed, i):
    c = fed.clients[i]
    return torch.cat([c.x_train, c.x_val, c.x_test]).numpy(), torch.cat([c.y_train, c.y_val, c.y_test]).numpy()


def sorted_rows(x, y):
    table = np.column_stack([x, y])
    return table[np.lexsort(table.T[::-1])]


def test_every_format_gives_the_clients_of_its_arrays(arrays, tmp_path):
    paths = write_all(arrays, tmp_path)
    feds = {name: load_federated(cfg_for(p), seed=3) for name, p in paths.items()}
    expected_ids = [str(i) for i in sorted(IDS)]
    for name, fed in feds.items():
        assert fed.partition_kind == "natural" and fed.client_ids == expected_ids, name
        assert fed.input_shape == (D,) and fed.num_classes == C and fed.task == "classification"
        for i, cid in enumerate(sorted(IDS)):  # the rows with that id, computed from the arrays
            rows = arrays["client"] == cid
            x, y = client_rows(fed, i)
            np.testing.assert_array_equal(sorted_rows(x, y), sorted_rows(arrays["x"][rows], arrays["y"][rows]))
        clusters = {cid: k % 2 for k, cid in enumerate(sorted(IDS))}
        assert fed.true_clusters.tolist() == [clusters[c] for c in sorted(IDS)], name
    # and the same splits: each client's rows are in file order in every format
    first = feds["npz"]
    for name, fed in feds.items():
        for a, b in zip(first.clients, fed.clients):
            for split in ("x_train", "y_train", "x_val", "y_test"):
                assert torch.equal(getattr(a, split), getattr(b, split)), (name, split)


def test_without_client_ids_the_pool_is_split_like_any_pooled_source(arrays, tmp_path):
    np.savez(tmp_path / "pool.npz", x=arrays["x"], y=arrays["y"])
    pq.write_table(pa.table({"label": arrays["y"], **{f"f{j}": arrays["x"][:, j] for j in range(D)}}),
                   tmp_path / "pool.parquet")
    a = load_federated(cfg_for(tmp_path / "pool.npz", num_clients=5), seed=0)
    b = load_federated(cfg_for(tmp_path / "pool.parquet", num_clients=5), seed=0)
    assert a.partition_kind == "dirichlet" and a.client_ids is None and a.num_clients == 5
    for ca, cb in zip(a.clients, b.clients):
        assert torch.equal(ca.x_train, cb.x_train) and torch.equal(ca.y_test, cb.y_test)
    every = np.concatenate([client_rows(a, i)[1] for i in range(5)])
    assert sorted(every.tolist()) == sorted(arrays["y"].tolist())  # each sample exactly once
    # a client column present but a pooled kind asked for: the pool, ids ignored
    c = load_federated(cfg_for(tmp_path.parent / tmp_path.name / "pool.npz", num_clients=4,
                               partition={"kind": "iid"}), seed=0)
    assert sum(cl.n_train + cl.n_val + cl.n_test for cl in c.clients) == N


def test_leaf_train_test_folders_keep_leafs_split_and_user_ids(tmp_path):
    rng = np.random.default_rng(0)
    users = ["f0003_11", "f0001_07", "f0002_40"]
    truth = {}
    for split, n in (("train", 9), ("test", 3)):
        (tmp_path / split).mkdir()
        blob = {"users": users, "num_samples": [n] * 3, "user_data": {}}
        for u in users:
            x = rng.random((n, 4)).astype(np.float32)
            y = rng.integers(0, 5, n)
            truth[(u, split)] = (x, y)
            blob["user_data"][u] = {"x": x.tolist(), "y": y.tolist()}
        (tmp_path / split / f"all_data_{split}.json").write_text(json.dumps(blob))
    fed = load_federated(cfg_for(tmp_path, num_clients=3, val_fraction=0.2), seed=0)
    assert fed.client_ids == sorted(users)
    for i, u in enumerate(sorted(users)):
        c = fed.clients[i]
        x, y = truth[(u, "test")]
        np.testing.assert_array_equal(sorted_rows(c.x_test.numpy(), c.y_test.numpy()), sorted_rows(x, y))
        x, y = truth[(u, "train")]
        got = sorted_rows(torch.cat([c.x_train, c.x_val]).numpy(), torch.cat([c.y_train, c.y_val]).numpy())
        np.testing.assert_array_equal(got, sorted_rows(x, y))
        assert c.n_val == 2  # 0.2 of LEAF's 9 training samples
    # a single LEAF file without a split: pfl's own splits
    single = load_federated(cfg_for(tmp_path / "train" / "all_data_train.json", num_clients=3), seed=0)
    assert single.client_ids == sorted(users) and single.clients[0].n_test == 2


def test_png_images_in_parquet_are_decoded_and_scaled(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (30, 5, 7), dtype=np.uint8)
    data = []
    for img in imgs:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        data.append(buf.getvalue())
    pq.write_table(pa.table({"image": data, "label": rng.integers(0, 2, 30), "client": np.arange(30) % 3}),
                   tmp_path / "img.parquet")
    fed = load_federated(cfg_for(tmp_path / "img.parquet", num_clients=3), seed=0)
    assert fed.input_shape == (1, 5, 7)
    x, _ = client_rows(fed, 0)
    want = imgs[np.arange(30) % 3 == 0].astype(np.float32)[:, None] / 255
    np.testing.assert_allclose(sorted_rows(x.reshape(len(x), -1), np.zeros(len(x))),
                               sorted_rows(want.reshape(len(want), -1), np.zeros(len(want))), rtol=0, atol=0)


def test_input_shape_regression_and_scale(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (60, 16)).astype(np.float64)
    pcsv.write_csv(pa.table({"label": rng.normal(size=60), **{f"p{j}": x[:, j] for j in range(16)}}),
                   tmp_path / "r.csv")
    fed = load_federated(cfg_for(tmp_path / "r.csv", num_clients=3, params={"input_shape": [1, 4, 4], "scale": 255}),
                         seed=0)
    assert fed.task == "regression" and fed.num_classes == 0 and fed.partition_kind == "iid"
    assert fed.input_shape == (1, 4, 4) and fed.clients[0].y_train.dtype == torch.float32
    assert float(torch.cat([c.x_train for c in fed.clients]).max()) <= 1.0
    with pytest.raises(ConfigError) as err:
        load_federated(cfg_for(tmp_path / "r.csv", num_clients=3, partition={"kind": "dirichlet"}), seed=0)
    assert err.value.field == "data.partition.kind"


def test_cache_serves_the_second_run_and_never_a_stale_partition(arrays, tmp_path, monkeypatch):
    from pfl.data import federated, files

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"label": arrays["y"], "client": arrays["client"], "x": list(arrays["x"])}), path)
    first = load_federated(cfg_for(path), seed=0)
    made = []
    real = federated.make_partition
    monkeypatch.setattr(federated, "make_partition", lambda *a: made.append(1) or real(*a))
    again = load_federated(cfg_for(path), seed=0)
    assert made == [] and again.partition_hash == first.partition_hash  # read from the cache
    # other labels in the same place: another key, a new partition, the new labels
    y2 = (arrays["y"] + 1) % C
    pq.write_table(pa.table({"label": y2, "client": arrays["client"], "x": list(arrays["x"])}), path)
    files._CACHE.clear()
    edited = load_federated(cfg_for(path), seed=0)
    assert made == [1] and edited.partition_hash != first.partition_hash
    assert sorted(client_rows(edited, 0)[1].tolist()) == sorted(y2[arrays["client"] == 2].tolist())


def test_client_metrics_name_each_natural_client_by_its_own_id(arrays, tmp_path):
    from pfl.resolver import load
    from pfl.federation.simulator import Simulator

    np.savez(tmp_path / "d.npz", **arrays)
    sim = Simulator(load(None, {"data.source": "files", "data.params.path": str(tmp_path / "d.npz"),
                                "data.num_clients": 4, "federation.rounds": 1, "tracking.enabled": False}))
    run_rounds(sim)
    # 4 of the 6 clients, drawn with seed 0 (tests/test_natural_clients.py), named in id order
    assert [r["client_id"] for r in sim.last_client_table] == ["5", "7", "10", "33"]


# ---- bad input: one ConfigError naming the key -----------------------------------------------


@pytest.mark.parametrize("case, field, words", [
    ("missing", "data.params.path", ["no such file"]),
    ("suffix", "data.params.format", ["'.txt'", "npz, parquet, csv, leaf"]),
    ("no_label", "data.params.label_column", ["no column 'label'", "columns found: target, client, f0"]),
    ("float_labels", "data.params.label_column", ["row 1", "1.5", "integers"]),
    ("text_labels", "data.params.label_column", ["string", "class ids"]),
    ("nan", "data.params.path", ["row 3", "'f1'", "NaN (not a number)"]),
    ("inf_list", "data.params.path", ["row 2", "x[0]", "inf"]),
    ("ragged_list", "data.params.path", ["row 4", "ragged"]),
    ("ragged_csv", "data.params.path", ["ragged", "CSV"]),
    ("small_client", "data.params.path", ["client 'tiny' has 2 samples", "min_client_samples: 3"]),
    ("too_many_clients", "data.num_clients", ["has 2 clients", "[1, 2]"]),
    ("split_cluster", "data.params.cluster_column", ["client 'a'", "two clusters"]),
])
def test_bad_files_fail_before_any_work_naming_the_key(tmp_path, case, field, words):
    y = np.array([0, 1, 0, 1, 0, 1, 0, 1])
    f = {"f0": np.arange(8.0), "f1": np.arange(8.0)}
    path, extra = tmp_path / "d.parquet", {"num_clients": 2}
    if case == "missing":
        path = tmp_path / "nope.parquet"
    elif case == "suffix":
        path = tmp_path / "d.txt"
        path.write_text("1,2\n")
    elif case == "no_label":
        pq.write_table(pa.table({"target": y, "client": y, "f0": f["f0"]}), path)
    elif case == "float_labels":
        pq.write_table(pa.table({"label": [0.0, 1.5] + [1.0] * 6, "f0": f["f0"]}), path)
        extra["params"] = {"task": "classification"}
    elif case == "text_labels":
        pq.write_table(pa.table({"label": ["cat", "dog"] * 4, "f0": f["f0"]}), path)
    elif case == "nan":
        f1 = f["f1"].copy()
        f1[3] = np.nan
        pq.write_table(pa.table({"label": y, "client": y, "f0": f["f0"], "f1": f1}), path)
    elif case == "inf_list":
        rows = [[1.0, 2.0]] * 8
        rows[2] = [np.inf, 0.0]
        pq.write_table(pa.table({"label": y, "client": y, "x": rows}), path)
    elif case == "ragged_list":
        rows = [[1.0, 2.0]] * 8
        rows[4] = [1.0, 2.0, 3.0]
        pq.write_table(pa.table({"label": y, "client": y, "x": rows}), path)
    elif case == "ragged_csv":
        path = tmp_path / "d.csv"
        path.write_text("label,f0\n0,1\n1,2,3\n")
    elif case == "small_client":
        pq.write_table(pa.table({"label": [0, 1, 0, 1, 0, 1, 0, 1], "client": ["big"] * 6 + ["tiny"] * 2,
                                 "f0": f["f0"]}), path)
    elif case == "too_many_clients":
        pq.write_table(pa.table({"label": y, "client": y, "f0": f["f0"]}), path)
        extra["num_clients"] = 5
    elif case == "split_cluster":
        pq.write_table(pa.table({"label": y, "client": ["a"] * 4 + ["b"] * 4, "cluster": [0, 0, 1, 1, 1, 1, 1, 1],
                                 "f0": f["f0"]}), path)
    with pytest.raises(ConfigError) as err:
        load_federated(cfg_for(path, **extra), seed=0)
    assert err.value.field == field, str(err.value)
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_bad_input_exits_2_from_pfl_run_before_mlflow(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from pfl import cli
    from pfl.tracking import tracking_uri

    pq.write_table(pa.table({"label": [0, 1] * 4, "client": [1] * 8, "f0": [0.0, 1, 2, np.nan, 4, 5, 6, 7]}),
                   tmp_path / "d.parquet")
    code = cli.main(["run", "--set", "data.source=files", f"data.params.path={tmp_path / 'd.parquet'}",
                     "data.num_clients=1", "federation.rounds=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("config error: data.params.path:") and "row 3" in err[0]
    runs = [r for e in MlflowClient(tracking_uri()).search_experiments()
            for r in MlflowClient(tracking_uri()).search_runs([e.experiment_id])]
    assert runs == []


# ---- Hugging Face (optional extra) -------------------------------------------------------------

def test_hf_without_the_extra_is_one_line_naming_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # what a missing package looks like to import
    from pfl.data import hf

    hf._inspect_cached.cache_clear()
    with pytest.raises(ConfigError) as err:
        load_federated(from_dict(DataConfig, {"source": "hf", "params": {"name": "mnist"}}, "data"), seed=0)
    assert err.value.field == "data.source" and "pip install -e '.[hf]'" in str(err.value)


def test_hf_local_parquet_and_imagefolder_match_the_files_source(arrays, tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    from PIL import Image

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"label": arrays["y"], "client": arrays["client"], "x": list(arrays["x"])}), path)
    via_hf = load_federated(from_dict(DataConfig, {"source": "hf", "num_clients": len(IDS), "params": {
        "name": "parquet", "data_files": [str(path)]}}, "data"), seed=2)
    via_files = load_federated(cfg_for(path), seed=2)
    assert via_hf.client_ids == via_files.client_ids
    for a, b in zip(via_hf.clients, via_files.clients):
        assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    rng = np.random.default_rng(0)
    for label in ("cat", "dog"):
        (tmp_path / "img" / label).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 256, (4, 6), dtype=np.uint8)).save(tmp_path / "img" / label / f"{i}.png")
    fed = load_federated(from_dict(DataConfig, {"source": "hf", "num_clients": 2, "partition": {
        "kind": "iid", "min_samples": 3}, "params": {"name": "imagefolder", "data_dir": str(tmp_path / "img")}},
        "data"), seed=0)
    assert fed.input_shape == (1, 4, 6) and fed.num_classes == 2 and fed.num_clients == 2
