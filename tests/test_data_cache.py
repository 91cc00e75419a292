"""LEAF JSON and CSV parsed once into Parquet in pfl's cache, then read from it (issue 41, item 4).

Every file is written here, small and real; what pfl makes of it is compared with an independent
reading of the same text by the ``json`` and ``csv`` modules. That a later load does not parse is
shown by making the parser fail: the load still works, from the cache. The cache is keyed by the
files' content: an edit that keeps the size and the modification time still gets a new entry.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import time

import numpy as np
import pytest
import torch

from pfl import cli
from pfl.config import DataConfig
from pfl.data import converted as converted_mod
from pfl.data import files as files_mod
from pfl.data import leaf as leaf_mod
from pfl.data import load_federated
from pfl.data.files import FilesParams
from pfl.metric_catalog import metric_known, reported_metrics
from pfl.resolver import load as load_config
from pfl.data.tables import row_at
from pfl.schema import ConfigError, from_dict

D = 6


@pytest.fixture(autouse=True)
def _fresh_process_memory():
    """Each load as a new process would do it: pfl's in-process memo of inspected files emptied."""
    files_mod._CACHE.clear()
    yield
    files_mod._CACHE.clear()


def write_leaf(root, rng) -> None:
    """train/ (two files) and test/: five writers, one of them without samples."""
    sizes = {"f0007_03": (5, 2), "f0001_11": (4, 2), "f0012_40": (6, 1), "f0003_02": (3, 2), "f0020_00": (0, 0)}
    users = list(sizes)
    for split, side, files in (("train", 0, [users[:3], users[3:]]), ("test", 1, [users])):
        (root / split).mkdir(parents=True)
        for k, names in enumerate(files):
            blob = {"users": names, "num_samples": [], "user_data": {}}
            for u in names:
                n = sizes[u][side]
                blob["num_samples"].append(n)
                blob["user_data"][u] = {"x": rng.random((n, D)).tolist(), "y": rng.integers(0, 4, n).tolist()}
            (root / split / f"part{k}_{split}.json").write_text(json.dumps(blob))


def leaf_truth(root) -> dict:
    """Rows as the JSON holds them, in file order: label, writer, test side, features."""
    rows = {"y": [], "client": [], "test": [], "x": []}
    for split in ("train", "test"):
        for f in sorted((root / split).glob("*.json")):
            blob = json.loads(f.read_text())
            for u in blob["users"]:
                data = blob["user_data"][u]
                for x, y in zip(data["x"], data["y"]):
                    rows["y"].append(y)
                    rows["client"].append(u)
                    rows["test"].append(split == "test")
                    rows["x"].append(x)
    return {k: np.asarray(v, dtype=np.float32 if k == "x" else None) for k, v in rows.items()}


def table_rows(table) -> dict:
    """The same from pfl's table: labels, client ids, test side and every feature."""
    return {"y": table.labels.to_numpy(zero_copy_only=False), "client": np.asarray(table.clients.to_pylist()),
            "test": table.test, "x": table.read_rows(np.arange(table.num_rows), lambda a: a.astype(np.float32))}


def assert_rows_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def tables_in(cache) -> list:
    return sorted(cache.glob("table-*.parquet")) if cache.is_dir() else []


def data_cfg(path, **extra) -> DataConfig:
    return from_dict(DataConfig, {"source": "files", "params": {"path": str(path)}, **extra}, "data")


def without_cache(monkeypatch, tmp_path) -> None:
    """pfl's cache folder where none can be made: every load parses, in memory."""
    (tmp_path / "plain-file").write_text("")
    monkeypatch.setenv("PFL_CACHE_DIR", str(tmp_path / "plain-file" / "cache"))
    files_mod._CACHE.clear()


def same_federation(a, b) -> None:
    assert a.client_ids == b.client_ids and a.partition_hash == b.partition_hash
    for ca, cb in zip(a.clients, b.clients):
        for name in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
            assert torch.equal(getattr(ca, name), getattr(cb, name)), name


def test_leaf_is_parsed_once_into_the_cache_then_read_from_it(tmp_path, monkeypatch):
    root = tmp_path / "leaf"
    write_leaf(root, np.random.default_rng(0))
    cache = tmp_path / "cache"
    truth = leaf_truth(root)
    p = FilesParams(path=str(root))

    first = leaf_mod.read_leaf(root, p)
    assert first.origin == "parsed LEAF JSON into the cache" and len(tables_in(cache)) == 1
    assert first.x is None  # the features stay in the file until clients are built
    assert_rows_equal(table_rows(first), truth)
    assert first.empty_clients == ["f0020_00"]
    assert first.client_files["f0003_02"] == ["train/part1_train.json", "test/part0_test.json"]
    assert str(first.where) == str(root)

    def no_parsing(*_):
        raise AssertionError("the JSON was parsed again")

    with monkeypatch.context() as m:
        m.setattr(leaf_mod, "_blob", no_parsing)
        again = leaf_mod.read_leaf(root, p)
        assert again.origin == "read from the cache" and len(tables_in(cache)) == 1
        assert_rows_equal(table_rows(again), truth)
        assert (again.empty_clients, again.client_files) == (first.empty_clients, first.client_files)
        # messages still name the file, the writer and the sample
        assert row_at(again.where, 16) == "train/part1_train.json user 'f0003_02' sample 1"
        cached = load_federated(data_cfg(root), seed=0)
    # the federation from the cache is the one parsed without any cache
    without_cache(monkeypatch, tmp_path)
    parsed = load_federated(data_cfg(root, cache=False), seed=0)
    same_federation(cached, parsed)
    assert cached.client_ids == ["f0001_11", "f0003_02", "f0007_03", "f0012_40"]
    assert [c.n_test for c in cached.clients] == [2, 2, 2, 1]  # LEAF's own test samples


def edit_keeping_size_and_mtime(path, old: str, new: str) -> None:
    stat = path.stat()
    text = path.read_bytes()
    assert len(old) == len(new) and old.encode() in text
    path.write_bytes(text.replace(old.encode(), new.encode(), 1))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)


def test_an_edited_file_gets_a_new_entry_and_an_unchanged_one_is_read_from_the_cache(tmp_path):
    root = tmp_path / "leaf"
    write_leaf(root, np.random.default_rng(1))
    p = FilesParams(path=str(root))
    before = leaf_mod.read_leaf(root, p)
    f = root / "test" / "part0_test.json"
    blob = json.loads(f.read_text())
    x, y = json.dumps(blob["user_data"]["f0001_11"]["x"]), blob["user_data"]["f0001_11"]["y"][0]
    # the first label of f0001_11 in test/ changes to another class, one digit for one digit
    edit_keeping_size_and_mtime(f, f'"f0001_11": {{"x": {x}, "y": [{y}', f'"f0001_11": {{"x": {x}, "y": [{(y + 1) % 4}')
    after = leaf_mod.read_leaf(root, p)
    assert after.origin == "parsed LEAF JSON into the cache" and len(tables_in(tmp_path / "cache")) == 2
    assert_rows_equal(table_rows(after), leaf_truth(root))
    changed = np.flatnonzero(table_rows(before)["y"] != table_rows(after)["y"])
    assert len(changed) == 1 and table_rows(after)["client"][changed[0]] == "f0001_11"
    # the edit undone: the first entry again, by content
    edit_keeping_size_and_mtime(f, f'"y": [{(y + 1) % 4}', f'"y": [{y}')
    undone = leaf_mod.read_leaf(root, p)
    assert undone.origin == "read from the cache" and len(tables_in(tmp_path / "cache")) == 2
    assert_rows_equal(table_rows(undone), table_rows(before))


def write_csv(path, rng, rows: int = 40) -> None:
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["label", "client", "f0", "f1", "f2"])
        for r in range(rows):
            out.writerow([r % 3, f"site{r % 5}"] + [repr(float(v)) for v in rng.normal(size=3).round(4)])


def csv_truth(path) -> dict:
    with open(path, newline="") as fh:
        lines = list(csv.reader(fh))[1:]
    return {"y": np.array([int(r[0]) for r in lines]), "client": np.array([r[1] for r in lines]), "test": None,
            "x": np.array([[float(v) for v in r[2:]] for r in lines], dtype=np.float32)}


def test_csv_is_parsed_once_into_the_cache_then_read_from_it(tmp_path, monkeypatch):
    path = tmp_path / "sites.csv"
    write_csv(path, np.random.default_rng(2))
    p = FilesParams(path=str(path))
    first = converted_mod.read_csv(path, p)
    assert first.origin == "parsed CSV into the cache" and len(tables_in(tmp_path / "cache")) == 1
    assert_rows_equal(table_rows(first), csv_truth(path))
    assert first.plan.columns == ("f0", "f1", "f2") and row_at(first.where, 7) == "line 9"

    def no_parsing(*_):
        raise AssertionError("the CSV was parsed again")

    with monkeypatch.context() as m:
        m.setattr(converted_mod, "parse_csv", no_parsing)
        again = converted_mod.read_csv(path, p)
        assert again.origin == "read from the cache"
        assert_rows_equal(table_rows(again), csv_truth(path))
        # other reading parameters are another entry
        with pytest.raises(AssertionError, match="parsed again"):
            converted_mod.read_csv(path, FilesParams(path=str(path), client_column="site"))
    # an edit with the same size and time: parsed again, the new value read
    line = path.read_text().splitlines()[5]
    fields = line.split(",")
    fields[2] = fields[2][:-1] + ("7" if fields[2][-1] != "7" else "8")
    edit_keeping_size_and_mtime(path, line, ",".join(fields))
    edited = converted_mod.read_csv(path, p)
    assert edited.origin == "parsed CSV into the cache" and len(tables_in(tmp_path / "cache")) == 2
    assert_rows_equal(table_rows(edited), csv_truth(path))
    # the federations with and without the cache are one
    cached = load_federated(data_cfg(path), seed=0)
    without_cache(monkeypatch, tmp_path)
    same_federation(cached, load_federated(data_cfg(path, cache=False), seed=0))


def test_a_bad_cell_is_refused_when_converting_and_nothing_is_cached(tmp_path):
    path = tmp_path / "bad.csv"
    write_csv(path, np.random.default_rng(3))
    lines = path.read_text().splitlines()
    lines[11] = ",".join(lines[11].split(",")[:-1] + ["nan"])
    path.write_text("\n".join(lines) + "\n")
    for _ in range(2):  # refused the same way again: no cached table hides it
        with pytest.raises(ConfigError, match=r"line 12, column 'f2' is NaN \(not a number\)"):
            converted_mod.read_csv(path, FilesParams(path=str(path)))
    assert tables_in(tmp_path / "cache") == [] and not list((tmp_path / "cache").glob("*.tmp"))


@pytest.mark.parametrize("how", ["read-only", "cannot be made"])
def test_a_cache_folder_that_cannot_be_written_falls_back_to_parsing(tmp_path, monkeypatch, caplog, how):
    root = tmp_path / "leaf"
    write_leaf(root, np.random.default_rng(4))
    cache = tmp_path / "cache"
    if how == "read-only":
        cache.mkdir()
        cache.chmod(0o555)
        if os.access(cache, os.W_OK):  # root writes anyway: the refusal it would get, by hand
            def refused(*_, **__):
                raise PermissionError(13, "Permission denied")
            monkeypatch.setattr(converted_mod.tempfile, "mkstemp", refused)
    else:
        without_cache(monkeypatch, tmp_path)
        cache = tmp_path / "plain-file" / "cache"
    with caplog.at_level(logging.WARNING, logger="pfl.data.converted"):
        table = leaf_mod.read_leaf(root, FilesParams(path=str(root)))
    assert table.origin == "parsed LEAF JSON (the cache folder is not writable)"
    assert any("could not write the data cache" in r.getMessage() and str(root) in r.getMessage()
               for r in caplog.records)
    assert tables_in(cache) == []
    assert_rows_equal(table_rows(table), leaf_truth(root))
    if how == "read-only":
        cache.chmod(0o755)


def test_the_summary_says_how_long_loading_took_and_how(tmp_path, capsys, monkeypatch):
    root = tmp_path / "leaf"
    write_leaf(root, np.random.default_rng(5))
    slow = leaf_mod._convert

    def slow_convert(*args):  # parsing that takes a measurable while, during the config's check
        time.sleep(0.4)
        return slow(*args)

    monkeypatch.setattr(leaf_mod, "_convert", slow_convert)
    args = ["run", "--set", "data.source=files", f"data.params.path={root}", "federation.rounds=1",
            "federation.local_epochs=1"]
    lines = []
    for _ in range(2):
        files_mod._CACHE.clear()
        assert cli.main(args) == 0
        lines.append(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  time ")))
    pattern = r"  time +([\d.]+) s \(data ([\d.]+) s: (.+); training ([\d.]+) s\)"
    (total, data, how, rounds), (_, data2, how2, _) = (re.fullmatch(pattern, line).groups() for line in lines)
    assert how == "parsed LEAF JSON into the cache" and how2 == "read from the cache"
    assert float(data) >= 0.4 > float(data2)  # the parse in the config's check is counted
    assert float(total) == pytest.approx(float(data) + float(rounds), abs=0.11)
    # and logged: time/data_load_s, a metric sweeps know
    import mlflow

    runs = mlflow.search_runs(search_all_experiments=True, order_by=["start_time ASC"])
    assert runs["metrics.time/data_load_s"].tolist() == pytest.approx([float(data), float(data2)], abs=0.051)
    assert metric_known("time/data_load_s", reported_metrics(load_config(None, ["data.source=digits"])))
